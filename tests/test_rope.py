"""RoPE tables against `transformers`' own inverse frequencies and attention factors, for
every scaling type pagefleet loads, including configs in the older layouts."""

from __future__ import annotations

import pytest
import torch

from pagefleet.common.model_config import ModelConfig
from pagefleet.worker.models.rope import rope_tables

BASE = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, max_position_embeddings=4096)
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=512),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    "yarn-untruncated": dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=128),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0,
                        original_max_position_embeddings=1024),
    "longrope": dict(rope_type="longrope", short_factor=[1.0 + i / 10 for i in range(8)],
                     long_factor=[1.0 + i for i in range(8)], original_max_position_embeddings=1024),
}


def _hf_tables(cfg: dict, scaling: dict, positions: torch.Tensor, long: bool):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"},
                                  rope_parameters={**scaling, "rope_theta": 10000.0})
    seq_len = scaling.get("original_max_position_embeddings", 0) + 1 if long else None
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu", seq_len=seq_len)
    freqs = torch.outer(positions.float(), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_match_transformers(name):
    scaling = SCALINGS[name]
    config = ModelConfig.from_hf({**BASE, "rope_parameters": {**scaling, "rope_theta": 10000.0}})
    cos, sin = rope_tables(config.rope_theta, config.rope_scaling, config.head_dim, 2048,
                           config.max_position_embeddings)
    short = torch.arange(0, 1024)  # longrope: below the original context, the short factors
    want_cos, want_sin = _hf_tables(BASE, scaling, short, long=False)
    torch.testing.assert_close(cos[short], want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[short], want_sin, atol=1e-5, rtol=0)
    if name == "longrope":  # from the original context on, the long ones
        beyond = torch.arange(1024, 2048)
        want_cos, want_sin = _hf_tables(BASE, scaling, beyond, long=True)
        torch.testing.assert_close(cos[beyond], want_cos, atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[beyond], want_sin, atol=1e-5, rtol=0)


def test_older_phi3_layout_loads():
    """Phi-3-mini-128k keeps original_max_position_embeddings beside rope_scaling and says `type`."""
    scaling = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = ModelConfig.from_hf({**BASE, "model_type": "phi3", "rope_scaling": scaling,
                                  "original_max_position_embeddings": 1024})
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 1024
    cos, _ = rope_tables(config.rope_theta, config.rope_scaling, config.head_dim, 2048, 4096)
    assert not torch.allclose(cos[1500], rope_tables(config.rope_theta, None, config.head_dim, 2048, 4096)[0][1500])
