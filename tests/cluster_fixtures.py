"""Helpers for the cluster tests: real processes on loopback, bounded waits, references."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagefleet.client import Client, Completion
from pagefleet.launcher import ClusterConfig, LocalCluster

PROMPTS = [f"request {i}: the quick brown fox {'jumps ' * (i % 4)}over the lazy dog" for i in range(16)]


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05):
    """``cond()``'s first truthy value, polled every ``every_s``; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def start_cluster(log_dir: Path, **kwargs) -> LocalCluster:
    cfg = ClusterConfig(port=0, log_dir=str(log_dir), device="cpu", **kwargs)
    cluster = LocalCluster(cfg)
    try:
        return cluster.start(timeout_s=90)
    except BaseException:
        cluster.stop()
        raise


def reference(prompts: list[str], max_tokens: int, **engine_kwargs) -> list[list[int]]:
    """Greedy tokens of the in-process engine."""
    from pagefleet import Engine, SamplingParams

    engine = Engine(model="tiny", device="cpu", **engine_kwargs)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def generate_all(target: str, prompts: list[str], max_tokens: int, **kwargs) -> list[Completion]:
    """Every prompt at once (one thread each); ``Completion.add`` checks indices are contiguous."""
    with Client(target) as c, ThreadPoolExecutor(len(prompts)) as pool:
        kwargs = {"temperature": 0, **kwargs}
        futs = [pool.submit(c.generate, p, max_tokens=max_tokens, ignore_eos=True, timeout=120, **kwargs)
                for p in prompts]
        return [f.result() for f in futs]


def log_events(log_dir: Path, name: str) -> list[dict]:
    events = []
    path = Path(log_dir) / f"{name}.log"
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def worker_reports(cluster: LocalCluster) -> dict[str, object]:
    return {w.worker_id: w.report for w in cluster.scheduler_state().workers}


def http_json(url: str, body: dict | None = None, timeout_s: float = 60) -> tuple[int, dict]:
    """GET ``url`` (or POST ``body`` as JSON): the HTTP status and the JSON answer, errors included."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
