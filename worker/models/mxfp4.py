"""MXFP4 weights (as gpt-oss ships its experts) dequantized at load.

Layout of the released checkpoints: ``<name>_blocks`` ``[..., rows, groups, 16]`` uint8, two
FP4 (E2M1) values per byte, low nibble first, 32 values per group; ``<name>_scales``
``[..., rows, groups]`` uint8, each group's power-of-two scale as an E8M0 exponent (bias 127).
The result is ``[..., rows, groups * 32]``, then transposed on its last two dims to the
unquantized parameter's layout (``[..., columns, rows]``).
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The full-precision tensor of one ``(blocks, scales)`` pair, in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., rows, groups, 32]
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent[..., None].float())
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every ``X_blocks`` / ``X_scales`` pair of ``state`` replaced by ``X``, in place."""
    for key in [k for k in state if k.endswith("_blocks")]:
        name = key.removesuffix("_blocks")
        state[name] = dequantize_mxfp4(state.pop(key), state.pop(f"{name}_scales"), dtype)
    return state
