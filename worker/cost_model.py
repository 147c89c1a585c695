"""Swap or recompute: the cost of each way to preempt one sequence, measured on this device.

Swapping a victim moves its blocks out and later back in; recomputing it runs its
tokens through the model again. ``calibrate`` measures both rates once at start-up
(the real ``SwapSpace`` copies and a real prefill of the model), so the choice follows
the machine: on a GPU with a fast link and a large model swap wins for long sequences;
on a slow link or a small model recompute can win.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pagefleet.common.blocks import num_blocks_for

from .models.layers import AttentionMetadata
from .swap import SwapSpace


@dataclass(frozen=True, slots=True)
class CostModel:
    """Measured rates. ``t_copy(n blocks) = copy_overhead_s + n * block_bytes / copy_bytes_per_s``."""

    block_bytes: int
    copy_bytes_per_s: float
    copy_overhead_s: float
    prefill_tokens_per_s: float

    def swap_seconds(self, num_blocks: int) -> float:
        """Out now and back in later: two transfers of ``num_blocks`` blocks."""
        one = self.copy_overhead_s + num_blocks * self.block_bytes / self.copy_bytes_per_s
        return 2.0 * one

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)


def _best_of(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy(space: SwapSpace, num_device_blocks: int, reps: int = 5) -> tuple[float, float]:
    """``(bytes_per_s, overhead_s)`` of one swap transfer, from a 1-block and a large one.

    Uses blocks from the start of both pools: call it only while they are free.
    On a CPU the pools are warm in cache here, so this overstates a later swap's rate.
    """
    # Every other device block: a victim's blocks are scattered, so measure the gather.
    big = max(1, min(space.num_blocks, num_device_blocks // 2, space.max_staging_blocks,
                     (32 << 20) // space.block_bytes))
    moved, secs = space.num_bytes_moved, space.transfer_seconds

    def round_trip(n: int):
        def run() -> None:
            space.swap_out([(2 * i, i) for i in range(n)])
            space.swap_in([(i, 2 * i) for i in range(n)])
            space.fence()
            space.synchronize()
        return run

    t1 = _best_of(round_trip(1), reps) / 2
    if big == 1:  # pools too small to tell the overhead from the rate
        per_block, overhead = t1, 0.0
    else:
        tn = _best_of(round_trip(big), reps) / 2
        # The slope, but never slower than the big transfer's own average (noise guard).
        per_block = max(min((tn - t1) / (big - 1), tn / big), 1e-12)
        overhead = max(t1 - per_block, 0.0)
    space.num_bytes_moved, space.transfer_seconds = moved, secs  # calibration is not traffic
    return space.block_bytes / per_block, overhead


@torch.inference_mode()
def measure_prefill(model, kv_caches, block_size: int, num_tokens: int, device: torch.device,
                    reps: int = 2) -> float:
    """Prefill tokens per second for one ``num_tokens`` prompt (K/V writes skipped)."""
    num_blocks = num_blocks_for(num_tokens, block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
        % kv_caches[0][0].shape[0],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )
    # Token ids inside the vocabulary, however small (a test model's may have fewer than 100).
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), 100)
    ids = torch.from_numpy(np.arange(num_tokens) % max(1, min(97, vocab - 3)) + min(3, vocab - 1)).to(device)
    pos = torch.arange(num_tokens, device=device)
    last = torch.tensor([num_tokens - 1], device=device)

    def run() -> None:
        model(ids, pos, kv_caches, meta, last)
        _sync(device)

    return num_tokens / _best_of(run, reps)


def calibrate(space: SwapSpace, model, kv_caches, *, block_size: int, num_device_blocks: int,
              prefill_tokens: int) -> CostModel:
    """Measure this device and model; the pools must still be empty."""
    bw, overhead = measure_copy(space, num_device_blocks)
    tps = measure_prefill(model, kv_caches, block_size, prefill_tokens, space.device)
    return CostModel(space.block_bytes, bw, overhead, tps)
