"""KV that moves between worker processes, on the real CPU engine (tiny model) over NIXL:
drain by migration (SIGTERM), the scheduler's Migrate calls, ownership moved in Redis at the
handover. Tokens are identical to an undisturbed run, greedy and seeded; none recomputed."""

from __future__ import annotations

import signal
import threading

import pytest
from cluster_fixtures import PROMPTS, generate_all, log_events, reference, start_cluster, wait_for

from pagefleet import Engine, SamplingParams

MAX_TOKENS = 128
SEED = 1234


def seeded_reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    engine = Engine(model="tiny", device="cpu")
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=SEED + i, ignore_eos=True)
              for i in range(len(prompts))]
    return [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def run_seeded(target: str, prompts: list[str], max_tokens: int):
    from concurrent.futures import ThreadPoolExecutor

    from pagefleet.client import Client

    with Client(target) as c, ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(c.generate, p, max_tokens=max_tokens, ignore_eos=True, timeout=120, temperature=0.9,
                            top_p=0.95, seed=SEED + i) for i, p in enumerate(prompts)]
        return [f.result() for f in futs]


@pytest.fixture
def kv_cluster(tmp_path):
    c = start_cluster(tmp_path, num_workers=2, worker_args=["--num-blocks", "256", "--kv-transfer", "nixl"],
                      scheduler_args=["--dead-after", "3.0"])
    c.log_dir = tmp_path
    yield c
    c.stop()


def busy_worker(cluster, at_least: int = 2) -> str | None:
    for w in cluster.scheduler_state().workers:
        if len(w.report.blocks_per_request) >= at_least:
            return w.worker_id
    return None


@pytest.mark.timeout(240)
def test_drain_by_migration_moves_every_request_with_its_kv_tokens_identical(kv_cluster):
    """SIGTERM a worker under load: its running requests move to the other worker with their
    KV (the scheduler's Migrate calls); every token arrives once, in order, as undisturbed."""
    greedy, seeded = PROMPTS[:4], PROMPTS[4:8]
    results: dict[str, list] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__(
            "greedy", generate_all(kv_cluster.gateway_target, greedy, MAX_TOKENS))),
        threading.Thread(target=lambda: results.__setitem__(
            "seeded", run_seeded(kv_cluster.gateway_target, seeded, MAX_TOKENS))),
    ]
    for t in threads:
        t.start()
    name = wait_for(lambda: busy_worker(kv_cluster), 60, "a worker with requests mid-generation", every_s=0.02)
    kv_cluster.kill(name, signal.SIGTERM, wait_s=60)
    for t in threads:
        t.join(180)
    assert [o.token_ids for o in results["greedy"]] == reference(greedy, MAX_TOKENS)
    assert [o.token_ids for o in results["seeded"]] == seeded_reference(seeded, MAX_TOKENS)
    assert all(o.finish_reason == "length" for o in (*results["greedy"], *results["seeded"]))
    (drained,) = [e for e in log_events(kv_cluster.log_dir, name) if e.get("event") == "worker.drained"]
    assert drained["by_migration"] and drained["num_migrated"] >= 2
    assert drained["num_recomputed"] == 0, "the other worker had room: nothing recomputed"
    state = kv_cluster.scheduler_state()
    assert state.num_migrated >= 2 and state.num_reassigned == 0 and state.num_transfers_expired == 0
    ended = [e for e in log_events(kv_cluster.log_dir, "scheduler") if e.get("event") == "transfer.ended"]
    assert {e["reason"] for e in ended} == {"drain"} and sum(e["outcome"] == "migrated" for e in ended) >= 2
