"""ReqToTokenTable: for each running request (a row), the pool slot of each of its positions.

The table lives on the model's device, so kernels read slots without a host round-trip; rows are
handed out and returned on the host.
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
        self._pending: list[tuple[int, int, list[int]]] = []
        # Tensor parallelism (model/tp_runner.py): a list that flush() appends each applied batch of writes to, as
        # a host int64 [3, n] (rows, cols, slots), for the other ranks' copies of the table. None: not kept.
        self.journal: list[torch.Tensor] | None = None

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
            self._pending.append((row, start, slots))

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
        """Apply every queued write with one host->device copy. Called before each forward."""
        if not self._pending:
            return
        idx = self._indices(self._pending)
        self._pending.clear()
        if self.journal is not None:
            self.journal.append(idx)
        if self.table.device.type == "cuda":
            idx = idx.pin_memory().to(self.table.device, non_blocking=True)
        self.table[idx[0], idx[1]] = idx[2].to(torch.int32)
