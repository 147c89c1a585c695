"""Plain-torch reference for the fused mixture-of-experts layer.

Layouts (shared with ``moe_triton``):

* ``hidden``: ``[num_tokens, hidden_size]``
* ``w13``: ``[num_experts, 2 * intermediate_size, hidden_size]``, each expert's gate rows then
  its up rows; ``b13`` (optional): ``[num_experts, 2 * intermediate_size]``
* ``w2``: ``[num_experts, hidden_size, intermediate_size]``; ``b2`` (optional):
  ``[num_experts, hidden_size]``
* ``topk_weights``: ``[num_tokens, top_k]`` float32; ``topk_ids``: ``[num_tokens, top_k]``
  int (the experts each token is routed to)
* ``activation``: maps ``[rows, 2 * intermediate_size]`` to ``[rows, intermediate_size]``
  (gated: silu(gate) * up, gpt-oss's clamped SwiGLU, ...), applied between the two GEMMs.

The result is ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``, in
``hidden``'s dtype (the sum in float32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens of each expert, through that expert, weighted and summed per token."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        x = hidden.index_select(0, token)
        h = F.linear(x, w13[e], None if b13 is None else b13[e])
        y = F.linear(activation(h), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)
