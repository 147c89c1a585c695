"""Moving KV blocks between workers: the transport seam, and NIXL behind it.

Mechanism only: which request moves where, and when, is decided elsewhere
(``migration.py`` runs the stages, the scheduler's ledger decides). This module owns

* ``KVLayout``: what a pool's blocks mean (model, dtype, block size, shape, layout);
  two pools can exchange blocks only if their layouts are equal, checked once when two
  workers first meet (``KVLayout.check_compatible``), never at request time.
* ``PoolHandle``: what a peer needs to read this worker's pool: the transport's agent
  name and metadata, the pool's base address and size, its layout, and where it runs.
* ``KVTransport``: ``register`` the pool once, ``connect`` a peer's handle (checks the
  layouts), ``read`` a list of the peer's blocks into local blocks (the receiver pulls),
  ``poll`` a transfer until ``"DONE"`` (or ``"ERR"``), ``progress`` from the owner's loop.

Two transports: ``NixlTransport`` (NIXL over UCX; what workers and every integration test
use) and ``LocalTransport`` (an in-process copy, for unit tests of the stages).

Pool layout (the engine's ``kv_cache``): ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``, contiguous, so block ``b`` of layer ``l``, key (0) or value (1)
``j`` is ``block_bytes_per_part`` bytes at ``((l * 2 + j) * num_blocks + b) *
block_bytes_per_part``. A read is one descriptor per (layer, part, run of blocks that are
consecutive on both sides), not one per block.

NIXL's own progress thread spins a core; it is off, and the pool's owner calls
``progress()`` from its loop (a peer's reads of our pool need our side to make progress
only while connections are set up; cma reads need none afterwards).
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"
CANCEL_WAIT_S = 5.0  # how long a cancelled NIXL read is let end before its blocks are set aside


class IncompatiblePeer(ValueError):
    """Two pools whose blocks do not mean the same thing: the pairing is refused."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one KV block holds. ``model``: the model's name or path (its weights decide the K/V)."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = LAYOUT

    @classmethod
    def of(cls, model: str, cache: torch.Tensor) -> KVLayout:
        if cache.dim() != 6 or cache.shape[1] != 2:
            raise ValueError(f"cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {list(cache.shape)}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = cache.shape
        return cls(model, str(cache.dtype).removeprefix("torch."), block_size, num_layers, num_kv_heads, head_dim)

    def key(self) -> str:
        """Every field as one string: two pools exchange blocks exactly when their keys are equal
        (what a worker reports, ``OccupancyReport.kv_layout``)."""
        return "/".join(str(v) for v in asdict(self).values())

    def check_compatible(self, peer: KVLayout) -> None:
        """Raise ``IncompatiblePeer`` naming every field that differs from ``peer``'s."""
        diffs = [f"{k}: ours {v!r}, peer's {getattr(peer, k)!r}"
                 for k, v in asdict(self).items() if getattr(peer, k) != v]
        if diffs:
            raise IncompatiblePeer("KV pools cannot exchange blocks (" + "; ".join(diffs) + ")")

    @property
    def block_bytes_per_part(self) -> int:
        """Bytes of one block of one layer's keys (or values)."""
        return self.block_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return self.block_bytes_per_part * self.num_layers * 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """What a peer needs to read a registered pool (sent over the control path)."""

    agent_name: str
    metadata: bytes
    base_addr: int
    num_blocks: int
    layout: KVLayout
    hostname: str = ""
    pid: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["metadata"] = self.metadata.hex()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PoolHandle:
        d = dict(d)
        d["metadata"] = bytes.fromhex(d["metadata"])
        d["layout"] = KVLayout(**d["layout"])
        return cls(**d)


def handle_to_proto(h: PoolHandle, worker_id: str = "", path: str = ""):
    """A ``pagefleet.v1.KvPoolInfo`` (what the ``KvPeer`` RPC carries)."""
    from pagefleet.protos import cluster_pb2

    return cluster_pb2.KvPoolInfo(worker_id=worker_id, agent_name=h.agent_name, agent_metadata=h.metadata,
                                  base_addr=h.base_addr, num_blocks=h.num_blocks,
                                  layout=cluster_pb2.KvLayout(**asdict(h.layout)), hostname=h.hostname,
                                  pid=h.pid, path=path)


def handle_from_proto(info) -> PoolHandle:
    """The ``PoolHandle`` in a ``KvPoolInfo``; ``ValueError`` if a field is missing."""
    if not info.agent_name or not info.num_blocks or not info.HasField("layout"):
        raise ValueError("KvPoolInfo: agent_name, num_blocks and layout are required")
    la = info.layout
    layout = KVLayout(la.model, la.dtype, la.block_size, la.num_layers, la.num_kv_heads, la.head_dim, la.layout)
    return PoolHandle(info.agent_name, info.agent_metadata, info.base_addr, info.num_blocks, layout,
                      info.hostname, info.pid)


def block_runs(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs consecutive on both sides: ``(remote first, local first, length)``."""
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local ones")
    runs: list[tuple[int, int, int]] = []
    for r, lo in zip(remote_ids, local_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == lo:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, lo, 1))
    return runs


def descriptors(base_addr: int, num_blocks: int, layout: KVLayout, runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(address, length, 0)`` for every (layer, part, run): ``runs`` is ``(first block, length)``."""
    part = layout.block_bytes_per_part
    out = []
    for lj in range(layout.num_layers * 2):
        row = base_addr + lj * num_blocks * part
        out.extend((row + first * part, n * part, 0) for first, n in runs)
    return out


@dataclass(slots=True)
class Transfer:
    """One read in flight: ``num_bytes`` into local ``local_block_ids``."""

    peer: str
    local_block_ids: list[int]
    num_bytes: int
    handle: object = None
    state: str = "PROC"


class KVTransport(ABC):
    """Registers one pool, reads peers' blocks into it. Not thread-safe: one owner loop."""

    name: ClassVar[str]

    def __init__(self, model: str) -> None:
        self.model = model
        self.cache: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.peers: dict[str, PoolHandle] = {}
        self.num_bytes_read_total = 0

    def register(self, cache: torch.Tensor) -> PoolHandle:
        """Register the pool (once); the handle peers connect with."""
        if self.cache is not None:
            raise RuntimeError("a transport registers one pool, once")
        if not cache.is_contiguous():
            raise ValueError("the KV pool must be contiguous")
        self.cache, self.layout = cache, KVLayout.of(self.model, cache)
        self._register(cache)
        return self.handle()

    def handle(self) -> PoolHandle:
        if self.cache is None:
            raise RuntimeError("register the pool first")
        return PoolHandle(self.agent_name, self._metadata(), self.cache.data_ptr(), self.cache.shape[2],
                          self.layout, socket.gethostname(), os.getpid())

    def connect(self, peer: PoolHandle) -> str:
        """Meet a peer (checks the layouts first: ``IncompatiblePeer``); its name for ``read``."""
        if self.layout is None:
            raise RuntimeError("register the pool first")
        self.layout.check_compatible(peer.layout)
        if peer.agent_name not in self.peers:
            self._connect(peer)
            self.peers[peer.agent_name] = peer
        return peer.agent_name

    def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int]) -> Transfer:
        """Start reading the peer's ``remote_block_ids`` into ``local_block_ids`` (same order)."""
        handle = self.peers.get(peer)
        if handle is None:
            raise KeyError(f"unknown peer {peer!r}: connect it first")
        runs = block_runs(list(remote_block_ids), list(local_block_ids))
        for ids, n in ((remote_block_ids, handle.num_blocks), (local_block_ids, self.cache.shape[2])):
            if ids and not (min(ids) >= 0 and max(ids) < n):
                raise ValueError(f"block ids outside a pool of {n} blocks")
        t = Transfer(peer, list(local_block_ids), len(local_block_ids) * self.layout.block_bytes)
        if not runs:
            t.state = "DONE"
            return t
        remote = descriptors(handle.base_addr, handle.num_blocks, self.layout, [(r, n) for r, _, n in runs])
        local = descriptors(self.cache.data_ptr(), self.cache.shape[2], self.layout, [(lo, n) for _, lo, n in runs])
        self._start(t, remote, local)
        return t

    def poll(self, t: Transfer) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``; a finished transfer's resources are released."""
        if t.state == "PROC":
            t.state = self._poll(t)
            if t.state == "DONE":
                self.num_bytes_read_total += t.num_bytes
            if t.state != "PROC":
                self._release(t)
        return t.state

    def cancel(self, t: Transfer) -> bool:
        """Stop a read in flight. True once its local blocks can no longer be written (free
        them); False if the read may still land in them (never reuse them)."""
        if t.state == "PROC":
            t.state = "ERR"
            self._release(t)
        return True

    def wait(self, t: Transfer) -> str:
        """Poll until the transfer is done (or failed)."""
        while self.poll(t) == "PROC":
            self.progress()
        return t.state

    def progress(self) -> None:  # noqa: B027 - a transport that needs no progress calls keeps this
        """Let the transport move (called from the owner's loop)."""

    def transport_to(self, peer: str) -> str:
        """The path reads from ``peer`` take (``cma``, ``tcp``, ``local``...), as best known."""
        return self.name

    @property
    @abstractmethod
    def agent_name(self) -> str: ...

    @abstractmethod
    def _register(self, cache: torch.Tensor) -> None: ...

    def _metadata(self) -> bytes:
        return b""

    @abstractmethod
    def _connect(self, peer: PoolHandle) -> None: ...

    @abstractmethod
    def _start(self, t: Transfer, remote: list, local: list) -> None: ...

    @abstractmethod
    def _poll(self, t: Transfer) -> str: ...

    def _release(self, t: Transfer) -> None:
        t.handle = None


