"""Incremental detokenization: whole characters only, stop strings across tokens."""

from __future__ import annotations

from pagefleet.common.tokenizer import ByteTokenizer
from pagefleet.worker.detokenizer import IncrementalDetokenizer

TOK = ByteTokenizer()


def _byte_level_bpe(tmp_path, corpus: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizer.json`` (as Llama-3 and Qwen2 ship) trained on ``corpus``,
    read as a checkpoint's tokenizer is (``<s>`` is 0, ``</s>`` 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pagefleet.common.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json", eos_token_ids=(1,), bos_token_id=0)


def stream(text: str, stop: tuple[str, ...] = (), min_tokens: int = 0) -> tuple[list[str], bool, str]:
    d = IncrementalDetokenizer(TOK, TOK.encode("prompt"), stop, min_tokens=min_tokens)
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
    hf = _byte_level_bpe(tmp_path, ["hello world naïve 東京 🚀 the quick brown fox"], 400)
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


def test_a_cut_character_flushes_as_decode_gives(tmp_path):
    """Ended by length (or a stop token) inside a multi-byte character: the text sent equals
    ``decode`` of all the tokens, U+FFFD included, with or without special tokens."""
    hf = _byte_level_bpe(tmp_path, ["plain ascii words only"], 300)
    ids = hf.encode("a 東京🚀", add_special_tokens=False)  # one token per byte of the CJK and emoji
    for cut in range(1, len(ids) + 1):
        for skip in (True, False):
            out = ids[:cut] + ([] if skip else [0])
            d = IncrementalDetokenizer(hf, hf.encode("words"), (), skip_special_tokens=skip)
            text = "".join(d.push(t) for t in out) + d.finish(flush=True)
            assert text == d.text == hf.decode(out, skip_special_tokens=skip), (cut, skip)


def test_a_prompt_cut_inside_a_character_leaks_nothing_into_the_output(tmp_path):
    """A prompt of token ids that ends inside a multi-byte character: the output's text is the
    decode of the output's tokens (it carried the prompt's text before: ``DecodeStream``
    hands back its whole context when that ends in U+FFFD), streamed or flushed at the end."""
    hf = _byte_level_bpe(tmp_path, ["plain ascii words only"], 300)
    euro = hf.encode("€", add_special_tokens=False)  # three byte tokens
    assert len(euro) == 3
    for cut in (1, 2):
        prompt = hf.encode("hello") + euro[:cut]
        for out in ([euro[cut]], [euro[cut]] * 2, euro[cut:], [euro[cut]] + hf.encode(" ok", add_special_tokens=False)):
            d = IncrementalDetokenizer(hf, prompt, ())
            text = "".join(d.push(t) for t in out) + d.finish(flush=True)
            assert text == hf.decode(out), (cut, out, text)
            assert "hello" not in text


def test_a_long_output_streams_as_decode_gives(tmp_path):
    """Hundreds of tokens (the stream keeps only the last ones it may need), multi-byte
    characters and special tokens among them, cut anywhere: the text sent equals ``decode``."""
    hf = _byte_level_bpe(tmp_path, ["plain ascii words only"], 300)
    ids = hf.encode("words only " * 300 + "東京🚀 plain" * 8, add_special_tokens=False)
    ids[200:200] = [0, 0, 1]  # special tokens mid-stream: no text when skipped
    assert len(ids) > 600
    for cut in list(range(len(ids) - 40, len(ids) + 1)) + [203, 257, 300]:
        for skip in (True, False):
            out = ids[:cut]
            d = IncrementalDetokenizer(hf, hf.encode("words"), (), skip_special_tokens=skip)
            text = "".join(d.push(t) for t in out) + d.finish(flush=True)
            assert text == d.text == hf.decode(out, skip_special_tokens=skip), (cut, skip)


def test_include_stop_sends_the_stop_string_and_nothing_after():
    d = IncrementalDetokenizer(TOK, [TOK.BOS], ("STOP",), include_stop=True)
    pieces = [d.push(b) for b in b"go STOP more"]
    assert None in pieces
    sent = "".join(p for p in pieces[:pieces.index(None)]) + d.finish(flush=False)
    assert sent == d.text == "go STOP"


def test_stop_strings_are_looked_for_only_past_min_tokens():
    """As vLLM: a stop string within the first ``min_tokens`` tokens does not end the output; one
    that ends past them does, even begun before them (the tail is held back all along)."""
    pieces, stopped, text = stream("xSTOPxxxxSTOPyy", ("STOP",), min_tokens=5)
    assert stopped and text == "xSTOPxxxx" and "".join(pieces) == text
    assert stream("xxSTOPyy", ("STOP",), min_tokens=4)[2] == "xx"  # ends at token 6, begun at 3
    assert stream("xxSTOPyy", ("STOP",), min_tokens=6)[1:] == (False, "xxSTOPyy")
    # A shorter stop string made before min_tokens, still in the held-back tail past it: not an
    # end (as vLLM, only a stop string that ends in the new text is one).
    assert stream("ab\ncdefgh", ("\n", "STOPXYZ"), min_tokens=3)[1:] == (False, "ab\ncdefgh")
    assert stream("ab\ncdefgh", ("\n", "STOPXYZ"))[2] == "ab"


def test_two_stop_strings_in_one_token_cut_at_the_earlier(tmp_path):
    """A token whose text holds two stop strings: the text was cut at the first in list order,
    so it could hold the other, a stop string shown. It is cut at the earliest now."""
    hf = _byte_level_bpe(tmp_path, [" cdcd cdcd cdcd"], 300)
    ids = hf.encode(" cdcd")
    assert len(ids) == 1, "the case needs one token for the whole text"
    for stops in (("d", " c"), (" c", "d")):
        d = IncrementalDetokenizer(hf, hf.encode("the"), stops)
        assert d.push(ids[0]) is None
        d.finish(flush=False)
        assert d.text == "", stops
