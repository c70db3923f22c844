"""ReqToTokenTable: for each running request (a row), the pool slot of each of its positions.

The table lives on the model's device, so kernels read slots without a host round-trip; rows are
handed out and returned on the host. Writes are queued on the host and applied by flush(), once per step: a
write (cells given as host slot ids) or a prefix copy (a row's first cells taken from another row on the
device: a request admitted on a cached prefix that a running request's row already holds).
"""

from __future__ import annotations

import numpy as np
import torch


class ReqToTokenTable:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._pending: list[tuple[int, int, list[int]]] = []  # writes of the segment being queued
        self._copies: list[tuple[int, int, int]] = []  # (dst, src, n) prefix copies of that segment
        self._copy_extent: dict[int, int] = {}  # row -> cells [0, n) a copy of the segment reads or writes there
        self._copy_dsts: set[int] = set()
        self._segments: list[tuple[list, list]] = []  # earlier segments (writes, copies), closed by a conflict
        # Tensor parallelism (parallel/tp_runner.py): a list that flush() appends each applied batch of writes to, as
        # a host int64 [3, n] (rows, cols, slots), for the other ranks' copies of the table. None: not kept.
        self.journal: list[torch.Tensor] | None = None

    def close(self) -> None:
        """Free the device table (the table is unusable afterwards)."""
        self.table = torch.empty((0, self.max_context), dtype=torch.int32)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """table[row, start:start+len(slots)] = slots — queued; applied by flush() (one copy per step)."""
        if slots:
            if start < self._copy_extent.get(row, 0):  # a queued copy reads or writes these cells: keep the order
                self._close_segment()
            self._pending.append((row, start, slots))

    def copy_prefix(self, dst: int, src: int, n: int, slots: list[int]) -> None:
        """table[dst, :n] = table[src, :n] — queued like write(), applied by flush() on the device. The caller
        guarantees that table[src, :n], once the writes queued before this call are applied, equals `slots`
        (which is what the reference, write(dst, 0, slots), would store). With tensor parallelism (a journal is
        kept) it is that write: the other ranks replay host slot ids."""
        if n == 0:
            return
        if self.journal is not None:
            self.write(dst, 0, slots)
            return
        if src in self._copy_dsts or dst in self._copy_extent:  # copies of one segment are applied together
            self._close_segment()
        self._copies.append((dst, src, n))
        self._copy_dsts.add(dst)
        for row in (dst, src):
            self._copy_extent[row] = max(self._copy_extent.get(row, 0), n)

    def _close_segment(self) -> None:
        """Queue order between segments is kept; inside one, its writes are applied before its copies, which is
        the order they were queued in up to swaps of operations on disjoint cells (write() and copy_prefix()
        close the segment on a conflict)."""
        if self._pending or self._copies:
            self._segments.append((self._pending, self._copies))
        self._pending, self._copies = [], []
        self._copy_extent, self._copy_dsts = {}, set()

    @staticmethod
    def _indices(writes: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """The queued writes, in order, as one int64 [3, n] host tensor (rows, cols, slots). Built in numpy: a request
        admitted with a long cached prefix writes thousands of slots, which Python-level list building
        would walk element by element (~2 ms for 3500 slots)."""
        if all(len(w[2]) == 1 for w in writes):  # a decode step: one new slot per request, in one pass
            rows, starts, slots = zip(*writes)
            return torch.tensor([rows, starts, [s[0] for s in slots]], dtype=torch.int64)
        blocks, run = [], ([], [], [])  # run: consecutive one-slot writes, kept in order
        for row, start, slots in writes:
            n = len(slots)
            if n == 1:  # a decode step's one new slot: the common case at large batches
                run[0].append(row)
                run[1].append(start)
                run[2].append(slots[0])
                continue
            if run[0]:
                blocks.append(np.array(run, dtype=np.int64))
                run = ([], [], [])
            block = np.empty((3, n), dtype=np.int64)
            block[0] = row
            block[1] = np.arange(start, start + n)
            block[2] = np.fromiter(slots, dtype=np.int64, count=n)
            blocks.append(block)
        if run[0]:
            blocks.append(np.array(run, dtype=np.int64))
        out = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
        return torch.from_numpy(out)

    def flush(self) -> None:
        """Apply every queued write and copy, in order: per segment one host->device copy of the writes' indices,
        then one gather/scatter on the device for its copies. Called before each forward."""
        if not (self._pending or self._copies or self._segments):
            return
        self._close_segment()
        segments, self._segments = self._segments, []
        for writes, copies in segments:
            if writes:
                self._apply_writes(writes)
            if copies:
                self._apply_copies(copies)

    def _apply_writes(self, writes: list[tuple[int, int, list[int]]]) -> None:
        idx = self._indices(writes)
        if self.journal is not None:
            self.journal.append(idx)
        if self.table.device.type == "cuda":
            idx = idx.pin_memory().to(self.table.device, non_blocking=True)
        self.table[idx[0], idx[1]] = idx[2].to(torch.int32)

    def _apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """table[dst, :n] = table[src, :n] for every (dst, src, n), no dst twice and no dst read as a src (the
        segment rules): gather the source rows' first max(n) cells, keep each row's first n, scatter."""
        dst, src, n = zip(*copies)
        width = max(n)
        idx = torch.tensor([dst, src, n], dtype=torch.int64)  # [3, k]
        if self.table.device.type == "cuda":
            idx = idx.pin_memory().to(self.table.device, non_blocking=True)
        block = self.table[idx[1], :width]  # [k, width]
        if min(n) != width:
            keep = torch.arange(width, device=block.device)[None, :] < idx[2][:, None]
            block = torch.where(keep, block, self.table[idx[0], :width])
        self.table[idx[0], :width] = block
