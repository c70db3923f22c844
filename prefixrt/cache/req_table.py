"""ReqToTokenTable: for each running request (a row), the pool slot of each of its positions.

The table lives on the model's device, so kernels read slots without a host round-trip; rows are
handed out and returned on the host.
"""

from __future__ import annotations

import torch

from prefixrt.cache.host_lists import int64_tensor


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

    def flush(self) -> None:
        """Apply every queued write with one host->device copy. Called before each forward."""
        if not self._pending:
            return
        rows, cols, vals = [], [], []
        for row, start, slots in self._pending:
            if len(slots) == 1:  # a decode step's one new slot: the common case at large batches
                rows.append(row)
                cols.append(start)
                vals.append(slots[0])
            else:
                rows.extend([row] * len(slots))
                cols.extend(range(start, start + len(slots)))
                vals.extend(slots)
        self._pending.clear()
        idx = int64_tensor(rows, cols, vals).view(3, -1)
        if self.journal is not None:
            self.journal.append(idx)
        if self.table.device.type == "cuda":
            idx = idx.pin_memory().to(self.table.device, non_blocking=True)
        self.table[idx[0], idx[1]] = idx[2].to(torch.int32)
