"""ReqToTokenTable: queued writes are applied in order by one flush; the numpy index assembly equals the plain
Python reference (rows, cols, slots listed write by write)."""

from __future__ import annotations

import random

import torch

from prefixrt.cache.req_table import ReqToTokenTable


def reference_indices(writes):
    rows, cols, vals = [], [], []
    for row, start, slots in writes:
        rows += [row] * len(slots)
        cols += list(range(start, start + len(slots)))
        vals += list(slots)
    return torch.tensor([rows, cols, vals], dtype=torch.int64)


def test_indices_equal_reference_in_order():
    rng = random.Random(0)
    for _ in range(50):
        writes = []
        for _ in range(rng.randint(1, 12)):
            n = rng.choice([1, 1, 1, 2, rng.randint(3, 400)])
            writes.append((rng.randrange(8), rng.randrange(64), [rng.randrange(1, 10**6) for _ in range(n)]))
        assert torch.equal(ReqToTokenTable._indices(writes), reference_indices(writes))


def test_indices_of_a_decode_step_equal_reference():
    """Every write one slot (a decode step): the one-pass path gives the same indices, in order."""
    rng = random.Random(2)
    for n in (1, 2, 256):
        writes = [(rng.randrange(300), rng.randrange(4096), [rng.randrange(1, 10**6)]) for _ in range(n)]
        got = ReqToTokenTable._indices(writes)
        assert got.dtype == torch.int64 and torch.equal(got, reference_indices(writes))


def test_flush_applies_queued_writes_in_order():
    rng = random.Random(1)
    table = ReqToTokenTable(6, 500, "cpu")
    expected = torch.zeros(6, 500, dtype=torch.int32)
    for step in range(20):
        for _ in range(rng.randint(1, 6)):
            row, n = rng.randrange(6), rng.choice([1, rng.randint(2, 300)])
            start = rng.randrange(500 - n)
            slots = [rng.randrange(1, 10**6) for _ in range(n)]
            table.write(row, start, slots)
            expected[row, start : start + n] = torch.tensor(slots, dtype=torch.int32)
        if step % 3 == 2:
            table.flush()
            assert torch.equal(table.table, expected)
    table.flush()
    assert torch.equal(table.table, expected)
