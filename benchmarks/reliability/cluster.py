"""The cluster a reliability scenario disturbs, and the row it reports.

``ReliabilityCluster``: a real ``redis-server`` with an append-only file fsynced on every
write, two gateways, the workers, an active scheduler and a standby, each a process of
its own on loopback (``LocalCluster``), logs in one directory per scenario. Helpers find
the active scheduler, a worker mid-generation, processes that exited, and wait until
every worker holds nothing (``wait_idle``: what is still held then is a leak).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagefleet.common.redis import Keys, RedisServer
from pagefleet.launcher import ClusterConfig, LocalCluster


@dataclass(frozen=True, slots=True)
class Settings:
    """``short``: the CI form (small counts); ``log_dir``: one folder per scenario under it;
    ``sim_time_scale``: the simulated workers' ``--time-scale`` where a scenario uses them;
    ``soak_*``: the soak's load seconds (None: its default), fraction of capacity, idle seconds."""

    short: bool
    log_dir: Path
    sim_time_scale: float = 1.0
    soak_seconds: float | None = None
    soak_load: float = 0.7
    soak_idle_s: float | None = None

    def pick(self, short, full):
        return short if self.short else full


@dataclass(slots=True)
class Row:
    """One scenario's result: the common counts, its own figures, and its own goals (met or not)."""

    scenario: str
    sent: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    missing: int = 0
    differing: int = 0
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    goals: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.missing or self.differing) and all(self.goals.values())


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


class ReliabilityCluster:
    """``with ReliabilityCluster(settings, "worker-kill") as c: c.gateway_targets ...``"""

    def __init__(self, settings: Settings, name: str, *, num_workers: int = 2, worker_args: Sequence[str] = (),
                 scheduler_args: Sequence[str] = (), gateway_args: Sequence[str] = (), standby: bool = True,
                 scheduler_redis_url: Callable[[str], str] | None = None) -> None:
        """``scheduler_redis_url``: Redis URL -> the URL each scheduler uses (e.g. through a proxy)."""
        self.log_dir = settings.log_dir / name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(appendonly=True)
        self.num_workers = num_workers
        self.standby = standby
        self._scheduler_url = scheduler_redis_url
        # One torch thread per worker: the workers' engines and every other process share few cores.
        self._cfg = dict(num_workers=num_workers, worker_args=["--num-blocks", "256", *worker_args],
                         scheduler_args=list(scheduler_args), gateway_args=list(gateway_args),
                         env={"OMP_NUM_THREADS": "1"})
        self.cluster: LocalCluster | None = None
        self.scheduler_urls: dict[str, str] = {}  # a scheduler's name -> the Redis URL it was given
        self._num_schedulers = 0

    def __enter__(self) -> ReliabilityCluster:
        self.redis.start()
        try:
            url = self.redis.url
            self.scheduler_urls["scheduler"] = self._scheduler_url(url) if self._scheduler_url else url
            cfg = ClusterConfig(port=0, device="cpu", log_dir=str(self.log_dir), redis_url=url, num_gateways=2,
                                scheduler_redis_url=self.scheduler_urls["scheduler"], **self._cfg)
            self.cluster = LocalCluster(cfg)
            self._num_schedulers = 1
            self.cluster.start(timeout_s=120)
            if self.standby:
                self.start_standby()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        self.redis.stop()

    # -- processes -----------------------------------------------------------------------
    @property
    def c(self) -> LocalCluster:
        assert self.cluster is not None
        return self.cluster

    @property
    def gateway_targets(self) -> list[str]:
        return self.c.gateway_targets

    def start_standby(self) -> str:
        """Another scheduler (it waits for the lease); its name."""
        name = f"scheduler-{self._num_schedulers}"
        self._num_schedulers += 1
        url = self._scheduler_url(self.redis.url) if self._scheduler_url else self.redis.url
        self.scheduler_urls[name] = url
        self.c.start_scheduler(name, redis_url=url)
        return name

    def schedulers(self) -> list[str]:
        return [n for n in self.c.procs if n.startswith("scheduler")]

    def active_scheduler(self) -> str | None:
        """The name of the scheduler that answers as active, None if none does."""
        from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

        for name in self.schedulers():
            try:
                with grpc.insecure_channel(f"127.0.0.1:{self.c.scheduler_ports[name]}") as ch:
                    state = cluster_pb2_grpc.SchedulerStub(ch).GetState(cluster_pb2.GetStateRequest(), timeout=2)
            except grpc.RpcError:
                continue
            if state.active:
                return name
        return None

    def state(self, timeout_s: float = 30.0):
        """The active scheduler's state (waiting for one to be active)."""
        name = wait_for(self.active_scheduler, timeout_s, "an active scheduler")
        return self.c.scheduler_state(name=name)

    def reports(self) -> dict[str, object]:
        return {w.worker_id: w.report for w in self.state().workers if w.HasField("report")}

    def busy_worker(self, timeout_s: float = 30.0) -> str:
        """A worker (of this cluster's processes) generating for at least one request now."""
        def find():
            return next((wid for wid, r in self.reports().items() if r.num_running and wid in self.c.procs), None)
        return wait_for(find, timeout_s, "a worker mid-generation")

    def exited(self) -> dict[str, int]:
        """Processes that exited by themselves since the last call (name -> exit code), forgotten."""
        done = {n: p.returncode for n, p in self.c.procs.items() if p.poll() is not None}
        for n in done:
            self.c.procs.pop(n)
        return done

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.c.procs[name].pid, sig)

    # -- the end of a scenario --------------------------------------------------------------
    def held(self) -> dict[str, int]:
        """What the workers still hold: device and swap blocks in use, requests."""
        reports = self.reports().values()
        return dict(
            blocks=sum(r.num_blocks - r.num_free_blocks for r in reports),
            swap_blocks=sum(r.num_swap_blocks - r.num_free_swap_blocks for r in reports),
            requests=sum(len(r.request_ids) for r in reports),
        )

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Until every worker holds nothing and the requests stream is empty; what is still held
        then (all zeros: nothing leaked). ``workers``: how many workers reported."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held()
            held["stream_entries"] = self.stream_length()
            if not any(held.values()) or time.monotonic() > deadline:
                held["workers"] = len(self.reports())
                return held
            time.sleep(0.2)

    @property
    def keys(self) -> Keys:
        return Keys(self.c.cfg.namespace)

    def stream_length(self) -> int:
        """Entries left in the requests stream: each is a request not finished (or not acknowledged)."""
        import redis

        with redis.Redis(port=self.redis.port, socket_timeout=5) as r:
            return int(r.xlen(self.keys.requests))

    def stream_entries(self, count: int = 5) -> list[str]:
        """The first ``count`` entries of the requests stream, as ``kind:request_id``."""
        import redis

        with redis.Redis(port=self.redis.port, socket_timeout=5) as r:
            entries = r.xrange(self.keys.requests, count=count)
        return [f"{f.get(b'kind', b'').decode()}:{f.get(b'rid', b'').decode()}" for _, f in entries]

    def events(self, name: str, *events: str) -> list[dict]:
        """The JSON log lines of process ``name`` whose event is one of ``events``."""
        path = self.log_dir / f"{name}.log"
        out = []
        for line in path.read_text().splitlines() if path.exists() else ():
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if e.get("event") in events:
                    out.append(e)
        return out
