"""gpt-oss's MXFP4 experts: dequantized at load exactly as `transformers` does, and a tiny
checkpoint written in the released blocks-and-scales layout generates what `transformers`
generates from the same weights unquantized."""

from __future__ import annotations

import json

import pytest
import torch
from arch_checkpoints import hf_greedy, make_arch_checkpoint
from safetensors.torch import load_file, save_file

from pagefleet import Engine, SamplingParams
from pagefleet.worker.models.mxfp4 import FP4_VALUES, dequantize_mxfp4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., columns, rows]`` (a parameter's layout) as blocks ``[..., rows, groups, 16]``
    and scales ``[..., rows, groups]``: per 32 values a power of two, each value the nearest
    FP4 number, two per byte (low nibble first)."""
    t = w.transpose(-1, -2).float()  # [..., rows, columns]
    groups = t.reshape(*t.shape[:-1], t.shape[-1] // 32, 32)
    top = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    index = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest; -0.0 never wins over +0.0
    blocks = index[..., 0::2] | (index[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), want)


@pytest.fixture(scope="module")
def quantized_gpt_oss(tmp_path_factory):
    """(blocks-and-scales checkpoint, the same weights unquantized)."""
    plain = make_arch_checkpoint(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")
    state = load_file(str(plain / "model.safetensors"))
    quantized = dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(quantized.pop(key))
        quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = blocks, scales
        state[key] = dequantize_mxfp4(blocks, scales, torch.float32)  # what the reference runs
    save_file(state, str(plain / "model.safetensors"))
    qdir = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (qdir / "config.json").write_text(json.dumps(cfg))
    save_file(quantized, str(qdir / "model.safetensors"))
    return qdir, plain


def test_blocks_and_scales_checkpoint_matches_transformers(quantized_gpt_oss):
    qdir, plain = quantized_gpt_oss
    assert any(k.endswith("_blocks") for k in load_file(str(qdir / "model.safetensors")))
    prompts = [[5, 9, 17, 33, 4, 71, 8, 19, 101, 3, 44, 12], [150, 7, 7, 90]]
    want = hf_greedy(plain, prompts, 8)
    engine = Engine(str(qdir), block_size=4, num_blocks=64, max_model_len=64, max_num_batched_tokens=6)
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == want
