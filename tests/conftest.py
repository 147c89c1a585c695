"""Shared fixtures: small random checkpoints written with `transformers`, pool checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def make_checkpoint(path: Path, kind: str, **overrides) -> Path:
    """A small random Llama or Qwen2 checkpoint, saved as Hugging Face writes it."""
    import transformers

    common = dict(
        vocab_size=199,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        model_cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(sliding_window=None, **common)
        model_cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = model_cls(cfg)
    # Wider weights than the default init, so logits are far apart and argmax is stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference: `transformers` greedy decoding, one prompt at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(g[0, len(p) :].tolist())
    return outs


def checkpoint_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def _engine_registry():
    """Every Engine made in this test process, weakly held (module-scoped ones included)."""
    import weakref

    from pagefleet.worker.engine import Engine

    live: weakref.WeakSet = weakref.WeakSet()
    init = Engine.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        live.add(self)

    Engine.__init__ = tracking_init
    yield live
    Engine.__init__ = init


@pytest.fixture(autouse=True)
def engines_end_with_every_block_free(_engine_registry):
    """After every test, each live engine with nothing left to run holds no blocks in
    either pool, and its pool adds up (free + used == total)."""
    yield
    for engine in list(_engine_registry):
        if engine.has_unfinished_requests():
            continue
        engine.check_integrity()
        # (blocks set aside, a read that could not be stopped may write them, are held on purpose)
        assert engine.kv.num_free_blocks + len(engine.kv.set_aside_blocks) == engine.kv.num_blocks, \
            "device blocks leaked"
        stats = engine.stats()
        assert stats.num_free_swap_blocks == stats.num_swap_blocks, "swap blocks leaked"
