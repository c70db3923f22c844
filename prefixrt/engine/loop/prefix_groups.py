"""Shared-prefix groups of a decode batch, for cascade attention (ForwardBatch.prefix_groups).

Running requests that reuse the same cached prefix hold the same pool pages for it: their first pages are
the radix tree's. A group is a set of batch rows whose first `prefix_len` positions map to the same pages;
only positions below every member's `cached_len` (pages owned by the tree, locked, immutable while the
request runs) are grouped. The groups are recomputed only when the batch's requests, their order or their
cached lengths change; otherwise the same list object is returned (the decode graphs then keep their
uploaded plan).
"""

from __future__ import annotations


class PrefixGrouper:
    def __init__(self, page_size: int, min_prefix_len: int = 256, min_group_size: int = 2):
        self.page_size = page_size
        self.min_prefix_len = min_prefix_len
        self.min_group_size = min_group_size
        self._key: tuple | None = None
        self._groups: list[tuple[int, list[int]]] | None = None

    def groups(self, reqs) -> list[tuple[int, list[int]]] | None:
        """[(prefix_len, [batch rows])] for the requests of a decode batch, or None when none share enough."""
        key = tuple((r.row, r.cached_len) for r in reqs)
        if key != self._key:
            self._key = key
            self._groups = self._compute(reqs)
        return self._groups

    def _compute(self, reqs) -> list[tuple[int, list[int]]] | None:
        ps = self.page_size
        by_first: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.cached_len >= self.min_prefix_len and r.pages:
                by_first.setdefault(r.pages[0], []).append(i)
        out = []
        for members in by_first.values():
            if len(members) < self.min_group_size:
                continue
            lead = reqs[members[0]].pages
            n = min(reqs[i].cached_len for i in members) // ps  # shared pages, at most
            for i in members[1:]:
                n = common_prefix(lead, reqs[i].pages, n)
            if n * ps >= self.min_prefix_len:
                out.append((n * ps, members))
        return out or None


def common_prefix(a: list[int], b: list[int], n: int) -> int:
    """Length of the longest common prefix of a[:n] and b[:n] (list comparisons run in C)."""
    n = min(n, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] holds; a[:hi+1] differs somewhere
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
