"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of token ids (``prefix_offset``..end) and only
the part past ``read_offset`` is new; a window that ends in U+FFFD is held back, so
half a UTF-8 character is never emitted. With stop strings, the last
``len(longest stop) - 1`` characters are held back until the request finishes.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset", "_done", "_tail", "_stops", "_hold")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        # A few prompt tokens as left context: some tokenizers decode a token's leading
        # space differently at the start of a string.
        ctx = list(prompt_token_ids[-5:])
        self._ids = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
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
        ids = self._ids
        ids.append(token_id)
        decode = self._tok.decode
        prefix = decode(ids[self._prefix_offset : self._read_offset])
        full = decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full[-1] == "\ufffd":
            return False
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        # A stop string that ends in the new text starts at most `hold` characters
        # before it, and those are still in the tail.
        self._tail += full[len(prefix) :]
        for s in self._stops:
            at = self._tail.find(s)
            if at != -1:
                self._tail = self._tail[:at]
                return True
        return False

    def flush(self) -> None:
        """At the end, decode what was held back as incomplete (it stays U+FFFD if it is)."""
        if self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._tok.decode(self._ids[self._prefix_offset :])
            self._tail += full[len(prefix) :]
            self._read_offset = len(self._ids)

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