class LocalTransport(KVTransport):
    """In-process stand-in: peers are pools registered in this process; a read is a copy.

    ``fail_next``: the next reads end in ``"ERR"`` (tests of the failure paths).
    """

    name = "local"
    _pools: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._name = f"local-{uuid.uuid4().hex[:8]}"
        self.fail_next = 0

    @property
    def agent_name(self) -> str:
        return self._name

    def _register(self, cache: torch.Tensor) -> None:
        LocalTransport._pools[self._name] = cache

    def _connect(self, peer: PoolHandle) -> None:
        if peer.agent_name not in LocalTransport._pools:
            raise ConnectionError(f"no pool {peer.agent_name!r} in this process")

    def _start(self, t: Transfer, remote: list, local: list) -> None:
        src = LocalTransport._pools[t.peer]
        src_bytes = src.view(-1).view(torch.uint8)
        dst_bytes = self.cache.view(-1).view(torch.uint8)
        s0, d0 = src.data_ptr(), self.cache.data_ptr()
        for (ra, n, _), (la, _, _) in zip(remote, local, strict=True):
            dst_bytes[la - d0 : la - d0 + n].copy_(src_bytes[ra - s0 : ra - s0 + n])

    def _poll(self, t: Transfer) -> str:
        if self.fail_next:
            self.fail_next -= 1
            return "ERR"
        return "DONE"

    def close(self) -> None:
        LocalTransport._pools.pop(self._name, None)


