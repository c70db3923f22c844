"""BlockCache: a table (hash-block) prefix cache in the style of vLLM's automatic prefix caching, behind the
PrefixCache contract, so the radix tree and the hash-block design can be compared inside one engine
(EngineConfig.prefix_cache="block").

Design (as vLLM's prefix-caching design describes it): a prefix is cut into full blocks of `block_tokens`
tokens; each cached block is an entry of one hash table keyed by (its parent block, its tokens), so a block's
key stands for its whole prefix (the parent chain). A lookup walks the prompt block by block from the start
and stops at the first block the table lacks; a partial block at the end is never cached. Every block carries
a reference count (one per lock of a path through it); blocks nobody references sit in one LRU free queue,
and eviction takes the queue's head. A path's blocks enter the queue tail first (the deepest block gets the
oldest position), so a prefix loses its tail before its head.

Invariants: a match never lies: the table's keys hold the token tuples themselves and the parent block's
identity (a unique id, not a hash of it), so a hit compares every token of the prefix exactly. A block is
evicted only once no cached block hangs under it: a locked block's ancestors are locked, and the free queue
holds every block before its queued ancestors (refreshes and unlocks walk a path tail first), so its head
never has a cached descendant. Each cache_salt has its own root id. Lookups change no entry (they
refresh recency only); `version` changes whenever an entry is added or removed.

Differences from the tree (what the ablation measures): matches stop at a block boundary (up to
block_tokens - 1 tokens of a shared prefix are recomputed), a request's last partial block is never shared,
and eviction is per block in queue order rather than per leaf of a tree.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from typing import Any

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.base import MatchResult, PrefixCache

BLOCK_TOKENS = 16  # vLLM's default block size


def block_tokens_for(page_size: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """The block size for a pool of `page_size`-token pages: the least multiple of both."""
    return math.lcm(page_size, block_tokens)


class _Block:
    __slots__ = ("id", "key", "parent", "slots", "ref", "children")

    def __init__(self, block_id: int, key: tuple, parent: _Block | None, slots: list[int]):
        self.id = block_id
        self.key = key  # (parent id, tokens): this block's entry in the table
        self.parent = parent  # None for a block at the start of a prompt
        self.slots = slots
        self.ref = 0  # locks of paths through this block
        self.children: set[_Block] = set()


class BlockCache(PrefixCache):
    retains = True

    def __init__(self, allocator: PageAllocator, block_tokens: int | None = None, on_evict=None):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.block_tokens = block_tokens_for(self.page_size) if block_tokens is None else block_tokens
        if self.block_tokens % self.page_size:
            raise ValueError(f"block_tokens {self.block_tokens} must be a multiple of page_size {self.page_size}")
        self._ids = itertools.count(1)
        self._roots: dict[Any, int] = {}  # salt -> the id its first blocks hang under
        self._table: dict[tuple, _Block] = {}
        self._free: OrderedDict[int, _Block] = OrderedDict()  # unreferenced blocks, least recently used first
        self._locked_blocks = 0
        self.version = 0
        self.on_evict = on_evict  # optional callback(slots) before slots are freed (debug poisoning)

    @property
    def align_tokens(self) -> int:
        return self.block_tokens

    def _root(self, salt: Any, create: bool) -> int | None:
        rid = self._roots.get(salt)
        if rid is None and create:
            rid = self._roots[salt] = -next(self._ids)  # negative: never a block's id
        return rid

    def _walk(self, tokens: list[int], salt: Any, limit: int) -> list[_Block]:
        """The cached blocks of tokens[:limit] from the start, up to the first missing one (read-only)."""
        parent = self._root(salt, create=False)
        path: list[_Block] = []
        if parent is None:
            return path
        b = self.block_tokens
        for pos in range(0, limit - limit % b, b):
            block = self._table.get((parent, tuple(tokens[pos:pos + b])))
            if block is None:
                break
            path.append(block)
            parent = block.id
        return path

    def _refresh(self, path: list[_Block]) -> None:
        """Unreferenced blocks of path move to the queue's end, tail first (the head is the most recent)."""
        for block in reversed(path):
            if block.ref == 0:
                self._free.move_to_end(block.id)

    # ------------------------------------------------------------------ contract
    def match_prefix(self, tokens: list[int], salt: Any = None, max_len: int | None = None) -> MatchResult:
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        path = self._walk(tokens, salt, limit)
        if not path:
            return MatchResult(0, [], None, 0, self.version)
        self._refresh(path)
        slots = [s for block in path for s in block.slots]
        return MatchResult(len(slots), slots, tuple(path), 0, self.version)

    def lock(self, match: MatchResult) -> tuple | None:
        if match.handle is None or match.length == 0:
            return None
        if match.version != self.version:
            raise RuntimeError("lock() on a stale match: the block table changed since match_prefix()")
        for block in match.handle:
            if block.ref == 0:
                del self._free[block.id]
                self._locked_blocks += 1
            block.ref += 1
        return match.handle

    def unlock(self, handle: tuple | None) -> None:
        if handle is None:
            return
        for block in reversed(handle):  # tail first into the queue
            if block.ref <= 0:
                raise RuntimeError("unlock of an unlocked block")
            block.ref -= 1
            if block.ref == 0:
                self._free[block.id] = block
                self._locked_blocks -= 1

    def unlocked_on_path(self, match: MatchResult) -> int:
        return sum(self.block_tokens for block in match.handle or () if block.ref == 0)

    def shared_on_path(self, handle) -> int:
        return sum(self.block_tokens for block in handle or () if block.ref > 1)

    def insert(self, tokens: list[int], slots: list[int], salt: Any = None) -> int:
        ps, b = self.page_size, self.block_tokens
        n = len(tokens) // ps * ps
        n_blocks = n // b * b
        path = self._walk(tokens, salt, n_blocks)
        existing = len(path) * b
        parent = path[-1].id if path else self._root(salt, create=True)
        parent_block = path[-1] if path else None
        new: list[_Block] = []
        for pos in range(existing, n_blocks, b):
            block = _Block(next(self._ids), (parent, tuple(tokens[pos:pos + b])), parent_block, list(slots[pos:pos + b]))
            self._table[block.key] = block
            if parent_block is not None:
                parent_block.children.add(block)
            new.append(block)
            parent, parent_block = block.id, block
        for block in new:  # unreferenced: into the queue (ordered tail first by the refresh below)
            self._free[block.id] = block
        self._refresh(path + new)
        if new:
            self.version += 1
        if n > n_blocks:  # the partial block the cache was offered: it owns those slots and keeps none
            self.allocator.free_slots(list(slots[n_blocks:n]))
        return existing

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens and self._free:
            _, block = self._free.popitem(last=False)
            # The queue's order puts every block before its queued ancestors (check_integrity), and a block's
            # descendants are unreferenced when it is: so the head has no cached descendant left.
            assert not block.children, "evicting a block whose descendants are still cached"
            if block.parent is not None:
                block.parent.children.discard(block)
            del self._table[block.key]
            if self.on_evict is not None:
                self.on_evict(block.slots)
            self.allocator.free_slots(block.slots)
            freed += len(block.slots)
            self.version += 1
        return freed

    def flush(self) -> int:
        return self.evict(self.evictable_tokens)

    @property
    def evictable_tokens(self) -> int:
        return len(self._free) * self.block_tokens

    @property
    def locked_tokens(self) -> int:
        return self._locked_blocks * self.block_tokens

    # ------------------------------------------------------------------ debugging
    def cached_slots(self) -> list[int]:
        return [s for block in self._table.values() for s in block.slots]

    def check_integrity(self) -> None:
        seen: set[int] = set()
        locked = 0
        for key, block in self._table.items():
            assert block.key == key, "a block is filed under another key"
            assert len(block.slots) == self.block_tokens == len(key[1]), "a partial block is cached"
            for s in block.slots:
                assert s not in seen, f"slot {s} owned by two blocks"
                seen.add(s)
            parent = block.parent
            if parent is None:
                assert key[0] in self._roots.values(), "a first block hangs under no salt"
            else:
                assert self._table.get(parent.key) is parent and key[0] == parent.id, "a block's parent is gone"
                assert block in parent.children, "a parent does not list its child"
                assert parent.ref >= block.ref, "a block is locked more than its parent"
            assert all(c.parent is block for c in block.children), "a child lists another parent"
            assert block.ref >= 0, "negative reference count"
            if block.ref:
                locked += 1
                assert block.id not in self._free, "a referenced block is in the free queue"
            else:
                assert self._free.get(block.id) is block, "an unreferenced block is missing from the free queue"
        position = {block_id: i for i, block_id in enumerate(self._free)}
        for block in self._free.values():
            parent = block.parent
            assert parent is None or parent.ref or position[block.id] < position[parent.id], \
                "a block is queued after its ancestor (eviction would orphan it)"
        assert len(self._free) + locked == len(self._table), "the free queue holds blocks not in the table"
        assert locked == self._locked_blocks, f"locked blocks {locked} != counter {self._locked_blocks}"
