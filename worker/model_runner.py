"""Turns a scheduled step into flat tensors, runs the model once, samples.

The step is flattened the same way for every kind of row: ``input_ids``,
``positions``, ``slot_mapping`` (one per token), ``block_tables``, ``seq_lens``,
``query_start_loc`` (one per sequence). Only each sequence's last row is sent
through the LM head.
"""

from __future__ import annotations

import numpy as np
import torch

from .kv_cache_manager import KVCacheManager
from .models.llama import AttentionMetadata, LlamaForCausalLM
from .request import Request
from .sampler import sample
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCacheManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_model_len: int,
        seed: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.generator = torch.Generator().manual_seed(seed)

    def prepare(self, out: SchedulerOutput):
        """The step's input tensors and, per request, whether its last row is sampled."""
        bs = self.block_size
        reqs, counts = out.requests, out.num_scheduled_tokens
        pads = out.num_padding_tokens or [0] * len(reqs)
        num_seqs = len(reqs)
        total = sum(counts) + sum(pads)
        input_ids = np.zeros(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.full(total, -1, dtype=np.int64)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        tables = self.kv.block_tables
        width = max(1, max(len(tables.get(r.request_id, ())) for r in reqs))
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        logits_rows = []
        sampled: list[Request] = []
        at = 0
        for i, (req, n, pad) in enumerate(zip(reqs, counts, pads, strict=True)):
            start = req.num_computed_tokens
            table = tables.get(req.request_id, ())
            block_tables[i, : len(table)] = table
            if n:
                end = start + n
                input_ids[at : at + n] = req.all_token_ids[start:end]
                pos = np.arange(start, end)
                positions[at : at + n] = pos
                tb = block_tables[i]
                slots[at : at + n] = tb[pos // bs].astype(np.int64) * bs + pos % bs
            if pad:
                # Padding rows are dropped; clamp so they never index past the RoPE table.
                pad_pos = np.arange(start + n, start + n + pad)
                positions[at + n : at + n + pad] = np.minimum(pad_pos, self.max_model_len - 1)
            seq_lens[i] = start + n + pad
            req.sample_now = n > 0 and not req.is_finished and start + n == req.num_tokens
            if req.sample_now:
                logits_rows.append(at + n - 1)
                sampled.append(req)
            elif n == 0 and pad:
                logits_rows.append(at + pad - 1)  # a finished static row still costs its head
            at += n + pad
            qsl[i + 1] = at
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
        )
        return (
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sampled,
        )

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], list[int]]:
        """Run the step; the requests that sampled a token, and their tokens."""
        input_ids, positions, meta, logits_idx, sampled = self.prepare(out)
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        if not sampled:
            return [], []
        # Rows of finished static rows come after nothing: pick the sampled ones out.
        if len(sampled) != logits.shape[0]:
            keep = [i for i, r in enumerate(_rows_owners(out)) if r is not None]
            logits = logits[keep]
        return sampled, sample(logits.cpu(), sampled, self.generator)


def _rows_owners(out: SchedulerOutput) -> list[Request | None]:
    """For each logits row of the step, the request that samples from it (None: discarded)."""
    owners: list[Request | None] = []
    pads = out.num_padding_tokens or [0] * len(out.requests)
    for req, n, pad in zip(out.requests, out.num_scheduled_tokens, pads, strict=True):
        if req.sample_now:
            owners.append(req)
        elif n == 0 and pad:
            owners.append(None)
    return owners
