"""The checkpoint that ``pagefleet bench serve --compare`` serves with every system.

A small random Llama written by `transformers`, with a byte-level BPE tokenizer trained
here (``tokenizers``) on generated text and a chat template in ``tokenizer_config.json``:
every server loads the same files, nothing is downloaded, and the same ``seed`` writes the
same weights and the same vocabulary.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# One turn per message, then the assistant's header when a reply is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "str", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt"]


def generated_text(seed: int, num_sentences: int = 20_000) -> Iterator[str]:
    """Pseudo-English: a seeded lexicon of syllable words drawn with Zipf frequencies."""
    rng = random.Random(seed)
    lexicon = sorted({"".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                              for _ in range(rng.choice((1, 1, 2, 2, 3))))
                      for _ in range(6000)})
    rng.shuffle(lexicon)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    for _ in range(num_sentences):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 18))
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(1, len(words)), str(rng.randint(0, 2100)))
        yield " ".join(words) + rng.choice((".", ".", ".", "?", "!", ",")) + ("\n" if rng.random() < 0.2 else "")


def train_tokenizer(seed: int, vocab_size: int, num_sentences: int = 20_000):
    """A byte-level BPE (GPT-2 style) trained on ``generated_text(seed)``; BOS added in front."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(generated_text(seed, num_sentences), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def make_checkpoint(path: str | Path, *, seed: int = 0, vocab_size: int = 2048, hidden_size: int = 256,
                    num_layers: int = 4, max_position_embeddings: int = 4096) -> Path:
    """Write the checkpoint into ``path`` (config, safetensors, tokenizer, chat template)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(seed, vocab_size)
    tok.save(str(path / "tokenizer.json"))
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS,
                                                              "pad_token": PAD}, indent=2))
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=hidden_size // 8, max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    # Wider than the default init: logits far apart, so greedy argmax agrees across implementations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path
