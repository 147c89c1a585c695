"""A throwaway Redis Cluster on loopback: ``with RedisClusterServer() as c: c.url``.

``num_primaries`` primaries with ``replicas`` replicas each, every node a ``redis-server
--cluster-enabled yes`` (``RedisServer``) on a free port in its own temp dir, joined by
``redis-cli --cluster create`` (3 primaries or more), or one primary serving every slot
(``CLUSTER ADDSLOTS``; its replicas joined by ``CLUSTER MEET`` and ``CLUSTER REPLICATE``): a
one-node cluster, the baseline a bench compares more primaries with. Used by ``pagefleet up --redis-cluster`` (when no
``--redis-url`` is given), ``bench token-path --primaries N`` and the tests; nothing here is
needed to *use* a cluster: components only take ``--redis-cluster`` and a node's URL.

Failover helpers (``replica_port``, ``pause``, ``cut_replicas``, ``kill``, ``resume``,
``takeover``) are for tests that make a primary's acknowledged writes go missing on purpose:
stop its replica, cut the replication link (else the stopped replica's kernel still buffers
what the primary sends, and nothing is lost), write, kill the primary, resume the replica and
promote it (``CLUSTER FAILOVER TAKEOVER``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from .redis import RedisServer, redis_cli_binary

# CRC16 of Redis Cluster (XMODEM), for ``key_slot``.
_CRC16_TABLE: list[int] = []
for _i in range(256):
    _c = _i << 8
    for _ in range(8):
        _c = ((_c << 1) ^ 0x1021) if _c & 0x8000 else (_c << 1)
    _CRC16_TABLE.append(_c & 0xFFFF)


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster slot of ``key`` (its ``{tag}`` only, when it has a non-empty one)."""
    k = key.encode() if isinstance(key, str) else key
    start = k.find(b"{")
    if start >= 0:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1:end]
    crc = 0
    for b in k:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16_TABLE[((crc >> 8) ^ b) & 0xFF]
    return crc % 16384


def cluster_port(taken: set[int] = frozenset()) -> int:
    """A free port for a cluster node: at most 55535, with its bus port (+10000) free too."""
    for _ in range(1000):
        port = random.randint(20000, 55535)
        if port in taken or port + 10000 in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (N, N+10000) for a Redis Cluster node")


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    port: int
    primary: bool
    primary_id: str  # a replica's primary; "" for a primary
    slots: tuple[tuple[int, int], ...]  # a primary's slot ranges

    def serves(self, slot: int) -> bool:
        return any(a <= slot <= b for a, b in self.slots)


