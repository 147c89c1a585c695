"""KV that moves between worker processes, on the real CPU engine (tiny model) over NIXL:
drain by migration (SIGTERM), the scheduler's Migrate calls, ownership moved in Redis at the
handover. Tokens are identical to an undisturbed run, greedy and seeded; none recomputed."""

from __future__ import annotations

import signal
import threading

import pytest
from cluster_fixtures import PROMPTS, generate_all, log_events, start_cluster, wait_for

from pagefleet import Engine, SamplingParams

MAX_TOKENS = 128
SEED = 1234


_ENGINE: list[Engine] = []


def _engine() -> Engine:
    """One in-process engine for every reference of this module (an undisturbed, colocated run)."""
    if not _ENGINE:
        _ENGINE.append(Engine(model="tiny", device="cpu"))
    return _ENGINE[0]


def reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    outs = _engine().generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def seeded_reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=SEED + i, ignore_eos=True)
              for i in range(len(prompts))]
    return [_engine().generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def run_seeded(target: str, prompts: list[str], max_tokens: int):
    from concurrent.futures import ThreadPoolExecutor

    from pagefleet.client import Client

    with Client(target) as c, ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(c.generate, p, max_tokens=max_tokens, ignore_eos=True, timeout=120, temperature=0.9,
                            top_p=0.95, seed=SEED + i) for i, p in enumerate(prompts)]
        return [f.result() for f in futs]


