"""The CPU swap pool and the batched block transfers between it and the device pool.

Mechanism only: which sequence is swapped, and when it comes back, is decided by the
scheduler (``policy.py``). This module owns

* ``SwapAllocator``: the swap pool's block ids. It hands out *contiguous extents* when
  it can, so that the host side of a transfer is one plain copy per extent instead of a
  scatter (host scatters run at a fraction of memory bandwidth).
* ``SwapSpace``: the swap pool's tensor, with the device pool's layout
  ``[num_layers, 2, num_swap_blocks, block_size, num_kv_heads, head_dim]`` (pinned
  host memory when the device is CUDA), and the copies:
  ``swap_out(mapping)`` / ``swap_in(mapping)`` with ``mapping`` a list of
  ``(src_block, dst_block)`` pairs.

A transfer is batched: on the device side the blocks of every layer are gathered with
one ``index_select`` into a contiguous staging buffer (or scattered from it with one
``index_copy_``), and each contiguous extent of the swap pool moves in one copy per
layer and tensor (on CPU, one copy over all layers). Never one copy per block.

On CUDA the copies run on a side stream. Ordering contract with the compute stream:

* a swap-out's gather waits for the compute stream (the K/V it reads are written), and
  the compute stream waits for the gather only (the freed device blocks may be
  reused by this step's forward); the device-to-host copy overlaps the forward;
* a swap-in is issued one step before its sequence runs: ``fence()`` (called before
  every forward) makes the compute stream wait for the swap-ins issued in earlier steps,
  so the host-to-device copy overlaps the forward of the step that issued it;
* everything on the side stream is in issue order, so a swap pool block freed and
  reused (abort while swapped, swap-in then swap-out) is never read or written out of
  order.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import torch

# Device staging for one transfer is at most this large; bigger transfers go in chunks.
_STAGING_BYTES = 256 << 20


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: ``(position in ids, first id, length)``."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            pos, first, n = out[-1]
            out[-1] = (pos, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


class SwapAllocator:
    """Block ids of the swap pool, per request; prefers one contiguous extent per request.

    ``allocate`` returns ``None`` (nothing changed) when too few blocks are free.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_swap_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)]  # sorted (start, length)
        self._num_free = num_blocks
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def can_allocate(self, num: int) -> bool:
        return num <= self._num_free

    def allocate(self, request_id: str, num: int) -> list[int] | None:
        """``num`` blocks for ``request_id`` (which must hold none), or ``None`` if too few are free."""
        if request_id in self.block_tables:
            raise RuntimeError(f"{request_id!r} already holds swap blocks")
        if num > self._num_free:
            return None
        ids: list[int] = []
        fit = next((i for i, (_, n) in enumerate(self._free) if n >= num), None)
        order = [fit] if fit is not None else sorted(
            range(len(self._free)), key=lambda i: -self._free[i][1]
        )
        for i in order:
            start, n = self._free[i]
            k = min(n, num - len(ids))
            ids.extend(range(start, start + k))
            self._free[i] = (start + k, n - k)
            if len(ids) == num:
                break
        self._free = [e for e in self._free if e[1] > 0]
        self._num_free -= num
        self.block_tables[request_id] = ids
        return ids

    def free(self, request_id: str) -> int:
        """Return every swap block of ``request_id``; the number freed."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        for _, first, n in _runs(sorted(table)):
            self._insert(first, n)
        self._num_free += len(table)
        return len(table)

    def _insert(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and sum(self._free[i - 1]) == start:  # merge with the extent before
            i -= 1
            start, n = self._free[i][0], self._free[i][1] + n
            del self._free[i]
        if i < len(self._free) and start + n == self._free[i][0]:  # and the one after
            n += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, n))

    def check_integrity(self) -> None:
        owned = [b for t in self.block_tables.values() for b in t]
        free = [b for s, n in self._free for b in range(s, s + n)]
        if len(set(owned)) != len(owned) or set(owned) & set(free):
            raise AssertionError("swap pool: a block is owned twice or both owned and free")
        if len(owned) + len(free) != self.num_blocks or len(free) != self._num_free:
            raise AssertionError(
                f"swap pool integrity: owned {len(owned)} + free {len(free)} != {self.num_blocks}"
            )


class SwapSpace:
    """The swap pool's tensor and the batched copies in and out of the device pool.

    ``device_cache`` is the engine's whole device pool, ``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]`` (each ``[layer, 0|1]`` a layer's key/value
    cache); the swap pool has the same layout with ``num_blocks`` swap blocks.
    """

    def __init__(self, device_cache: torch.Tensor, num_blocks: int) -> None:
        if device_cache.dim() != 6 or device_cache.shape[1] != 2:
            raise ValueError(f"device_cache must be [num_layers, 2, num_blocks, ...], got {list(device_cache.shape)}")
        self.device = device_cache.device
        self.device_cache = device_cache
        self.num_blocks = num_blocks
        self.num_layers = device_cache.shape[0]
        self.block_shape = tuple(device_cache.shape[3:])
        self.dtype = device_cache.dtype
        self.is_cuda = self.device.type == "cuda"
        shape = (self.num_layers, 2, num_blocks, *self.block_shape)
        # Written before it is ever read; zeroed anyway so its pages are resident up front
        # (first-touch page faults would otherwise be paid inside the first swap-outs).
        self.cache = torch.zeros(shape, dtype=self.dtype, pin_memory=self.is_cuda)
        self.block_bytes = self.cache[:, :, 0].numel() * self.cache.element_size()
        self.max_staging_blocks = max(1, min(num_blocks, _STAGING_BYTES // self.block_bytes))
        self._staging: torch.Tensor | None = None
        self.num_bytes_moved = 0
        self.num_transfers = 0
        self.transfer_seconds = 0.0
        if self.is_cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._unfenced: list[torch.cuda.Event] = []
            self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
            self._keep: list[torch.Tensor] = []  # pinned index tensors in flight

    # -- public ----------------------------------------------------------------------
    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to swap blocks: ``mapping`` is ``(device_block, swap_block)`` pairs."""
        self._transfer(mapping, out=True)

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy swap blocks to device blocks: ``mapping`` is ``(swap_block, device_block)`` pairs."""
        self._transfer(mapping, out=False)

    def fence(self) -> None:
        """Make the compute stream wait for every swap-in issued so far (CUDA; no-op on CPU)."""
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            for ev in self._unfenced:
                compute.wait_event(ev)
            self._unfenced.clear()
            self._collect(block=False)

    def synchronize(self) -> None:
        """Wait for every transfer in flight (and account its time)."""
        if self.is_cuda:
            self.stream.synchronize()
            self._collect(block=True)

    @property
    def bytes_per_second(self) -> float:
        self.synchronize()
        return self.num_bytes_moved / self.transfer_seconds if self.transfer_seconds else 0.0

    # -- the copies ------------------------------------------------------------------
    def _transfer(self, mapping: Sequence[tuple[int, int]], *, out: bool) -> None:
        if not mapping:
            return
        # Ordered by the swap side, so each of its extents is one contiguous range.
        pairs = sorted(mapping, key=lambda p: p[1] if out else p[0])
        step = self.max_staging_blocks
        for lo in range(0, len(pairs), step):
            chunk = pairs[lo : lo + step]
            dev_ids = [p[0] if out else p[1] for p in chunk]
            swap_ids = [p[1] if out else p[0] for p in chunk]
            if self.is_cuda:
                self._cuda_chunk(dev_ids, swap_ids, out)
            else:
                t0 = time.perf_counter()
                self._host_chunk(dev_ids, swap_ids, out)
                self.transfer_seconds += time.perf_counter() - t0
            self.num_bytes_moved += len(chunk) * self.block_bytes
        self.num_transfers += 1

    def _host_chunk(self, dev_ids: list[int], swap_ids: list[int], out: bool) -> None:
        """Both pools in host memory: per swap extent, one copy over every layer.

        A contiguous device range is a plain (strided) copy; otherwise one
        ``index_select`` gathers straight into the extent, or one ``index_copy_``
        scatters from it.
        """
        dev_all, swap_all = self.device_cache, self.cache
        for pos, first, n in _runs(swap_ids):
            part = dev_ids[pos : pos + n]
            span = swap_all[:, :, first : first + n]
            if len(_runs(part)) == 1:
                d0 = part[0]
                (span.copy_(dev_all[:, :, d0 : d0 + n]) if out
                 else dev_all[:, :, d0 : d0 + n].copy_(span))
                continue
            idx = torch.tensor(part, dtype=torch.int64)
            if out:
                torch.index_select(dev_all, 2, idx, out=span)
            else:
                dev_all.index_copy_(2, idx, span)

    def _cuda_chunk(self, dev_ids: list[int], swap_ids: list[int], out: bool) -> None:
        n = len(dev_ids)
        stage = self._stage(n)  # [num_layers, 2, n, *block_shape] on the device, contiguous
        idx_host = torch.tensor(dev_ids, dtype=torch.int64).pin_memory()
        self._keep.append(idx_host)
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # K/V written and device blocks released by compute
            idx = idx_host.to(self.device, non_blocking=True)
            start.record(self.stream)
            if out:
                torch.index_select(self.device_cache, 2, idx, out=stage)  # one gather, all layers
                gathered = torch.cuda.Event()
                gathered.record(self.stream)
                compute.wait_event(gathered)  # only the gather: the copy overlaps compute
                self._extent_copies(stage, swap_ids, out=True)
            else:
                self._extent_copies(stage, swap_ids, out=False)
                self.device_cache.index_copy_(2, idx, stage)  # one scatter, all layers
                done = torch.cuda.Event()
                done.record(self.stream)
                self._unfenced.append(done)
            end.record(self.stream)
        self._timing.append((start, end))

    def _extent_copies(self, stage: torch.Tensor, swap_ids: list[int], *, out: bool) -> None:
        """Device staging <-> pinned swap extents: one contiguous copy per layer and tensor."""
        for pos, first, n in _runs(swap_ids):
            for layer in range(self.num_layers):
                for j in range(2):
                    dev = stage[layer, j, pos : pos + n]
                    span = self.cache[layer, j, first : first + n]
                    (span.copy_(dev, non_blocking=True) if out else dev.copy_(span, non_blocking=True))

    def _stage(self, n: int) -> torch.Tensor:
        numel = self.num_layers * 2 * n * self.cache[0, 0, 0].numel()
        if self._staging is None or self._staging.numel() < numel:
            if self._staging is not None:
                self.stream.synchronize()  # the old buffer may still be in use
            cap = numel // n * self.max_staging_blocks
            self._staging = torch.empty(cap, dtype=self.dtype, device=self.device)
        return self._staging[:numel].view(self.num_layers, 2, n, *self.block_shape)

    def _collect(self, *, block: bool) -> None:
        """Account the time of finished transfers; drop what they kept alive."""
        while self._timing and (block or self._timing[0][1].query()):
            start, end = self._timing.pop(0)
            end.synchronize()
            self.transfer_seconds += start.elapsed_time(end) / 1e3
        if not self._timing:
            self._keep.clear()
