"""Incremental detokenization with stop strings.

Each request has its tokenizer's stream decoder, which returns only whole characters.
With stop strings, the last ``len(longest stop) - 1`` characters are held back until
the request finishes, so a stop string is never shown, even in part (with
``include_stop``, the stop string that ended the output is sent, and nothing after it).
"""

from __future__ import annotations

from typing import Protocol


class TokenStream(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StreamingTokenizer(Protocol):
    def stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> TokenStream: ...


class IncrementalDetokenizer:
    __slots__ = ("_stream", "_done", "_tail", "_stops", "_hold", "_include_stop", "_min_tokens", "_num_pushed",
                 "_stopped", "stop_string")

    def __init__(self, tokenizer: StreamingTokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 *, include_stop: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        """``min_tokens``: stop strings are looked for once more tokens than that were pushed (as
        vLLM: a stop string in the first ``min_tokens`` tokens does not end the output)."""
        self._stream = tokenizer.stream(prompt_token_ids, skip_special_tokens)
        self._include_stop = include_stop
        self._done: list[str] = []  # text already handed out, in pieces (no quadratic joins)
        self._tail = ""  # text decoded but not yet handed out (the stop-string hold-back)
        self._stops = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._min_tokens = min_tokens
        self._num_pushed = 0  # tokens pushed (counted where there are stop strings)
        self._stopped = False  # a stop string appeared: every later push is None too
        self.stop_string: str | None = None  # the one that appeared

    @property
    def text(self) -> str:
        """The output's text so far (cut before a stop string, if one appeared)."""
        return "".join(self._done) + self._tail

    @property
    def num_pieces(self) -> int:
        """Pieces of text handed out so far (a mark for ``text_since``)."""
        return len(self._done)

    def text_since(self, num_pieces: int, count: int | None = None) -> str:
        """The text handed out after the first ``num_pieces`` pieces (``count`` of them, or all):
        what ``push`` and ``finish`` returned since ``num_pieces`` was read, in one string (each
        non-empty return is one piece)."""
        return "".join(self._done[num_pieces:None if count is None else num_pieces + count])

    def push(self, token_id: int) -> str | None:
        """Append one token; the text to hand out now, or None if a stop string appeared.

        After None the text is cut before the stop string; ``finish`` returns what is left.
        """
        new = self._stream.step(token_id)
        if not self._stops:  # nothing to hold back
            if new:
                self._done.append(new)
            return new
        if self._stopped:
            return None
        self._num_pushed += 1
        if not new:
            return ""
        # A stop string that ends in the new text starts at most `hold` characters
        # before it, and those are still in the tail (held back before min_tokens too, so one
        # that ends just past it is found whole).
        before = len(self._tail)
        tail = self._tail + new
        if self._num_pushed > self._min_tokens:
            # The earliest of the stop strings that end in the new text: cut at a later one, the
            # text would hold an earlier one (vLLM cuts at the first in list order).
            found = [(at, s) for s in self._stops
                     if (at := tail.find(s, max(0, before - len(s) + 1))) != -1]  # one that ends in the new text
            if found:
                at, s = min(found, key=lambda f: f[0])
                self._tail = tail[:at + len(s)] if self._include_stop else tail[:at]
                self._stopped = True
                self.stop_string = s
                return None
        cut = len(tail) - self._hold
        if cut <= 0:
            self._tail = tail
            return ""
        out, self._tail = tail[:cut], tail[cut:]
        self._done.append(out)
        return out

    def finish(self, flush: bool) -> str:
        """The text not yet handed out; with ``flush``, an incomplete last character too (as U+FFFD)."""
        tail = self._tail + (self._stream.flush() if flush else "")
        self._tail = ""
        if tail:
            self._done.append(tail)
        return tail
