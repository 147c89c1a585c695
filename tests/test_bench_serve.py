"""``pagefleet bench serve``: datasets, traffic and metrics without a server; then small
real runs (the gRPC backend against a local cluster; the OpenAI backend against
pagefleet's HTTP door and, marked slow, against ``transformers serve``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagefleet.bench import serve
from pagefleet.bench.backends import OpenAIBackend, Sampling
from pagefleet.bench.checkpoint import train_tokenizer
from pagefleet.bench.datasets import (
    SEPARATOR,
    SampleRequest,
    add_dataset_args,
    random_requests,
    sample_requests,
    shared_prefix_requests,
    sharegpt_requests,
    short_chat_requests,
)
from pagefleet.bench.loadgen import arrival_times
from pagefleet.bench.serve_metrics import (
    RequestResult,
    calculate_metrics,
    length_checks,
    parse_goodput,
)
from pagefleet.bench.tokenizer import ByteTokenizer, FileTokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> FileTokenizer:
    """A small byte-level BPE with a BOS post-processor, trained here."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(seed=0, vocab_size=512, num_sentences=2000).save(str(path))
    return FileTokenizer(path)


@pytest.fixture(params=["tiny", "bpe"])
def tok(request, bpe):
    return ByteTokenizer() if request.param == "tiny" else bpe


def seen_by_server(tok, prompt: str) -> int:
    return len(tok.encode(prompt)) + tok.num_special_tokens


# -- datasets ---------------------------------------------------------------------------------
def test_random_is_seeded_and_exactly_as_long_as_asked(tok):
    a = random_requests(tok, 20, input_len=96, output_len=24, seed=7)
    assert a == random_requests(tok, 20, input_len=96, output_len=24, seed=7)
    assert a != random_requests(tok, 20, input_len=96, output_len=24, seed=8)
    assert tok.num_special_tokens == 1  # both add a BOS, which counts in prompt_len
    for r in a:
        assert r.prompt_len == 96 == seen_by_server(tok, r.prompt)
        assert r.expected_output_len == 24
    assert len({r.prompt for r in a}) > 10  # offsets drawn from the allowed ids: a few may repeat


def test_random_range_ratio_and_prefix(tok):
    reqs = random_requests(tok, 200, input_len=65, output_len=40, range_ratio=0.5, prefix_len=8, seed=1)
    # vLLM's bounds: [floor(64 * 0.5), ceil(64 * 1.5)] sampled tokens, after the prefix and the BOS.
    ins = [r.prompt_len - 8 - 1 for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 32 and max(ins) <= 96 and len(set(ins)) > 20
    assert min(outs) >= 20 and max(outs) <= 60 and len(set(outs)) > 20
    for r in reqs:
        assert r.prompt_len == seen_by_server(tok, r.prompt)
    prefixes = {tuple(tok.encode(r.prompt)[:8]) for r in reqs}
    assert len(prefixes) == 1


def test_random_rejects_bad_ratio(tok):
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tok, 1, 16, 4, range_ratio=1.0)


def test_shared_prefix_groups_share_their_system_prompt_tokens(tok):
    reqs = shared_prefix_requests(tok, num_groups=3, prompts_per_group=4, system_prompt_len=48,
                                  question_len=12, output_len=9, seed=3)
    assert reqs == shared_prefix_requests(tok, 3, 4, 48, 12, 9, seed=3)
    assert len(reqs) == 12
    assert sorted(r.group for r in reqs) == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled, as SGLang does
    sep = len(tok.encode(SEPARATOR))
    by_group: dict[int, set] = {}
    for r in reqs:
        assert r.expected_output_len == 9
        assert r.prompt_len == 48 + sep + 12 + 1 == seen_by_server(tok, r.prompt)
        ids = tok.encode(r.prompt)
        by_group.setdefault(r.group, set()).add(tuple(ids[:48]))
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({p for prefixes in by_group.values() for p in prefixes}) == 3


def test_short_chat_turns_are_seeded_and_short(tok):
    reqs = short_chat_requests(tok, 400, seed=5)
    assert reqs == short_chat_requests(tok, 400, seed=5)
    assert reqs != short_chat_requests(tok, 400, seed=6)
    words = [len(r.prompt.split()) for r in reqs]
    assert min(words) == 10 and max(words) == 90  # 400 draws of 81 values reach both ends
    assert len(set(words)) > 50
    assert all(r.prompt_len == seen_by_server(tok, r.prompt) for r in reqs)
    outs = np.array([r.expected_output_len for r in reqs])
    most = (outs >= 8) & (outs <= 48)
    assert 0.8 <= most.mean() <= 0.97 and outs.min() == 8
    assert outs[~most].min() > 48 and outs.max() <= 4 * 48
    assert len({r.prompt for r in reqs}) == len(reqs)
    narrow = short_chat_requests(tok, 50, min_words=3, max_words=3, min_output=2, max_output=2, seed=0)
    assert {len(r.prompt.split()) for r in narrow} == {3}
    assert {r.expected_output_len for r in narrow} <= {2, *range(3, 9)}


