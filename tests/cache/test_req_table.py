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


def test_copies_and_writes_flush_as_if_applied_one_by_one_in_order():
    """copy_prefix next to write: whatever the interleaving (copies out of rows written in the same flush, writes
    over cells a queued copy reads or fills, chains of copies), flush() leaves the table as applying every
    operation at once, in queue order, would."""
    rng = random.Random(3)
    for trial in range(60):
        rows, width = 6, 120
        table = ReqToTokenTable(rows, width, "cpu")
        expected = torch.zeros(rows, width, dtype=torch.int32)
        for _ in range(rng.randint(1, 25)):
            if rng.random() < 0.4:
                dst, src = rng.sample(range(rows), 2)
                n = rng.randint(1, width)
                table.copy_prefix(dst, src, n, expected[src, :n].tolist())
                expected[dst, :n] = expected[src, :n].clone()
            else:
                row, n = rng.randrange(rows), rng.randint(1, 40)
                start = rng.randrange(width - n)
                slots = [rng.randrange(1, 10**6) for _ in range(n)]
                table.write(row, start, slots)
                expected[row, start:start + n] = torch.tensor(slots, dtype=torch.int32)
            if rng.random() < 0.1:
                table.flush()
                assert torch.equal(table.table, expected), trial
        table.flush()
        assert torch.equal(table.table, expected), trial


def test_followers_copying_one_row_share_a_segment():
    """The admission pattern: one row written from the host, then many rows copying its prefix and writing past
    it: one segment (one index copy for the writes, one gather/scatter for the copies)."""
    table = ReqToTokenTable(8, 64, "cpu")
    prefix = list(range(100, 140))
    table.write(0, 0, prefix)
    table.write(0, 40, [7, 8])
    for dst in range(1, 8):
        table.copy_prefix(dst, 0, 40, prefix)
        table.write(dst, 40, [dst, dst])
    assert table._segments == []  # nothing closed a segment
    table.flush()
    for dst in range(1, 8):
        assert table.table[dst, :42].tolist() == prefix + [dst, dst]


def test_copy_prefix_with_a_journal_is_the_host_write():
    """Tensor parallelism: the other ranks replay host slot ids, so a copy is journalled as the write it stands
    for."""
    table = ReqToTokenTable(4, 32, "cpu")
    table.journal = []
    table.write(0, 0, [5, 6, 7])
    table.copy_prefix(1, 0, 3, [5, 6, 7])
    table.flush()
    assert torch.equal(torch.cat(table.journal, dim=1), reference_indices([(0, 0, [5, 6, 7]), (1, 0, [5, 6, 7])]))
    assert table.table[1, :3].tolist() == [5, 6, 7]
