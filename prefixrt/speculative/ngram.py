"""The radix-lookahead / n-gram drafter (no weights): propose what already followed the request's current
tokens, from two places.

1. The prefix cache: if the tree holds the request's whole sequence and more (a retry, a sibling sample of the
   same prompt, an answer that repeats a cached one), the cached continuation (the most recently used branch).
   The walk starts at the request's locked node, so its cost is the tokens past its cached prefix plus k.
2. Its own context: the latest earlier occurrence of its last n tokens (n = 4, 3, 2, longest first) and what
   followed it (an answer quoting its document, code re-emitted with an edit). An incremental index per
   request (NgramIndex) makes a step cost O(new tokens + k), whatever the context length;
   `ngram_lookup_reference` is the scan it must agree with.
"""

from __future__ import annotations

from prefixrt.request import Req
from prefixrt.speculative.drafter import Drafter

NGRAM_SIZES = (4, 3, 2)


def ngram_lookup_reference(ids: list[int], k: int, sizes=NGRAM_SIZES) -> list[int]:
    """The reference: for n in sizes (in order), the latest end e < len(ids) with ids[e-n:e] == ids[-n:] gives
    ids[e:e+k]; [] when no size matches."""
    L = len(ids)
    for n in sizes:
        if L <= n:
            continue
        suffix = ids[L - n:]
        for e in range(L - 1, n - 1, -1):
            if ids[e - n:e] == suffix:
                return ids[e:e + k]
    return []


class NgramIndex:
    """For each n in sizes, n-gram -> the latest end position e (exclusive) of its occurrence, over the ends
    e <= len(ids) - 1 seen so far (the current suffix itself is never its own match). Grows with the sequence;
    ids must only be appended to (a request's all_ids)."""

    def __init__(self, sizes=NGRAM_SIZES):
        self.sizes = sizes
        self._indexes: dict[Req, NgramIndex] = {}  # each request's incremental index over its own tokens
        self.maps: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self.upto = 0  # ends e < upto are indexed

    def lookup(self, ids: list[int], k: int) -> list[int]:
        L = len(ids)
        for e in range(max(self.upto, 1), L):  # index the ends up to L - 1
            for n in self.sizes:
                if e >= n:
                    self.maps[n][tuple(ids[e - n:e])] = e
        self.upto = max(self.upto, L)
        for n in self.sizes:
            if L <= n:
                continue
            e = self.maps[n].get(tuple(ids[L - n:]))
            if e is not None:
                return ids[e:e + k]
        return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, sizes=NGRAM_SIZES):
        self.sizes = sizes
        self._indexes: dict[Req, NgramIndex] = {}  # each request's incremental index over its own tokens

    def propose(self, req: Req, k: int, cache=None) -> list[int]:
        if k <= 0:
            return []
        ids = req.all_ids
        if cache is not None and hasattr(cache, "continuation"):
            cont = cache.continuation(ids, req.salt, k, req.cache_handle, req.cached_len)
            if cont:
                return cont
        index = self._indexes.get(req)
        if index is None:
            index = self._indexes[req] = NgramIndex(self.sizes)
        return index.lookup(ids, k)

    def on_finished(self, req: Req) -> None:
        self._indexes.pop(req, None)
