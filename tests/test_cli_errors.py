"""The commands as a stranger runs them: a bad flag or variable is one line naming it (exit 2,
no traceback) before anything starts; `pagefleet up` leaves no process behind however it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagefleet", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("args", "env", "says"), [
    (["up", "--device", "tpu"], {}, "--device"),
    (["up", "--num-blocks", "-1"], {}, "--num-blocks"),
    (["up", "--port", "70000"], {}, "--port"),
    (["up", "--model", "/nonexistent/model"], {}, "--model"),
    (["up", "--redis-url", "localhost:6379"], {}, "--redis-url"),
    (["up", "--policy", "bogus"], {}, "--policy"),
    (["up", "--log-level", "bogus"], {}, "--log-level"),
    (["up", "--demo", "hi", "--demo-tokens", "0"], {}, "--demo-tokens"),
    (["up"], {"PAGEFLEET_WORKERS": "abc"}, "PAGEFLEET_WORKERS"),
    (["up"], {"PAGEFLEET_LOG_FORMAT": "bogus"}, "PAGEFLEET_LOG_FORMAT"),
    (["up"], {"PAGEFLEET_REDIS_SOCKET": "maybe"}, "PAGEFLEET_REDIS_SOCKET"),
    (["up", "--redis-socket", "--redis-cluster"], {}, "--redis-socket"),  # was ignored
    (["up", "--redis-socket", "--redis-url", "redis://127.0.0.1:1"], {}, "--redis-socket"),
    (["up", "--engine", "sim", "--time-scale", "0"], {}, "--time-scale"),  # started Redis and a scheduler first
    (["up", "--engine", "sim", "--time-scale", "nan"], {}, "--time-scale"),
    (["up", "--gateway-processes", "0"], {}, "--gateway-processes must be at least 1, got 0"),
    (["up", "--gateway-processes", "100000"], {}, "--gateway-processes must be at most 256"),  # forked them all
    (["gateway", "--processes", "100000"], {}, "--processes must be at most 256"),
    (["up", "--sim-wait", "spin"], {}, "--sim-wait needs --engine sim"),
    (["worker", "--sim-wait", "spin"], {}, "--sim-wait need --engine sim"),
    (["up", "--engine", "sim", "--sim-wait", "nap"], {}, "--sim-wait"),
    (["gateway", "--port", "-1"], {}, "--port"),
    (["generate", "hi", "--max-tokens", "-1"], {}, "--max-tokens"),
    (["generate", "hi", "--priority", "99999999999"], {}, "--priority"),
    # A hash tag in the namespace would put every shard's keys in one slot of a Redis Cluster.
    (["up", "--namespace", "x{y}"], {}, "--namespace"),
    (["scheduler", "--namespace", "x{y}", "--redis-cluster"], {}, "--namespace"),
    (["gateway", "--namespace", ""], {}, "--namespace"),
    (["bench", "token-path", "--primaries", "3"], {}, "--primaries sizes the throwaway Redis Cluster"),  # was ignored
])
def test_a_bad_value_is_one_line_naming_it_before_anything_starts(args, env, says):
    t0 = time.monotonic()
    out = _run(*args, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # refused before a cluster started


def test_up_on_cuda_without_a_cuda_device_is_one_line_before_anything_starts():
    """It started Redis, the scheduler and the gateway, then each worker died with a traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = _run("up", "--device", "cuda")
    assert out.returncode == 2 and "--device cuda: no CUDA device is available" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_run_into_a_pipe_that_closes_stops_quietly():
    """``pagefleet run ... | head -1``: a BrokenPipeError traceback and exit 1 before."""
    proc = subprocess.Popen([sys.executable, "-m", "pagefleet", "run", "hello there", "--max-tokens", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"[hello there]")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0 and "Traceback" not in err, err[-2000:]


def test_generate_says_what_is_wrong_in_one_line():
    """A CA that cannot be read is a line (exit 2); a negative seed is vLLM's int64 (the
    gateway being down is then what is said)."""
    out = _run("generate", "hi", "--ca", "/nonexistent.pem")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nonexistent" in out.stderr, out.stderr
    out = _run("generate", "hi", "--seed", "-1", "--target", "127.0.0.1:1")
    assert out.returncode == 1 and "Traceback" not in out.stderr and "UNAVAILABLE" in out.stderr, out.stderr


def test_up_with_a_redis_that_does_not_answer_says_so_at_once():
    t0 = time.monotonic()
    out = _run("up", "--redis-url", "redis://127.0.0.1:1")
    assert out.returncode == 1 and "does not answer" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - t0 < 30  # not the 120 s of a cluster that never gets ready


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _up_ready(args: list[str], stderr) -> tuple[subprocess.Popen, str]:
    """``pagefleet up`` on simulated workers (free ports, a session of its own), once its ready
    line came: the process and that line (killed if it never came)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagefleet", "up", "--port", "0", "--http-port", "0",
                             "--engine", "sim", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("pagefleet ready") or not line:
            break
    if not line.startswith("pagefleet ready"):
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"up never said it was ready: {line!r}")
    return proc, line


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_up_leaves_no_process_behind_when_its_terminal_closes_or_it_is_killed(sig):
    """SIGHUP (the terminal closed) ended `up` without its cleanup, and SIGKILL cannot be
    caught: Redis, the scheduler, the workers and the gateway served on, orphaned. `up` stops
    them on SIGHUP, and each dies with it however it dies."""
    proc, _ = _up_ready(["--workers", "1"], stderr=subprocess.DEVNULL)
    try:
        children = _children(proc.pid)
        assert len(children) >= 4, children  # redis, scheduler, worker, gateway
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for c in _children(proc.pid):
            os.kill(c, signal.SIGKILL)


def test_up_takes_a_namespace_for_a_second_cluster_on_one_redis(monkeypatch):
    """Two `up`s on one --redis-url shared the `pf` keys (each took the other's workers for
    dead): `--namespace` gives each its own, passed to every process it starts."""
    from pagefleet import launcher

    seen = {}

    class Stop(Exception):
        pass

    def fake(cfg):
        seen["namespace"] = cfg.namespace
        raise Stop

    monkeypatch.setattr(launcher, "LocalCluster", fake)
    monkeypatch.setattr(launcher, "_redis_answers", lambda url: "")
    with pytest.raises(Stop):
        launcher.main(["--namespace", "second", "--redis-url", "redis://127.0.0.1:1", "--port", "0", "--http-port", "0"])
    assert seen == {"namespace": "second"}


def test_a_checkpoint_that_does_not_load_is_one_line_naming_why(tmp_path):
    """``pagefleet models DIR`` printed the checkpoint's table (exit 0) for an activation no
    layer has, and ``run`` a traceback; both now name it in one line, as the gateway refuses it."""
    from conftest import make_checkpoint

    from pagefleet.common.model_config import load_model_spec

    path = make_checkpoint(tmp_path / "relu2", "llama", hidden_act="relu2")
    with pytest.raises(ValueError, match="hidden_act 'relu2'"):
        load_model_spec(str(path))
    # config.json not an object, or a field of the wrong type: a traceback before (a review's repro)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    typed = make_checkpoint(tmp_path / "typed", "llama")
    cfg = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers="two")))
    for bad, says in ((listed, "must hold a JSON object"), (typed, "num_hidden_layers must be a positive integer")):
        with pytest.raises(ValueError, match=says):
            load_model_spec(str(bad))
    for args in (["models", str(path)], ["run", "--model", str(path), "hi"], ["models", str(tmp_path / "none")],
                 ["models", str(listed)], ["models", str(typed)], ["run", "--model", str(typed), "hi"]):
        out = _run(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stderr[-2000:])
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _worker_pids(up_pid: int) -> dict[str, int]:
    """``up``'s worker processes by worker id."""
    out = {}
    for pid in _children(up_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "worker" in argv and "--worker-id" in argv:
            out[argv[argv.index("--worker-id") + 1]] = pid
    return out


def test_up_serves_on_when_a_worker_is_drained_or_killed():
    """A worker drained (SIGTERM: its requests move or resume elsewhere, then it exits 0) stopped
    the whole of `up`, and every request in flight with it. The others serve on; `up` says so,
    and stops once no worker is left."""
    proc, line = _up_ready(["--workers", "2", "--workers-per-process", "1"], stderr=subprocess.PIPE)
    try:
        target = line.split("gateway ", 1)[1].split(",", 1)[0]
        workers = _worker_pids(proc.pid)
        assert sorted(workers) == ["worker-0", "worker-1"], workers
        os.kill(workers["worker-0"], signal.SIGTERM)
        said = ""
        while not said.startswith("pagefleet up:"):  # (the components' warnings come here too)
            said = proc.stderr.readline()
            assert said, "up's stderr ended"
        assert "worker-0 drained; 1 worker processes serve on" in said, said
        out = _run("generate", "--target", target, "--max-tokens", "4", "hello")
        assert out.returncode == 0 and proc.poll() is None, (out.stdout, out.stderr)
        os.kill(workers["worker-1"], signal.SIGKILL)
        assert proc.wait(60) == 1
        rest = proc.stderr.read()
        assert "worker-1 exited with -9; 0 worker processes serve on" in rest and "no worker process of model" in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_reaped_worker_leaves_nothing_behind_and_a_late_one_stops_nothing(tmp_path):
    """A worker process reaped by `up` was no longer in `stop()`'s list, so what it left in its
    process group outlived `up`; and one that ended between the reap and the liveness check
    stopped every component. Its group is killed at the reap; the check leaves workers to it."""
    from pagefleet.launcher import LocalCluster

    c = object.__new__(LocalCluster)
    c.redis, c.cfg = None, type("Cfg", (), {"log_dir": None})()
    child_pid = tmp_path / "child.pid"
    worker = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {child_pid}; exit 0"], start_new_session=True)
    gateway = subprocess.Popen(["sleep", "300"], start_new_session=True)
    c.procs = {"worker-0": worker, "gateway": gateway}
    try:
        deadline = time.monotonic() + 10
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.reap_workers() == [("worker-0", 0)]
        child = int(child_pid.read_text())
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "what the worker left behind outlived it"

        class EndsOnItsSecondLook:
            returncode = None
            pid = worker.pid  # (its group gone: reaped above)

            def __init__(self):
                self.looks = 0

            def poll(self):
                self.looks += 1
                self.returncode = 0 if self.looks >= 2 else None
                return self.returncode

        c.procs["worker-1"] = EndsOnItsSecondLook()
        assert c.reap_workers() == []
        c.check_alive(workers_may_end=True)  # it ended since: left to the next reap, not an error
        assert c.reap_workers() == [("worker-1", 0)]
    finally:
        c.procs.pop("worker-1", None)
        c.stop(grace_s=1)
