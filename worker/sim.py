"""A model-free engine: the real engine, with its steps' time and tokens simulated.

``SimEngine`` is an ``Engine`` (the same batch scheduler, KV manager, prefix cache and
swap pool accounting) whose executor runs no model:

* a step takes the time the profile's step-time model gives it (``sim_profile.py``: ``a +
  b * batched tokens + c * KV tokens read``, plus its swap transfers from bytes and
  bandwidth), accumulated on a simulated clock (``SimExecutor.clock_s``) and, with a finite
  ``time_scale``, slept out in real time: the engine's own work counts towards the sleep,
  and a step whose work took longer than its share sleeps not at all (simulated time then
  runs slower than ``time_scale`` asks). ``wait="spin"`` spins it out instead, its CPU counted
  as the model's, as a GPU worker's host thread spins in CUDA's default synchronize while its
  core has nothing else to run: a worker's host path then costs what it does warm, on a
  machine with a core to spare a worker (a wait that sleeps pays the wake-up and cold caches
  of every step: ``bench token-path --sim-wait``);
* its tokens are a pure function of the request's seed (the engine's ``seed`` for requests
  without one; 0 for greedy requests, whose tokens a real model draws from no seed, so a
  greedy request's tokens are the same on every worker) and the position the token takes:
  ``sim_token_id``, so a client can check
  every token, and preemption, recompute or a move to another worker never change them.
  Tokens come from ``sim_vocabulary`` (printable ASCII for the byte tokenizer; never an
  end-of-sequence id, so an output runs to its ``max_tokens`` unless a stop matches).

The model named by ``model`` gives the tokenizer and the vocabulary only; the profile gives
the memory (the KV pool's size, the longest sequence) and the time.
"""

from __future__ import annotations

import functools
import math
import os
import time

from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.model_config import ModelSpec
from pagefleet.common.tokenizer import ByteTokenizer

from .batch_scheduler import SchedulerOutput
from .cost_model import CostModel
from .engine import Engine
from .executor import Executor
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .sampler import SamplerOutput
from .sim_profile import SimProfile, load_profile

DEFAULT_PROFILE = "llama-3-8b-h100"
_M64 = (1 << 64) - 1
# The log-probability given to the alternatives of a simulated token (all mass on the token).
_UNLIKELY = -9999.0


SIM_WAITS = ("sleep", "spin")


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a 64-bit hash with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sim_vocabulary(spec: ModelSpec) -> list[int]:
    """The token ids a simulated model generates, in a fixed order."""
    tok = spec.tokenizer
    if isinstance(tok, ByteTokenizer):
        return list(range(0x20, 0x7F))  # printable ASCII: readable text, one token a character
    special = set(tok.eos_token_ids) | {tok.bos_token_id}
    return [t for t in range(spec.config.vocab_size) if t not in special]


@functools.lru_cache(maxsize=65536)
def _seed_key(seed: int) -> int:
    return _mix64(_mix64(seed & _M64))


def sim_token_id(seed: int, position: int, vocabulary: list[int], attempt: int = 0) -> int:
    """The token a simulated model puts at ``position`` (0-based over prompt + output)."""
    h = _mix64(_seed_key(seed) ^ (position & 0xFFFFFFFFFFFF) ^ (attempt << 48))
    return vocabulary[h % len(vocabulary)]


def sim_seed(params, engine_seed: int) -> int:
    """The seed a simulated request's tokens hash: 0 when greedy, else its own or the engine's."""
    if params.temperature == 0:
        return 0
    return engine_seed if params.seed is None else params.seed


def step_shape(out: SchedulerOutput) -> tuple[int, int]:
    """``(batched tokens, KV tokens read)`` of a step: every row computed, padding included,
    and for each scheduled request the context its attention reads (new tokens included)."""
    counts = out.num_scheduled_tokens
    if out.num_padding_tokens is not None:
        counts = [k + p for k, p in zip(counts, out.num_padding_tokens, strict=True)]
    kv = sum(r.num_computed_tokens for r in out.requests) + sum(counts)
    return sum(counts), kv


