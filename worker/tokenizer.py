"""Tokenizers: a byte-level one for the built-in ``tiny`` model, and ``tokenizer.json`` files."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """Token ids 0..255 are bytes; then BOS, EOS and PAD. Prompts start with BOS."""

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    bos_token_id = BOS
    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        try:
            raw = bytes(token_ids)
        except ValueError:  # special tokens present: drop them
            raw = bytes(t for t in token_ids if t < 256)
        return raw.decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        """Nothing to save: the tokenizer is part of the code (``tiny`` checkpoints say so)."""


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...], bos_token_id: int | None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


class NoTokenizer:
    """For checkpoints without ``tokenizer.json``: prompts must be token ids."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise ValueError("prompt: this model has no tokenizer.json; pass prompt token ids")

    def decode(self, token_ids: list[int]) -> str:
        return ""
