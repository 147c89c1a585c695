"""Tokenizers: a byte-level one for the built-in ``tiny`` model, and ``tokenizer.json`` files.

Each tokenizer also hands out a per-request ``stream``: ``step(token_id)`` returns the text
that token completes ("" while a character is still incomplete), so detokenizing costs
one call per token, never a re-decode of a window.
"""

from __future__ import annotations

import codecs
from pathlib import Path


class ByteTokenizer:
    """Token ids 0..255 are bytes; then BOS, EOS and PAD. Prompts start with BOS."""

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    bos_token_id = BOS
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        try:
            raw = bytes(token_ids)
        except ValueError:  # special tokens present: drop them
            raw = bytes(t for t in token_ids if t < 256)
        return raw.decode("utf-8", errors="replace")

    def stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> _ByteStream:
        return _ByteStream()  # special tokens have no text here, skipped or not


_BYTES = [bytes((i,)) for i in range(256)]


class _ByteStream:
    __slots__ = ("_utf8",)

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if token_id >= 256:  # special tokens have no text
            return ""
        return self._utf8.decode(_BYTES[token_id])

    def flush(self) -> str:
        """What an incomplete character at the end decodes to (U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...], bos_token_id: int | None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False`` for text that already holds them (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (llguidance reads the tokenizer from it)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def special_token_ids(self) -> set[int]:
        """The added tokens marked special (``</s>``, ``<|im_end|>``); not those added as text
        (Qwen's ``<think>``, ``<tool_call>``)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> _HFStream:
        return _HFStream(self._tok, prompt_token_ids, skip_special_tokens)


class _HFStream:
    """``tokenizers``' own incremental decoder, primed with the prompt's last tokens
    (some tokenizers decode a token's leading space differently at the start of a text).

    ``flush`` gives what ``decode`` gives for the tokens still pending at the end (an
    incomplete character decodes to U+FFFD), so the text handed out in all equals
    ``decode`` of all the tokens. A step appends its token and counts the ones whose text is
    not out yet (no list made a token); ``flush`` reads the last ones back.
    """

    __slots__ = ("_tok", "_stream", "_skip", "_ids", "_num_pending")
    _CONTEXT = 5
    _KEEP = 256  # ids kept before the oldest are dropped (down to the last _CONTEXT and the pending)

    def __init__(self, tok, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-self._CONTEXT:])
        # A prompt that ends inside a character (token ids cut mid-UTF-8): the context ends
        # before it, or the output's first text would carry the prompt's (DecodeStream hands
        # back the whole context when it ends in U+FFFD); the output's bytes decode on their own.
        while context and tok.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._ids = context  # the context, then the tokens stepped
        self._num_pending = 0  # the last ones of ``_ids`` whose text is not out yet
        self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._tok, token_id)
        ids = self._ids
        ids.append(token_id)
        if not text:
            self._num_pending += 1
            return ""
        self._num_pending = 0
        if len(ids) > self._KEEP:
            del ids[:-self._CONTEXT]
        return text

    def flush(self) -> str:
        n = self._num_pending
        if not n:
            return ""
        ids = self._ids
        context, pending = ids[max(0, len(ids) - n - self._CONTEXT):len(ids) - n], ids[len(ids) - n:]
        before = self._tok.decode(context, skip_special_tokens=self._skip)
        after = self._tok.decode(context + pending, skip_special_tokens=self._skip)
        self._num_pending = 0
        if after.startswith(before):
            return after[len(before):]
        return self._tok.decode(pending, skip_special_tokens=self._skip)  # never the context's text


class NoTokenizer:
    """For checkpoints without ``tokenizer.json``: prompts must be token ids."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("this model has no tokenizer.json: give the prompt as token ids")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> _NoStream:
        return _NoStream()


class _NoStream:
    def step(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
