"""The gateway's served models and their shards, from its flags (``gateway/models.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cluster_fixtures import http_json

from pagefleet.gateway.models import ServedModel, UnknownModel, served_models


def test_one_model_is_shard_s0_and_several_get_a_shard_each():
    assert served_models(None) == [ServedModel("tiny", "tiny", ("s0",))]
    assert served_models(["tiny"], ["my-tiny"]) == [ServedModel("my-tiny", "tiny", ("s0",))]
    assert served_models(["tiny", "llama=/ckpt/llama"]) == [
        ServedModel("tiny", "tiny", ("s0",)), ServedModel("llama", "/ckpt/llama", ("s1",))]
    assert served_models(["a=tiny", "b=/x"], shards=["b=s7,s8"])[1].shards == ("s7", "s8")
    assert served_models(["/path/with=sign"])[0] == ServedModel("/path/with=sign", "/path/with=sign", ("s0",))
    # A Hugging Face style name (it was read as a path, and the model could not be named so)
    assert served_models(["meta-llama/Llama-3.2-1B=/ckpt/l"])[0] == ServedModel("meta-llama/Llama-3.2-1B",
                                                                               "/ckpt/l", ("s0",))


@pytest.mark.parametrize("models, names, shards, error", [
    (["tiny", "tiny"], None, None, "served twice"),
    (["a=tiny", "b=tiny"], None, ["a=s0", "b=s0"], "serves both"),
    (["a=tiny"], None, ["c=s1"], "expected MODEL=SHARD"),
    (["a=tiny"], None, ["a=bad{tag}"], "hash tag"),
    (["a="], None, None, "no checkpoint"),
    (["=tiny"], None, None, "no name before"),
    (["a=tiny"], None, ["a=s1", "a=s2"], "given twice"),
    (["a=tiny"], None, ["a=s1,s1"], "named twice"),
    (["tiny"], ["x", "y"], None, "--served-model-name given 2 times"),
])
def test_bad_flags_say_what_is_wrong(models, names, shards, error):
    with pytest.raises(ValueError, match=error):
        served_models(models, names, shards)


def test_an_unknown_model_names_the_served_ones():
    assert "`a`, `b`" in str(UnknownModel("c", ["a", "b"])) and "`c`" in str(UnknownModel("c", ["a", "b"]))
    assert "required" in str(UnknownModel(None, ["a", "b"]))
    # a huge name is cut short: echoed whole it overflowed a client's bound on a status's metadata
    long = str(UnknownModel("x" * 100_000, ["a"]))
    assert len(long) < 400 and "x" * 256 + "..." in long


@pytest.mark.parametrize("argv, error", [
    (["gateway", "--model", "tiny", "--model", "tiny"], "served twice"),
    (["scheduler", "--shard", "a}b"], "--shard"),
    (["worker", "--shard", ""], "--shard"),
    (["up", "--workers", "2", "--shards-per-model", "3"], "--shards-per-model"),
    (["up", "--model", "a=tiny", "--model", "b=tiny", "--served-model-name", "x"], "--served-model-name"),
])
def test_the_commands_refuse_bad_model_and_shard_flags(argv, error):
    out = subprocess.run([sys.executable, "-m", "pagefleet", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and error in out.stderr, out.stderr


def test_each_model_has_its_own_tokenizer_and_chat_template_at_one_gateway(tmp_path):
    """One gateway process serving the byte-level ``tiny`` and a checkpoint with a BPE tokenizer
    and a chat template of its own: ``/tokenize`` of a model's name gives that model's tokens
    (the chat rendered with that model's template, as transformers renders it)."""
    import os
    import time
    import urllib.request

    import transformers
    from conftest import make_checkpoint
    from test_openai import CONVERSATIONS, build_tokenizer, write_tokenizer_config

    from pagefleet.common.model_config import load_model_spec
    from pagefleet.common.redis import RedisServer
    from pagefleet.common.service import free_port

    bpe = tmp_path / "bpe"
    bpe.mkdir()
    make_checkpoint(bpe, "llama", vocab_size=build_tokenizer(bpe), max_position_embeddings=2048)
    write_tokenizer_config(bpe)
    hf = transformers.AutoTokenizer.from_pretrained(bpe)
    with RedisServer() as redis:
        port, http = free_port(), free_port()
        gateway = subprocess.Popen([sys.executable, "-m", "pagefleet", "gateway", "--port", str(port), "--http-port",
                                    str(http), "--model", "tiny", "--model", f"bpe={bpe}", "--redis-url", redis.url],
                                   env=dict(os.environ, PAGEFLEET_LOG_LEVEL="warning"))
        try:
            base = f"http://127.0.0.1:{http}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"{base}/v1/models", timeout=5):
                        break
                except OSError:
                    if time.monotonic() > deadline or gateway.poll() is not None:
                        raise
                    time.sleep(0.2)
            tiny = load_model_spec("tiny").tokenizer
            status, body = http_json(f"{base}/tokenize", {"model": "tiny", "prompt": "hello world"})
            assert status == 200 and body["tokens"] == tiny.encode("hello world")
            status, body = http_json(f"{base}/tokenize", {"model": "bpe", "prompt": "hello world"})
            assert status == 200 and body["tokens"] == hf("hello world")["input_ids"] != tiny.encode("hello world")
            messages = CONVERSATIONS[1]
            status, body = http_json(f"{base}/tokenize", {"model": "bpe", "messages": messages})
            assert status == 200
            assert body["tokens"] == list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                  return_dict=False))
            status, body = http_json(f"{base}/tokenize", {"model": "gpt-9", "prompt": "hi"})
            assert status == 404 and "`tiny`" in body["error"]["message"] and "`bpe`" in body["error"]["message"]
            # no model while several are served: refused as gRPC refuses it (the first model answered it)
            for path, req in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                              ("/v1/chat/completions", {"model": None, "messages": messages}),
                              ("/tokenize", {"prompt": "hi"})]:
                status, body = http_json(f"{base}{path}", req)
                assert status == 400 and body["error"]["param"] == "model", (path, body)
                assert "tiny" in body["error"]["message"] and "bpe" in body["error"]["message"]
        finally:
            gateway.terminate()
            gateway.wait(10)


