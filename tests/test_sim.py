"""The simulated engine: the real engine's invariants, tokens from (seed, position), step
times from its profile; profiles and their fit."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import pytest

from pagefleet import SamplingParams
from pagefleet.worker.sim import SimEngine, sim_token_id, step_shape
from pagefleet.worker.sim_profile import (
    SimProfile,
    StepTimeModel,
    fit_step_time,
    load_profile,
    profile_names,
)

FAST = math.inf  # never sleep


def expected(engine: SimEngine, prompt: list[int], n: int, seed: int | None = None, greedy: bool = False) -> list[int]:
    s = 0 if greedy else engine.executor.seed if seed is None else seed
    return [sim_token_id(s, len(prompt) + i, engine.executor.vocabulary) for i in range(n)]


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tiny_profile(**step) -> SimProfile:
    base = load_profile("llama-3-8b-h100")
    return dataclasses.replace(base, name="test", step=StepTimeModel(**{"a": 0.0, "b": 0.0, "c": 0.0, **step}))


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_small_pool_preempts_and_gives_the_same_tokens(preemption):
    """Under pressure (swap or recompute) every request still gets its tokens, which are
    the function of (seed, position); the pools end free and add up."""
    ps = prompts(12, seed=1)
    params = [SamplingParams(max_tokens=24, seed=(i if i % 2 else None), temperature=0.8, ignore_eos=True)
              for i in range(len(ps))]
    roomy = SimEngine(time_scale=FAST, num_blocks=512, block_size=4)
    tight = SimEngine(time_scale=FAST, num_blocks=40, block_size=4, num_swap_blocks=64, preemption=preemption,
                      max_num_batched_tokens=32)
    want = [expected(roomy, p, 24, sp.seed) for p, sp in zip(ps, params, strict=True)]
    assert [o.token_ids for o in roomy.generate(ps, params)] == want
    outs = tight.generate(ps, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    stats = tight.stats()
    assert stats.num_preemptions_total > 0, "the pool was meant to force preemption"
    if preemption == "swap":
        assert stats.num_swapped_out_blocks_total > 0
        assert stats.num_swapped_in_blocks_total <= stats.num_swapped_out_blocks_total
        assert tight.executor.num_swapped_bytes_total > 0
    else:
        assert stats.num_recomputes_total > 0 and stats.num_swapped_out_blocks_total == 0
    for e in (roomy, tight):
        e.check_integrity()
        assert e.kv.num_free_blocks == e.kv.num_blocks
        assert e.stats().num_free_swap_blocks == e.stats().num_swap_blocks


def test_directed_preemption_and_resume_elsewhere_keep_the_tokens():
    e = SimEngine(time_scale=FAST, num_blocks=256, num_swap_blocks=64, block_size=4)
    p = prompts(1, seed=2)[0]
    sp = SamplingParams(max_tokens=30, seed=7, ignore_eos=True)
    rid = e.add_request(p, sp)
    got: list[int] = []
    for i in range(12):
        got += [t for d in e.step() for t in d.token_ids]
        if i in (4, 8):
            assert e.preempt_request(rid, mode="swap" if i == 4 else "recompute")
    assert len(got) < 30
    # The rest on another engine, resumed from the tokens emitted so far.
    other = SimEngine(time_scale=FAST, num_blocks=256, seed=99)
    e.abort_request(rid)
    other.add_request(p, sp, output_token_ids=got)
    while other.has_unfinished_requests():
        got += [t for d in other.step() for t in d.token_ids]
    assert got == expected(e, p, 30, seed=7)


def test_prefix_cache_hits_and_counts_like_the_engine():
    e = SimEngine(time_scale=FAST, num_blocks=256, block_size=4)
    shared = list(range(40, 80))
    ps = [shared + [100 + i, 101 + i] for i in range(6)]
    e.generate(ps[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    e.generate(ps[1:], SamplingParams(max_tokens=2, ignore_eos=True))
    s = e.stats()
    assert s.prefix_cache_hits_total >= 5 * 40 - 5 * 4, s
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_min_tokens_and_stop_tokens_and_logprobs():
    e = SimEngine(time_scale=FAST, num_blocks=128)
    p = [65, 66, 67]
    first = expected(e, p, 1)[0]
    # The first token stops it, unless min_tokens holds it back.
    out = e.generate([p], SamplingParams(max_tokens=8, stop_token_ids=[first]))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = e.generate([p], SamplingParams(max_tokens=8, stop_token_ids=[first], min_tokens=2))[0]
    assert out.token_ids[0] != first and len(out.token_ids) >= 2
    out = e.generate([p], SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert [lp.top_token_ids[0] for lp in out.logprobs] == out.token_ids
    assert all(lp.logprob == 0.0 and len(lp.top_logprobs) == 2 for lp in out.logprobs)


def test_step_time_follows_the_profile():
    prof = tiny_profile(a=1e-3, b=2e-5, c=3e-7)
    e = SimEngine(prof, time_scale=FAST, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    ps = [[70] * 10, [71] * 30]
    for p in ps:
        e.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    shapes = []
    run = e.executor.execute

    def record(out):
        shapes.append(step_shape(out))
        return run(out)

    e.executor.execute = record
    total = 0.0
    while e.has_unfinished_requests():
        e.step()
        n, kv = shapes[-1]
        assert e.executor.last_step_s == pytest.approx(1e-3 + 2e-5 * n + 3e-7 * kv)
        total += e.executor.last_step_s
    # First step: the whole first prompt and 6 of the second (budget 16), reading 10 + 6.
    assert shapes[0] == (16, 16)
    assert e.executor.clock_s == pytest.approx(total)


def test_swap_transfers_take_bytes_over_bandwidth():
    prof = dataclasses.replace(tiny_profile(), swap_bytes_per_s=1e9, transfer_overhead_s=1e-4)
    e = SimEngine(prof, time_scale=FAST, num_blocks=64, num_swap_blocks=64, block_size=4)
    rid = e.add_request([70] * 20, SamplingParams(max_tokens=10, ignore_eos=True))
    e.step()
    assert e.preempt_request(rid, mode="swap")
    one_way = 1e-4 + 5 * prof.block_bytes(4) / 1e9  # 20 computed tokens: 5 blocks of 4
    e.step()  # copies them out
    assert e.executor.last_step_s == pytest.approx(one_way)
    e.step()  # and back in (never both ways in one step)
    assert e.executor.last_step_s == pytest.approx(one_way)
    assert e.executor.num_swapped_bytes_total == 10 * prof.block_bytes(4)
    e.abort_request(rid)


def test_time_scale_paces_steps_in_real_time():
    prof = tiny_profile(a=0.02)
    for scale, lo, hi in ((1.0, 0.1, 0.5), (10.0, 0.01, 0.09)):
        e = SimEngine(prof, time_scale=scale, num_blocks=64)
        t0 = time.perf_counter()
        e.generate([[70, 71]], SamplingParams(max_tokens=5, ignore_eos=True))  # 5 steps of 20 ms simulated
        assert lo <= time.perf_counter() - t0 <= hi, scale
        assert e.executor.clock_s == pytest.approx(0.1)


def test_a_step_spun_out_takes_its_time_and_counts_its_cpu_as_the_models():
    """``wait="spin"``: the step's time passes on the clock as asleep, the tokens are the same,
    and the thread's CPU while it spins is the model's (so the host path outside it stays what
    it is); asleep, a wait costs the model nothing."""
    prof = tiny_profile(a=0.02)
    runs = {}
    for wait in ("sleep", "spin"):
        e = SimEngine(prof, time_scale=1.0, num_blocks=64, wait=wait)
        t0 = time.perf_counter()
        out = e.generate([[70, 71]], SamplingParams(max_tokens=5, ignore_eos=True, seed=3, temperature=1.0))
        runs[wait] = (time.perf_counter() - t0, out[0].token_ids, e.executor.model_cpu_seconds_total)
        assert e.executor.clock_s == pytest.approx(0.1)
        assert runs[wait][0] >= 0.1
    assert runs["spin"][1] == runs["sleep"][1]
    assert runs["sleep"][2] < 0.02  # the cost model and token draw only
    assert runs["spin"][2] > max(0.01, 2 * runs["sleep"][2])  # the spin: its thread on a CPU for much of 100 ms
    with pytest.raises(ValueError, match="wait must be one of sleep, spin"):
        SimEngine(prof, wait="nap")


def test_shipped_profiles_load_and_cite_their_source():
    names = profile_names()
    assert {"llama-3-8b-h100", "llama-3-70b-tp8-h100"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name and len(p.source) > 100
        assert p.num_blocks(16) * 16 >= p.max_model_len
        # A decode step of 64 sequences of 1k tokens: milliseconds, not micro- or whole seconds.
        assert 3e-3 < p.step.seconds(64, 64 * 1024) < 0.1


def test_bad_profiles_and_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a file"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.toml"
    bad.write_text('source = ""\nkv_bytes_per_token = 1\nkv_cache_bytes = 1\nmax_model_len = 1\n'
                   'swap_bytes_per_s = 1.0\n[step]\na = 0\nb = 0\nc = 0\n')
    with pytest.raises(ValueError, match="source"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="time_scale"):
        SimEngine(time_scale=0)
    with pytest.raises(ValueError, match="device"):
        SimEngine(device="cuda")
    with pytest.raises(ValueError, match="max_model_len"):
        SimEngine(max_model_len=10**6)


def test_fit_recovers_the_coefficients():
    rng = random.Random(0)
    truth = StepTimeModel(5e-3, 3e-5, 5e-8)
    samples = []
    for _ in range(400):
        n, kv = rng.randint(1, 2048), rng.randint(1, 200_000)
        samples.append((n, kv, truth.seconds(n, kv) * rng.uniform(0.98, 1.02)))
    fit, r2 = fit_step_time(samples)
    assert fit.a == pytest.approx(truth.a, rel=0.1)
    assert fit.b == pytest.approx(truth.b, rel=0.05)
    assert fit.c == pytest.approx(truth.c, rel=0.05)
    assert r2 > 0.99
    # A coefficient the data do not support comes out 0, never negative.
    flat = [(n, kv, 1e-3 + 1e-5 * n) for n, kv in ((1, 9), (5, 3), (9, 1), (20, 20), (3, 50))]
    fit, _ = fit_step_time(flat)
    assert fit.c == 0.0 and fit.a == pytest.approx(1e-3) and fit.b == pytest.approx(1e-5)


# -- a cluster of simulated workers ---------------------------------------------------------
def test_eight_simulated_workers_in_one_process_serve_through_the_gateway(tmp_path):
    """``--engine sim --count 8``: one worker process, eight workers the scheduler tells
    apart; requests go end to end and their tokens are the function of (seed, position)."""
    from cluster_fixtures import generate_all, start_cluster

    from pagefleet.common.model_config import load_model_spec
    from pagefleet.worker.sim import sim_vocabulary

    cluster = start_cluster(tmp_path, num_workers=8, workers_per_process=8,
                            worker_args=["--engine", "sim", "--time-scale", "20", "--num-blocks", "256"])
    try:
        assert [n for n in cluster.procs if n.startswith("worker")] == ["worker-0"]
        state = cluster.scheduler_state()
        assert sorted(w.worker_id for w in state.workers) == [f"worker-0-{i}" for i in range(8)]
        assert len({w.address for w in state.workers}) == 8
        ps = [f"{i}: a simulated request" for i in range(24)]  # no shared prefix: spread by load
        outs = generate_all(cluster.gateway_target, ps, 16, temperature=0.7, seed=1234)
        spec = load_model_spec("tiny")
        vocab = sim_vocabulary(spec)
        for p, o in zip(ps, outs, strict=True):
            n = len(spec.tokenizer.encode(p))
            assert o.token_ids == [sim_token_id(1234, n + i, vocab) for i in range(16)]
            assert o.finish_reason == "length"
        served = [w.num_assigned for w in cluster.scheduler_state().workers]
        assert sum(served) == 24 and sum(1 for n in served if n) >= 4, served
    finally:
        cluster.stop()


def test_bench_scheduler_runs_small_and_writes_its_figures(tmp_path):
    from pagefleet.benchmarks.fleet import scheduler as bench

    out = tmp_path / "scheduler.json"
    assert bench.main(["--workers", "4", "--queued", "60", "--json", str(out), "--poll", "0.05"]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "scheduler" and set(report["targets"]) == {
        "placements_per_s", "decision_p99_ms", "scheduler_cpu_per_s"}
    (point,) = report["results"]
    assert point["num_workers"] == 4 and point["num_queued"] == 60
    for key in ("placements_per_s", "decision_p50_ms", "decision_p99_ms", "scheduler_cpu_per_s",
                "redis_commands_per_request", "redis_commands_by_name_per_request", "max_queue_length_seen"):
        assert key in point, key
    assert point["placements_per_s"] > 0 and 0 < point["decision_p50_ms"] <= point["decision_p99_ms"]
    # Every request: the gateway's XADD, the scheduler's fence, the worker's writes at least.
    assert point["redis_commands_per_request"] >= 3
    assert point["redis_commands_by_name_per_request"]["xadd"] >= 1
    core = point["placement_core"]
    assert core["placements"] == 60 and core["decision_p50_ms"] <= core["decision_p99_ms"]


def test_histogram_quantiles_interpolate_inside_buckets():
    from pagefleet.benchmarks.fleet.scheduler import quantile

    buckets = [(0.001, 50.0), (0.002, 90.0), (0.004, 100.0), (math.inf, 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.001)
    assert quantile(buckets, 0.7) == pytest.approx(0.0015)
    assert quantile(buckets, 0.95) == pytest.approx(0.003)
    assert quantile([(0.001, 0.0), (math.inf, 0.0)], 0.5) is None


def test_sim_fit_writes_a_profile_the_worker_loads(tmp_path):
    """``pagefleet bench sim-fit`` on a ``bench engine`` report: the fitted coefficients, the
    base profile's memory, a source that says where they come from."""
    from pagefleet.bench import sim_fit

    truth = StepTimeModel(4e-3, 2e-5, 1e-8)
    rng = random.Random(1)
    steps = [[n, kv, truth.seconds(n, kv)] for n, kv in ((rng.randint(1, 512), rng.randint(1, 9000))
                                                        for _ in range(50))]
    report = {"date": "2026-01-01", "machine": "test", "trace": {},
              "results": [{"system": "pagefleet static"}, {"system": "pagefleet continuous", "step_timings": steps}]}
    src, out = tmp_path / "engine.json", tmp_path / "fitted.json"
    src.write_text(json.dumps(report))
    assert sim_fit.main(["--from", str(src), "--out", str(out), "--base", "llama-3-70b-tp8-h100"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "fitted" and "50 steps" in prof.source
    assert prof.step.a == pytest.approx(4e-3) and prof.step.b == pytest.approx(2e-5)
    assert prof.kv_bytes_per_token == load_profile("llama-3-70b-tp8-h100").kv_bytes_per_token
    engine = SimEngine(str(out), time_scale=FAST, num_blocks=64)
    engine.generate([[70, 71]], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(SystemExit):
        sim_fit.main(["--from", str(src), "--out", str(out), "--system", "pagefleet static"])


def test_the_fleet_simulator_serves_a_trace_with_the_schedulers_policies():
    """Four simulated workers under the scheduler's ledger on one clock:
    every request finishes with its tokens, and a shared prefix draws its group to one place."""
    from pagefleet.benchmarks.fleet.sim import FleetConfig, FleetSim, TraceRequest

    prof = load_profile("llama-3-8b-h100")
    system = list(range(40, 40 + 64))
    trace = [TraceRequest(f"r{i}", [256, *system, 100 + i], 8, 0.01 * i) for i in range(20)]
    sim = FleetSim(FleetConfig(num_workers=4, profile=prof, placement="prefix"))
    out = sim.run(trace, until_s=30)
    assert all(o.finish_reason == "length" and o.num_tokens == 8 for o in out.values())
    assert all(0 < o.ttft_s < 1 and 0 < o.tpot_s < 0.05 for o in out.values())
    sim.ledger.check_integrity()  # the scheduler's own ledger
    assert sim.ledger.num_waiting == 0 and sim.ledger.num_placed <= 1  # the last finish is forgotten a hop later
    served = [w.engine.stats().prefix_cache_hits_total for w in sim.workers]
    assert sum(1 for h in served if h) == 1 and max(served) >= 19 * 64 - 64, served
    ideal = FleetSim(FleetConfig(num_workers=4, profile=prof, ideal=True)).run(trace, until_s=30)
    assert all(o.finish_reason == "length" for o in ideal.values())


def test_the_fleet_simulators_workers_report_as_real_ones_busy_and_idle():
    """As ``StreamOccupancy`` sends them: a worker that stepped since its last timed report reports
    again ``report_interval_s`` later, an idle one ``heartbeat_s`` later (its heartbeat)."""
    from pagefleet.benchmarks.fleet.sim import FleetConfig, FleetSim, TraceRequest

    prof = load_profile("llama-3-8b-h100")
    sim = FleetSim(FleetConfig(num_workers=2, profile=prof, report_interval_s=0.1, heartbeat_s=0.4))
    ticks: dict[str, list[float]] = {"w000": [], "w001": []}
    tick = sim._report_tick

    def record(w):
        ticks[w.entry.worker_id].append(sim.now)
        tick(w)

    sim._report_tick = record
    # One long request (its worker busy until ~2 s), then a short one at 6 s that ends the run.
    sim.run([TraceRequest("long", [256, 5, 6], 100, 0.0), TraceRequest("end", [256, 7], 2, 6.0)], until_s=30)
    busy = next(w for w in sim.workers if w.engine.stats().num_generated_tokens_total >= 100).entry.worker_id
    idle = next(k for k in ticks if k != busy)
    gaps = lambda ts: [round(b - a, 6) for a, b in zip(ts, ts[1:], strict=False)]  # noqa: E731
    early = [t for t in ticks[busy] if t < 1.0]
    assert len(early) >= 8 and set(gaps(early)) == {0.1}, ticks[busy]
    assert set(gaps([t for t in ticks[busy] if t > 3.0])) == {0.4}  # done: a heartbeat now
    assert set(gaps(ticks[idle][1:])) == {0.4}, ticks[idle]  # never stepped (its first report counts as a change)
    with pytest.raises(ValueError, match="heartbeat_s"):
        FleetSim(FleetConfig(num_workers=1, profile=prof, heartbeat_s=0))


def test_the_fleet_simulator_preempts_through_the_ledger():
    """A full worker and a higher-priority arrival: the ledger's round places it by preempting a
    lower-priority sequence (none with preemption off); every request still finishes."""
    from pagefleet.benchmarks.fleet.sim import FleetConfig, FleetSim, TraceRequest

    prof = load_profile("llama-3-8b-h100")
    trace = [TraceRequest(f"low{i}", [256] + [10 + i] * 200, 400, 0.0) for i in range(4)]
    trace.append(TraceRequest("high", [256] + [99] * 300, 16, 0.5, priority=1))
    for preempt, want in ((True, 1), (False, 0)):
        sim = FleetSim(FleetConfig(num_workers=1, profile=prof, policy="priority", num_blocks=64, preempt=preempt))
        out = sim.run(trace, until_s=60)
        assert all(o.finish_reason == "length" for o in out.values())
        assert sim.ledger.num_preemptions == want
        sim.ledger.check_integrity()


def test_the_study_finds_knees_and_writes_its_report(tmp_path):
    from pagefleet.benchmarks.fleet import study

    pts = [{"rate": 10, "attainment": 1.0}, {"rate": 20, "attainment": 0.95}, {"rate": 30, "attainment": 0.5}]
    assert study.knee(pts, 0.9) == pytest.approx(20 + 10 * 0.05 / 0.45)
    assert study.knee(pts[:2], 0.9) == 20 and study.knee(pts[2:], 0.9) is None
    out = tmp_path / "study.json"
    assert study.main(["--workers", "2", "--duration", "2", "--drain", "4", "--rate-factors", "1", "--suites",
                       "policy", "--sharegpt-rate", "10", "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    curves = report["suites"]["policy"]
    assert [c["name"] for c in curves] == ["fcfs", "priority", "deadline", "ideal (one pool)"]
    for c in curves:
        (p,) = c["points"]
        assert p["rate"] == 10 and p["num_requests"] == 20 and 0 <= p["attainment"] <= 1
    assert (tmp_path / "study-policy.png").exists()


def test_the_study_runs_only_the_named_curves_and_refuses_unknown_ones(tmp_path, capsys):
    from pagefleet.benchmarks.fleet import study

    out = tmp_path / "study.json"
    assert study.main(["--workers", "2", "--duration", "2", "--drain", "4", "--rate-factors", "1,1.5", "--suites",
                       "bursty", "--curves", "round-robin", "--sharegpt-rate", "10", "--json", str(out),
                       "--plot-dir", ""]) == 0
    curves = json.loads(out.read_text())["suites"]["bursty"]
    assert [c["name"] for c in curves] == ["round-robin"] and [p["rate"] for p in curves[0]["points"]] == [10, 15]
    for argv in (["--suites", "nope"], ["--suites", "policy", "--curves", "round-robin"]):
        with pytest.raises(SystemExit):
            study.main([*argv, "--json", str(tmp_path / "x.json")])
        assert "unknown" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _all_free(sim) -> None:
    """Every worker's pool ends free, nothing held for a move, the ledger consistent."""
    sim.ledger.check_integrity()
    assert not sim.ledger.transfers
    for w in sim.workers:
        assert not w.sending and not w.receiving
        assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks, list(w.engine.kv.block_tables)


def test_the_fleet_simulator_disaggregates_long_prompts_and_moves_their_kv_over_the_profiles_link():
    """One prefill and two decode workers: a long prompt prefills on the prefill worker and its
    KV moves to a decode worker in the profile's transfer time; a short one stays local.
    Every request gets all its tokens; the pools end free."""
    from pagefleet.benchmarks.fleet.sim import FleetConfig, FleetSim, TraceRequest
    from pagefleet.scheduler.moves import MoveConfig

    prof = load_profile("llama-3-8b-h100")
    trace = [TraceRequest("long", [256] + [7] * 2047, 32, 0.0), TraceRequest("short", [256] + [8] * 99, 32, 0.0)]
    sim = FleetSim(FleetConfig(num_workers=3, profile=prof, num_prefill_workers=1,
                               moves=MoveConfig(short_prompt_tokens=256)))
    out = sim.run(trace, until_s=30)
    assert all(o.finish_reason == "length" and o.num_tokens == 32 for o in out.values())
    assert sim.moves.started == {"disaggregation": 1} and sim.moves.num_done == 1
    (took,) = sim.moves.transfer_s
    assert took == pytest.approx(prof.kv_transfer_seconds(2049) + sim.cfg.hop_s)  # prompt + first token
    assert sim.moves.bytes_moved == 2049 * prof.kv_bytes_per_token
    prefill, *decode = sim.workers
    assert prefill.entry.role == "prefill" and {w.entry.role for w in decode} == {"decode"}
    assert prefill.engine.stats().num_generated_tokens_total == 1  # the long one's first token only
    assert sum(w.engine.stats().num_generated_tokens_total for w in decode) == 31 + 32
    # The decode worker took the received blocks as cached: it computed only the partial last block.
    assert max(w.engine.stats().prefix_cache_hits_total for w in decode) == 2048
    _all_free(sim)
    with pytest.raises(ValueError, match="num_prefill_workers"):
        FleetSim(FleetConfig(num_workers=2, profile=prof, num_prefill_workers=2))


def test_the_fleet_simulator_migrates_from_an_overloaded_worker_with_a_short_downtime():
    """A shared prefix draws six long answers to one worker of two; as they grow past 80 % of
    its pool, the ledger moves some to the idle worker (two-stage copy: a final stage of a
    few tokens); without migration the full worker preempts instead."""
    from pagefleet.benchmarks.fleet.sim import FleetConfig, FleetSim, TraceRequest
    from pagefleet.scheduler.moves import MoveConfig

    prof = load_profile("llama-3-8b-h100")
    system = [256] + [9] * 511
    trace = [TraceRequest(f"r{i}", [*system, 100 + i], 600, 0.001 * i) for i in range(6)]
    runs = {}
    for name, moves in (("none", MoveConfig()), ("balance", MoveConfig(migrate_above=0.8, migrate_below=0.6))):
        sim = FleetSim(FleetConfig(num_workers=2, profile=prof, num_blocks=200, moves=moves))
        out = sim.run(trace, until_s=60)
        assert all(o.finish_reason == "length" and o.num_tokens == 600 for o in out.values())
        _all_free(sim)
        runs[name] = sim
    none, bal = runs["none"], runs["balance"]
    assert none.moves.started == {} and sum(w.engine.stats().num_preemptions_total for w in none.workers) > 0
    assert bal.moves.started.get("balance", 0) >= 1 and bal.moves.num_done >= 1
    assert all(0 < d < 0.01 for d in bal.moves.downtime_s)  # a few tokens' KV, not the sequence's
    assert sum(w.engine.stats().num_preemptions_total for w in bal.workers) < \
        sum(w.engine.stats().num_preemptions_total for w in none.workers)


def test_the_study_compares_colocated_with_disaggregated_fleets_and_migration_with_none(tmp_path):
    from pagefleet.benchmarks.fleet import study

    out = tmp_path / "kv.json"
    assert study.main(["--workers", "4", "--duration", "1", "--drain", "1", "--rate-factors", "1", "--suites",
                       "disagg-prefill,migrate", "--prefill-heavy-rate", "3", "--skewed-rate", "3", "--json", str(out),
                       "--plot-dir", str(tmp_path), "--plot-tag", "t"]) == 0
    report = json.loads(out.read_text())
    curves = {c["name"]: c for c in report["suites"]["disagg-prefill"]}
    assert list(curves) == ["colocated", "disaggregated 1P:3D", "disaggregated 1P:1D", "disaggregated 3P:1D"]
    assert [c["prefill_fraction"] for c in curves.values()] == [0.0, 0.25, 0.5, 0.75]
    (colocated,), (disagg,) = curves["colocated"]["points"], curves["disaggregated 1P:1D"]["points"]
    assert colocated["moves"]["started"] == {} and colocated["moves"]["gb_moved"] == 0
    assert disagg["moves"]["started"]["disaggregation"] == disagg["moves"]["done"] > 0
    assert disagg["moves"]["gb_moved"] > 0 and disagg["moves"]["transfer_p50_ms"] > 0
    assert disagg["num_requests"] == 12 and set(disagg["attainment_by_tpot_ms"]) == {str(ms) for ms in study.TPOT_SLOS_MS}
    assert [c["name"] for c in report["suites"]["migrate"]] == ["no migration", "load-balance migration"]
    assert (tmp_path / "study-disagg-prefill-t.png").exists() and (tmp_path / "study-migrate-t.png").exists()
    with pytest.raises(SystemExit) as refused:
        study.main(["--suites", "nope", "--json", str(out), "--plot-dir", ""])
    assert refused.value.code == 2


def test_a_large_batch_draws_what_each_request_alone_would():
    """A step of many requests gives each the tokens it gets alone, greedy, seeded and with
    ``min_tokens`` (a finish token drawn before it is drawn again)."""
    engine = SimEngine(time_scale=FAST, max_num_seqs=64)
    ps = prompts(40, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0 if i % 3 == 0 else 1.0, seed=None if i % 3 == 1 else i)
              for i in range(len(ps))]
    for i in range(0, len(ps), 4):  # its first token stops it, after min_tokens: drawn again till then
        first = expected(engine, ps[i], 1, params[i].seed, greedy=params[i].temperature == 0)[0]
        params[i] = dataclasses.replace(params[i], stop_token_ids=[first], min_tokens=3)
    outs = engine.generate(ps, params)
    for i, (p, sp, o) in enumerate(zip(ps, params, outs, strict=True)):
        alone = SimEngine(time_scale=FAST).generate([p], [sp])[0]
        assert o.token_ids == alone.token_ids
        if i % 4:
            assert o.token_ids == expected(engine, p, 12, sp.seed, greedy=sp.temperature == 0)
        else:
            assert o.token_ids[0] != expected(engine, p, 1, sp.seed, greedy=sp.temperature == 0)[0]


def test_the_simulated_models_cpu_is_counted_apart_from_the_host_path():
    """The cost model and token draw (what a forward pass and the sampler are to a real
    engine) are counted on the stepping thread, cumulative in the engine's stats and its
    metric; the tokens are the same measured or not."""
    import prometheus_client

    from pagefleet.common.metrics import WorkerMetrics

    engine = SimEngine(time_scale=FAST, max_num_seqs=8)
    ps = prompts(8, seed=5)
    params = SamplingParams(max_tokens=20, seed=1, temperature=1.0)
    outs = engine.generate(ps, params)
    total = engine.stats().sim_model_cpu_seconds_total
    assert total > 0 and engine.executor.model_cpu_seconds_total == total
    assert engine.executor.last_model_cpu_seconds <= total
    unmeasured = SimEngine(time_scale=FAST, max_num_seqs=8)
    unmeasured.executor.measure_model_cpu = False
    assert [o.token_ids for o in unmeasured.generate(ps, params)] == [o.token_ids for o in outs]
    assert unmeasured.stats().sim_model_cpu_seconds_total == 0.0
    metrics = WorkerMetrics(prometheus_client.CollectorRegistry())
    metrics.observe_stats(engine.stats())
    assert metrics.registry.get_sample_value("pagefleet:sim_model_cpu_seconds_total") == pytest.approx(total)
