"""Decode steps replayed from CUDA graphs.

A decode-only step (every sequence computes one token) launches the same few kernels per
layer whatever the batch holds; on a GPU each launch costs the host microseconds the device
spends idle, so at small batches a step is bound by launches, not by the device. At start-up
``DecodeGraphs`` captures the whole forward pass once for each batch size of a ladder (1, 2,
4, 8, then steps of 8 up to ``max_num_seqs``: ``capture_sizes``); a decode step of ``n``
sequences then copies its inputs into the graph's static buffers, pads them to the next
captured size and replays one graph.

Padding rows are inert: their slot is ``-1`` (``write_kv`` skips it, so no cache is
written), their context is one token of a block id that exists (the attention kernel reads
it and the row's output is dropped), and their logits are never sampled. Mixed
prefill/decode steps, steps larger than the largest size, and ``enforce_eager`` run the
model eagerly.

Everything here but the capture runs without CUDA: ``DecodeGraphs(..., capture=False)``
runs the padded static buffers through the eager model, which is how the CPU tests check
that padding changes no token (``tests/test_cuda_graphs.py``).
"""

from __future__ import annotations

import bisect
import time

import torch

from .models.decoder import CausalLM
from .models.layers import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 8, up to and including
    ``max_num_seqs`` (which ends the ladder when it is not on it)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """One CUDA graph of the decode forward pass per size of ``capture_sizes``, sharing one
    memory pool and one set of static input buffers (views of their first rows per size)."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, max_num_seqs: int, max_blocks_per_seq: int, *, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        big, width = self.sizes[-1], max(1, max_blocks_per_seq)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(big, **i64)
        self.positions = torch.zeros(big, **i64)
        self.slot_mapping = torch.full((big,), -1, **i64)
        self.block_tables = torch.zeros((big, width), **i32)
        self.seq_lens = torch.ones(big, **i32)
        self.query_start_loc = torch.arange(big + 1, **i32)
        self.logits_rows = torch.arange(big, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0
        if capture:
            self._capture()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        """The captured size a step of ``n`` sequences pads to (None: larger than any)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta,
                          self.logits_rows[:size])

    def _capture(self) -> None:
        """Warm each size up eagerly (Triton compiles its kernels on first launch, which a
        capture must not see), then capture it; largest first, so the smaller graphs reuse
        the pool's blocks. The buffers hold padding only here: nothing is written to a cache."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)  # warm-up off the capture's stream, as PyTorch advises
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits of a decode step of ``n = len(input_ids)`` sequences (``n <= max_size``),
        rows as ``logits_indices`` picks them, as the eager forward pass would return them."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        width = meta.block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            raise ValueError(f"a decode step of {n} sequences x {width} blocks exceeds the captured buffers")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if size > n:  # rows left by a larger step: make them padding again
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        graph = self.graphs.get(size)
        if graph is None:
            logits = self._forward(size)  # capture=False: the same buffers, eagerly
        else:
            graph.replay()
            logits = self.outputs[size]
        self.num_replays += 1
        return logits.index_select(0, logits_indices)  # a copy: the next replay overwrites ``logits``