class NixlTransport(KVTransport):
    """NIXL over UCX. The agent runs without its progress thread (``progress`` drives it)."""

    name = "nixl"

    def __init__(self, model: str, agent_name: str | None = None) -> None:
        super().__init__(model)
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise RuntimeError("KV transfer needs the nixl-cu12 package") from e
        self._name = agent_name or f"pf-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._paths: dict[str, str] = {}

    @property
    def agent_name(self) -> str:
        return self._name

    def _register(self, cache: torch.Tensor) -> None:
        self._reg = self.agent.register_memory(cache)
        self._mem = "DRAM" if cache.device.type == "cpu" else "VRAM"

    def _metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _connect(self, peer: PoolHandle) -> None:
        self.agent.add_remote_agent(peer.metadata)
        self._paths[peer.agent_name] = detect_path(peer)

    def _start(self, t: Transfer, remote: list, local: list) -> None:
        dev = 0 if self._mem == "DRAM" else self.cache.device.index or 0
        local_descs = self.agent.get_xfer_descs([(a, n, dev) for a, n, _ in local], self._mem)
        remote_descs = self.agent.get_xfer_descs(remote, self._mem)
        t.handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, t.peer)
        state = self.agent.transfer(t.handle)
        if state == "ERR":
            t.state = "ERR"
            self._release(t)

    def _poll(self, t: Transfer) -> str:
        try:
            return self.agent.check_xfer_state(t.handle)
        except Exception:  # NIXL raises for a read that failed (its peer gone: NIXL_ERR_REMOTE_DISCONNECT)
            return "ERR"

    def _release(self, t: Transfer) -> None:
        if t.handle is not None:
            self.agent.release_xfer_handle(t.handle)
            t.handle = None

    def cancel(self, t: Transfer) -> bool:
        """NIXL cannot stop a read in flight: its handle released, the read still lands. So a
        read is let end (a live peer's read ends in milliseconds, a dead peer's in an error),
        up to ``CANCEL_WAIT_S``; one still running then may still write its blocks (False)."""
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self.poll(t) == "PROC":
            if time.monotonic() > deadline:
                return False
            self.progress()
            time.sleep(0.0002)
        return True

    def progress(self) -> None:
        self.agent.get_new_notifs()  # drives the UCX worker (connections, remote requests)

    def transport_to(self, peer: str) -> str:
        return self._paths.get(peer, "unknown")


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def detect_path(peer: PoolHandle) -> str:
    """How UCX reads ``peer``'s pool: ``cma`` (one copy, kernel to kernel) when the peer is on
    this host and this process may read its memory (``process_vm_readv``, ptrace rules), else
    ``tcp`` (5-15x slower on one host); a peer on another host: ``network``."""
    if peer.hostname != socket.gethostname() or not peer.pid:
        return "network"
    if peer.pid == os.getpid():
        return "cma"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(1)
        local, remote = _IoVec(ctypes.cast(buf, ctypes.c_void_p), 1), _IoVec(peer.base_addr, 1)
        n = libc.process_vm_readv(peer.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    except (OSError, AttributeError):
        return "tcp"
    return "cma" if n == 1 else "tcp"


TRANSPORTS = {"nixl": NixlTransport, "local": LocalTransport}


def make_transport(kind: str, model: str) -> KVTransport:
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {kind!r}")
    return TRANSPORTS[kind](model)


__all__ = ["IncompatiblePeer", "KVLayout", "KVTransport", "LocalTransport", "NixlTransport", "PoolHandle",
           "Transfer", "block_runs", "handle_from_proto", "handle_to_proto", "descriptors", "detect_path", "make_transport"]
