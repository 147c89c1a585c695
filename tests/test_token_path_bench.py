"""``pagefleet bench token-path``, small: it runs, every stream comes back whole, and it counts
what a token costs; and a burst of streams past grpc's default pending-call bound is served."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagefleet.bench.floor import _pieces


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, "-m", "pagefleet", "bench", "token-path", *args, "--json", str(out)],
                   check=True, timeout=600)
    return json.loads(out.read_text())


def test_token_path_bench_counts_the_cost_of_a_token(tmp_path):
    report = _bench(tmp_path, "--workers", "2", "--requests", "24", "--concurrency", "8", "--max-tokens", "12",
                    "--time-scale", "inf", "--report-interval", "0.2")  # passed to the scheduler, which takes it
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"floor", "stream", "fixed"}
    for r in by_mode.values():
        assert r["num_whole"] == r["num_streams"], r["errors"]
    stream = by_mode["stream"]
    assert stream["num_tokens"] == 24 * 12
    assert 0 < stream["redis_commands"] < 6  # one write a step for all its requests, not several a token
    assert stream["redis_commands_by_name"]["xadd"] > 0
    assert stream["redis_command_us_by_name"]["xadd"] > 0  # each command's own time, per token
    assert 1 <= stream["tokens_per_write"] <= 2 * 8 * 12  # a write holds a step of its worker's requests
    assert stream["redis_cpu_us_per_write"] > 0
    assert all(v > 0 for v in stream["cpu_us"].values())
    # The workers' host path: their CPU less the simulated model's (worker-0's a token)
    assert 0 < stream["worker_sim_model_cpu_us"] < stream["cpu_us"]["workers"]
    assert stream["worker_cpu_us_outside_model"] == pytest.approx(stream["cpu_us"]["workers"] - stream["worker_sim_model_cpu_us"])
    by_thread = stream["worker_cpu_us_by_thread"]  # the workers' threads, by the names the OS shows
    assert by_thread["engine"] > 0 and by_thread["main"] > 0
    # The same CPU as the processes' (theirs in clock ticks: 10 ms, ~35 us a token of this short run, each)
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / stream["num_tokens"]
    assert abs(sum(by_thread.values()) - stream["cpu_us"]["workers"]) <= 0.2 * stream["cpu_us"]["workers"] + 4 * tick_us
    assert stream["redis_bytes_per_request_kept"] > 0
    assert by_mode["fixed"]["per"] == "request" and by_mode["fixed"]["num_tokens"] == 24
    assert by_mode["floor"]["cpu_us_per_message"] > 0
    paced = stream["floor_paced"]  # the floor again, its messages as the stream's: as many tokens, as far apart
    per = paced["tokens_per_message"]
    assert per == max(1.0, round(stream["num_tokens"] / stream["num_messages"], 3))
    assert paced["num_whole"] == 24 and paced["num_tokens"] == 24 * 12
    assert paced["num_messages"] == 24 * len(list(_pieces(12, per)))  # sizes mixed to that mean
    assert paced["pace_ms"] == round(stream["message_gap_ms_p50"], 3) > 0
    # The paced floor's CPU is counted in clock ticks (10 ms): this small run's (~288 tokens at
    # ~20 us) can read 0 ticks on a loaded machine, and then there is no ratio to give.
    if paced["cpu_us_per_token"]:
        assert stream["gateway_cpu_vs_paced_floor"] > 0
    else:
        assert stream["gateway_cpu_vs_paced_floor"] is None


def test_a_burst_of_streams_past_grpcs_pending_call_bound_is_served(tmp_path):
    # grpc's server fails calls it has not taken up past 1,000 pending with CANCELLED unless told
    # otherwise (SERVER_OPTIONS): 3,000 streams at once against a trivial servicer with them.
    report = _bench(tmp_path, "--modes", "", "--requests", "3000", "--concurrency", "3000", "--max-tokens", "2")
    floor, = report["results"]
    assert floor["num_whole"] == 3000, floor["errors"]


def test_token_path_bench_over_the_http_door(tmp_path):
    report = _bench(tmp_path, "--backend", "openai", "--workers", "2", "--requests", "16", "--concurrency", "8",
                    "--max-tokens", "10", "--time-scale", "inf", "--modes", "stream", "--stream-interval", "4")
    by_mode = {r["mode"]: r for r in report["results"]}
    assert by_mode["floor"]["num_whole"] == 16 and by_mode["stream"]["num_whole"] == 16
    stream = by_mode["stream"]
    assert stream["num_tokens"] == 160
    paced = stream["floor_paced"]  # its messages as the stream's: several tokens each (4, 4, 2 a stream)
    per = paced["tokens_per_message"]
    assert paced["num_whole"] == 16 and per == round(160 / stream["num_messages"], 3) > 1
    assert paced["num_messages"] == 16 * len(list(_pieces(10, per))) and paced["num_tokens"] == 160


@pytest.mark.parametrize("interval", ["0", "-1", "6", "nan"])
def test_token_path_bench_refuses_a_report_interval_its_scheduler_would(interval, capsys):
    from pagefleet.bench.token_path import main

    assert main(["--report-interval", interval]) == 2
    assert "--report-interval" in capsys.readouterr().err


def test_the_floor_mixes_message_sizes_to_a_fractional_mean_and_refuses_bad_flags():
    from pagefleet.bench.floor import main

    sizes = [len(ids) for _, ids, _ in _pieces(10, 2.5)]
    assert sizes == [2, 3, 3, 2] and [i for i, _, _ in _pieces(10, 2.5)] == [0, 2, 5, 8]
    assert [len(ids) for _, ids, _ in _pieces(3, 1)] == [1, 1, 1] and not list(_pieces(0, 4))
    for bad in (["--tokens-per-message", "0.5"], ["--tokens-per-message", "inf"], ["--pace-ms", "-1"],
                ["--pace-ms", "nan"]):
        with pytest.raises(SystemExit):
            main(["grpc", "1", *bad])


def test_host_path_bench_counts_every_token_and_splits_the_cost():
    from pagefleet.benchmarks.host_path import main, measure

    r = measure(batch=4, max_tokens=8)
    assert r["tokens"] == 4 * 7  # the decode steps' (each first token comes with its prompt's step)
    assert r["us_per_token"] > 0 and all(r[k] >= 0 for k in ("step_us", "write_us"))
    assert r["excluded_us"] > 0  # the simulated model (its cost model, its token draw) is left out
    assert abs(r["step_us"] + r["write_us"] - r["us_per_token"]) < 0.05
    with pytest.raises(SystemExit):
        main(["--batch", "0"])


def test_host_path_bench_on_the_real_engine_leaves_the_forward_pass_out():
    import torch

    from pagefleet.benchmarks.host_path import main, measure

    threads = torch.get_num_threads()
    r = measure(batch=4, max_tokens=8, prompt_len=40, engine="model")
    assert torch.get_num_threads() == threads  # the forward ran on one thread, and torch is as it was
    assert r["engine"] == "model" and r["device"] == "cpu"
    assert r["tokens"] == 4 * 7  # every request to its max_tokens, EOS or not
    assert r["excluded_us"] > 0 and r["us_per_token"] > 0 and r["step_us"] >= 0
    assert abs(r["step_us"] + r["write_us"] - r["us_per_token"]) < 0.05
    with pytest.raises(SystemExit):
        main(["--engine", "gpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # a usage error naming the missing device
            main(["--engine", "model", "--device", "cuda", "--batch", "1", "--rounds", "1", "--max-tokens", "2"])
    cold = measure(batch=4, max_tokens=8, touch_mb=1, idle_ms=1)  # outside the timing
    assert cold["touch_mb"] == 1 and cold["idle_ms"] == 1 and cold["tokens"] == 4 * 7
    for bad in (["--touch-mb", "-1"], ["--idle-ms", "-1"], ["--prompt-len", "0"], ["--max-tokens", "1"],
                ["--prompt-len", "100000", "--rounds", "1", "--batch", "1"]):  # past the model's length
        with pytest.raises(SystemExit):
            main(bad)


@pytest.mark.parametrize("flag", ["--concurrency", "--connections", "--gateway-processes", "--stream-interval",
                                  "--max-num-seqs", "--prompt-len", "--workers-per-process"])
def test_token_path_bench_refuses_counts_below_one(flag, capsys):
    """--concurrency 0 hung for good (a semaphore of 0), --connections 0 ended in a traceback,
    --gateway-processes 0 ran one process and recorded 0; --max-num-seqs 0 started a cluster
    whose workers refused it, --workers-per-process -1 was taken."""
    from pagefleet.bench.token_path import main

    assert main(["--no-floor", flag, "0"]) == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--time-scale", "--timeout"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_token_path_bench_refuses_times_not_above_zero(flag, bad, capsys):
    """--time-scale 0 started a cluster whose workers exited naming the flag only in their
    logs (a traceback here); --timeout 0 measured nothing and divided by it."""
    from pagefleet.bench.token_path import main

    assert main(["--no-floor", flag, bad]) == 2
    assert f"{flag} must be above 0" in capsys.readouterr().err
    assert main(["--no-floor", "--modes", ","]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_token_path_bench_stopped_by_sigterm_stops_its_cluster(tmp_path):
    """SIGTERM ended the bench and left its whole cluster running, orphaned; it now stops it,
    as Ctrl-C does."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def cluster_pids() -> set[int]:
        out = set()
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.readlink(f"/proc/{pid}/cwd").startswith("/tmp/pagefleet-token-path-"):
                    out.add(int(pid))
            except OSError:
                continue
        return out - {os.getpid()}

    before = cluster_pids()
    bench = subprocess.Popen([sys.executable, "-m", "pagefleet", "bench", "token-path", "--no-floor", "--modes",
                              "stream", "--workers", "1", "--requests", "64", "--max-tokens", "4000",
                              "--concurrency", "2", "--json", str(tmp_path / "out.json")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(cluster_pids() - before - {bench.pid}) < 3:  # redis, scheduler, worker, gateway...
            assert time.monotonic() < deadline and bench.poll() is None, "the bench's cluster never started"
            time.sleep(0.5)
        time.sleep(2)
        bench.send_signal(signal.SIGTERM)
        bench.wait(60)
        deadline = time.monotonic() + 20
        while cluster_pids() - before:
            assert time.monotonic() < deadline, f"left running: {cluster_pids() - before}"
            time.sleep(0.5)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
