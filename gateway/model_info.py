"""What the gateway needs of the model, without loading it: tokenizer, context, vocabulary.

The gateway tokenizes prompts to count them and to refuse, at the door, prompts that
would not fit the model's context. It reads ``config.json`` and ``tokenizer.json`` only
(no weights, no torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagefleet.worker.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    tokenizer: object
    max_model_len: int
    vocab_size: int

    @classmethod
    def load(cls, model: str, max_model_len: int | None = None) -> ModelInfo:
        if model == "tiny":
            # Mirrors worker/models/loader.tiny_config: 2048 positions over the byte vocabulary.
            limit, vocab, tokenizer = 2048, ByteTokenizer.vocab_size, ByteTokenizer()
        else:
            path = Path(model)
            if not (path / "config.json").is_file():
                raise ValueError(f"model: {model!r} is neither 'tiny' nor a directory with config.json")
            raw = json.loads((path / "config.json").read_text())
            limit = raw.get("max_position_embeddings", 2048)
            window = raw.get("sliding_window")
            if window and not (raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False)):
                limit = min(limit, window)
            vocab = raw["vocab_size"]
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            if (path / "tokenizer.json").is_file():
                tokenizer = HFTokenizer(path / "tokenizer.json", eos_ids, raw.get("bos_token_id"))
                vocab = max(vocab, tokenizer.vocab_size)
            else:
                tokenizer = NoTokenizer(eos_ids)
        if max_model_len is not None:
            if not 1 <= max_model_len <= limit:
                raise ValueError(f"max_model_len must be between 1 and {limit} for this model")
            limit = max_model_len
        return cls(tokenizer, limit, vocab)
