"""The radix tree's key comparison: the first differing position of two token lists, against the element by
element reference (early differences, long matches that end mid-list, one list a prefix of the other)."""

from __future__ import annotations

import random

from prefixrt.cache.radix import _common_prefix_len


def reference(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_common_prefix_len_equals_reference():
    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 4000 if rng.random() < 0.1 else 300))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        if rng.random() < 0.5:
            a, b = b, a
        assert _common_prefix_len(a, b) == reference(a, b)