class SimExecutor(Executor):
    """Runs steps on a simulated clock (see the module docstring). ``time_scale``: simulated
    seconds per real second (``math.inf``: never sleep); ``wait``: how a step's time is waited
    out, ``sleep`` or ``spin`` (``SIM_WAITS``)."""

    def __init__(self, profile: SimProfile, spec: ModelSpec, *, max_model_len: int | None, seed: int,
                 time_scale: float = 1.0, wait: str = "sleep") -> None:
        if not (isinstance(time_scale, int | float) and time_scale > 0):
            raise ValueError(f"time_scale must be > 0 (inf: as fast as possible), got {time_scale!r}")
        if wait not in SIM_WAITS:
            raise ValueError(f"wait must be one of {', '.join(SIM_WAITS)}, got {wait!r}")
        limit = profile.max_model_len
        if max_model_len is None:
            max_model_len = limit
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and {limit} for profile {profile.name!r}, "
                             f"got {max_model_len!r}")
        self.profile = profile
        self.device = f"sim:{profile.name}"
        self.max_model_len = max_model_len
        self.seed = seed
        self.vocabulary = sim_vocabulary(spec)
        self.time_scale = float(time_scale)
        self.wait = wait
        self.block_size = 0
        self.clock_s = 0.0  # simulated seconds of every step so far
        self.last_step_s = 0.0  # simulated seconds of the latest step
        self.num_swapped_bytes_total = 0
        self._unslept_s = 0.0  # simulated time of the current step not yet slept out
        # The simulated model's CPU (its cost model and token draw: what a forward pass and the
        # sampler are to a real engine), on the thread that steps, measured where ``measure_model_cpu``.
        self.measure_model_cpu = False
        self.model_cpu_seconds_total = 0.0
        self.last_model_cpu_seconds = 0.0

    # -- sizing ------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        return self.profile.block_bytes(block_size)

    def num_blocks_that_fit(self, block_size: int) -> int:
        return self.check_fits(self.profile.num_blocks(block_size), block_size)

    def allocate(self, kv: KVCacheManager, num_swap_blocks: int) -> None:
        self.block_size = kv.block_size  # no tensors: the pools are the engine's accounting alone

    def calibrate(self, max_num_batched_tokens: int) -> CostModel:
        p, bs = self.profile, self.block_size
        n = max(1, min(max_num_batched_tokens, self.max_model_len, 512))
        prefill_s = p.step.seconds(n, n)
        return CostModel(p.block_bytes(bs), p.swap_bytes_per_s, p.transfer_overhead_s,
                         n / prefill_s if prefill_s > 0 else math.inf)

    # -- the step ----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput]:
        sampled: list[Request] = []
        if out.requests:
            done = RequestStatus.FINISHED_STOPPED
            # As ModelRunner.prepare: a request samples when the step computes its last missing token.
            sampled = [r for r, k in zip(out.requests, out.num_scheduled_tokens, strict=True)
                       if k > 0 and r.num_computed_tokens + k == len(r.all_token_ids) and r.status < done]
        if not self.measure_model_cpu:
            return self._model(out, sampled)
        c0 = time.thread_time()
        result = self._model(out, sampled)
        self.last_model_cpu_seconds = spent = time.thread_time() - c0
        self.model_cpu_seconds_total += spent
        return result

    def _model(self, out: SchedulerOutput, sampled: list[Request]) -> tuple[list[Request], SamplerOutput]:
        """The simulated model's part of a step: its time on the simulated clock, and the
        tokens of ``sampled`` (with their logprobs where asked)."""
        p, bs = self.profile, self.block_size
        num_moved = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        seconds = p.transfer_seconds(len(out.blocks_to_swap_out), bs) + p.transfer_seconds(len(out.blocks_to_swap_in), bs)
        self.num_swapped_bytes_total += num_moved * p.block_bytes(bs)
        if out.requests:
            seconds += p.step.seconds(*step_shape(out))
        self.last_step_s = seconds
        self.clock_s += seconds
        self._unslept_s += seconds
        if not sampled:
            return [], SamplerOutput([])
        tokens = [self._token(r) for r in sampled]
        if not any(r.params.logprobs is not None for r in sampled):
            return sampled, SamplerOutput(tokens)
        logprobs = [None if r.params.logprobs is None else self._logprobs(r, t)
                    for r, t in zip(sampled, tokens, strict=True)]
        return sampled, SamplerOutput(tokens, logprobs)

    def _token(self, r: Request) -> int:
        seed = sim_seed(r.params, self.seed)
        position = len(r.all_token_ids)
        t = sim_token_id(seed, position, self.vocabulary)
        attempt = 0  # min_tokens: a finish token is drawn again (as the sampler masks it)
        while t in r.finish_token_ids and len(r.output_token_ids) < r.params.min_tokens and attempt < 64:
            attempt += 1
            t = sim_token_id(seed, position, self.vocabulary, attempt)
        return t

    def _logprobs(self, r: Request, token: int) -> TokenLogprobs:
        """All mass on the token: log-probability 0, the next ids of the vocabulary after it."""
        k = min(r.params.logprobs, len(self.vocabulary))
        i = self.vocabulary.index(token)
        top = [self.vocabulary[(i + j) % len(self.vocabulary)] for j in range(k)]
        return TokenLogprobs(0.0, top, [0.0] + [_UNLIKELY] * (k - 1) if k else [])

    def pace(self, started_at: float) -> None:
        """Sleep out what is left of the step begun at ``started_at`` (``time.perf_counter``)."""
        owed, self._unslept_s = self._unslept_s, 0.0
        if math.isinf(self.time_scale) or not owed:
            return
        until = started_at + owed / self.time_scale
        left = until - time.perf_counter()
        if left <= 0:
            return
        if self.wait == "sleep":
            time.sleep(left)
            return
        # Spun out, the GIL let go at every turn (as torch lets it go in a CUDA synchronize) and
        # the CPU given up only to a thread that wants it (sched_yield: no timer, no sleep, unlike
        # time.sleep(0)), the thread's CPU the model's.
        c0 = time.thread_time()
        while time.perf_counter() < until:
            os.sched_yield()
        spent = time.thread_time() - c0
        self.last_model_cpu_seconds += spent
        self.model_cpu_seconds_total += spent


