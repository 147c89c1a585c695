"""``pagefleet bench serve``: online serving, measured as ``vllm bench serve`` measures it.

Sends a dataset's requests (``--dataset-name random | shared-prefix | sharegpt | short-chat``) at
``--request-rate`` (Poisson, or gamma with ``--burstiness``), at most ``--max-concurrency``
at a time, and times every token at the client: TTFT, TPOT, ITL, E2EL (mean, median and
``--metric-percentiles`` of ``--percentile-metrics``), request / output / total token
throughput and ``--goodput`` (requests/s within the SLOs). Same flags, same definitions
and the same JSON names as vLLM's, so figures compare with published ones.

Where:
* ``--backend openai --base-url http://HOST:PORT`` (``--endpoint /v1/completions`` or
  ``/v1/chat/completions``): any OpenAI-compatible server, pagefleet's HTTP door included;
* ``--backend grpc --base-url HOST:PORT``: a pagefleet gateway, with ``pagefleet.client``;
* no ``--base-url``: a local pagefleet cluster started here (``--workers``, ``--model``).
  Then also ``--compare-in-process`` (the same trace through an ``Engine`` in this
  process: what the cluster's path costs) and ``--probe N`` (N one-token requests one at
  a time to both: the TTFT the path adds).
* ``--compare transformers``: on one checkpoint written here (a small random Llama, a
  BPE tokenizer trained here, a chat template), ``pagefleet up`` through its OpenAI door
  and ``transformers serve --continuous-batching``, one after the other, the same trace
  and the same client; first a few greedy requests to both, whose texts must agree.

Prompts are the dataset's text, each exactly ``prompt_len`` tokens for the model's
tokenizer (``--tokenizer``); ``--ignore-eos`` with ``max_tokens`` makes every output its
asked length, and the run counts those that are not. ``--save-result`` writes the JSON
(``--result-dir``, ``--result-filename``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import platform
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from .backends import GrpcBackend, OpenAIBackend, Sampling, first_model
from .datasets import SampleRequest, add_dataset_args, sample_requests
from .loadgen import arrival_times, probe_ttft, run_trace, warm_up
from .serve_metrics import (
    METRICS,
    RequestResult,
    calculate_metrics,
    format_report,
    length_checks,
    parse_goodput,
    parse_list,
)

PROBE_PROMPT = "probe {i}: " + "z" * 32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench serve", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--backend", default="openai", choices=("openai", "grpc"), help="how requests are sent")
    s.add_argument("--base-url", default=None,
                   help="the server (openai: http://HOST:PORT; grpc: HOST:PORT); default: start a local cluster")
    s.add_argument("--endpoint", default="/v1/completions", help="openai: /v1/completions or /v1/chat/completions")
    s.add_argument("--model", default=None,
                   help="the model: its name at the server (default: the first of /v1/models) and, without "
                        "--base-url, what the local cluster loads ('tiny' or a checkpoint directory; default tiny)")
    s.add_argument("--served-model-name", default=None, help="the model's name in requests, if not --model")
    s.add_argument("--tokenizer", default=None, help="'tiny', a checkpoint directory or tokenizer.json (default: --model)")
    s.add_argument("--workers", type=int, default=1, help="local cluster: workers")
    s.add_argument("--device", default="auto", help="local cluster and in-process engine: device")
    s.add_argument("--num-blocks", type=int, default=None, help="local cluster and in-process engine: KV blocks")
    add_dataset_args(p)
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests out at once")
    t.add_argument("--num-warmups", type=int, default=0, help="copies of the first request sent before the run")
    r = p.add_argument_group("requests")
    r.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    r.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    r.add_argument("--extra-body", type=json.loads, default=None, help="openai: JSON merged into every request body")
    m = p.add_argument_group("metrics and results")
    m.add_argument("--percentile-metrics", default=",".join(METRICS), help="metrics to report: ttft,tpot,itl,e2el")
    m.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99")
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    m.add_argument("--save-result", action="store_true", help="write the JSON (and a PNG beside it)")
    m.add_argument("--save-detailed", action="store_true", help="with per-request timings, lengths and texts")
    m.add_argument("--result-dir", default=None, help="where the JSON goes (default: here)")
    m.add_argument("--result-filename", default=None, help="its name (default: LABEL-RATEqps[-concurrencyC]-MODEL-TIME.json)")
    m.add_argument("--label", default=None, help="first part of the default file name (default: --backend)")
    m.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    c = p.add_argument_group("comparisons")
    c.add_argument("--compare-in-process", action="store_true",
                   help="local cluster only: the same trace through an Engine in this process as well")
    c.add_argument("--probe", type=int, default=0, metavar="N",
                   help="local cluster only: N sequential one-token requests to the cluster and in-process")
    c.add_argument("--compare", default=None, choices=("transformers",),
                   help="pagefleet against `transformers serve` on one checkpoint made here, side by side")
    c.add_argument("--greedy-checks", type=int, default=4, help="--compare: greedy requests whose texts must agree")
    return p


# -- one run ----------------------------------------------------------------------------------
async def measure(backend, requests: list[SampleRequest], args, label: str) -> tuple[list[RequestResult], float]:
    await warm_up(backend, requests[0], args.num_warmups, args.max_concurrency)
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    return await run_trace(backend, requests, arrivals, args.max_concurrency, label=label,
                           progress=not args.disable_tqdm)


def summarize(name: str, results: list[RequestResult], duration: float, requests: list[SampleRequest], args,
              check_prompt_len: bool) -> dict:
    """The run's metrics and length checks; printed in vLLM's layout."""
    pm = parse_list(args.percentile_metrics, METRICS)
    metrics = calculate_metrics(results, duration, percentile_metrics=pm,
                                metric_percentiles=[float(x) for x in parse_list(args.metric_percentiles)],
                                goodput_ms=parse_goodput(args.goodput))
    metrics.update(length_checks(results, [r.prompt_len for r in requests] if check_prompt_len else None))
    print(format_report(name, metrics, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                        percentile_metrics=pm))
    for key, what in (("num_output_len_mismatch", "came back with another output length than asked"),
                      ("num_prompt_len_mismatch", "were counted by the server with another prompt length")):
        if metrics.get(key) and (key != "num_output_len_mismatch" or args.ignore_eos):
            print(f"WARNING: {metrics[key]} requests {what}")
    failed = [r.error for r in results if not r.success]
    for i, err in enumerate(failed[:5]):
        print(f"failed request {i}: {err[:300]}")
    return metrics


def per_request(results: list[RequestResult]) -> dict:
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def run_config(args, model_id: str, num_prompts: int) -> dict:
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend, "endpoint": args.endpoint, "base_url": args.base_url,
        "model_id": model_id, "tokenizer_id": args.tokenizer or model_id,
        "dataset_name": args.dataset_name, "num_prompts": num_prompts, "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate != math.inf else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos, "temperature": args.temperature, "num_warmups": args.num_warmups,
        "command": shlex.join(["pagefleet", "bench", "serve", *args.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {name: _version(name) for name in ("pagefleet", "torch", "transformers")},
        "load_average_at_start": os.getloadavg()[0],
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def result_path(args, model_id: str, label: str) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{label}-{args.request_rate}qps{conc}-{Path(model_id).name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Path(args.result_dir or ".") / name


def save(doc: dict, runs: dict[str, list[RequestResult]], metrics: dict[str, dict], args, model_id: str,
         label: str, title: str) -> None:
    from .serve_plot import plot

    doc["load_average_at_end"] = os.getloadavg()[0]  # other work on the machine skews the figures
    path = result_path(args, model_id, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=lambda o: asdict(o)))
    print(f"JSON: {path}")
    png = path.with_suffix(".png")
    print(f"plot: {png}" if plot(runs, metrics, png, title) else "plot: skipped (no matplotlib)")


def counts_prompt_as_sent(args) -> bool:
    """Whether the server's prompt count should be the dataset's: not through a chat template."""
    return args.backend == "grpc" or not args.endpoint.rstrip("/").endswith("chat/completions")


def make_backend(args, base_url: str, model: str, sampling: Sampling):
    if args.backend == "grpc":
        return GrpcBackend(base_url, sampling)
    conns = args.max_concurrency or max(1, args.num_prompts)
    return OpenAIBackend(base_url, args.endpoint, model, sampling, max_connections=conns)


def run_single(args) -> int:
    from .servers import local_cluster
    from .tokenizer import load_tokenizer

    local = args.base_url is None
    if not local and (args.compare_in_process or args.probe):
        raise SystemExit("--compare-in-process and --probe start their own cluster: leave out --base-url")
    model = args.model or ("tiny" if local else None)
    if model is None and args.backend == "openai":
        model = asyncio.run(first_model(args.base_url))
    if model is None and not args.tokenizer:
        raise SystemExit("--backend grpc with --base-url: give --model or --tokenizer for the prompts")
    tok = load_tokenizer(args.tokenizer or model)
    requests = sample_requests(args, tok)
    sampling = Sampling(args.temperature, args.ignore_eos, args.extra_body or {})
    probes = [SampleRequest(PROBE_PROMPT.format(i=i), 0, 1) for i in range(args.probe)]
    doc = run_config(args, model, len(requests))
    runs: dict[str, list[RequestResult]] = {}
    metrics: dict[str, dict] = {}

    probe_engine_s: list[float] = []
    if args.compare_in_process or probes:
        in_process, probe_engine_s = _in_process(args, model, requests, sampling, probes)
        if in_process is not None:
            runs["in-process"], metrics["in-process"] = in_process
    cluster = local_cluster(model, workers=args.workers, device=args.device, num_blocks=args.num_blocks,
                            http=args.backend == "openai") if local else None
    try:
        base_url = args.base_url or (cluster.http_url if args.backend == "openai" else cluster.gateway_target)
        name = "pagefleet" if local else args.backend

        async def go():
            # In the loop: a grpc.aio channel belongs to the loop it was made in.
            backend = make_backend(args, base_url, args.served_model_name or model, sampling)
            try:
                out = await measure(backend, requests, args, name)
                return out, await probe_ttft(backend, probes)
            finally:
                await backend.aclose()

        (results, duration), probe_server_s = asyncio.run(go())
    finally:
        if cluster is not None:
            cluster.stop()
    runs[name] = results
    metrics[name] = summarize(name, results, duration, requests, args, check_prompt_len=counts_prompt_as_sent(args))
    doc.update(metrics[name])
    if args.compare_in_process:
        doc["in_process"] = metrics["in-process"]
        ratio = metrics[name]["output_throughput"] / metrics["in-process"]["output_throughput"]
        doc["cluster_throughput_ratio"] = ratio
        print(f"\ncluster output throughput / in-process: {ratio * 100:.1f} %")
    if probes:
        _report_probe(doc, probe_server_s, probe_engine_s)
    print(f"load average (1 min): {doc['load_average_at_start']:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    if args.save_detailed:
        doc.update(per_request(results))
    if args.save_result:
        save(doc, runs, metrics, args, model, args.label or args.backend, f"pagefleet bench serve: {name}")
    return 0 if metrics[name]["completed"] else 1


def _in_process(args, model, requests, sampling, probes):
    """The trace (``--compare-in-process``) and the probes through an Engine in this process:
    ``((results, metrics) or None, probe TTFTs)``. The engine is gone before the cluster starts."""
    from pagefleet import Engine

    from .inprocess import on_thread, probe_engine, run_engine

    engine = Engine(model=model, device=args.device, num_blocks=args.num_blocks)
    warm = [requests[0]] * args.num_warmups
    on_thread(run_engine, engine, warm, [0.0] * len(warm), args.max_concurrency, sampling, progress=False)
    run = None
    if args.compare_in_process:
        arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        results, duration = on_thread(run_engine, engine, requests, arrivals, args.max_concurrency, sampling,
                                      progress=not args.disable_tqdm)
        run = results, summarize("in-process", results, duration, requests, args, check_prompt_len=True)
    probe_s = on_thread(probe_engine, engine, probes) if probes else []
    del engine
    _release_device_memory()
    return run, probe_s


def _release_device_memory() -> None:
    """Give the in-process engine's device memory back, so that the cluster's worker, which sizes
    its KV pool from the memory free on the device, finds it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _report_probe(doc: dict, server_s: list[float], engine_s: list[float] | None) -> None:
    import numpy as np

    doc["probe_ttft_ms"] = [x * 1e3 for x in server_s]
    p50 = float(np.median(server_s)) * 1e3 if server_s else float("nan")
    print(f"\nprobe: {len(server_s)} sequential one-token requests, TTFT p50 {p50:.2f} ms")
    if engine_s:
        doc["probe_in_process_ttft_ms"] = [x * 1e3 for x in engine_s]
        added = p50 - float(np.median(engine_s)) * 1e3
        doc["path_added_ttft_p50_ms"] = added
        print(f"TTFT the path adds (p50, cluster - in-process): {added:.2f} ms")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)  # for the record in the JSON
    try:
        parse_list(args.percentile_metrics, METRICS)
        parse_goodput(args.goodput)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
    except ValueError as e:
        parser.error(str(e))
    if args.compare:
        from .compare import run_compare

        return run_compare(args)
    return run_single(args)
