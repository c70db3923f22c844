"""RadixCache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Invariants (docs/design.md): matches compare tokens, never hashes; a lookup never changes the tree's shape (only
lock, insert and evict split nodes); every node on a matched path has its recency refreshed; only unlocked leaves
are evicted (a long one may lose only its tail: EVICT_MIN_TOKENS), least recently used first, from an incremental heap (lazy deletion, compacted when stale
entries outnumber live ones); each cache_salt has its own root.
Keys are page-aligned: every node holds a whole number of pages.

Pins (kept prefixes, cache/pins.py): `pin` marks a matched path kept until `unpin`; like locks, pins are closed
upward (a pinned node's ancestors are pinned). Here, with the pool the only tier, a pinned unlocked node is never
evicted: its tokens count as `pinned_tokens`, neither evictable nor locked, so free + evictable + locked + pinned
+ private == total. A tiered cache moves pinned nodes to its host tier instead (tiered_radix.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.base import MatchResult, PrefixCache

_ANY = object()  # _evict_lru: leaves of any salt
# Eviction takes whole leaves, except that a leaf longer than what is needed plus this gives up only its tail of
# max(needed, this) tokens: a session's context evicted to make room for a few pages keeps its head as a hit.
EVICT_MIN_TOKENS = 512


class _Node:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "pin_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key: list[int], slots: list[int], parent: _Node | None, last_access: int):
        self.key = key
        self.slots = slots
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.pin_ref = 0  # kept prefixes whose path holds this node (cache/pins.py)
        self.last_access = last_access
        self.id = next(_Node._ids)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(min(n, 16)):  # an early difference, found without copying
        if a[i] != b[i]:
            return i
    if a[:n] == b[:n]:  # the common full match, compared in C
        return n
    lo, hi = 16, n  # a[:lo] == b[:lo]; the first difference is in [lo, hi): halve it with slice compares
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def _matched_len(key: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """_common_prefix_len(key, tokens[pos:limit]) (the reference), with one slice of tokens instead of three when
    the whole key matches (the common case: the path of a cached prefix, thousands of tokens long)."""
    k = len(key)
    if k <= limit - pos and key[-1] == tokens[pos + k - 1] and key == tokens[pos:pos + k]:
        return k
    return _common_prefix_len(key, tokens[pos:limit])


class RadixCache(PrefixCache):
    retains = True
    supports_insert_below = True  # insert_below (a subclass whose insert does more sets this False)
    _node_class = _Node
    pins_hold_pool = True  # a pinned node keeps its pool slots (a tiered cache moves it to the host instead)

    def __init__(self, allocator: PageAllocator, on_evict=None):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._roots: dict[Any, _Node] = {}
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []
        self._num_nodes = 0
        self._evictable = 0
        self._locked = 0
        self._pinned = 0  # pool tokens of unlocked pinned nodes (pins_hold_pool): not evictable
        self._salt_pinned: dict = {}  # salt -> tokens of its pinned nodes, any tier (salts with none left out)
        self.version = 0
        self.on_evict = on_evict  # optional callback(slots) before slots are freed (debug poisoning)
        self.salt_quota: int | None = None  # set_salt_quota
        self._salt_tokens: dict = {}  # salt -> its pool tokens in the tree (salts holding none left out)
        self.salt_counters = None  # SaltCounters (KVManager's): pool evictions per salt

    # ------------------------------------------------------------------ helpers
    def _page_key(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _is_root(self, node: _Node) -> bool:
        return node.parent is None

    def _held_by_pin(self, node: _Node) -> bool:
        """node's pool tokens are out of eviction because a pin holds them (not a lock)."""
        return self.pins_hold_pool and node.pin_ref > 0

    def _push_if_evictable_leaf(self, node: _Node) -> None:
        if not self._is_root(node) and node.lock_ref == 0 and not node.children and not self._held_by_pin(node):
            heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _touch(self, node: _Node, tick: int) -> None:
        node.last_access = tick
        self._push_if_evictable_leaf(node)

    def _add_leaf(self, parent: _Node, key: list[int], slots: list[int], tick: int) -> _Node:
        """A new leaf under parent holding key's K/V at slots (copied), counted as evictable."""
        new = self._node_class(list(key), list(slots), parent, tick)
        parent.children[self._page_key(new.key, 0)] = new
        self._num_nodes += 1
        self._evictable += len(new.key)
        self._count(parent, len(new.key))
        self.version += 1
        self._push_if_evictable_leaf(new)
        return new

    def _split(self, node: _Node, offset: int) -> _Node:
        """Split node after `offset` tokens; returns the new upper node. Counters are unchanged."""
        parent = node.parent
        upper = _Node(node.key[:offset], node.slots[:offset], parent, node.last_access)
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[offset:]
        node.slots = node.slots[offset:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        self._num_nodes += 1
        self.version += 1
        return upper

    # ------------------------------------------------------------------ contract
    def match_prefix(self, tokens: list[int], salt: Any = None, max_len: int | None = None) -> MatchResult:
        pos, slots, last = 0, [], None
        for child, n in self._matched_children(tokens, salt, max_len):
            slots.extend(child.slots if n == len(child.slots) else child.slots[:n])
            pos += n
            last = child, n
        if last is None:
            return MatchResult(0, [], None, 0, self.version)
        return MatchResult(pos, slots, last[0], last[1], self.version)

    def _matched_children(self, tokens: list[int], salt: Any, max_len: int | None, touch: bool = True
                          ) -> Iterator[tuple[_Node, int]]:
        """The nodes along tokens' matched path under salt's root, each touched (unless touch is False: a lookahead
        that is not a use), with how many of its tokens match (page-aligned, > 0); the last one may match only
        partly."""
        root = self._roots.get(salt)
        limit = self._align(len(tokens) if max_len is None else min(max_len, len(tokens)))
        if root is None or limit == 0:
            return
        tick = next(self._clock)
        node, pos = root, 0
        while pos < limit:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                return
            n = self._align(_matched_len(child.key, tokens, pos, limit))
            if n == 0:
                return
            if touch:
                self._touch(child, tick)
            yield child, n
            pos += n
            if n < len(child.key):
                return
            node = child

    def continuation(self, tokens: list[int], salt: Any, max_new: int, handle: _Node | None = None,
                     start: int = 0) -> list[int]:
        """Up to max_new tokens the tree holds right after the whole of `tokens` (following the most recently used
        branch), or [] when the tree does not hold `tokens` itself. Read only (touches nothing: a lookahead is not
        a use). handle/start: a locked node whose path is tokens[:start] (a running request's cache_handle and
        cached_len), where the walk begins, so its cost is len(tokens) - start + max_new."""
        node = handle if handle is not None else self._roots.get(salt)
        pos = start if handle is not None else 0
        if node is None or max_new <= 0:
            return []
        n, ps = len(tokens), self.page_size
        out: list[int] = []
        while pos < n:
            rest = tokens[pos:]
            if len(rest) >= ps:
                child = node.children.get(self._page_key(tokens, pos))
            else:  # less than a page left: any child whose key starts with it
                fits = [c for c in node.children.values() if c.key[: len(rest)] == rest]
                child = max(fits, key=lambda c: c.last_access) if fits else None
            if child is None:
                return []
            m = _common_prefix_len(child.key, rest)
            if m < len(child.key) and m < len(rest):
                return []  # diverges inside the node
            pos += m
            node = child
            if pos == n:
                out = child.key[m: m + max_new]
        while len(out) < max_new and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out.extend(node.key[: max_new - len(out)])
        return out

    @staticmethod
    def _on_pool(node: _Node) -> bool:
        """Whether node's K/V is in the device pool: always here (a tiered cache also has host-only nodes)."""
        return True

    def lock(self, match: MatchResult) -> _Node | None:
        if match.handle is None or match.length == 0:
            return None
        if match.version != self.version:
            raise RuntimeError("lock() on a stale match: the tree changed since match_prefix()")
        node: _Node = match.handle
        if match.offset < len(node.key):
            node = self._split(node, match.offset)
        return self._lock_path(node)

    def _lock_path(self, node: _Node) -> _Node:
        """Lock node and its ancestors; returns node, the handle for unlock()."""
        handle = node
        while not self._is_root(node):
            if node.lock_ref == 0 and self._on_pool(node):
                if self._held_by_pin(node):
                    self._pinned -= len(node.key)
                else:
                    self._evictable -= len(node.key)
                self._locked += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return handle

    def unlock(self, handle: _Node | None) -> None:
        node = handle
        while node is not None and not self._is_root(node):
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._released(node)
            node = node.parent

    def _released(self, node: _Node) -> None:
        """node's last lock is gone: its pool tokens count as evictable (or pinned) again."""
        if self._on_pool(node):
            if self._held_by_pin(node):
                self._pinned += len(node.key)
            else:
                self._evictable += len(node.key)
            self._locked -= len(node.key)
            self._push_if_evictable_leaf(node)

    # ------------------------------------------------------------------ pins (kept prefixes)
    def pin(self, match: MatchResult):
        """Keep the matched path (pool part and, in a tiered cache, host part) until unpin(handle). Like lock, it
        may split a node; the match must be fresh. Returns the handle (None for an empty match)."""
        node, offset = (match.host_handle, match.host_offset) if match.host_length else (match.handle, match.offset)
        if node is None:
            return None
        if match.version != self.version:
            raise RuntimeError("pin() on a stale match: the tree changed since match_prefix()")
        if offset < len(node.key):
            node = self._split(node, offset)
        handle = node
        while not self._is_root(node):
            if node.pin_ref == 0:
                self._count_pinned(node, len(node.key))
                if node.lock_ref == 0 and self._on_pool(node) and self.pins_hold_pool:
                    self._evictable -= len(node.key)
                    self._pinned += len(node.key)
            node.pin_ref += 1
            node = node.parent
        return handle

    def unpin(self, handle) -> None:
        """Undo one pin: the path's nodes go back to the LRU once no pin and no lock holds them."""
        node = handle
        while node is not None and not self._is_root(node):
            if node.pin_ref <= 0:
                raise RuntimeError("unpin of an unpinned radix node")
            node.pin_ref -= 1
            if node.pin_ref == 0:
                self._count_pinned(node, -len(node.key))
                if node.lock_ref == 0 and self._on_pool(node) and self.pins_hold_pool:
                    self._pinned -= len(node.key)
                    self._evictable += len(node.key)
                self._unpinned(node)
            node = node.parent

    def _unpinned(self, node: _Node) -> None:
        """node's last pin is gone (hook: a tiered cache puts it back on its host LRU)."""
        self._push_if_evictable_leaf(node)

    def _count_pinned(self, node: _Node, delta: int) -> None:
        salt = self._salt_of(node)
        left = self._salt_pinned.get(salt, 0) + delta
        if left:
            self._salt_pinned[salt] = left
        else:
            self._salt_pinned.pop(salt, None)

    def pinned_by_salt(self) -> dict:
        """Tokens of pinned nodes per salt, in any tier (salts with none left out). Read-only."""
        return dict(self._salt_pinned)

    def pinned_on_path(self, handle) -> int:
        """Tokens of the path to handle that a pin already keeps (pins are closed upward). Read-only."""
        node, total = handle, 0
        while node is not None and not self._is_root(node):
            if node.pin_ref > 0:
                total += len(node.key)
            node = node.parent
        return total

    def pinned_nodes(self) -> list:
        """Every pinned node (for per-tier figures). Read-only."""
        return [n for n in self._iter_nodes() if n.pin_ref > 0]

    @property
    def pinned_tokens(self) -> int:
        """Pool tokens that pins hold out of eviction (unlocked pinned nodes; 0 where pins may move to a host tier)."""
        return self._pinned

    def unlocked_on_path(self, match: MatchResult) -> int:
        # Unlocked nodes form the lower end of a path (a locked node's ancestors are locked); a partly matched
        # node counts its matched tokens only (lock splits it there).
        node, n = match.handle, match.offset
        total = 0
        while node is not None and not self._is_root(node) and node.lock_ref == 0 and node.slots is not None:
            total += 0 if self._held_by_pin(node) else n
            node = node.parent
            n = len(node.key) if node is not None else 0
        return total

    def shared_on_path(self, handle) -> int:
        node, total = handle, 0
        while node is not None and not self._is_root(node):
            if node.lock_ref > 1 and node.slots is not None:
                total += len(node.key)
            node = node.parent
        return total

    def insert(self, tokens: list[int], slots: list[int], salt: Any = None) -> int:
        n_total = self._align(len(tokens))
        if n_total == 0:
            return 0
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self._node_class([], [], None, 0)
        tick = next(self._clock)
        node, pos, existing = root, 0, None  # existing: where the caller's slots were first taken (see _adopt)
        while pos < n_total:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                self._inserted_leaf(self._add_leaf(node, tokens[pos:n_total], slots[pos:n_total], tick))
                return pos if existing is None else existing
            n = self._align(_common_prefix_len(child.key, tokens[pos:n_total]))
            if n < len(child.key):
                child = self._split(child, n)
            if self._adopt(child, slots[pos: pos + n]) and existing is None:
                existing = pos
            self._touch(child, tick)
            pos += n
            node = child
        return pos if existing is None else existing

    def _inserted_leaf(self, node: _Node) -> None:
        """Hook: insert() created this leaf (a tiered cache may copy it to its host tier)."""

    def _adopt(self, node: _Node, slots: list[int]) -> bool:
        """Hook: insert() walks through node, which it matched in full; True if node took the caller's slots
        (a tiered cache's host-only node). The caller's slots past that point are the cache's then, which insert's
        answer says by stopping the count of tokens already cached there."""
        return False

    def insert_below(self, handle: _Node, start: int, tokens: list[int], slots: list[int]
                     ) -> tuple[int, list[int], MatchResult]:
        """`insert(tokens, ...)` then `match_prefix(tokens)`, for a request extending its own cached prefix: the
        first `start` tokens are the path of `handle`, a node the caller holds locked (so it is in the tree and its
        path ends at `start`), and `slots` are those of tokens[start:]. The walk starts at handle instead of the
        root (a running request re-publishing a long prefix compares only what it added). Returns insert's
        answer (tokens the tree already had), the tree's slots for tokens [start, that), and the match of all the
        tokens for `lock` (its `slots` are left empty: the caller has them)."""
        n_total = self._align(len(tokens))
        tick = next(self._clock)
        up = handle
        while up.parent is not None:  # the LRU stamps insert's walk from the root would set
            up.last_access = tick
            up = up.parent
        node, pos, have = handle, start, []
        while pos < n_total:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                new = self._add_leaf(node, tokens[pos:n_total], slots[pos - start:n_total - start], tick)
                return pos, have, MatchResult(n_total, [], new, len(new.key), self.version)
            n = self._align(_common_prefix_len(child.key, tokens[pos:n_total]))
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, tick)
            have.extend(child.slots)
            pos += n
            node = child
        return pos, have, MatchResult(n_total, [], node, len(node.key), self.version)

    def evict(self, num_tokens: int) -> int:
        freed = 0
        if self.salt_quota is not None:  # salts over their quota give up their own LRU leaves first
            for salt, used in list(self._salt_tokens.items()):
                if used > self.salt_quota and freed < num_tokens:
                    freed += self._evict_lru(min(used - self.salt_quota, num_tokens - freed), salt)
        freed += self._evict_lru(num_tokens - freed, _ANY)
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._compact_heap()
        return freed

    def _evict_lru(self, num_tokens: int, salt) -> int:
        """Evict LRU leaves (of `salt` only, unless _ANY) until num_tokens are freed or none is left."""
        freed, others = 0, []
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            tick, _, node = entry
            if not self._evictable_entry(node, tick):
                continue  # stale entry: the node was touched, locked, grew children, or is gone
            if salt is not _ANY and self._salt_of(node) != salt:
                others.append(entry)
                continue
            keep = len(node.key) - max(self._align(num_tokens - freed + self.page_size - 1), EVICT_MIN_TOKENS)
            if keep >= EVICT_MIN_TOKENS:  # a long leaf gives up its tail only: its head stays a prefix hit
                self._split(node, self._align(keep))  # node is now the tail
            freed += self._evict_node(node)
        for entry in others:
            heapq.heappush(self._heap, entry)
        return freed

    def _evictable_entry(self, node: _Node, tick: int) -> bool:
        return (node.parent is not None and not node.children and node.lock_ref == 0 and node.last_access == tick
                and not self._held_by_pin(node))

    def _evict_node(self, node: _Node) -> int:
        self._count_eviction(node, len(node.key))
        parent = node.parent
        del parent.children[self._page_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        self._evictable -= len(node.key)
        self._count(parent, -len(node.key))
        if self.on_evict is not None:
            self.on_evict(node.slots)
        self.allocator.free_slots(node.slots)
        self.version += 1
        if self._is_root(parent):
            if not parent.children:
                self._roots = {k: r for k, r in self._roots.items() if r is not parent}
        else:
            self._push_if_evictable_leaf(parent)
        return len(node.key)

    # ------------------------------------------------------------------ per-salt quota
    def set_salt_quota(self, tokens: int | None) -> None:
        """Cap on the pool tokens one cache_salt keeps once memory is short: when eviction is
        needed, salts over it lose their own LRU leaves first (max_cached_fraction_per_salt)."""
        self.salt_quota = tokens
        self._salt_tokens = {}
        for salt, root in self._roots.items():
            self._salt_tokens[salt] = sum(len(n.key) for n in self._subtree(root) if n is not root and n.slots is not None)

    def _subtree(self, node: _Node):
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _salt_of(self, node: _Node):
        while node.parent is not None:
            node = node.parent
        for salt, root in self._roots.items():
            if root is node:
                return salt
        return _ANY

    def _count(self, node: _Node, delta: int) -> None:
        """Pool tokens of node's salt change by delta."""
        if delta:
            salt = self._salt_of(node)
            left = self._salt_tokens.get(salt, 0) + delta
            if left:
                self._salt_tokens[salt] = left
            else:
                self._salt_tokens.pop(salt, None)

    def _count_eviction(self, node: _Node, num_tokens: int) -> None:
        if self.salt_counters is not None:
            self.salt_counters.add(self._salt_of(node), "evicted_tokens_total", num_tokens)

    def _check_salt_counts(self) -> None:
        for salt, root in self._roots.items():
            want = sum(len(n.key) for n in self._subtree(root) if n is not root and n.slots is not None)
            assert self._salt_tokens.get(salt, 0) == want, f"salt count {self._salt_tokens.get(salt)} != {want}"
        for salt, used in self._salt_tokens.items():
            assert salt in self._roots or used == 0, "a salt without a tree still counts tokens"

    def salt_usage(self) -> dict:
        """Pool tokens cached per salt (salts holding none are left out)."""
        return dict(self._salt_tokens)

    def _compact_heap(self) -> None:
        live = [(n.last_access, n.id, n) for n in self._iter_nodes()
                if n.lock_ref == 0 and not n.children and not self._held_by_pin(n)]
        heapq.heapify(live)
        self._heap = live

    def flush(self) -> int:
        return self.evict(self._evictable)

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def locked_tokens(self) -> int:
        return self._locked

    # ------------------------------------------------------------------ inspection
    def largest_prefixes(self, max_nodes: int = 40, head_tokens: int = 12) -> list[dict]:
        """The biggest cached subtrees as a pruned tree, for display (read-only: no recency, no splits).

        One entry per salt root that holds tokens: {"namespace": None or "salted", "tokens": its cached
        tokens, "children": [...]}. A node entry: {"tokens": len(its key), "prefix_tokens": tokens from the
        root to its end, "subtree_tokens": its tokens plus its descendants', "locked": whether a running
        request holds it, "head": the first `head_tokens` ids of its key, "children": [...]}. Children are
        sorted by subtree_tokens, largest first; at most `max_nodes` nodes in all, chosen largest-first
        (every kept node's parent is kept)."""
        sizes: dict[int, int] = {}
        for node in reversed(list(self._iter_nodes())):  # children come after parents in _iter_nodes
            sizes[node.id] = len(node.key) + sum(sizes[c.id] for c in node.children.values())
        out, frontier = [], []
        for salt, root in self._roots.items():
            entry = {"namespace": None if salt is None else "salted", "children": [],
                     "tokens": sum(sizes[c.id] for c in root.children.values())}
            if entry["tokens"]:
                out.append(entry)
                frontier += [(c, 0, entry) for c in root.children.values()]
        kept = 0
        while frontier and kept < max_nodes:
            frontier.sort(key=lambda t: sizes[t[0].id])
            node, start, parent = frontier.pop()
            end = start + len(node.key)
            entry = {"tokens": len(node.key), "prefix_tokens": end, "subtree_tokens": sizes[node.id],
                     "locked": node.lock_ref > 0, "head": list(node.key[:head_tokens]), "children": []}
            parent["children"].append(entry)
            kept += 1
            frontier += [(c, end, entry) for c in node.children.values()]
        return out

    # ------------------------------------------------------------------ debugging
    def _iter_nodes(self):
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_slots(self) -> list[int]:
        return [s for n in self._iter_nodes() for s in n.slots]

    def check_integrity(self) -> None:
        evictable = locked = pinned = count = 0
        seen: set[int] = set()
        for node in self._iter_nodes():
            count += 1
            assert len(node.key) == len(node.slots) and len(node.key) % self.page_size == 0, "ragged node"
            assert len(node.key) > 0, "empty non-root node"
            for s in node.slots:
                assert s not in seen, f"slot {s} owned twice in the tree"
                seen.add(s)
            child_lock = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_lock, "a child is locked more than its parent"
            assert all(node.pin_ref >= c.pin_ref for c in node.children.values()), "pins not closed upward"
            if node.lock_ref:
                locked += len(node.key)
            elif self._held_by_pin(node):
                pinned += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    assert any(e[2] is node and e[0] == node.last_access for e in self._heap), "leaf missing from heap"
        assert count == self._num_nodes, f"node count {count} != {self._num_nodes}"
        self._check_salt_counts()
        assert evictable == self._evictable, f"evictable {evictable} != counter {self._evictable}"
        assert locked == self._locked, f"locked {locked} != counter {self._locked}"
        assert pinned == self._pinned, f"pinned {pinned} != counter {self._pinned}"
        self._check_pinned_by_salt()

    def _check_pinned_by_salt(self) -> None:
        want: dict = {}
        for salt, root in self._roots.items():
            n = sum(len(x.key) for x in self._subtree(root) if x is not root and x.pin_ref > 0)
            if n:
                want[salt] = n
        assert want == self._salt_pinned, f"pinned per salt {self._salt_pinned} != {want}"