class SimEngine(Engine):
    """An ``Engine`` whose steps are simulated from ``profile`` (a shipped name, a file, or a
    ``SimProfile``). ``model`` gives only the tokenizer and vocabulary; ``num_blocks=None``
    and ``max_model_len=None`` take the profile's. Other arguments as ``Engine``'s.

    >>> engine = SimEngine("llama-3-8b-h100", time_scale=math.inf)
    """

    def __init__(self, profile: str | SimProfile = DEFAULT_PROFILE, model: str = "tiny", *,
                 time_scale: float = 1.0, wait: str = "sleep", **engine_args) -> None:
        for arg in ("device", "dtype"):
            if arg in engine_args:
                raise ValueError(f"{arg}: a simulated engine runs no model")
        self.profile = profile if isinstance(profile, SimProfile) else load_profile(profile)
        self.time_scale = time_scale
        self.wait = wait
        super().__init__(model, **engine_args)

    def _make_executor(self, spec: ModelSpec, *, device: str, dtype: str, max_model_len: int | None,
                       seed: int, max_num_seqs: int, enforce_eager: bool, load_format: str) -> SimExecutor:
        executor = SimExecutor(self.profile, spec, max_model_len=max_model_len, seed=seed, time_scale=self.time_scale,
                                wait=self.wait)
        executor.measure_model_cpu = True  # two clock reads a step: the host path is told apart from the model
        return executor

    def step(self):
        started_at = time.perf_counter()
        deltas = super().step()
        self.executor.pace(started_at)
        return deltas