class RedisClusterServer:
    """``num_primaries`` x (1 + ``replicas``) ``redis-server`` processes forming one cluster.

    ``node_timeout_ms``: the cluster's failure detection (``cluster-node-timeout``);
    ``auto_failover``: False keeps replicas from promoting themselves (a test promotes one
    with ``takeover`` when it chooses).
    """

    def __init__(self, num_primaries: int = 3, replicas: int = 1, *, node_timeout_ms: int = 2000,
                 auto_failover: bool = True, die_with_parent: bool = False) -> None:
        if num_primaries < 1 or num_primaries == 2:
            raise ValueError(f"a Redis Cluster here has 1 primary or at least 3 (redis-cli --cluster create "
                             f"wants 3), got {num_primaries}")
        if replicas < 0:
            raise ValueError(f"replicas must be 0 or more, got {replicas}")
        self.num_primaries = num_primaries
        self.replicas = replicas
        self.password = None  # no AUTH (as ``RedisServer`` without one)
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms)]
        if not auto_failover:
            args += ["--cluster-replica-no-failover", "yes"]
        self.servers: list[RedisServer] = []
        taken: set[int] = set()
        for _ in range(num_primaries * (1 + replicas)):
            port = cluster_port(taken)
            taken |= {port, port + 10000}
            self.servers.append(RedisServer(port, extra_args=args, die_with_parent=die_with_parent))

    @property
    def url(self) -> str:
        """A node's URL (any one does: the client finds the rest); the first live one."""
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                return f"redis://127.0.0.1:{s.port}"
        return f"redis://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout_s: float = 60.0) -> RedisClusterServer:
        try:
            for s in self.servers:
                s.start()
            if self.num_primaries == 1:
                self._create_one_primary(timeout_s)
            else:
                cmd = [redis_cli_binary(), "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                       "--cluster-replicas", str(self.replicas), "--cluster-yes"]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                if out.returncode != 0:
                    raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
            self.wait_ok(timeout_s)
            self._wait_settled(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_one_primary(self, timeout_s: float) -> None:
        """The first node serves all 16,384 slots; every other one meets it and replicates it."""
        import redis as sync_redis

        primary, *replicas = self.servers
        with self._client(primary.port) as c:
            c.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
            primary_id = c.execute_command("CLUSTER", "MYID")
        primary_id = primary_id.decode() if isinstance(primary_id, bytes) else primary_id
        deadline = time.monotonic() + timeout_s
        for s in replicas:
            with self._client(s.port) as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", primary.port)
                while True:  # until gossip has told it the primary's id
                    try:
                        c.execute_command("CLUSTER", "REPLICATE", primary_id)
                        break
                    except sync_redis.exceptions.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

    def _client(self, port: int):
        import redis as sync_redis

        return sync_redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=5)

    def wait_ok(self, timeout_s: float = 60.0, ports: list[int] | None = None) -> None:
        """Until every live node (or those on ``ports``) says ``cluster_state:ok`` and every
        replica has its primary's link up."""
        import redis as sync_redis

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self._node_ok(p) for p in ports or self.live_ports()):
                    return
            except sync_redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Redis Cluster was not ok within {timeout_s}s")
            time.sleep(0.1)

    def _wait_settled(self, timeout_s: float) -> None:
        """Until every node sees every primary and replica as such (gossip spreads the roles
        ``--cluster create`` set)."""
        want = (self.num_primaries, self.num_primaries * self.replicas)
        deadline = time.monotonic() + timeout_s
        while True:
            views = [self.nodes(p) for p in self.live_ports()]
            if all((sum(n.primary for n in v), sum(not n.primary for n in v)) == want for v in views):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Redis Cluster's roles did not settle within {timeout_s}s")
            time.sleep(0.1)

    def _node_ok(self, port: int) -> bool:
        with self._client(port) as c:
            if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                return False
            info = c.info("replication")
            return info.get("role") == "master" or info.get("master_link_status") == "up"

    def live_ports(self) -> list[int]:
        return [s.port for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def nodes(self, port: int | None = None) -> list[ClusterNode]:
        """``CLUSTER NODES`` as one live node (``port``: that one) sees it, failed nodes left out."""
        with self._client(port or self.live_ports()[0]) as c:
            text = c.execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        nodes = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8 or "fail" in parts[2].split(",") or "noaddr" in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            primary = "master" in parts[2]
            slots = []
            for r in parts[8:]:
                if r.startswith("["):
                    continue  # a slot being migrated
                a, _, b = r.partition("-")
                slots.append((int(a), int(b or a)))
            nodes.append(ClusterNode(parts[0], port, primary, "" if primary else parts[3], tuple(slots)))
        return nodes

    def primary_port(self, key: str) -> int:
        """The port of the primary serving ``key``'s slot."""
        slot = key_slot(key)
        return next(n.port for n in self.nodes() if n.primary and n.serves(slot))

    def replica_port(self, primary_port: int) -> int:
        """The port of a replica of the primary on ``primary_port``."""
        nodes = self.nodes()
        pid = next(n.node_id for n in nodes if n.port == primary_port)
        return next(n.port for n in nodes if n.primary_id == pid)

    def primary_ports(self) -> list[int]:
        return sorted(n.port for n in self.nodes() if n.primary)

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def pause(self, port: int) -> None:
        """SIGSTOP the node on ``port`` (it keeps its connections but answers nothing)."""
        os.killpg(self.server(port).proc.pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT the node on ``port``."""
        os.killpg(self.server(port).proc.pid, signal.SIGCONT)

    def cut_replicas(self, primary_port: int) -> None:
        """Close the primary's replication links (``CLIENT KILL TYPE replica``): what it writes
        next reaches no replica (a stopped replica would still read what its kernel buffered)."""
        with self._client(primary_port) as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (nothing of it is kept: it had no persistence)."""
        self.server(port).kill()

    def takeover(self, replica_port: int, timeout_s: float = 30.0) -> None:
        """Promote the replica on ``replica_port`` now (``CLUSTER FAILOVER TAKEOVER``: no
        agreement of the other primaries, no catching up with its old primary), then wait until
        the live nodes agree the cluster is ok."""
        with self._client(replica_port) as c:
            c.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        deadline = time.monotonic() + timeout_s
        while next((n.primary for n in self.nodes(replica_port) if n.port == replica_port), False) is False:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica on {replica_port} was not promoted within {timeout_s}s")
            time.sleep(0.05)
        self.wait_ok(timeout_s, ports=[p for p in self.live_ports() if self._is_primary(p)])

    def _is_primary(self, port: int) -> bool:
        with self._client(port) as c:
            return c.info("replication").get("role") == "master"

    def stop(self) -> None:
        for s in self.servers:
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.killpg(s.proc.pid, signal.SIGCONT)  # a paused node must be able to stop
            s.stop()

    def __enter__(self) -> RedisClusterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
