"""The benchmark's tokenizer: what it needs to build prompts of an exact token count.

Counts here leave out the special tokens the server adds (``num_special_tokens``: the BOS
of ``tiny`` and of most checkpoints), as vLLM's datasets do; a prompt's ``prompt_len``
adds them back, so it is the count the server sees.
"""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """``tiny``'s byte tokenizer. Random prompts draw printable ASCII only: other bytes
    alone are not valid UTF-8 and would not survive the trip through text."""

    name = "tiny"
    num_special_tokens = 1  # BOS
    allowed_ids = list(range(32, 127))

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library (what pagefleet's gateway reads)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Not the special tokens, nor pieces of a UTF-8 character (they decode to U+FFFD and
        # would not come back as themselves from text).
        self.allowed_ids = [i for i in range(self.vocab_size)
                            if i not in special and "\ufffd" not in self._tok.decode([i])]
        probe = "a b"
        self.num_special_tokens = (len(self._tok.encode(probe, add_special_tokens=True).ids)
                                   - len(self._tok.encode(probe, add_special_tokens=False).ids))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(name: str) -> ByteTokenizer | FileTokenizer:
    """``"tiny"``, a checkpoint directory with ``tokenizer.json``, or a ``tokenizer.json`` file."""
    if name == "tiny":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return FileTokenizer(path / "tokenizer.json")
    if path.is_file():
        return FileTokenizer(path)
    raise ValueError(f"tokenizer: {name!r} is neither 'tiny', a directory with tokenizer.json, nor a "
                     "tokenizer.json file (nothing is downloaded; pass --tokenizer)")