def test_short_chat_rejects_bad_ranges(tok):
    with pytest.raises(ValueError, match="short-chat-min-words"):
        short_chat_requests(tok, 4, min_words=20, max_words=10)
    with pytest.raises(ValueError, match="short-chat-min-output"):
        short_chat_requests(tok, 4, min_output=0)
    with pytest.raises(ValueError, match="num-prompts"):
        short_chat_requests(tok, 0)


def test_short_chat_from_the_command_line(tok):
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    args = p.parse_args(["--dataset", "short-chat", "--num-prompts", "12", "--seed", "2",
                         "--short-chat-max-words", "20"])
    reqs = sample_requests(args, tok)
    assert reqs == short_chat_requests(tok, 12, 10, 20, 8, 48, seed=2)


def _conversation(human: str, gpt: str | None) -> dict:
    turns = [{"from": "human", "value": human}] + ([{"from": "gpt", "value": gpt}] if gpt is not None else [])
    return {"id": human[:8], "conversations": turns}


@pytest.fixture
def sharegpt_file(tmp_path) -> Path:
    data = [_conversation(f"question {i}: how do the {i} lanterns glow at night?",
                          "they glow " + "softly " * (i + 2)) for i in range(6)]
    data += [_conversation("only one turn here", None), _conversation("hi", "ok"),
             _conversation("long " * 1100, "fine answer here")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_from_a_file(tok, sharegpt_file):
    reqs = sharegpt_requests(tok, sharegpt_file, num_prompts=4, seed=0)
    assert reqs == sharegpt_requests(tok, sharegpt_file, num_prompts=4, seed=0)
    assert len(reqs) == 4
    data = {c["conversations"][0]["value"]: c["conversations"][1]["value"]
            for c in json.loads(sharegpt_file.read_text()) if len(c["conversations"]) == 2}
    for r in reqs:
        assert r.prompt.startswith("question ")  # the one-turn, too-short and too-long ones are skipped
        assert r.prompt_len == seen_by_server(tok, r.prompt)
        assert r.expected_output_len == seen_by_server(tok, data[r.prompt])  # vLLM counts the BOS too
    fixed = sharegpt_requests(tok, sharegpt_file, num_prompts=10, output_len=5, seed=0)
    assert len(fixed) == 10 and {r.expected_output_len for r in fixed} == {5}  # six fit: drawn again
    assert {r.prompt for r in fixed} == {p for p in data if p.startswith("question ")}


# -- traffic ----------------------------------------------------------------------------------------
def test_arrival_times():
    assert arrival_times(5, math.inf) == [0.0] * 5
    even = arrival_times(4, 2.0, burstiness=math.inf)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_times(200, 10.0, seed=1)
    assert poisson == arrival_times(200, 10.0, seed=1) != arrival_times(200, 10.0, seed=2)
    assert poisson == sorted(poisson) and poisson[-1] == pytest.approx(20.0)  # rescaled to n / rate
    gaps = np.diff(arrival_times(2000, 10.0, burstiness=0.25, seed=1))
    assert np.std(gaps) / np.mean(gaps) > 1.5  # gamma of shape 0.25: CV 2
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


# -- metrics -------------------------------------------------------------------------------------------
def _result(ttft, itl, out, start=0.0, prompt=10, ok=True) -> RequestResult:
    return RequestResult(success=ok, start_time=start, ttft=ttft, itl=list(itl), latency=ttft + sum(itl),
                         prompt_len=prompt, output_tokens=out, expected_output_len=out)


def test_metrics_math():
    results = [
        _result(0.100, [0.010, 0.010, 0.010], 4, start=0.0),   # tpot 10 ms, e2el 130 ms
        _result(0.200, [0.020, 0.040], 3, start=0.1),           # tpot 30 ms, e2el 260 ms
        _result(0.300, [], 1, start=0.2),                       # one token: no TPOT, no ITL
        _result(0.050, [0.050], 4, start=0.3),                  # one chunk of 3 tokens: tpot 50/3 ms
        _result(9.0, [], 0, ok=False),                          # failed: counted apart
    ]
    m = calculate_metrics(results, duration_s=2.0, metric_percentiles=[50, 99],
                          goodput_ms={"ttft": 250, "tpot": 20})
    assert (m["completed"], m["failed"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 12)
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 6.0 and m["total_token_throughput"] == 26.0
    ttft = np.array([100, 200, 300, 50.0])
    assert m["mean_ttft_ms"] == pytest.approx(ttft.mean())
    assert m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["std_ttft_ms"] == pytest.approx(ttft.std())
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99))  # linear interpolation: 297
    assert m["p99_ttft_ms"] == pytest.approx(297.0)  # 200 + 0.97 * (300 - 200)
    tpot = [10.0, 30.0, 50 / 3]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpot)) and m["median_tpot_ms"] == pytest.approx(50 / 3)
    itl = [10, 10, 10, 20, 40, 50.0]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itl)) and m["p50_itl_ms"] == pytest.approx(15.0)
    assert m["median_e2el_ms"] == pytest.approx(np.median([130, 260, 300, 100.0]))
    # goodput: TTFT <= 250 ms and TPOT <= 20 ms (0 for a one-token request): the 1st and 4th.
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert calculate_metrics(results, 2.0)["request_goodput"] is None
    # vLLM's peaks: token chunks in the busiest second (all here: 4 + 3 + 1 + 2), requests in flight.
    assert m["max_concurrent_requests"] == 3 and m["max_output_tokens_per_s"] == 10.0
    only = calculate_metrics(results, 2.0, percentile_metrics=["ttft"])
    assert "mean_ttft_ms" in only and "mean_itl_ms" not in only


