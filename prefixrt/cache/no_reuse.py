"""NoReuseCache: a prefix cache that keeps nothing. Used for radix_cache=False and as a test baseline."""

from __future__ import annotations

from typing import Any

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.base import MatchResult, PrefixCache


class NoReuseCache(PrefixCache):
    retains = False

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size

    def match_prefix(self, tokens, salt: Any = None, max_len=None) -> MatchResult:
        return MatchResult(0, [])

    def lock(self, match: MatchResult):
        return None

    def unlock(self, handle) -> None:
        return None

    def insert(self, tokens, slots, salt: Any = None) -> int:
        n = len(tokens) // self.page_size * self.page_size
        self.allocator.free_slots(list(slots[:n]))
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0

    @property
    def locked_tokens(self) -> int:
        return 0

    def flush(self) -> int:
        return 0
