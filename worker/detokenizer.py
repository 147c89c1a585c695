"""Incremental detokenization with stop strings.

Each request has its tokenizer's stream decoder, which returns only whole characters.
With stop strings, the last ``len(longest stop) - 1`` characters are held back until
the request finishes, so a stop string is never shown, even in part.
"""

from __future__ import annotations

from typing import Protocol


class TokenStream(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StreamingTokenizer(Protocol):
    def stream(self, prompt_token_ids: list[int]) -> TokenStream: ...


class IncrementalDetokenizer:
    __slots__ = ("_stream", "_done", "_tail", "_stops", "_hold")

    def __init__(self, tokenizer: StreamingTokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._stream = tokenizer.stream(prompt_token_ids)
        self._done: list[str] = []  # text already handed out, in pieces (no quadratic joins)
        self._tail = ""  # text decoded but not yet handed out (the stop-string hold-back)
        self._stops = stop
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        """The output's text so far (cut before a stop string, if one appeared)."""
        return "".join(self._done) + self._tail

    def add(self, token_id: int) -> bool:
        """Append one token; True if a stop string appeared (the text is then cut before it)."""
        new = self._stream.step(token_id)
        if not new:
            return False
        # A stop string that ends in the new text starts at most `hold` characters
        # before it, and those are still in the tail.
        self._tail += new
        for s in self._stops:
            at = self._tail.find(s)
            if at != -1:
                self._tail = self._tail[:at]
                return True
        return False

    def flush(self) -> None:
        """At the end, decode what was held back as incomplete (U+FFFD for bytes that never completed)."""
        self._tail += self._stream.flush()

    def take(self, finished: bool) -> str:
        """The text not yet handed out; unless finished, minus what a stop string might still claim."""
        tail = self._tail
        if not tail:
            return ""
        cut = len(tail) if finished else len(tail) - self._hold
        if cut <= 0:
            return ""
        out, self._tail = tail[:cut], tail[cut:]
        self._done.append(out)
        return out

    def mark_emitted(self) -> None:
        """Everything decoded so far counts as handed out (a resumed request's earlier text)."""
        self.take(finished=True)
