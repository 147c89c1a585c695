"""Getting a step's inputs onto the device: one packed copy, block tables kept there by diffs.

``StepUploader.upload`` packs every array of a step into one host buffer (pinned on CUDA,
so the copy is asynchronous) and issues a single non-blocking copy; the arrays come back as
views of one device buffer. Before the host buffer is written again, the previous copy is
waited for (an event recorded after it: a step that samples nothing never waits for the
device otherwise).

``DeviceBlockTables`` keeps each request's block table in a row of a device tensor between
steps. A step sends only the block ids its requests gained since they were last sent (and
a whole row when a request's table was replaced: freed and allocated again after a
preemption), plus the rows of this step's requests in order; the step's ``block_tables``
is a gather of those rows on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts aligned for any dtype's view


class StepUploader:
    def __init__(self, device: torch.device, initial_bytes: int = 1 << 20) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._layouts: dict[tuple, _Layout] = {}  # see ``upload``
        self._reserve(initial_bytes)
        self._copied = None  # CUDA event recorded after the last copy
        self.num_copies = 0  # host-to-device copies issued (one per step)
        self.num_bytes = 0  # bytes they moved

    def _reserve(self, nbytes: int) -> None:
        if self._host is not None and self._host.numel() >= nbytes:
            return
        size = max(nbytes, 2 * (self._host.numel() if self._host is not None else 0))
        host = torch.empty(size, dtype=torch.uint8)
        if self.device.type == "cuda":
            host = host.pin_memory()
            self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._host = host
        self._layouts = {}  # their views are of the old buffers

    def upload(self, arrays: Sequence, dtypes: Sequence | None = None) -> list[torch.Tensor]:
        """Each array as a tensor on the device, dtypes kept: 1-D numpy arrays, or lists of
        ints with their numpy ``dtypes`` given (one for each array; None: each array's own).

        The arrays of one dtype go into one region of the buffer in one call (lists as one
        list, converted once). The tensors handed back are views of the buffer made once for
        each layout (the arrays' dtypes and lengths: a decode step's is the last one's,
        unless a request came, went, or gained a block) and kept: a step costs no torch call
        but the copy. They hold this step's values until the next ``upload`` writes the buffer
        again (a step's inputs are read by its forward pass alone)."""
        if dtypes is None:
            dtypes = [a.dtype for a in arrays]
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host buffer (before it is written or replaced)
        key = (*dtypes, *map(len, arrays))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(arrays, [np.dtype(d) for d in dtypes], key)
        for dst, idx in layout.fills:
            if len(idx) == 1:
                dst[:] = arrays[idx[0]]
            elif all(type(arrays[i]) is list for i in idx):
                dst[:] = [x for i in idx for x in arrays[i]]
            else:
                np.concatenate([arrays[i] for i in idx], out=dst, casting="unsafe")
        if layout.copy is not None:
            dev, host = layout.copy
            dev.copy_(host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_copies += 1
        self.num_bytes += layout.nbytes
        return list(layout.views)

    def _layout(self, arrays: Sequence, dtypes: list[np.dtype], key: tuple) -> _Layout:
        groups: dict = {}
        for i, dtype in enumerate(dtypes):
            groups.setdefault(dtype, []).append(i)
        regions, end = [], 0  # (dtype, indices, byte offset, element count)
        for dtype, idx in groups.items():
            count = sum(len(arrays[i]) for i in idx)
            regions.append((dtype, idx, end, count))
            end += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
        self._reserve(end)
        host_np = self._host.numpy()
        base = self._dev if self.device.type == "cuda" else self._host  # on a CPU the host buffer is the device's
        fills, views = [], [None] * len(arrays)
        for dtype, idx, off, count in regions:
            nbytes = count * dtype.itemsize
            if count:
                fills.append((host_np[off:off + nbytes].view(dtype), idx))
            split = base[off:off + nbytes].view(_TORCH_DTYPES[dtype.type]).split([len(arrays[i]) for i in idx])
            for i, v in zip(idx, split, strict=True):
                views[i] = v
        copy = (self._dev[:end], self._host[:end]) if self.device.type == "cuda" else None
        if len(self._layouts) >= _MAX_LAYOUTS:
            self._layouts.clear()
        layout = self._layouts[key] = _Layout(fills, views, copy, end)
        return layout


class _Layout:
    """Where one layout of a step's arrays goes in the buffers, and the views handed back."""

    __slots__ = ("fills", "views", "copy", "nbytes")

    def __init__(self, fills: list, views: list, copy, nbytes: int) -> None:
        self.fills = fills  # (the host buffer's region of one dtype as an array, the indices of its arrays)
        self.views = views  # each array's tensor on the device, in order
        self.copy = copy  # (device, host) regions of the one copy (None on a CPU)
        self.nbytes = nbytes


# Layouts kept (a batch size and a number of block-table entries sent make one).
_MAX_LAYOUTS = 256
_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


class DeviceBlockTables:
    """Block tables on the device, one row per request, updated by diffs (see the module doc)."""

    def __init__(self, num_rows: int, num_cols: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros((max(num_rows, 1), max(num_cols, 1)), dtype=torch.int32, device=device)
        self._narrow: tuple = (None, 0, None)  # see ``apply``
        self._row: dict[str, int] = {}
        # request id -> (the table list the row was filled from, how many of its blocks were sent)
        self._sent: dict[str, tuple[list[int], int]] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self.num_entries_sent = 0  # cumulative: block ids sent to the device

    def diffs(self, request_ids: Sequence[str], tables: Sequence[list[int]], live: dict[str, list[int]]
              ) -> tuple[list[int], list[int], list[int], list[int]]:
        """For this step's requests (their ids and block tables, in step order): their rows,
        and the (row, column, block id) entries to write first, as lists of ints (rows and
        columns int64 on the device, block ids int32). ``live``: every request that holds a
        table now (rows of the others are reused)."""
        rows: list[int] = []
        d_rows: list[int] = []
        d_cols: list[int] = []
        d_vals: list[int] = []
        need = max((len(t) for t in tables), default=0)
        if need > self.table.shape[1]:
            self._widen(need)
        row_of, sent = self._row, self._sent
        for rid, table in zip(request_ids, tables, strict=True):
            row = row_of.get(rid)
            if row is None:
                row = self._take_row(rid, live)
            rows.append(row)
            was = sent.get(rid)
            n = 0 if was is None or was[0] is not table else was[1]  # a new table: sent whole
            m = len(table)
            if m != n:  # most decode steps: nothing new (a block is gained every block_size steps)
                d_rows.extend([row] * (m - n))
                d_cols.extend(range(n, m))
                d_vals.extend(table[n:])
                sent[rid] = (table, m)
        self.num_entries_sent += len(d_vals)
        return rows, d_rows, d_cols, d_vals

    def apply(self, rows: torch.Tensor, d_rows: torch.Tensor, d_cols: torch.Tensor, d_vals: torch.Tensor,
              width: int) -> torch.Tensor:
        """Write the diffs, then gather the step's ``[len(rows), width]`` block tables."""
        table = self.table
        if d_vals.shape[0]:
            table[d_rows, d_cols] = d_vals
        width = max(width, 1)
        narrow = self._narrow  # the table's first ``width`` columns, a view kept while they are the same
        if narrow[0] is not table or narrow[1] != width:
            narrow = self._narrow = (table, width, table[:, :width])
        return narrow[2].index_select(0, rows)

    def _take_row(self, rid: str, live: dict[str, list[int]]) -> int:
        if not self._free_rows:  # rows of requests that no longer hold a table come back
            for gone in [r for r in self._row if r not in live]:
                self._free_rows.append(self._row.pop(gone))
                self._sent.pop(gone, None)
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row[rid] = row
        return row

    def _grow_rows(self) -> None:
        old = self.table
        self.table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=old.dtype, device=self.device)
        self.table[: old.shape[0]] = old
        self._free_rows = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))

    def _widen(self, num_cols: int) -> None:
        old = self.table
        self.table = torch.zeros((old.shape[0], max(num_cols, 2 * old.shape[1])), dtype=old.dtype,
                                 device=self.device)
        self.table[:, : old.shape[1]] = old