@pytest.mark.parametrize("flag, error", [("0", "--max-model-len must be at least 1"),
                                          ("99999", "--max-model-len: max_model_len must be between 1 and 2048")])
def test_a_bad_max_model_len_is_a_flag_error_not_a_traceback(flag, error):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pagefleet", "gateway", "--port", "0", "--max-model-len", flag],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and error in run.stderr and "Traceback" not in run.stderr, run.stderr[-1500:]


def test_a_gateway_chosen_id_lands_in_a_shard_with_workers():
    """A model on two shards, one with its workers down: every request without the client's own
    id whose id hashed there waited until its deadline while the other shard stood idle. The
    gateway draws its ids in shards with workers (a client's own id keeps its shard: its retries
    and Cancel find it there); not knowing yet, or none anywhere, any shard."""
    from types import SimpleNamespace

    from pagefleet.common.redis import Keys
    from pagefleet.gateway.core import GatewayCore

    core = GatewayCore.__new__(GatewayCore)
    core.shards = [Keys("ns", s) for s in ("s0", "s1", "s2")]
    core.readers = {s: SimpleNamespace(num_workers=n) for s, n in (("s0", 2), ("s1", 0), ("s2", None))}
    for choices in (1, 2):  # 32 draws: the odds that none fits, (5/9)^32, are 1e-8
        for _ in range(200):
            rid = core.new_id("cmpl-", choices)
            assert rid.startswith("cmpl-")
            ids = [rid] if choices == 1 else [f"{rid}-{k}" for k in range(choices)]
            assert all(core.shard_of(i).shard != "s1" for i in ids)
    core.readers["s0"].num_workers = core.readers["s2"].num_workers = 0  # none anywhere: any shard
    assert {core.shard_of(core.new_id()).shard for _ in range(200)} == {"s0", "s1", "s2"}
