"""The registry and the torch-free list of supported model types agree; ``pagefleet models``
lists them and describes a checkpoint."""

from __future__ import annotations

import pytest
from arch_checkpoints import make_arch_checkpoint

from pagefleet.cli import main
from pagefleet.common.model_config import SUPPORTED, ModelConfig
from pagefleet.worker.models.catalog import features
from pagefleet.worker.models.registry import ARCHITECTURES


def test_registry_and_supported_list_agree():
    assert set(ARCHITECTURES) == set(SUPPORTED)


def test_models_lists_every_architecture(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for model_type, hf_name in SUPPORTED.items():
        assert any(line.split()[:2] == [model_type, hf_name] for line in out.splitlines()), model_type


def test_models_describes_a_checkpoint(tmp_path, capsys):
    path = make_arch_checkpoint(tmp_path, "gpt_oss")
    want = {"model_type": "gpt_oss", "context": 256, "rope": "yarn", "sliding window": "8 on 1 of 2 layers",
            "moe": "4 experts, top 2 (topk_softmax)", "attention sinks": True, "attention soft-cap": None}
    got = features(str(path))
    assert {k: got[k] for k in want} == want
    assert main(["models", str(path)]) == 0
    assert "sliding window       8 on 1 of 2 layers" in capsys.readouterr().out


def test_a_checkpoint_of_another_head_is_refused():
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForSequenceClassification"], vocab_size=10, hidden_size=8,
               intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="not a causal language model"):
        ModelConfig.from_hf(cfg)
    assert ModelConfig.from_hf({**cfg, "architectures": ["Qwen3ForCausalLM"]}).model_type == "qwen3"


@pytest.mark.parametrize(("model_type", "extra", "sliding"), [
    ("gemma2", {}, [True, False, True, False, True, False]),
    ("gemma3_text", {"sliding_window_pattern": 3}, [True, True, False, True, True, False]),
    ("gpt_oss", {}, [True, False, True, False, True, False]),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 4}, [False] * 4 + [True] * 2),
    ("mistral", {}, [True] * 6),
])
def test_sliding_layers_of_configs_without_layer_types(model_type, extra, sliding):
    """Checkpoints saved before transformers wrote ``layer_types`` slide on the layers it
    would fill in."""
    cfg = dict(model_type=model_type, vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
               num_attention_heads=2, sliding_window=4, **extra)
    config = ModelConfig.from_hf(cfg)
    assert [config.window_of(i) == 4 for i in range(6)] == sliding
