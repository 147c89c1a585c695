"""``pagefleet bench serve --compare transformers``: two servers, one checkpoint, one trace.

The checkpoint is written here (``checkpoint.make_checkpoint``, from ``--seed``) into a
temp dir; both servers load those files and run on the CPU in float32, one after the
other, so neither shares the machine with the other:

* ``pagefleet up --workers 1 --model DIR --http-port P``, through its OpenAI door;
* ``transformers serve --continuous-batching DIR``.

Each first answers ``--greedy-checks`` short greedy requests one at a time (the same
texts must come back from both: the same model, computed by two implementations), then
``--num-warmups`` copies of the first request, then the trace, all from the same client
with the same requests and arrival times. Outputs are their asked length on both:
pagefleet gets ``ignore_eos``; ``transformers serve`` rejects unknown fields, so it gets a
``generation_config`` whose EOS is a token that does not exist. Greedy (temperature 0)
unless ``--temperature`` says otherwise.

Targets on a CPU: pagefleet's output throughput at least 3x the peer's, and a lower TTFT p50.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
from pathlib import Path

from .backends import OpenAIBackend, Sampling
from .checkpoint import generated_text, make_checkpoint
from .datasets import SampleRequest, sample_requests
from .serve_metrics import RequestResult
from .servers import ServerProcess, pagefleet_up, transformers_serve
from .tokenizer import load_tokenizer

GREEDY_TOKENS = 16
THROUGHPUT_TARGET = 3.0
# What each server needs in a request body to generate past EOS.
IGNORE_EOS_BODY = {
    "pagefleet": {"ignore_eos": True},
    "transformers": {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})},
}


def greedy_prompts(seed: int, n: int) -> list[SampleRequest]:
    return [SampleRequest(text.strip(), 0, GREEDY_TOKENS)
            for text in itertools.islice(generated_text(seed + 1), n)]


async def _serve_one(server: ServerProcess, name: str, model: str, requests: list[SampleRequest],
                     greedy: list[SampleRequest], args) -> tuple[list[str], list[RequestResult], float]:
    from .serve import measure

    body = {**IGNORE_EOS_BODY[name], **(args.extra_body or {})}
    check = OpenAIBackend(server.url, args.endpoint, model, Sampling(0.0, False, body))
    try:
        texts = []
        for req in greedy:
            r = await check.send(req)
            texts.append(r.generated_text if r.success else f"<failed: {r.error[:200]}>")
    finally:
        await check.aclose()
    conns = args.max_concurrency or max(1, len(requests))
    backend = OpenAIBackend(server.url, args.endpoint, model, Sampling(args.temperature, False, body), conns)
    try:
        results, duration = await measure(backend, requests, args, name)
    finally:
        await backend.aclose()
    return texts, results, duration


def describe_checkpoint(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "dtype")
    return {k: cfg.get(k) for k in keys}


def preflight() -> str | None:
    """Why ``transformers serve`` cannot run here, or None (checked before anything starts)."""
    import importlib.util

    from .servers import transformers_cli

    if transformers_cli() is None:
        return "no `transformers` command (pip install 'transformers[serving]')"
    for module in ("fastapi", "uvicorn", "accelerate"):  # accelerate: it loads with a device_map
        if importlib.util.find_spec(module) is None:
            return f"`transformers serve` needs {module} (pip install {module})"
    return None


def side_by_side(metrics: dict[str, dict]) -> str:
    names = list(metrics)
    keys = [k for k in next(iter(metrics.values()))
            if isinstance(next(iter(metrics.values()))[k], int | float) and not k.startswith("std_")]
    lines = [f"{'metric':<34}" + "".join(f"{n:>16}" for n in names)]
    for k in keys:
        cells = "".join(f"{metrics[n][k]:>16.2f}" if isinstance(metrics[n][k], float) else f"{metrics[n][k]:>16}"
                        for n in names)
        lines.append(f"{k:<34}{cells}")
    return "\n".join(lines)


def run_compare(args) -> int:
    from .serve import counts_prompt_as_sent, per_request, run_config, save, summarize

    if args.base_url:
        raise SystemExit("--compare starts both servers itself: leave out --base-url")
    missing = preflight()
    if missing:
        raise SystemExit(f"--compare transformers: {missing}")
    args.ignore_eos = True  # exact output lengths on both sides
    if args.temperature is None:
        args.temperature = 0.0  # greedy, unless asked otherwise
    with tempfile.TemporaryDirectory(prefix="pagefleet-bench-") as tmp:
        ckpt = str(make_checkpoint(Path(tmp) / "model", seed=args.seed))
        tok = load_tokenizer(ckpt)
        requests = sample_requests(args, tok)
        config = run_config(args, "compare-checkpoint", len(requests))
        config["checkpoint"] = describe_checkpoint(Path(ckpt))
        greedy = greedy_prompts(args.seed, args.greedy_checks)
        servers = {"pagefleet": pagefleet_up(ckpt, Path(tmp), num_blocks=args.num_blocks),
                   "transformers": transformers_serve(ckpt, Path(tmp))}
        texts: dict[str, list[str]] = {}
        runs: dict[str, list[RequestResult]] = {}
        metrics: dict[str, dict] = {}
        # The servers run one after the other, so each has its own share of a busy machine.
        load: dict[str, list[float]] = {}
        for name, server in servers.items():
            print(f"\n-- {name}: {' '.join(server.cmd)}")
            load[name] = [os.getloadavg()[0]]
            with server:
                texts[name], runs[name], duration = asyncio.run(
                    _serve_one(server, name, ckpt, requests, greedy, args))
                if not all(r.success for r in runs[name]):
                    rc = server.proc.poll()
                    state = "running" if rc is None else f"exited with {rc}"
                    print(f"{name} ({state}) failed requests; the end of its log:\n{server.log_tail()}")
            load[name].append(os.getloadavg()[0])
            metrics[name] = summarize(name, runs[name], duration, requests, args,
                                      check_prompt_len=counts_prompt_as_sent(args))
    agree = [a == b for a, b in zip(texts["pagefleet"], texts["transformers"], strict=True)]
    pf, tf = metrics["pagefleet"], metrics["transformers"]
    ratio = pf["output_throughput"] / tf["output_throughput"] if tf["output_throughput"] else float("inf")
    summary = {
        "output_throughput_ratio": ratio,
        "ttft_p50_ms": {"pagefleet": pf.get("median_ttft_ms"), "transformers": tf.get("median_ttft_ms")},
        "greedy_agree": sum(agree), "greedy_checks": len(agree),
        "throughput_target_met": ratio >= THROUGHPUT_TARGET,
        "ttft_target_met": pf.get("median_ttft_ms", 0) < tf.get("median_ttft_ms", 0),
    }
    print("\n" + side_by_side(metrics))
    print(f"\ngreedy texts agree: {sum(agree)}/{len(agree)}")
    for i, ok in enumerate(agree):
        if not ok:
            print(f"  prompt {i}: pagefleet {texts['pagefleet'][i]!r}\n            transformers {texts['transformers'][i]!r}")
    print(f"output throughput pagefleet / transformers: {ratio:.2f}x (target >= {THROUGHPUT_TARGET:.0f}x: "
          f"{'met' if summary['throughput_target_met'] else 'missed'})")
    print(f"TTFT p50: pagefleet {pf.get('median_ttft_ms', float('nan')):.1f} ms, transformers "
          f"{tf.get('median_ttft_ms', float('nan')):.1f} ms (target lower: "
          f"{'met' if summary['ttft_target_met'] else 'missed'})")
    print(f"load average (1 min) on {os.cpu_count()} CPUs, before and after each server's run: "
          + ", ".join(f"{n} {a:.1f} -> {b:.1f}" for n, (a, b) in load.items()))
    if args.save_result:
        doc = {**config,
               "servers": {n: s.cmd for n, s in servers.items()},
               "greedy_check": {"prompts": [g.prompt for g in greedy], "texts": texts, "agree": agree},
               "summary": summary,
               "load_average_per_server": load,
               "runs": {n: {**metrics[n], **(per_request(runs[n]) if args.save_detailed else {})} for n in runs}}
        save(doc, runs, metrics, args, "compare-checkpoint", args.label or "compare-transformers",
             f"pagefleet vs transformers serve: {ratio:.2f}x output throughput")
    return 0 if all(m["completed"] for m in metrics.values()) else 1
