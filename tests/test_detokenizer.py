"""Incremental detokenization: whole characters only, stop strings across tokens."""

from __future__ import annotations

from pagefleet.common.tokenizer import ByteTokenizer
from pagefleet.worker.detokenizer import IncrementalDetokenizer

TOK = ByteTokenizer()


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    d = IncrementalDetokenizer(TOK, TOK.encode("prompt"), stop)
    pieces, stopped = [], False
    for b in text.encode("utf-8"):
        out = d.push(b)
        if out is None:
            stopped = True
            pieces.append(d.finish(flush=False))
            break
        pieces.append(out)
    if not stopped:
        pieces.append(d.finish(flush=True))
    return pieces, stopped, d.text


def test_multibyte_characters_are_never_split():
    text = "naïve 東京 🚀 ok"
    pieces, stopped, full = stream(text)
    assert not stopped
    assert "".join(pieces) == text == full
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_shown():
    pieces, stopped, full = stream("hello STOP world", stop=("STOP",))
    assert stopped
    assert full == "hello "
    assert "".join(pieces) == "hello "
    assert not any("S" in p for p in pieces)


def test_stop_string_made_of_multibyte_characters():
    pieces, stopped, full = stream("abc東京def", stop=("東京",))
    assert stopped and full == "abc" and "".join(pieces) == "abc"


def test_text_before_a_partial_stop_match_is_released_at_the_end():
    pieces, stopped, full = stream("the end ST", stop=("STOP",))
    assert not stopped
    assert "".join(pieces) == full == "the end ST"


def test_an_invalid_byte_sequence_ends_as_replacement_character():
    d = IncrementalDetokenizer(TOK, [TOK.BOS], ())
    assert d.push(0xE6) == ""  # first byte of a three-byte character, never completed
    assert d.finish(flush=True) == "\ufffd"


def test_tokenizer_json_streams_whole_characters(tmp_path):
    """A byte-level BPE `tokenizer.json`, as Llama-3 and Qwen2 ship, streamed token by token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pagefleet.common.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world naïve 東京 🚀 the quick brown fox"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json", eos_token_ids=(1,), bos_token_id=0)
    text = "naïve 東京 🚀 brown STOP fox"
    ids = hf.encode(text)
    d = IncrementalDetokenizer(hf, hf.encode("the quick"), ("STOP",))
    pieces, stopped = [], False
    for t in ids:
        out = d.push(t)
        if out is None:
            stopped = True
            pieces.append(d.finish(flush=False))
            break
        pieces.append(out)
    assert stopped
    assert "".join(pieces) == d.text == "naïve 東京 🚀 brown "
    assert all("\ufffd" not in p for p in pieces)
