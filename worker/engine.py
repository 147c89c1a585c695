"""The engine of one worker: requests in, token deltas out, one step at a time.

``Engine.generate`` is the in-process batch API; ``add_request`` / ``step`` /
``abort_request`` are the streaming API the worker service drives.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.model_config import ModelSpec, load_model_spec
from pagefleet.common.sampling_params import SamplingParams, only_finish_tokens_allowed

from .batch_scheduler import BatchScheduler
from .continuous_scheduler import ContinuousScheduler
from .detokenizer import IncrementalDetokenizer
from .executor import Executor, ModelExecutor
from .kv_cache_manager import KVCacheManager
from .outputs import EngineStats, RequestOutput, TokenDelta
from .policy import PREEMPTION_MODES, PreemptionPolicy
from .request import Request, RequestStatus
from .static_scheduler import StaticScheduler
from .swap import SwapAllocator

Prompt = str | Sequence[int]

# With num_swap_blocks=None: at most this much host memory for the swap pool (vLLM's default too).
_SWAP_BYTES = 4 << 30


class Engine:
    """One model, one paged KV pool, continuous (or static) batching.

    ``num_blocks=None`` sizes the pool from free memory. ``num_swap_blocks`` is the CPU
    swap pool for preempted sequences: 0 (the default in-process) recomputes instead,
    ``None`` takes as many blocks as the device pool within 4 GiB of host memory (the
    worker service's default). ``preemption="auto"`` measures this machine's copy and
    prefill speed at start-up and picks swap or recompute per victim.
    ``enable_prefix_caching``: keep full blocks of computed tokens, keyed by their prefix,
    for later requests that start the same way (continuous batching only).
    ``enforce_eager``: on a GPU, run decode steps eagerly instead of replaying the CUDA
    graphs captured at start-up (``cuda_graphs``; a CPU always runs eagerly).
    ``load_format="dummy"``: the checkpoint's shape with random weights (benchmarks).

    What runs the steps is an ``Executor`` (``executor.py``), made by ``_make_executor``:
    the model here, a step-time model in ``sim.SimEngine``.

    >>> engine = Engine(model="tiny")
    >>> out = engine.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0))[0]
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        batching: str = "continuous",
        seed: int = 0,
        num_swap_blocks: int | None = 0,
        preemption: str = "auto",
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        load_format: str = "auto",
    ) -> None:
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {enforce_eager!r}")
        if num_swap_blocks is not None and (not isinstance(num_swap_blocks, int) or num_swap_blocks < 0):
            raise ValueError(f"num_swap_blocks must be a non-negative integer or None, got {num_swap_blocks!r}")
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model_name = model
        self.spec = load_model_spec(model)
        self.tokenizer, self.model_config = self.spec.tokenizer, self.spec.config
        self.executor = self._make_executor(self.spec, device=device, dtype=dtype, max_model_len=max_model_len,
                                            seed=seed, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                                            load_format=load_format)
        self.device = self.executor.device
        self.max_model_len = self.executor.max_model_len
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = self.executor.num_blocks_that_fit(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer or None, got {num_blocks!r}")
        self.kv = KVCacheManager(num_blocks, block_size,
                                 enable_caching=enable_prefix_caching and batching == "continuous")
        if batching == "static":  # static batching reserves up front and never preempts
            num_swap_blocks = 0
        elif num_swap_blocks is None:  # as many as the device pool, within the host budget
            num_swap_blocks = min(num_blocks, _SWAP_BYTES // self.executor.block_bytes(block_size))
        self.executor.allocate(self.kv, num_swap_blocks)
        self.batching = batching
        self.preemption = preemption
        self.cost_model = None
        if batching == "static":
            self.scheduler: BatchScheduler = StaticScheduler(self.kv, max_num_seqs=max_num_seqs)
        else:
            swap = SwapAllocator(num_swap_blocks) if num_swap_blocks else None
            if swap is not None and preemption == "auto":
                self.cost_model = self.executor.calibrate(max_num_batched_tokens)
            self.scheduler = ContinuousScheduler(
                self.kv,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                swap=swap,
                policy=PreemptionPolicy(preemption),
                cost_model=self.cost_model,
            )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        # Deltas of other requests that ``generate`` stepped past: the next ``step`` returns them first.
        self._held: list[TokenDelta] = []
        self.num_generated_tokens_total = 0
        self.last_step_tokens = 0  # tokens the latest step computed (prompt chunks and decodes)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._grammar_compiler = None  # structured output's, made by the first request that needs it

    def _make_executor(self, spec: ModelSpec, *, device: str, dtype: str, max_model_len: int | None,
                       seed: int, max_num_seqs: int, enforce_eager: bool, load_format: str) -> Executor:
        """What runs the steps: the model of ``spec`` (a subclass may run something else)."""
        return ModelExecutor(spec, device=device, dtype=dtype, max_model_len=max_model_len, seed=seed,
                             max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, load_format=load_format)

    # -- the streaming API -------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        output_token_ids: Sequence[int] | None = None,
    ) -> str:
        """Queue one request; its id. Raises ``ValueError`` (naming the field) and changes nothing if it is bad.

        ``output_token_ids`` resumes a request elsewhere started: those tokens count as
        already generated (and already emitted); generation continues after them.
        """
        req = self._make_request(prompt, params, request_id, priority, output_token_ids)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def _make_request(self, prompt, params, request_id, priority, output_token_ids) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        for field, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                           ("logit_bias", params.logit_bias or {}),
                           ("bad_words", [t for w in params.bad_words_token_ids or () for t in w])):
            self._token_ids(list(ids), field)  # within the vocabulary, as a prompt's (the gateway checks them too)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:  # a caller's own id of that shape
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        prompt_ids = self._prompt_ids(prompt)
        resumed = self._token_ids(output_token_ids or [], "output_token_ids")
        if len(resumed) >= params.max_tokens:
            raise ValueError("output_token_ids: the request has already produced max_tokens tokens")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        usable = self.kv.num_blocks - len(self.kv.set_aside_blocks)  # blocks set aside are never reused
        if self.kv.num_blocks_for(total) > usable:
            raise ValueError(
                f"prompt: {total} tokens need {self.kv.num_blocks_for(total)} blocks but the pool "
                f"has {usable}; lower max_tokens"
            )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings,
                                       include_stop=params.include_stop_str_in_output,
                                       skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)
        # Replay the earlier tokens: their text went out where they were made, except what
        # was held back for stop strings, which stays in the tail and goes out with the next.
        for t in resumed:
            if detok.push(t) is None:
                break
        req = Request(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            arrival_seq=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            detokenizer=detok,
            output_token_ids=resumed,
        )
        if error := only_finish_tokens_allowed(params, req.finish_token_ids):
            raise ValueError(error)
        if params.structured_outputs is not None:  # compiles off this thread while the prompt is prefilled
            req.grammar = self._grammars().request_grammar(params.structured_outputs)
        return req

    def _grammars(self):
        if self._grammar_compiler is None:
            from .structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     tuple(self.tokenizer.eos_token_ids))
        return self._grammar_compiler

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self._token_ids(prompt, "prompt")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def _token_ids(self, ids: Sequence[int], field: str) -> list[int]:
        try:  # integers only (numpy's and torch's too): 72.7 or True is no token id, not 72 or 1
            if any(isinstance(t, bool) for t in ids):
                raise TypeError("a bool is no token id")
            ids = [operator.index(t) for t in ids]
        except (TypeError, ValueError):
            raise ValueError(f"{field}: must be a string or a list of integer token ids") from None
        vocab = self.model_config.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ValueError(f"{field}: token id {t} is outside the vocabulary [0, {vocab})")
        return ids

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """Stop a request now and free its blocks; its final delta, or None if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.status = RequestStatus.FINISHED_ABORTED
        self.scheduler.remove(req)
        final = TokenDelta(request_id, [], req.detokenizer.finish(flush=False), req.num_output_tokens, "abort")
        held = [d for d in self._held if d.request_id == request_id]
        if not held:
            return final
        # What ``generate`` held of it goes out in its last delta, in order, not after it.
        self._held = [d for d in self._held if d.request_id != request_id]
        return TokenDelta(request_id, [t for d in held for t in d.token_ids], "".join(d.text for d in held) + final.text,
                          held[0].index, "abort")

    def preempt_request(self, request_id: str, mode: str = "auto") -> bool:
        """Take a running sequence off the device now; it resumes here when room returns.

        ``mode``: ``"swap"`` (recompute if the swap pool is full), ``"recompute"``, or
        ``"auto"`` (the engine's own choice). Its device blocks are free when this returns;
        the copies run with the next step. False if the request is unknown or not on the device.
        """
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        return self.scheduler.preempt(req, None if mode == "auto" else mode)

    # -- moving requests between engines (migration.py runs the stages) --------------------
    @property
    def kv_cache(self):
        """The device pool's tensor, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.executor.kv_cache

    def freeze_request(self, request_id: str) -> Request | None:
        """Stop running a request, keeping its blocks and place here (a migration's last
        stage); the request, or None if it is not running (waiting, swapped, unknown)."""
        req = self.requests.get(request_id)
        if req is None or not hasattr(self.scheduler, "detach") or not self.scheduler.detach(req):
            return None
        return req

    def thaw_request(self, request_id: str) -> None:
        """Run a frozen request again (its migration gave up)."""
        self.scheduler.attach(self.requests[request_id])

    def release_request(self, request_id: str) -> bool:
        """Forget a request that lives on elsewhere now, freeing its blocks; False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        return True

    def import_request(self, req: Request) -> None:
        """Run ``req`` (made by ``_make_request``), whose block table in ``self.kv`` already
        holds its ``num_computed_tokens`` tokens' K/V (moved in from another engine)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        table = self.kv.block_tables.get(req.request_id, [])
        if len(table) < self.kv.num_blocks_for(req.num_computed_tokens):
            raise ValueError(f"{req.request_id!r}: its table holds {len(table)} blocks, short of "
                             f"{req.num_computed_tokens} computed tokens")
        self.requests[req.request_id] = req
        if self.kv.enable_caching:
            self.kv.cache_blocks(req)
        self.scheduler.attach(req)

    def has_unfinished_requests(self) -> bool:
        """Requests running or waiting, or deltas of them that the next ``step`` has yet to return."""
        return bool(self.requests or self._held)

    def step(self) -> list[TokenDelta]:
        """Run one iteration; a delta for every request that produced tokens or finished (first
        those of other requests a ``generate`` call stepped past)."""
        if self._held:
            held, self._held = self._held, []
            return held + self._step()
        return self._step()

    def _step(self) -> list[TokenDelta]:
        out = self.scheduler.schedule()
        if not out:
            self.last_step_tokens = 0
            return []
        self.last_step_tokens = sum(out.num_scheduled_tokens)
        sampled, result = self.executor.execute(out)
        if not out.requests:  # a step of copies only
            return []
        tokens = result.token_ids
        self.scheduler.update_after_step(out)
        self.num_generated_tokens_total += len(tokens)
        append = self._append
        if result.logprobs is not None:
            return [append(r, t, lp) for r, t, lp in zip(sampled, tokens, result.logprobs, strict=True)]
        return [append(req, tok) for req, tok in zip(sampled, tokens, strict=True)]

    def _append(self, req: Request, token: int, logprobs: TokenLogprobs | None = None) -> TokenDelta:
        """Record a sampled token; the request's delta. Runs for every running request every step."""
        if req.grammar is not None and req.grammar.error is not None:
            return self._failed(req, f"structured output: {req.grammar.error}")
        if token < 0:  # the sampler's NO_TOKEN: its masks left nothing to draw at this step
            return self._failed(req, "no token can be drawn: allowed_token_ids, bad_words and min_tokens "
                                     "together forbid every token at this step")
        out_ids = req.output_token_ids
        out_ids.append(token)
        req.all_token_ids.append(token)
        lps = req.output_logprobs  # the last len(lps) outputs' (None: not asked for)
        if lps is not None:
            lps.append(logprobs)
        detok = req.detokenizer
        stop_token = token in req.finish_token_ids
        if stop_token and not req.params.include_stop_str_in_output:
            text = ""  # a stop token's own text is not sent (as vLLM does)
        else:
            text = detok.push(token)  # None: a stop string appeared
        # Request.check_stop_token, inline (every running request, every step).
        if text is None or stop_token:
            status = RequestStatus.FINISHED_STOPPED
        elif len(out_ids) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        else:
            index = req.num_emitted_tokens
            req.num_emitted_tokens = n = len(out_ids)
            return TokenDelta(req.request_id, [token] if index == n - 1 else out_ids[index:], text, index,
                              None, None if lps is None else lps[len(lps) - n + index:])
        # Ended by a stop string: what is held back is cut off; by length or a stop token: an
        # incomplete last character still goes out (as U+FFFD, as decode gives it).
        text = (text or "") + detok.finish(flush=text is not None)
        req.status = status
        self.requests.pop(req.request_id, None)
        self.scheduler.remove(req)
        index = req.num_emitted_tokens
        req.num_emitted_tokens = len(out_ids)
        return TokenDelta(req.request_id, out_ids[index:], text, index, req.finish_reason,
                          None if lps is None else lps[len(lps) - len(out_ids) + index:], stop=stop_reason_of(req))

    def _failed(self, req: Request, error: str) -> TokenDelta:
        """``req`` cannot go on (its constraint does not compile, or its masks leave no token): it
        ends with an error, the token this step drew for it dropped."""
        req.status = RequestStatus.FINISHED_ERROR
        self.requests.pop(req.request_id, None)
        self.scheduler.remove(req)
        return TokenDelta(req.request_id, [], req.detokenizer.finish(flush=False), req.num_emitted_tokens,
                          req.finish_reason, None, error)

    # -- the batch API -----------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in the order of ``prompts``.

        Every prompt is checked before any is queued, so a bad one raises ``ValueError``
        and leaves the engine (and requests already in it) as they were.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts: pass a list of prompts (strings or lists of token ids)")
        if isinstance(params, dict):
            raise ValueError("params must be a SamplingParams or a list of them, got a dict "
                             "(SamplingParams(**params) makes one)")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} for {len(prompts)} prompts")
        reqs = [
            self._make_request(p, sp, None, 0, None)
            for p, sp in zip(prompts, params, strict=True)
        ]
        for req in reqs:
            self.requests[req.request_id] = req
            self.scheduler.add(req)
        pending = {r.request_id for r in reqs}
        while pending:
            for d in self.step():
                if d.request_id not in pending:  # another request's (``add_request``): kept for its caller
                    self._held.append(d)
                elif d.finished:
                    pending.discard(d.request_id)
            if pending and not self.scheduler.has_unfinished():
                raise RuntimeError("engine stalled with requests pending")
        return [
            RequestOutput(r.request_id, r.prompt_token_ids, r.output_token_ids, r.detokenizer.text, r.finish_reason,
                          r.output_logprobs, stop_reason_of(r))
            for r in reqs
        ]

    # -- introspection -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Both pools and the queues now; the counters since the engine was made."""
        s = self.scheduler
        swap = s.swap
        return EngineStats(
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            block_size=self.block_size,
            num_swap_blocks=swap.num_blocks if swap else 0,
            num_free_swap_blocks=swap.num_free_blocks if swap else 0,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_swapped=s.num_swapped,
            blocks_per_request={rid: len(t) for rid, t in self.kv.block_tables.items() if t},
            swap_blocks_per_request=(
                {rid: len(t) for rid, t in swap.block_tables.items() if t} if swap else {}
            ),
            request_ids=list(self.requests),
            num_steps_total=s.num_steps_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
            num_preemptions_total=s.num_preemptions_total,
            num_recomputes_total=s.num_recomputes_total,
            num_swapped_out_blocks_total=s.num_swapped_out_blocks_total,
            num_swapped_in_blocks_total=s.num_swapped_in_blocks_total,
            prefix_cache_queries_total=self.kv.prefix_cache_queries_total,
            prefix_cache_hits_total=self.kv.prefix_cache_hits_total,
            sim_model_cpu_seconds_total=getattr(self.executor, "model_cpu_seconds_total", 0.0),
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.scheduler.swap is not None:
            self.scheduler.swap.check_integrity()


def stop_reason_of(req: Request) -> str | int | None:
    """What stopped a finished request, as vLLM's ``stop_reason``: the stop string that appeared,
    or the stop token of its own (``stop_token_ids``; not the model's end of sequence); else None."""
    if req.status != RequestStatus.FINISHED_STOPPED:
        return None
    if req.detokenizer.stop_string is not None:
        return req.detokenizer.stop_string
    last = req.output_token_ids[-1] if req.output_token_ids else None
    return last if last in req.stop_token_ids and last not in req.eos_token_ids else None
