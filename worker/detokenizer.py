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
    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset", "text", "_emitted", "_stops", "_hold")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        # A few prompt tokens as left context: some tokenizers decode a token's leading
        # space differently at the start of a string.
        ctx = list(prompt_token_ids[-5:])
        self._ids = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self.text = ""  # the output's text so far (truncated at a stop string)
        self._emitted = 0  # characters of `text` already handed out
        self._stops = stop
        self._hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Append one token; True if a stop string appeared (``text`` is then cut before it)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        start = max(0, len(self.text) - self._hold)
        self.text += new
        for s in self._stops:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def flush(self) -> None:
        """At the end, decode what was held back as incomplete (it stays U+FFFD if it is)."""
        if self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._tok.decode(self._ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)

    def take(self, finished: bool) -> str:
        """The text not yet handed out; unless finished, minus what a stop string might still claim."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
