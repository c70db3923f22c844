"""The prefix-cache contract. RadixCache is the real one; BlockCache (block.py) the hash-block baseline;
NoReuseCache is the null one (radix_cache=False).

Ownership: slots handed to `insert` belong to the cache afterwards (it frees them through the allocator on
eviction). Slots returned by `match_prefix` stay the cache's; a caller that uses them must `lock` the match
first so eviction cannot take them. Namespaces (cache_salt) never share entries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class MatchResult:
    length: int  # matched tokens, a multiple of page_size
    slots: list[int]  # pool slots of those tokens
    handle: Any = None  # opaque: where the match ended (for lock)
    offset: int = 0  # tokens of the handle's node that matched (a partial node is split on lock)
    version: int = 0  # cache version at match time; a lock on a stale match is a bug
    # Tiered caches only: tokens matched past `length` whose K/V is in the host tier alone (not in the pool),
    # and where that part ended (for lock_host). length/slots/handle describe the pool-resident part.
    host_length: int = 0
    host_handle: Any = None
    host_offset: int = 0


class PrefixCache(ABC):
    page_size: int
    retains: bool  # False: nothing is ever kept (the no-reuse ablation)
    supports_insert_below = False  # RadixCache: insert_below, the walk from a locked node (kv_manager.cache_unfinished)

    @property
    def align_tokens(self) -> int:
        """Cached prefixes are whole multiples of this many tokens (a multiple of page_size): matches have such
        lengths and insert keeps only such a prefix. The page size, unless the cache stores larger units."""
        return self.page_size

    @abstractmethod
    def match_prefix(self, tokens: list[int], salt: Any = None, max_len: int | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of tokens[:max_len]. Read-only for the tree's structure; it
        refreshes the recency of every node on the matched path."""

    @abstractmethod
    def lock(self, match: MatchResult) -> Any:
        """Protect the matched slots from eviction; returns a handle for unlock. May split a node.
        The match must be fresh (no insert or evict since it was made)."""

    @abstractmethod
    def unlock(self, handle: Any) -> None:
        """Undo one lock. The slots become evictable once no lock covers them."""

    @abstractmethod
    def insert(self, tokens: list[int], slots: list[int], salt: Any = None) -> int:
        """Offer tokens[:n] (n = len(tokens) rounded down to a page) with their slots. Returns how many leading
        tokens were already cached: the caller keeps ownership of slots[:that] (free them if they were private
        duplicates); the cache takes ownership of slots[that:n]."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens of unlocked leaves, least recently used first, if that many exist.
        Returns the number of tokens freed."""

    @property
    @abstractmethod
    def evictable_tokens(self) -> int: ...

    @property
    @abstractmethod
    def locked_tokens(self) -> int: ...

    @abstractmethod
    def flush(self) -> int:
        """Evict every unlocked entry; returns tokens freed."""

    def unlocked_on_path(self, match: MatchResult) -> int:
        """Pool tokens of match's path that no lock covers now: what locking it takes out of evictable_tokens.
        Read-only."""
        return 0

    def shared_on_path(self, handle: Any) -> int:
        """Pool tokens of the path to a locked handle that another lock holds too (a request's prefix shared with
        others: releasing the request frees none of them). Read-only."""
        return 0

    def check_integrity(self) -> None:
        """Raise AssertionError if internal counters disagree with the structure (default: nothing to check)."""
        return None
