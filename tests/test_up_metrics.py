"""``pagefleet up --metrics-port N``: every component of the local cluster serves its own /metrics.

The gateway gets N, the scheduler N+1 and worker i N+2+i; ``0`` picks a free port for each;
unset, nothing serves metrics. One real cluster (tiny model, CPU, one worker, then a second
one added) checks that each port answers with its component's metrics.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pagefleet.common.service import _hand_out, free_port
from pagefleet.launcher import ClusterConfig, LocalCluster, _metrics_summary, build_parser

pytestmark = pytest.mark.timeout(120)

COMPONENT_METRIC = {
    "gateway": "pagefleet:gateway_requests_in_flight",
    "scheduler": "pagefleet:scheduler_queue_length",
    "worker": "pagefleet:kv_cache_usage_perc",
}


def free_port_run(count: int) -> int:
    """A port N such that N..N+count-1 are all free right now."""
    for _ in range(100):
        base = free_port()
        if base + count - 1 > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        for port in range(base + 1, base + count):  # so the cluster's own ports are not drawn from the run
            _hand_out(port)
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def scrape(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def test_up_help_states_the_port_order():
    out = subprocess.run([sys.executable, "-m", "pagefleet", "up", "--help"], capture_output=True, text=True,
                         timeout=30, env={k: v for k, v in os.environ.items() if not k.startswith("PAGEFLEET_")})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--metrics-port N" in text
    for part in ("gateway on N", "scheduler on N+1", "worker i on N+2+i", "0: any free port", "PAGEFLEET_METRICS_PORT"):
        assert part in text, part


def test_metrics_port_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEFLEET_METRICS_PORT", "9300")
    assert build_parser().parse_args([]).metrics_port == 9300
    assert build_parser().parse_args(["--metrics-port", "9400"]).metrics_port == 9400
    monkeypatch.delenv("PAGEFLEET_METRICS_PORT")
    assert build_parser().parse_args([]).metrics_port is None


def test_port_assignment_without_starting_anything():
    assert LocalCluster(ClusterConfig(port=0)).metrics_ports == {}  # unset: no metrics
    fixed = LocalCluster(ClusterConfig(port=0, metrics_port=9100))
    assert fixed.metrics_ports == {"gateway": 9100, "scheduler": 9101}  # workers get theirs when added
    assert fixed.metrics_url("scheduler") == "http://127.0.0.1:9101/metrics"
    anyport = LocalCluster(ClusterConfig(port=0, metrics_port=0))
    ports = list(anyport.metrics_ports.values())
    assert len(ports) == 2 and all(ports) and len(set(ports)) == 2
    assert not set(ports) & {anyport.gateway_port, anyport.scheduler_port}
    assert _metrics_summary({}) == ""
    assert _metrics_summary({"gateway": 9100, "scheduler": 9101, "worker-0": 9102}) == (
        ", metrics gateway :9100, scheduler :9101, worker-0 :9102")


def _child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_each_component_serves_metrics_on_its_own_port(tmp_path, monkeypatch):
    base = free_port_run(4)  # gateway, scheduler, worker-0, worker-1 (added below)
    # The launcher's own variable: children must get their explicit --metrics-port, not this.
    monkeypatch.setenv("PAGEFLEET_METRICS_PORT", str(base))
    cfg = ClusterConfig(port=0, num_workers=1, device="cpu", metrics_port=base, log_dir=str(tmp_path),
                        worker_args=["--num-blocks", "64"])
    with LocalCluster(cfg) as cluster:
        assert cluster.metrics_ports == {"gateway": base, "scheduler": base + 1, "worker-0": base + 2}
        added = cluster.add_worker()
        assert cluster.metrics_ports[added] == base + 3
        cluster.wait_ready(60, num_workers=2)
        for name, port in cluster.metrics_ports.items():
            status, body = scrape(f"http://127.0.0.1:{port}/metrics")
            assert status == 200, name
            metric = COMPONENT_METRIC[name.split("-")[0]]
            assert metric in body, f"{name} on :{port} lacks {metric}"
            others = set(COMPONENT_METRIC.values()) - {metric}
            assert not any(m in body for m in others), f"{name} on :{port} serves another component's metrics"
        if Path("/proc/self/environ").exists():
            for name, proc in cluster.procs.items():
                assert "PAGEFLEET_METRICS_PORT" not in _child_env(proc.pid), name


def test_every_shards_scheduler_serves_metrics_after_the_workers(tmp_path):
    """With several shards only the first shard's scheduler had a /metrics port: the others'
    queues and decisions went unseen. Each shard's scheduler now gets one, after the workers'."""
    base = free_port_run(5)  # gateway, scheduler, 2 workers, the second shard's scheduler
    cfg = ClusterConfig(port=0, num_workers=2, shards_per_model=2, device="cpu", metrics_port=base,
                        log_dir=str(tmp_path), worker_args=["--engine", "sim", "--time-scale", "1"])
    with LocalCluster(cfg) as cluster:
        assert cluster.metrics_ports["scheduler-s1"] == base + 4
        status, body = scrape(cluster.metrics_url("scheduler-s1"))
        assert status == 200 and 'shard="s1"' in body and COMPONENT_METRIC["scheduler"] in body
