"""Turns a scheduled step into flat tensors, runs the model once, samples.

The step is flattened the same way for every kind of row: ``input_ids``,
``positions``, ``slot_mapping`` (one per token), ``block_tables``, ``seq_lens``,
``query_start_loc`` (one per sequence). Only each sequence's last row is sent
through the LM head. A step's inputs reach the device in one packed non-blocking copy, the
block tables as diffs against rows kept there (``step_inputs``); the one wait for the device
in a step is reading the sampled ids. A decode-only step replays a CUDA graph when the runner
has them (``cuda_graphs``: on a GPU unless ``enforce_eager``); every other step runs eagerly.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from pagefleet.kernels import attention_split_choices, forced_attention_splits

from .batch_scheduler import SchedulerOutput
from .cuda_graphs import DecodeGraphs
from .kv_cache_manager import KVCacheManager
from .models.decoder import CausalLM
from .models.layers import AttentionMetadata
from .request import Request, RequestStatus
from .sampler import SamplerOutput, sample
from .step_inputs import DeviceBlockTables, StepUploader
from .structured import start_grammar_masks

_EMPTY: list[int] = []
# The staged inputs' dtypes, in ``upload``'s order: input ids, positions, slots, logits rows,
# table rows, diff rows, diff columns (int64); sequence lengths, query starts, diff block ids (int32).
_STAGED_DTYPES = (np.int64,) * 7 + (np.int32,) * 3


def _block_table(rows: list[list[int]], lens: list[int], width: int) -> np.ndarray:
    """``rows`` (block tables of ``lens`` blocks) as one ``[len(rows), width]`` array, zero-padded."""
    table = np.zeros((len(rows), width), dtype=np.int32)
    table[np.arange(width)[None, :] < np.array(lens)[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), dtype=np.int32, count=sum(lens)
    )
    return table


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
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
        # Unseeded requests' random draws (seeded ones hash their seed: see sampler).
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # profile=True times the forward pass alone (wall and this thread's CPU time), for the
        # step-overhead figure; it waits for the device, so it is off while serving.
        self.profile = False
        self.last_model_seconds = 0.0
        self.last_model_cpu_seconds = 0.0
        self.last_sample_cpu_seconds = 0.0  # the sampler's (its tensor ops and its one read of the ids)
        # A step's inputs go into one packed buffer (on a GPU, one copy), the block tables kept
        # there and sent as diffs (``step_inputs``). On a CPU too: the buffer is the device's (no
        # copy), and a decode step's inputs built as lists into it cost less than the numpy
        # arrays and the whole ``[requests, blocks]`` table of the unstaged path (False: that path).
        self.stage_inputs = True
        self.uploader = StepUploader(device)
        max_blocks = -(-max_model_len // kv.block_size)
        self.device_tables = DeviceBlockTables(256, max_blocks, device)
        self.max_blocks_per_seq = max_blocks
        self.graphs: DecodeGraphs | None = None  # see capture_graphs
        self.last_step_graphed = False

    def warm_up(self) -> int:
        """Compile every Triton kernel variant a step can need now, at start, rather than in a
        serving step (1-2 s each on an H200's host; a step that met a new one stalled every
        request in it).

        A step's variants differ only in whether it is decode-only and in how many ranges the
        attention splits each context into (the kernels' arguments that move from step to step
        are not specialized on: ``kernels/triton_ops.py``). So: a padding batch of one sequence,
        one query row and then two, under each split count the attention can take. Padding rows
        write no cache slot. Returns the number of forward passes."""
        i64 = dict(dtype=torch.int64, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        passes = 0
        with torch.inference_mode():
            for splits in attention_split_choices(self.device):
                with forced_attention_splits(splits):
                    for rows in (1, 2):  # decode-only, then prompt-shaped
                        meta = AttentionMetadata(
                            slot_mapping=torch.full((rows,), -1, **i64),
                            block_tables=torch.zeros((1, -(-rows // self.block_size)), **i32),
                            seq_lens=torch.full((1,), rows, **i32),
                            query_start_loc=torch.tensor([0, rows], **i32),
                        )
                        self.model(torch.zeros(rows, **i64), torch.zeros(rows, **i64), self.kv_caches, meta,
                                   torch.tensor([rows - 1], **i64))
                        passes += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return passes

    def capture_graphs(self, max_num_seqs: int, *, capture: bool = True) -> DecodeGraphs:
        """Capture the decode graphs for batches up to ``max_num_seqs`` (``capture=False``:
        only their padded buffers, run eagerly; the CPU tests check padding so)."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.device, max_num_seqs,
                                   self.max_blocks_per_seq, capture=capture)
        return self.graphs

    def prepare(self, out: SchedulerOutput):
        """The step's input tensors, the requests whose last row is sampled, the rows of the
        logits they keep (static batching) and whether the step is decode-only.

        Per-request Python work is kept to list comprehensions; everything per token is
        numpy, so a step of 256 decoding sequences costs well under a millisecond here. A
        decode step with staged inputs (a GPU's) does nothing per block: its slots come from
        each request's last block, the device's tables from diffs; the host builds the whole
        ``[requests, blocks]`` table only where attention reads it from here (the CPU) or for
        steps with prompt chunks.
        """
        bs = self.block_size
        reqs, counts = out.requests, out.num_scheduled_tokens
        n = len(reqs)
        pads = out.num_padding_tokens
        tables = self.kv.block_tables
        starts = [r.num_computed_tokens for r in reqs]
        rows = [tables.get(r.request_id, _EMPTY) for r in reqs]
        decode = pads is None and counts.count(1) == n  # one token per request: mostly decoding
        if decode and self.stage_inputs:
            return self._prepare_staged_decode(reqs, starts, rows)
        lens = [len(t) for t in rows]
        width = max(max(lens), 1)
        c = np.array(counts, dtype=np.int64)
        s = np.array(starts, dtype=np.int64)
        block_tables = _block_table(rows, lens, width)
        if decode:
            q, qsl = c, np.arange(n + 1, dtype=np.int64)
            positions = s
            # The slot of each request's one new token: in its last block.
            slots = np.fromiter((t[st // bs] for t, st in zip(rows, starts, strict=True)), np.int64, n) * bs + s % bs
            input_ids = np.fromiter(
                (r.all_token_ids[st] for r, st in zip(reqs, starts, strict=True)), np.int64, n
            )
        else:
            q = c if pads is None else c + np.array(pads, dtype=np.int64)
            qsl = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q, out=qsl[1:])
            total = int(qsl[-1])
            seq_of_row = np.repeat(np.arange(n), q)
            offset_in_seq = np.arange(total) - qsl[:-1][seq_of_row]
            positions = s[seq_of_row] + offset_in_seq
            block_idx = np.minimum(positions // bs, width - 1)
            slots = block_tables[seq_of_row, block_idx].astype(np.int64) * bs + positions % bs
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    r.all_token_ids[st : st + k] + [0] * (qq - k)
                    for r, st, k, qq in zip(reqs, starts, counts, q.tolist(), strict=True)
                ),
                np.int64,
                total,
            )
            slots[offset_in_seq >= c[seq_of_row]] = -1  # padding rows (static batching)
            # Padding rows are dropped; clamp so they never index past the RoPE table.
            np.minimum(positions, self.max_model_len - 1, out=positions)
        # A request samples when this step computes its last missing token.
        done = RequestStatus.FINISHED_STOPPED
        flags = [
            k > 0 and st + k == len(r.all_token_ids) and r.status < done
            for r, st, k in zip(reqs, starts, counts, strict=True)
        ]
        sampled = [r for r, f in zip(reqs, flags, strict=True) if f]
        last_real = qsl[1:] - 1 - (q - c)  # each sequence's last real row
        if pads is None:
            logits_rows = last_real[np.flatnonzero(flags)]
            keep = None
        else:
            # A finished static row still costs its LM head; its logits are dropped.
            ghost = [k == 0 and p > 0 for k, p in zip(counts, pads, strict=True)]
            rows_of = [i for i, (f, g) in enumerate(zip(flags, ghost, strict=True)) if f or g]
            logits_rows = np.where(c[rows_of] > 0, last_real[rows_of], qsl[1:][rows_of] - 1)
            keep = [j for j, i in enumerate(rows_of) if flags[i]]
        if not self.stage_inputs:
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots),
                block_tables=torch.from_numpy(block_tables),
                seq_lens=torch.from_numpy((s + q).astype(np.int32)),
                query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            )
            return (torch.from_numpy(input_ids), torch.from_numpy(positions), meta,
                    torch.from_numpy(np.asarray(logits_rows, dtype=np.int64)), sampled, keep, decode)
        return (*self._stage(reqs, rows, width, input_ids, positions, slots, np.asarray(logits_rows), s + q, qsl),
                sampled, keep, decode)

    def _prepare_staged_decode(self, reqs: list[Request], starts: list[int], rows: list[list[int]]):
        """``prepare`` for a step of one token a request, inputs staged (a GPU's decode step):
        each input as a list built in one pass over the requests, converted once for all in
        ``upload``; no numpy or torch call of its own (each costs microseconds when the
        forward pass between two steps has left its code cold)."""
        bs = self.block_size
        done = RequestStatus.FINISHED_STOPPED
        input_ids = [r.all_token_ids[st] for r, st in zip(reqs, starts, strict=True)]
        slots = [t[st // bs] * bs + st % bs for t, st in zip(rows, starts, strict=True)]  # in its last block
        # A request samples when this step computes its last missing token (its row's logits).
        logits_rows = [i for i, (r, st) in enumerate(zip(reqs, starts, strict=True))
                       if st + 1 == len(r.all_token_ids) and r.status < done]
        sampled = [reqs[i] for i in logits_rows]
        return (*self._stage(reqs, rows, max(max(map(len, rows)), 1), input_ids, starts, slots, logits_rows,
                             [st + 1 for st in starts], list(range(len(reqs) + 1))),
                sampled, None, True)

    def _stage(self, reqs: list[Request], rows: list[list[int]], width: int, input_ids, positions, slots,
               logits_rows, seq_lens, query_start_loc):
        """The step's inputs (numpy arrays or lists of ints) in one upload with the block tables'
        diffs: the input ids, positions, the attention metadata and the logits rows, on the device."""
        table_rows, d_rows, d_cols, d_vals = self.device_tables.diffs([r.request_id for r in reqs], rows,
                                                                      self.kv.block_tables)
        (input_ids_t, positions_t, slots_t, logits_t, table_rows_t, d_rows_t, d_cols_t, seq_lens_t, qsl_t,
         d_vals_t) = self.uploader.upload(
            [input_ids, positions, slots, logits_rows, table_rows, d_rows, d_cols, seq_lens, query_start_loc,
             d_vals], _STAGED_DTYPES)
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=self.device_tables.apply(table_rows_t, d_rows_t, d_cols_t, d_vals_t, width),
            seq_lens=seq_lens_t,
            query_start_loc=qsl_t,
        )
        return input_ids_t, positions_t, meta, logits_t

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput]:
        """Run the step; the requests that sampled a token, and their tokens (with logprobs
        where asked), one per request."""
        input_ids, positions, meta, logits_idx, sampled, keep, decode = self.prepare(out)
        start_grammar_masks(sampled)  # structured output's masks, on their thread while the forward runs
        if self.profile:
            t0, c0 = time.perf_counter(), time.thread_time()
            self.last_sample_cpu_seconds = 0.0
        graphs = self.graphs
        self.last_step_graphed = decode and graphs is not None and input_ids.shape[0] <= graphs.max_size
        if self.last_step_graphed:
            logits = graphs.run(input_ids, positions, meta, logits_idx)
        else:
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        if self.profile:
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            self.last_model_seconds = time.perf_counter() - t0
            self.last_model_cpu_seconds = time.thread_time() - c0
        if not sampled:
            return [], SamplerOutput([])
        if keep is not None:  # static batching: drop the finished rows' logits
            logits = logits[keep]
        # The step's one wait for the device: reading the sampled ids (and logprobs).
        if not self.profile:
            return sampled, sample(logits, sampled, self.generator)
        c0 = time.thread_time()
        tokens = sample(logits, sampled, self.generator)
        self.last_sample_cpu_seconds = time.thread_time() - c0
        return sampled, tokens
