"""Structured output in the worker: a grammar per request, one token bitmask per step.

``GrammarCompiler`` compiles each distinct constraint once (an llguidance ``LLMatcher`` built
in a small thread pool, off the engine thread, and kept in an LRU); every request that uses
it gets a cheap ``deep_copy``. Compiling starts when the request is added, so it runs while
the prompt is prefilled; the first masked step waits for it only if it is not done yet.

``RequestGrammar`` is a request's matcher and the number of its output tokens the matcher
has consumed. Before each mask it consumes the output tokens it has not seen, so its state
is always rebuilt from the tokens already emitted: after a preemption (swap or recompute),
and for a request resumed on another worker (whose earlier output arrives with it).

``apply_grammar_masks`` fills one bitmask for the rows that need it (llguidance's executor,
in parallel, the GIL released) and applies it to the logits on their device in one
``masked_fill``. A matcher in error (its compile failed, or it was handed a token it does not
allow) lets only end-of-sequence through, so the request ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

from pagefleet.common.grammar import GrammarError, grammar_of, kind_of, ll_tokenizer
from pagefleet.common.sampling_params import StructuredOutputs

from .request import Request

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiled matchers by constraint, built off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int = 2) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer = None
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self.executor = LLExecutor(num_threads)
        self.num_compiled = 0

    def request_grammar(self, so: StructuredOutputs) -> RequestGrammar:
        """A new request's grammar (its compile started, or shared with an earlier request's)."""
        return RequestGrammar(self.submit(so), self.executor)

    def submit(self, so: StructuredOutputs) -> Future:
        """A future of the compiled matcher for ``so`` (shared: deep-copy it before use)."""
        with self._lock:
            fut = self._cache.get(so)
            if fut is not None:
                self._cache.move_to_end(so)
                return fut
            fut = self._pool.submit(self._compile, so)
            self._cache[so] = fut
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, so: StructuredOutputs) -> LLMatcher:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            tok = self._ll_tokenizer
        matcher = LLMatcher(tok, grammar_of(so), log_level=0)
        if matcher.is_error():
            raise GrammarError(kind_of(so), matcher.get_error())
        self.num_compiled += 1
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher, kept in step with its output tokens."""

    __slots__ = ("_future", "_matcher", "num_consumed", "failed", "executor")

    def __init__(self, future: Future, executor: LLExecutor) -> None:
        self._future = future
        self.executor = executor
        self._matcher: LLMatcher | None = None
        self.num_consumed = 0
        self.failed = False

    def matcher(self, output_token_ids: list[int]) -> LLMatcher | None:
        """The matcher after every output token so far; None if it failed."""
        if self.failed:
            return None
        if self._matcher is None:
            try:
                self._matcher = self._future.result().deep_copy()
            except Exception:
                self.failed = True
                return None
        n = len(output_token_ids)
        if n > self.num_consumed:
            self._matcher.consume_tokens(output_token_ids[self.num_consumed:])
            self.num_consumed = n
        if self._matcher.is_error():
            self.failed = True
            return None
        return self._matcher


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Mask ``logits[rows[i]]`` to what ``reqs[i]``'s grammar allows next, in place."""
    n, vocab = len(rows), logits.shape[-1]
    bitmask = np.full((n, (vocab + 31) // 32), -1, dtype=np.int32)
    matchers = []
    for j, r in enumerate(reqs):
        m = r.grammar.matcher(r.output_token_ids)
        if m is None:  # only end-of-sequence
            bitmask[j] = 0
            for t in r.eos_token_ids or r.finish_token_ids:
                if t < vocab:
                    bitmask[j, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        else:
            matchers.append((m, j))
    if matchers:
        fill_next_token_bitmask_par(reqs[0].grammar.executor, matchers, bitmask)
    dev = logits.device
    words = torch.from_numpy(bitmask).to(dev)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(n, -1)[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))
