"""The gateway's served models and their shards, from its flags (``gateway/models.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagefleet.gateway.models import ServedModel, UnknownModel, served_models


def test_one_model_is_shard_s0_and_several_get_a_shard_each():
    assert served_models(None) == [ServedModel("tiny", "tiny", ("s0",))]
    assert served_models(["tiny"], ["my-tiny"]) == [ServedModel("my-tiny", "tiny", ("s0",))]
    assert served_models(["tiny", "llama=/ckpt/llama"]) == [
        ServedModel("tiny", "tiny", ("s0",)), ServedModel("llama", "/ckpt/llama", ("s1",))]
    assert served_models(["a=tiny", "b=/x"], shards=["b=s7,s8"])[1].shards == ("s7", "s8")
    assert served_models(["/path/with=sign"])[0] == ServedModel("/path/with=sign", "/path/with=sign", ("s0",))


@pytest.mark.parametrize("models, names, shards, error", [
    (["tiny", "tiny"], None, None, "served twice"),
    (["a=tiny", "b=tiny"], None, ["a=s0", "b=s0"], "serves both"),
    (["a=tiny"], None, ["c=s1"], "expected MODEL=SHARD"),
    (["a=tiny"], None, ["a=bad{tag}"], "hash tag"),
    (["a="], None, None, "no checkpoint"),
    (["tiny"], ["x", "y"], None, "--served-model-name given 2 times"),
])
def test_bad_flags_say_what_is_wrong(models, names, shards, error):
    with pytest.raises(ValueError, match=error):
        served_models(models, names, shards)


def test_an_unknown_model_names_the_served_ones():
    assert "`a`, `b`" in str(UnknownModel("c", ["a", "b"])) and "`c`" in str(UnknownModel("c", ["a", "b"]))
    assert "required" in str(UnknownModel(None, ["a", "b"]))


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