def test_metrics_of_nothing_are_zero():
    m = calculate_metrics([_result(1.0, [], 0, ok=False)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0


def test_goodput_flags_and_length_checks():
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:1000"]) == {"ttft": 200, "tpot": 50.5, "e2el": 1000}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    rs = [_result(0.1, [0.1], 2), _result(0.1, [0.1], 2, prompt=11), _result(0.1, [], 1)]
    rs[2].expected_output_len = 2
    assert length_checks(rs, [10, 10, 10]) == {"num_output_len_mismatch": 1, "num_prompt_len_mismatch": 1}


# -- the OpenAI backend's stream parsing, on a canned stream --------------------------------------------
def _httpx_or_skip():
    from pagefleet.bench.backends import _httpx

    try:
        return _httpx()
    except ImportError:
        pytest.skip("neither httpx2 nor httpx is installed")


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


@pytest.mark.parametrize("chat", [False, True])
def test_openai_backend_reads_chunks_usage_and_done(chat):
    httpx = _httpx_or_skip()
    seen = {}

    def choice(text, finish=None):
        c = {"index": 0, "finish_reason": finish}
        c.update({"delta": {"content": text}} if chat else {"text": text})
        return c

    def handler(request):
        seen["body"] = json.loads(request.content)
        first = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]} if chat else {"choices": [choice("He")]}
        body = _sse(first, {"choices": [choice("He" if chat else "llo")]}, {"choices": [choice(" world")]},
                    # the final chunk carries both the finish reason and the usage (transformers serve's way)
                    {"choices": [choice("", "length")], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
                    b"[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    backend = OpenAIBackend("http://x", "/v1/chat/completions" if chat else "/v1/completions", "m",
                            Sampling(0.0, True, {"seed": 1}))
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    req = SampleRequest("Hi there", prompt_len=5, expected_output_len=3)
    r = asyncio.run(backend.send(req))
    asyncio.run(backend.aclose())
    assert r.success and r.error == ""
    assert r.output_tokens == 3 and r.prompt_len == 7  # the server's counts win
    assert len(r.itl) == (1 if chat else 2)  # role-only and finish-only chunks carry no token
    assert r.generated_text == ("He world" if chat else "Hello world")
    body = seen["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["seed"] == 1
    assert (body["max_completion_tokens"] if chat else body["max_tokens"]) == 3


def test_openai_backend_failures():
    httpx = _httpx_or_skip()
    replies = iter([httpx.Response(422, content=b'{"detail": "no"}'),
                    httpx.Response(200, content=_sse({"choices": [{"text": "a"}]}))])  # no finish reason
    backend = OpenAIBackend("http://x", "/v1/completions", "m", Sampling())
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: next(replies)))
    req = SampleRequest("Hi", 2, 4)
    first, second = asyncio.run(backend.send(req)), asyncio.run(backend.send(req))
    assert not first.success and first.error.startswith("HTTP 422")
    assert not second.success and "finish reason" in second.error


# -- real runs ---------------------------------------------------------------------------------------------
EXPECTED_KEYS = {"date", "backend", "model_id", "num_prompts", "request_rate", "max_concurrency", "duration",
                 "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "request_goodput", "output_throughput", "total_token_throughput", "num_output_len_mismatch",
                 "num_prompt_len_mismatch", "input_lens", "output_lens", "ttfts", "itls", "errors"}
EXPECTED_KEYS |= {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}


def _run(argv: list[str], result_dir: Path) -> dict:
    args = [*argv, "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", "run.json", "--disable-tqdm"]
    assert serve.main(args) == 0
    assert (result_dir / "run.png").stat().st_size > 0
    return json.loads((result_dir / "run.json").read_text())


