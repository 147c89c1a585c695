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
``masked_fill``. A step's masks depend only on tokens already sampled, so the model runner
starts them (``start_grammar_masks``) before its forward, on a thread of their own, and the
sampler only waits for them (``OVERLAP`` False: computed after the forward, in line). A matcher in error (its compile failed, or it was handed a token it does not
allow) lets only end-of-sequence through, so the request ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

from pagefleet.common.grammar import GrammarError, grammar_of, kind_of, ll_tokenizer, matcher_error
from pagefleet.common.sampling_params import StructuredOutputs
from pagefleet.common.service import name_os_thread

from .request import Request

MAX_CACHED_GRAMMARS = 256
OVERLAP = True  # compute a step's masks while its forward runs
# Named for the OS too: a thread started from the engine thread would show as "engine".
_MASK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask", initializer=name_os_thread,
                                  initargs=("grammar-mask",))


class GrammarCompiler:
    """Compiled matchers by constraint, built off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int = 2) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer = None
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar", initializer=name_os_thread,
                                        initargs=("grammar",))
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self.executor = LLExecutor(num_threads)
        self.num_compiled = 0

    def request_grammar(self, so: StructuredOutputs) -> RequestGrammar:
        """A new request's grammar (its compile started, or shared with an earlier request's)."""
        return RequestGrammar(self.submit(so), self.executor, self.vocab_size, self._eos)

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

    __slots__ = ("_future", "_matcher", "num_consumed", "failed", "error", "executor", "vocab_size", "prepared",
                 "eos_token_ids")

    def __init__(self, future: Future, executor: LLExecutor, vocab_size: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self._future = future
        self.executor = executor
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # the model's: what a failed matcher lets through
        self.prepared: tuple[Future, int] | None = None  # (this step's bitmask, its row) when started early
        self._matcher: LLMatcher | None = None
        self.num_consumed = 0
        self.failed = False
        # Why its constraint did not compile for this model (the engine ends it with this error).
        self.error: str | None = None

    def matcher(self, output_token_ids: list[int]) -> LLMatcher | None:
        """The matcher after every output token so far; None if it failed."""
        if self.failed:
            return None
        if self._matcher is None:
            try:
                self._matcher = self._future.result().deep_copy()
            except Exception as e:
                self.failed = True
                self.error = (e.reason if isinstance(e, GrammarError) else str(e)) or type(e).__name__
                return None
        m, n = self._matcher, len(output_token_ids)
        for t in output_token_ids[self.num_consumed:n]:
            if m.is_stopped():  # the constraint is met: what follows (an end token the request
                break           # does not end on) is no error; its mask lets only the end through
            m.consume_token(t)
        self.num_consumed = max(self.num_consumed, n)
        if m.is_error():  # handed a token it does not allow: the request ends with why
            self.failed = True
            self.error = matcher_error(m, "the output left its constraint")
            return None
        return m


def start_grammar_masks(reqs: list[Request]) -> None:
    """Start the bitmasks of the constrained ``reqs`` on the mask thread (before the forward)."""
    constrained = [r for r in reqs if r.grammar is not None]
    if not constrained or not OVERLAP:
        return
    fut = _MASK_THREAD.submit(grammar_bitmask, constrained, constrained[0].grammar.vocab_size)
    for j, r in enumerate(constrained):
        r.grammar.prepared = (fut, j)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Mask ``logits[rows[i]]`` to what ``reqs[i]``'s grammar allows next, in place."""
    n, vocab = len(rows), logits.shape[-1]
    started = [r.grammar.prepared for r in reqs]
    for r in reqs:
        r.grammar.prepared = None
    if all(p is not None and p[0] is started[0][0] and p[1] == j for j, p in enumerate(started)) \
            and started[0][0].result().shape[0] == n:
        bitmask = started[0][0].result()
    else:
        # The mask thread may still be moving these requests' matchers: let it finish first, so
        # no matcher consumes a token on two threads at once.
        wait({p[0] for p in started if p is not None})
        bitmask = grammar_bitmask(reqs, vocab)
    # Bit t % 32 of word t // 32 is token t: on a little-endian host, bit t of the bytes.
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    logits_masked(logits, rows, allowed)


def grammar_bitmask(reqs: list[Request], vocab: int) -> np.ndarray:
    """``[len(reqs), ceil(vocab / 32)]`` int32: what each request's grammar allows next."""
    n = len(reqs)
    bitmask = np.full((n, (vocab + 31) // 32), -1, dtype=np.int32)
    matchers = []
    for j, r in enumerate(reqs):
        m = r.grammar.matcher(r.output_token_ids)
        if m is None:  # only end-of-sequence
            bitmask[j] = 0
            words = bitmask.view(np.uint32)
            for t in r.eos_token_ids or r.finish_token_ids or r.grammar.eos_token_ids:
                if t < vocab:
                    words[j, t // 32] |= np.uint32(1 << (t % 32))
        else:
            matchers.append((m, j))
    if matchers:
        fill_next_token_bitmask_par(reqs[0].grammar.executor, matchers, bitmask)
        for m, j in matchers:
            # A matcher can fail filling its mask (a grammar that compiled but whose lexer or
            # first mask cannot be built: a recursive $ref, a regex too large to expand); its mask
            # then lets only the end through, which would end the request as a clean STOP with an
            # output outside the constraint. It ends with why instead, at this step's token.
            if m.is_error():
                g = reqs[j].grammar
                g.failed = True
                g.error = matcher_error(m, "the constraint failed")
    return bitmask


def logits_masked(logits: torch.Tensor, rows: list[int], allowed: np.ndarray) -> None:
    """Mask ``logits[rows]`` to ``allowed``. The grammar wins: a row whose every allowed token an
    earlier mask took (``min_tokens`` holding back the end the grammar asks for, bad words,
    ``allowed_token_ids``) gets its allowed tokens back, evenly, instead of drawing a token of
    no probability that the grammar forbids. No read of the device."""
    dev = logits.device
    blocked = torch.from_numpy(allowed).to(dev) == 0
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    x = logits.index_select(0, idx).masked_fill_(blocked, float("-inf"))
    dead = torch.isneginf(x).all(dim=-1, keepdim=True)
    x = torch.where(dead & ~blocked, torch.zeros((), dtype=x.dtype, device=dev), x)
    logits.index_copy_(0, idx, x)
