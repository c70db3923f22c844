"""ReqToTokenTable: for each running request (a row), the pool slot of each of its positions.

The table lives on the model's device, so kernels read slots without a host round-trip; rows are
handed out and returned on the host.
"""

from __future__ import annotations

import torch


class ReqToTokenTable:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

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
        """table[row, start:start+len(slots)] = slots."""
        if slots:
            self.table[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32).to(
                self.table.device, non_blocking=True
            )

    def write_many(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """Scatter one slot per (row, position): the decode-step fast path (one host->device copy)."""
        if rows:
            idx = torch.tensor([rows, positions, slots], dtype=torch.int64).to(self.table.device, non_blocking=True)
            self.table[idx[0], idx[1]] = idx[2].to(torch.int32)