@pytest.fixture
def kv_cluster(tmp_path):
    # --drain-timeout 30 (up's is 5): on a loaded machine (a CI run) the migrations had not ended
    # within 5 s, the drain handed the requests back, and they resumed by recompute instead.
    c = start_cluster(tmp_path, num_workers=2,
                      worker_args=["--num-blocks", "256", "--kv-transfer", "nixl", "--drain-timeout", "30"],
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
    KV (the scheduler's Migrate calls); every token arrives once, in order, as undisturbed.
    256 tokens a request: with 128, on a loaded machine the drain came ~70 % through, and three
    of four requests finished at the source before their migrations began."""
    greedy, seeded, max_tokens = PROMPTS[:4], PROMPTS[4:8], 256
    results: dict[str, list] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__(
            "greedy", generate_all(kv_cluster.gateway_target, greedy, max_tokens))),
        threading.Thread(target=lambda: results.__setitem__(
            "seeded", run_seeded(kv_cluster.gateway_target, seeded, max_tokens))),
    ]
    for t in threads:
        t.start()
    name = wait_for(lambda: busy_worker(kv_cluster), 60, "a worker with requests mid-generation", every_s=0.02)
    kv_cluster.kill(name, signal.SIGTERM, wait_s=60)
    for t in threads:
        t.join(180)
    assert [o.token_ids for o in results["greedy"]] == reference(greedy, max_tokens)
    assert [o.token_ids for o in results["seeded"]] == seeded_reference(seeded, max_tokens)
    assert all(o.finish_reason == "length" for o in (*results["greedy"], *results["seeded"]))
    (drained,) = [e for e in log_events(kv_cluster.log_dir, name) if e.get("event") == "worker.drained"]
    assert drained["by_migration"] and drained["num_migrated"] >= 2
    assert drained["num_recomputed"] == 0, "the other worker had room: nothing recomputed"
    state = kv_cluster.scheduler_state()
    assert state.num_migrated >= 2 and state.num_reassigned == 0 and state.num_transfers_expired == 0
    ended = [e for e in log_events(kv_cluster.log_dir, "scheduler") if e.get("event") == "transfer.ended"]
    assert {e["reason"] for e in ended} == {"drain"} and sum(e["outcome"] == "migrated" for e in ended) >= 2


def transfers_ended(cluster, reason: str) -> list[dict]:
    return [e for e in log_events(cluster.log_dir, "scheduler")
            if e.get("event") == "transfer.ended" and e.get("reason") == reason]


@pytest.mark.timeout(240)
def test_the_scheduler_balances_load_by_live_migration(tmp_path):
    """Every request lands on worker-0 (the only one that prefills: worker-1 decodes only); the
    scheduler (--migrate-above) moves running requests to the idle worker-1 with their KV,
    tokens as undisturbed. 256 tokens a request: the three pass 0.3 of the pool about halfway
    (with 128 they passed it only near their end, and a move could find its request finished)."""
    c = start_cluster(tmp_path, num_workers=1, worker_args=["--num-blocks", "96", "--kv-transfer", "nixl"],
                      scheduler_args=["--migrate-above", "0.3", "--migrate-below", "0.2", "--short-prompt-tokens", "0"])
    c.log_dir = tmp_path
    try:
        c.add_worker(["--role", "decode"])
        c.wait_ready(num_workers=2)
        prompts, max_tokens = PROMPTS[8:11], 256
        results = generate_all(c.gateway_target, prompts, max_tokens)
        assert [o.token_ids for o in results] == reference(prompts, max_tokens)
        placed = {e["worker_id"] for e in log_events(c.log_dir, "scheduler") if e.get("event") == "request.placed"}
        assert placed == {"worker-0"}
        moved = [e for e in transfers_ended(c, "balance") if e["outcome"] == "migrated"]
        assert moved and (moved[0]["source"], moved[0]["target"]) == ("worker-0", "worker-1"), moved
        state = c.scheduler_state()
        assert state.num_reassigned == 0
        layouts = {w.report.kv_layout for w in state.workers}  # what the scheduler pairs them by
        assert len(layouts) == 1 and "/16/" in layouts.pop()
    finally:
        c.stop()


@pytest.mark.timeout(240)
def test_prefill_decode_disaggregation_hands_prompts_over_with_their_kv(tmp_path):
    """A prefill worker and a decode worker: long prompts prefill on the first and decode on the
    second (their KV moved at once), short ones prefill on the decode worker; tokens identical
    to a colocated run, greedy and seeded. 128 tokens a request: with 48, on a loaded machine
    two of six finished on the prefill worker before their handoff came."""
    c = start_cluster(tmp_path, num_workers=1, worker_args=["--num-blocks", "256", "--kv-transfer", "nixl",
                                                             "--role", "prefill"],
                      scheduler_args=["--short-prompt-tokens", "40", "--dead-after", "3.0"])
    c.log_dir = tmp_path
    try:
        c.add_worker(["--role", "decode"])
        c.wait_ready(num_workers=2)
        long_prompts = [p + " and runs on into the long grass past the old stone wall" for p in PROMPTS[:3]]
        greedy, seeded = [*long_prompts, "a short one"], [p + " again" for p in long_prompts]
        results: dict[str, list] = {}
        threads = [
            threading.Thread(target=lambda: results.__setitem__("greedy", generate_all(c.gateway_target, greedy, 128))),
            threading.Thread(target=lambda: results.__setitem__("seeded", run_seeded(c.gateway_target, seeded, 128))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [o.token_ids for o in results["greedy"]] == reference(greedy, 128)
        assert [o.token_ids for o in results["seeded"]] == seeded_reference(seeded, 128)
        handed = [e for e in transfers_ended(c, "disaggregation") if e["outcome"] == "migrated"]
        assert len(handed) >= len(long_prompts) * 2 - 1, handed  # one may finish before its handoff
        assert len({e["request_id"] for e in handed}) == len(handed), "each handed over once"
        assert all((e["source"], e["target"]) == ("worker-0", "worker-1") for e in handed)
        placed = {e["request_id"]: e["worker_id"] for e in log_events(c.log_dir, "scheduler")
                  if e.get("event") == "request.placed"}
        short_id = results["greedy"][3].request_id
        assert placed[short_id] == "worker-1", "a short prompt prefills on the decode worker"

        # The decode worker restarts under the same id (a container restarted in place): it has
        # forgotten the prefill worker, which meets it again; handoffs resume (they were refused
        # "has not met this worker" for good).
        argv = list(c.procs["worker-1"].args)  # [..., python, -m, pagefleet, worker, --worker-id, worker-1, ...]
        args = argv[argv.index("pagefleet"):]  # from "pagefleet" on: args[1:] is the component's own
        c.kill("worker-1")
        wait_for(lambda: any(e.get("event") == "worker.dead" and e.get("worker_id") == "worker-1"
                             for e in log_events(c.log_dir, "scheduler")), 60, "worker-1 declared dead")
        c._spawn("worker-1", args[1:])
        c.wait_ready(num_workers=2)
        before = len(transfers_ended(c, "disaggregation"))
        again = [p + " once more, on past the wall" for p in long_prompts[:2]]
        assert [o.token_ids for o in generate_all(c.gateway_target, again, 128)] == reference(again, 128)
        after = transfers_ended(c, "disaggregation")[before:]
        assert any(e["outcome"] == "migrated" for e in after), after
    finally:
        c.stop()


@pytest.mark.slow  # waits out a death (--dead-after) and a lease; the mechanism's kill -9 tests are fast
@pytest.mark.timeout(300)
def test_the_target_killed_mid_transfer_loses_nothing_and_the_drain_moves_on(tmp_path):
    """A drain's target is frozen (SIGSTOP) so its migration hangs mid-transfer, then killed -9:
    the source keeps the request (it never handed it over), the scheduler moves it to the
    third worker instead, and the dead target's own requests resume from their tokens.
    Every token once, in order, as undisturbed."""
    import os

    c = start_cluster(tmp_path, num_workers=2, worker_args=["--num-blocks", "128", "--kv-transfer", "nixl"],
                      scheduler_args=["--dead-after", "3.0"])
    c.log_dir = tmp_path
    try:
        c.add_worker(["--num-blocks", "512"])  # worker-2: the most room, the drain's first choice
        c.wait_ready(num_workers=3)
        prompts = PROMPTS[:6]
        # Long enough that the source still runs its requests when its drain starts (at 128 tokens
        # a request could end between the scheduler seeing it and the drain: nothing to move).
        max_tokens = 4 * MAX_TOKENS
        results: list = []
        t = threading.Thread(target=lambda: results.extend(generate_all(c.gateway_target, prompts, max_tokens)))
        t.start()
        # The drain's source: whichever of the two small workers placement gave requests first.
        source = wait_for(lambda: next((w.worker_id for w in c.scheduler_state().workers
                                        if w.worker_id != "worker-2" and w.report.blocks_per_request), None),
                          60, "worker-0 or worker-1 running requests", every_s=0.02)
        os.killpg(c.procs["worker-2"].pid, signal.SIGSTOP)
        os.killpg(c.procs[source].pid, signal.SIGTERM)
        wait_for(lambda: any(e.get("event") == "transfer.started" and e.get("target") == "worker-2"
                             for e in log_events(tmp_path, "scheduler")), 30, "a drain move to the frozen worker-2")
        c.kill("worker-2")
        t.join(240)
        assert [o.token_ids for o in results] == reference(prompts, max_tokens)
        assert all(o.finish_reason == "length" for o in results)
        ended = [e for e in log_events(tmp_path, "scheduler") if e.get("event") == "transfer.ended"]
        assert not any(e["outcome"] == "migrated" and e["target"] == "worker-2" for e in ended)
    finally:
        c.stop()


@pytest.mark.slow  # waits out a death (--dead-after) and a lease; the mechanism's kill -9 tests are fast
@pytest.mark.timeout(300)
def test_the_source_frozen_then_killed_mid_transfer_loses_nothing_and_frees_the_targets_blocks(tmp_path):
    """A draining source is frozen (SIGSTOP) once the target has opened a migration (most
    often mid-transfer; a migration already handed over is settled by Redis), then killed -9:
    the target's reservations lapse with their lease and free every block, the scheduler
    resumes the requests from the tokens Redis holds, exactly once, as undisturbed."""
    import os

    c = start_cluster(tmp_path, num_workers=2, worker_args=["--num-blocks", "128", "--kv-transfer", "nixl"],
                      scheduler_args=["--dead-after", "3.0"])
    c.log_dir = tmp_path
    try:
        prompts = PROMPTS[:6]
        results: list = []
        t = threading.Thread(target=lambda: results.extend(generate_all(c.gateway_target, prompts, MAX_TOKENS)))
        t.start()
        name = wait_for(lambda: busy_worker(c, 2), 60, "a worker with requests mid-generation", every_s=0.02)
        other = next(w for w in ("worker-0", "worker-1") if w != name)
        os.killpg(c.procs[name].pid, signal.SIGTERM)
        wait_for(lambda: any(e.get("event") == "migration.begun" for e in log_events(tmp_path, other)),
                 30, "a drain move under way at the target", every_s=0.005)
        os.killpg(c.procs[name].pid, signal.SIGSTOP)
        wait_for(lambda: any(e.get("event") == "worker.dead" and e.get("worker_id") == name
                             for e in log_events(tmp_path, "scheduler")), 30, "the frozen source declared dead")
        c.kill(name)
        t.join(240)
        assert [o.token_ids for o in results] == reference(prompts, MAX_TOKENS)
        assert all(o.finish_reason == "length" for o in results)

        def idle():
            (w,) = [w for w in c.scheduler_state().workers if w.worker_id == other]
            return not w.report.request_ids and w.report.num_free_blocks == w.report.num_blocks
        wait_for(idle, 30, f"{other} idle with every block free (no reservation left behind)")
    finally:
        c.stop()