SMALL_TRACE = ["--model", "tiny", "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "8",
               "--random-range-ratio", "0.5", "--max-concurrency", "3", "--request-rate", "50",
               "--ignore-eos", "--temperature", "0", "--goodput", "ttft:5000", "tpot:1000"]


def test_grpc_backend_against_a_local_cluster(tmp_path):
    doc = _run(["--backend", "grpc", "--device", "cpu", "--num-blocks", "256", *SMALL_TRACE,
                "--compare-in-process", "--probe", "3", "--num-warmups", "2"], tmp_path)
    assert set(doc) >= EXPECTED_KEYS
    assert doc["completed"] == 6 and doc["failed"] == 0 and doc["errors"] == [""] * 6
    assert doc["num_output_len_mismatch"] == 0 and doc["num_prompt_len_mismatch"] == 0
    asked = [r.expected_output_len for r in random_requests(ByteTokenizer(), 6, 40, 8, 0.5, seed=0)]
    assert doc["output_lens"] == asked and doc["total_output_tokens"] == sum(asked)
    assert doc["request_goodput"] is not None and doc["output_throughput"] > 0
    assert doc["in_process"]["completed"] == 6 and doc["cluster_throughput_ratio"] > 0
    assert len(doc["probe_ttft_ms"]) == 3 and "path_added_ttft_p50_ms" in doc


def _has_http_door() -> bool:
    from dataclasses import fields

    from pagefleet.launcher import ClusterConfig

    return "http_port" in {f.name for f in fields(ClusterConfig)}


@pytest.fixture(scope="module")
def http_cluster():
    from pagefleet.bench.servers import local_cluster

    if not _has_http_door():
        pytest.skip("this launcher has no OpenAI HTTP door yet")
    cluster = local_cluster("tiny", device="cpu", num_blocks=256, http=True)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_openai_backend_against_pagefleets_http_door(http_cluster, tmp_path, endpoint):
    doc = _run(["--backend", "openai", "--base-url", http_cluster.http_url, "--endpoint", endpoint,
                *SMALL_TRACE], tmp_path)
    assert doc["completed"] == 6 and doc["num_output_len_mismatch"] == 0
    if endpoint == "/v1/completions":
        assert set(doc) >= EXPECTED_KEYS and doc["num_prompt_len_mismatch"] == 0
    else:  # the chat template adds tokens to every prompt: not the dataset's count, not checked
        assert set(doc) >= EXPECTED_KEYS - {"num_prompt_len_mismatch"}
        asked = [r.prompt_len for r in random_requests(ByteTokenizer(), 6, 40, 8, 0.5, seed=0)]
        assert all(seen > a for seen, a in zip(doc["input_lens"], asked, strict=True))


def _can_run_transformers_serve() -> bool:
    from pagefleet.bench.compare import preflight

    return preflight() is None


@pytest.mark.slow
@pytest.mark.skipif(not (_has_http_door() and _can_run_transformers_serve()),
                    reason="needs pagefleet's HTTP door, `transformers serve` and accelerate")
def test_compare_with_transformers_serve(tmp_path):
    doc = _run(["--compare", "transformers", "--num-prompts", "8", "--random-input-len", "32",
                "--random-output-len", "8", "--max-concurrency", "4", "--greedy-checks", "2"], tmp_path)
    assert set(doc["runs"]) == {"pagefleet", "transformers"}
    for run in doc["runs"].values():
        assert run["completed"] == 8 and run["num_output_len_mismatch"] == 0 and run["num_prompt_len_mismatch"] == 0
    assert doc["greedy_check"]["agree"] == [True, True]
    assert doc["summary"]["output_throughput_ratio"] > 0


def test_every_bench_command_resolves_and_the_shared_prefix_flags_have_one_spelling():
    """``pagefleet bench <name>`` for every name routes to a module with ``main`` (the studies now
    live in ``pagefleet.benchmarks``); the shared-prefix workload's flags are ``--gsp-*`` for
    every command, the older ``--sp-*`` still accepted."""
    import importlib

    from pagefleet.bench import SUITES

    assert {"decode", "engine", "kernels", "preemption", "reliability", "scheduler", "serve", "sim-fit",
            "study"} <= set(SUITES)
    for name in ("reliability", "scheduler", "serve", "sim-fit", "study"):  # the torch-free ones
        assert callable(importlib.import_module(SUITES[name]).main), name
    from pagefleet.benchmarks.fleet import study

    new = study.build_parser().parse_args(["--gsp-num-groups", "3", "--gsp-system-prompt-len", "64"])
    old = study.build_parser().parse_args(["--sp-groups", "3", "--sp-system-len", "64"])
    assert (new.gsp_num_groups, new.gsp_system_prompt_len) == (old.gsp_num_groups, old.gsp_system_prompt_len) == (3, 64)
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    assert p.parse_args(["--sp-groups", "5"]).gsp_num_groups == 5
