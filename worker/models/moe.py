"""The sparse mixture-of-experts block: a router picks ``top_k`` experts per token, the
experts' weights are stacked (``w13``: gate rows then up rows; ``w2``: down), and
``kernels.fused_moe`` runs every token through its experts in one grouped pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pagefleet.kernels import fused_moe

from .layers import ACTIVATIONS


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    # "softmax_topk": softmax over all experts, then the top k (Mixtral, Qwen3-MoE);
    # "topk_softmax": the top k logits, then their softmax (gpt-oss).
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # or "swiglu_oai": gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _gated(act: str, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def _swiglu_oai(alpha: float, limit: float, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        e, i = spec.num_experts, spec.intermediate_size
        self.router = nn.Linear(hidden_size, e, bias=spec.router_bias)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i))
        self.w13_bias = nn.Parameter(torch.zeros(e, 2 * i)) if spec.expert_bias else None
        self.w2_bias = nn.Parameter(torch.zeros(e, hidden_size)) if spec.expert_bias else None
        if spec.activation == "swiglu_oai":
            self.activation = partial(_swiglu_oai, spec.swiglu_alpha, spec.swiglu_limit)
        elif spec.activation in ACTIVATIONS:
            self.activation = partial(_gated, spec.activation)
        else:
            raise ValueError(f"expert activation {spec.activation!r} is not supported")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k])``."""
        logits = self.router(x)
        k = self.spec.top_k
        if self.spec.routing == "topk_softmax":
            values, ids = torch.topk(logits, k, dim=-1)
            return torch.softmax(values.float(), dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.activation, self.w13_bias, self.w2_bias)


def stack_experts(state: dict[str, torch.Tensor], prefix: str, num_experts: int,
                  gate: str, up: str, down: str) -> None:
    """Replace ``{prefix}.{e}.{gate|up|down}.weight`` (one matrix per expert, as most
    checkpoints store them) by the stacked ``w13`` and ``w2`` next to the router, in place."""
    owner = prefix.rsplit(".", 1)[0]
    w1 = [state.pop(f"{prefix}.{e}.{gate}.weight") for e in range(num_experts)]
    w3 = [state.pop(f"{prefix}.{e}.{up}.weight") for e in range(num_experts)]
    w2 = [state.pop(f"{prefix}.{e}.{down}.weight") for e in range(num_experts)]
    state[f"{owner}.w13"] = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3, strict=True)])
    state[f"{owner}.w2"] = torch.stack(w2)
