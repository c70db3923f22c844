"""TieredRadixCache: the radix tree over two tiers of K/V memory, the device pool and the host pool.

Each node's K/V lives in the pool (`slots`), in the host tier (`host_slots`), or both; the node records which.
Invariants, on top of RadixCache's (docs/design.md):
- Pool residency is prefix-closed: a node with pool slots has a parent with pool slots (or the root). So a
  match is a pool-resident part followed by a host-only part, and loading the host part makes the whole path
  pool-resident.
- Every node holds its K/V somewhere; a node whose pool copy is dropped without a host copy is deleted with its
  (host-only) subtree.
- The pool counters (evictable, locked) count pool-resident tokens only, so KVManager's free + cached + private
  == total is unchanged; the host tier has its own: host free + host cached == host total.
- Two LRUs: pool eviction takes unlocked nodes without pool-resident children, oldest first, and moves them to
  the host tier (copying them there first if they have no host copy and the policy says so); host eviction takes
  the oldest host copies: a copy of a pool-resident node is dropped, a host-only node is deleted once it has no
  children and no lock.
- Write policies (when a node gets its host copy): write_through, at insert; write_through_selective, once the
  node has been hit `write_threshold` times (a node evicted before that is dropped); write_back, on eviction.
- Copies go through KVTransfer (one FIFO: host slots are reusable at once, see transfer.py); pool slots being
  copied into or out of are handed to `tracker` (KVManager), which frees them only once the copy is done.
- Loads ahead (session prefetch, cache/session_prefetch.py): `load_back(..., ahead=True)` loads a host-only path
  into the pool before any request asks for it; its nodes are marked `prefetched` until an admission uses them
  (record_hit: counted as used) or the pool evicts them first (counted as wasted). A lookahead match
  (`match_prefix(..., touch=False)`) leaves recency alone: a prefetched path is as old as its last real use.
- Pins (kept prefixes, cache/pins.py) do not hold the pool: a pinned node leaves the pool like any other, but
  always for the host tier (copied there whatever the write policy; if the host tier cannot make room it stays
  in the pool), and the host LRU never drops a pinned node's copy. So a kept prefix survives floods of both tiers.
"""

from __future__ import annotations

import heapq
from typing import Any

from prefixrt.cache.allocator import PageAllocator, pages_to_slots
from prefixrt.cache.base import MatchResult
from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.radix import RadixCache, _Node
from prefixrt.cache.transfer import KVTransfer, Transfer
from prefixrt.config.engine_config import WRITE_POLICIES


class _TNode(_Node):
    __slots__ = ("host_slots", "hits", "load", "prefetched")

    def __init__(self, key, slots, parent, last_access, host_slots=None):
        super().__init__(key, slots, parent, last_access)
        self.host_slots = host_slots  # None: no host copy
        self.hits = 0  # admissions that used this node (write_through_selective)
        self.load: Transfer | None = None  # the load that gave it its pool slots (a reader waits for it)
        self.prefetched = False  # its pool slots came from a load ahead that no admission has used yet


class TieredRadixCache(RadixCache):
    supports_insert_below = False  # its insert also revives host-only nodes: KVManager uses insert + match
    _node_class = _TNode
    pins_hold_pool = False  # pinned nodes move to the host tier; the host tier keeps them

    def __init__(self, allocator: PageAllocator, host: HostKVPool, transfer: KVTransfer,
                 policy: str = "write_through", write_threshold: int = 2, debug: bool = False):
        super().__init__(allocator)
        if policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}")
        self.host = host
        self.host_alloc = host.allocator
        self.transfer = transfer
        self.policy = policy
        self.write_threshold = write_threshold
        self.debug = debug
        self.tracker = None  # KVManager: track(transfer, pool_slots) and free_cached(pool_slots)
        self._host_heap: list[tuple[int, int, _TNode]] = []
        self._host_cached = 0
        self._dropping = False  # flush(): pool eviction deletes instead of moving to the host
        self._stuck: list = []  # pinned pool leaves that found no host room this eviction (pushed back after it)
        self.host_hit_tokens_total = 0  # tokens loaded back for requests (at admission or for a waiting one)
        self.ahead_used_tokens_total = 0  # tokens loaded ahead (session prefetch) that an admission then used
        self.ahead_wasted_tokens_total = 0  # tokens loaded ahead that left the pool before any admission used them
        self.backed_up_tokens_total = 0
        self.host_evicted_tokens_total = 0

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _on_pool(node) -> bool:
        return node.slots is not None

    def _pool_leaf(self, node) -> bool:
        return not any(c.slots is not None for c in node.children.values())

    def _push_if_evictable_leaf(self, node) -> None:
        if node.parent is not None and node.lock_ref == 0 and node.slots is not None and self._pool_leaf(node):
            heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _push_host(self, node) -> None:
        if node.parent is not None and node.host_slots is not None:
            heapq.heappush(self._host_heap, (node.last_access, node.id, node))

    def _touch(self, node, tick: int) -> None:
        node.last_access = tick
        self._push_if_evictable_leaf(node)
        self._push_host(node)

    def _split(self, node, offset: int):
        parent = node.parent
        upper = _TNode(node.key[:offset], None if node.slots is None else node.slots[:offset], parent,
                       node.last_access, None if node.host_slots is None else node.host_slots[:offset])
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        upper.hits = node.hits
        upper.load = node.load
        upper.prefetched = node.prefetched
        parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[offset:]
        if node.slots is not None:
            node.slots = node.slots[offset:]
        if node.host_slots is not None:
            node.host_slots = node.host_slots[offset:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        self._num_nodes += 1
        self.version += 1
        self._push_host(upper)
        return upper

    # ------------------------------------------------------------------ contract
    def match_prefix(self, tokens: list[int], salt: Any = None, max_len: int | None = None,
                     touch: bool = True) -> MatchResult:
        """RadixCache.match_prefix over both tiers: the pool-resident part (length, slots, handle) and the host-only
        part after it (host_length, host_handle). touch False: a lookahead, the path's recency is left as it is."""
        pos, slots = 0, []
        gpu_end, gpu_handle, gpu_off = 0, None, 0
        host_handle, host_off = None, 0
        for child, n in self._matched_children(tokens, salt, max_len, touch):
            if child.slots is not None:
                slots.extend(child.slots if n == len(child.slots) else child.slots[:n])
                gpu_end, gpu_handle, gpu_off = pos + n, child, n
            else:
                host_handle, host_off = child, n
            pos += n
        return MatchResult(gpu_end, slots, gpu_handle, gpu_off, self.version,
                           host_length=pos - gpu_end, host_handle=host_handle, host_offset=host_off)

    def lock_host(self, match: MatchResult):
        """Lock the whole matched path, host-only part included (so neither tier evicts it); for load_back."""
        if match.host_length == 0:
            return self.lock(match)
        if match.version != self.version:
            raise RuntimeError("lock_host() on a stale match: the tree changed since match_prefix()")
        node = match.host_handle
        if match.host_offset < len(node.key):
            node = self._split(node, match.host_offset)
        return self._lock_path(node)

    def _released(self, node) -> None:
        super()._released(node)
        self._push_host(node)

    def host_tokens_on_path(self, handle) -> int:
        """Tokens of the host-only nodes at the end of the path to handle (what load_back needs slots for)."""
        n, node = 0, handle
        while node is not None and node.parent is not None and node.slots is None:
            n += len(node.key)
            node = node.parent
        return n

    def load_back(self, handle, slots: list[int], ahead: bool = False) -> Transfer:
        """Give the host-only nodes at the end of the (locked) path to handle the pool slots `slots`, in path
        order, and start copying their K/V there. The caller tracks the returned Transfer for those slots.
        ahead: no request asked for it yet (session prefetch): the nodes are marked prefetched, not counted as a hit."""
        path, node = [], handle
        while node.parent is not None and node.slots is None:
            assert node.lock_ref > 0, "load_back on an unlocked path"
            path.append(node)
            node = node.parent
        path.reverse()
        assert sum(len(n.key) for n in path) == len(slots), "load_back: slots do not cover the host part"
        src, off = [], 0
        for n in path:
            k = len(n.key)
            n.slots = list(slots[off: off + k])
            n.prefetched = ahead
            src.extend(n.host_slots)
            self._locked += k
            off += k
        self._count(handle, len(slots))
        self.version += 1
        if not ahead:
            self.host_hit_tokens_total += len(slots)
        load = self.transfer.load(src, list(slots))
        for n in path:
            n.load = load
        return load

    def load_on_path(self, handle) -> Transfer | None:
        """The latest load into the pool slots of the path to handle that may still be in flight (None: all
        done). The copies run in one FIFO: waiting for the latest covers the others. Clears finished marks."""
        latest, node = None, handle
        while node is not None and node.parent is not None:
            t = node.load
            if t is not None:
                if t.query():
                    node.load = None
                elif latest is None or t.seq > latest.seq:
                    latest = t
            node = node.parent
        return latest

    def backup_path(self, handle) -> int:
        """Give every pool-resident node on the path to handle a host copy, whatever the write policy (a retracted
        request's K/V, kept for its resume). Returns the tokens copied; stops early if the host tier is full."""
        copied, node = 0, handle
        while node is not None and node.parent is not None:
            if node.slots is not None and node.host_slots is None:
                if not self._backup(node):
                    break
                copied += len(node.key)
            node = node.parent
        return copied

    def record_hit(self, handle) -> None:
        """An admission used the path to handle: count a hit on each node; the policy may back nodes up now."""
        node = handle
        while node is not None and node.parent is not None:
            node.hits += 1
            if node.prefetched:
                node.prefetched = False
                self.ahead_used_tokens_total += len(node.key)
            if node.slots is not None and node.host_slots is None and (
                    self.policy == "write_through"
                    or (self.policy == "write_through_selective" and node.hits >= self.write_threshold)):
                self._backup(node)
            node = node.parent

    def _inserted_leaf(self, node) -> None:
        if self.policy == "write_through":
            self._backup(node)

    def _adopt(self, node, slots: list[int]) -> bool:
        if node.slots is not None:
            return False
        node.slots = list(slots)  # host-only: adopt the caller's freshly computed K/V (prefix-closed)
        if node.lock_ref:
            self._locked += len(slots)
        else:
            self._evictable += len(slots)
        self._count(node, len(slots))
        self.version += 1
        return True

    def _evictable_entry(self, node, tick: int) -> bool:
        return (node.parent is not None and node.slots is not None and node.lock_ref == 0
                and node.last_access == tick and self._pool_leaf(node))

    def _evict_node(self, node) -> int:
        """Pool eviction of one LRU pool leaf: it moves to the host tier (copied first if it has no host copy
        and the policy allows), or it is dropped with its host-only subtree."""
        n = len(node.key)
        if node.pin_ref and node.host_slots is None and not self._backup(node):
            self._stuck.append(node)  # kept, and no host room for it: it stays in the pool
            return 0
        self._count_eviction(node, n)
        self._left_pool_unused(node)
        keep = (not self._dropping or node.pin_ref > 0) and (node.host_slots is not None or (
            (self.policy != "write_through_selective" or node.hits >= self.write_threshold)
            and self._backup(node)))
        if keep:
            self._evictable -= n
            self._count(node, -n)
            slots, node.slots = node.slots, None
            self.tracker.free_cached(slots)
            self.version += 1
            self._push_if_evictable_leaf(node.parent)
            self._push_host(node)
        else:
            self._delete_subtree(node)
        return n

    def _left_pool_unused(self, node) -> None:
        """node's pool slots are going: if a load ahead put them there and no admission used them, it was wasted."""
        if node.prefetched:
            node.prefetched = False
            self.ahead_wasted_tokens_total += len(node.key)

    def evict(self, num_tokens: int) -> int:
        try:
            return super().evict(num_tokens)
        finally:
            stuck, self._stuck = self._stuck, []
            for node in stuck:
                self._push_if_evictable_leaf(node)

    def _unpinned(self, node) -> None:
        self._push_if_evictable_leaf(node)
        self._push_host(node)

    def flush(self) -> int:
        """Drop every unlocked, unpinned entry of both tiers; returns pool tokens freed."""
        self._dropping = True
        try:
            freed = self.evict(self._evictable)
        finally:
            self._dropping = False
        self._evict_host(self._host_cached)
        return freed

    def _compact_heap(self) -> None:
        live = [(n.last_access, n.id, n) for n in self._iter_nodes()
                if n.lock_ref == 0 and n.slots is not None and self._pool_leaf(n)]
        heapq.heapify(live)
        self._heap = live

    # ------------------------------------------------------------------ the host tier
    def _alloc_host(self, num_tokens: int) -> list[int] | None:
        ps = self.page_size
        pages = num_tokens // ps
        if not self.host_alloc.can_alloc(pages):
            self._evict_host((pages - self.host_alloc.free_pages) * ps)
        if not self.host_alloc.can_alloc(pages):
            return None
        # Ascending: fresh pages then form long contiguous runs, so a copy is a few large DMA transfers.
        return pages_to_slots(sorted(self.host_alloc.alloc(pages)), ps)

    def _free_host(self, slots: list[int]) -> None:
        """Cached host slots back to the host allocator."""
        self._return_host_slots(slots)
        self._host_cached -= len(slots)

    def _return_host_slots(self, slots: list[int]) -> None:
        if self.debug:
            self.transfer.poison_host(slots)  # queued behind the copies that may still read them
        self.host_alloc.free_slots(slots)

    def _host_copy_dropped(self, node, slots: list[int]) -> None:
        """node's host copy leaves the tier (node is still linked to the tree). Here: freed at once; the disk tier
        (disk_radix.py) may write it out first."""
        self._free_host(slots)

    @property
    def host_held_tokens(self) -> int:
        """Host slots out of the tree but not yet free (a disk tier's writes; 0 here)."""
        return 0

    def _backup(self, node) -> bool:
        """Copy a pool-resident node to the host tier. False if the host tier cannot make room."""
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        node.host_slots = host
        self._host_cached += len(host)
        self.tracker.track(self.transfer.backup(node.slots, host), node.slots)
        self.backed_up_tokens_total += len(host)
        self._push_host(node)
        return True

    def _evict_host(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens and self._host_heap:
            tick, _, node = heapq.heappop(self._host_heap)
            if node.parent is None or node.host_slots is None or node.last_access != tick:
                continue
            n = len(node.key)
            if node.pin_ref:
                continue  # kept: pushed again once unpinned
            if node.slots is not None:  # pool-resident: only the host copy goes
                host, node.host_slots = node.host_slots, None
                self._host_copy_dropped(node, host)
            elif node.lock_ref > 0 or node.children:
                continue  # pushed again once unlocked or childless
            else:
                self._delete_subtree(node)
            freed += n
            self.host_evicted_tokens_total += n
        if len(self._host_heap) > 4 * self._num_nodes + 64:
            live = [(n.last_access, n.id, n) for n in self._iter_nodes() if n.host_slots is not None]
            heapq.heapify(live)
            self._host_heap = live
        return freed

    def _delete_subtree(self, node) -> None:
        """Remove node and its descendants (which hold no pool slots: prefix-closure) from the tree."""
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children first
            assert n.lock_ref == 0 and n.pin_ref == 0, "deleting a locked or pinned radix node"
            n.children = {}
            if n.slots is not None:
                self._left_pool_unused(n)
                self._evictable -= len(n.key)
                self._count(node, -len(n.key))
                self.tracker.free_cached(n.slots)
                n.slots = None
            if n.host_slots is not None:
                self._host_copy_dropped(n, n.host_slots)
                n.host_slots = None
            if n is not node:
                n.parent = None
                self._num_nodes -= 1
        parent = node.parent
        del parent.children[self._page_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        self.version += 1
        if parent.parent is None:
            if not parent.children:
                self._roots = {k: r for k, r in self._roots.items() if r is not parent}
        else:
            self._push_if_evictable_leaf(parent)
            self._push_host(parent)

    # ------------------------------------------------------------------ accounting
    @property
    def host_cached_tokens(self) -> int:
        return self._host_cached

    def cached_slots(self) -> list[int]:
        return [s for n in self._iter_nodes() if n.slots is not None for s in n.slots]

    def check_integrity(self) -> None:
        evictable = locked = count = host = 0
        seen: set[int] = set()
        seen_host: set[int] = set()
        for node in self._iter_nodes():
            count += 1
            k = len(node.key)
            assert k > 0 and k % self.page_size == 0, "empty or ragged node"
            assert node.slots is not None or node.host_slots is not None, "a node with its K/V nowhere"
            assert node.slots is None or len(node.slots) == k, "ragged pool slots"
            assert node.host_slots is None or len(node.host_slots) == k, "ragged host slots"
            child_lock = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_lock, "a child is locked more than its parent"
            assert all(node.pin_ref >= c.pin_ref for c in node.children.values()), "pins not closed upward"
            if node.slots is not None:
                assert node.parent.parent is None or node.parent.slots is not None, "pool residency not prefix-closed"
                for s in node.slots:
                    assert s not in seen, f"pool slot {s} owned twice in the tree"
                    seen.add(s)
                if node.lock_ref:
                    locked += k
                else:
                    evictable += k
                    if self._pool_leaf(node):
                        assert any(e[2] is node and e[0] == node.last_access for e in self._heap), \
                            "pool leaf missing from heap"
            if node.host_slots is not None:
                host += k
                for s in node.host_slots:
                    assert s not in seen_host, f"host slot {s} owned twice in the tree"
                    seen_host.add(s)
                if node.lock_ref == 0 and node.pin_ref == 0 and (node.slots is not None or not node.children):
                    assert any(e[2] is node and e[0] == node.last_access for e in self._host_heap), \
                        "host copy missing from the host heap"
        assert count == self._num_nodes, f"node count {count} != {self._num_nodes}"
        self._check_salt_counts()
        assert evictable == self._evictable, f"evictable {evictable} != counter {self._evictable}"
        assert locked == self._locked, f"locked {locked} != counter {self._locked}"
        assert host == self._host_cached, f"host cached {host} != counter {self._host_cached}"
        self._check_pinned_by_salt()
        held = self.host_held_tokens
        assert self.host_alloc.free_tokens + host + held == self.host_alloc.total_tokens, (
            f"host KV leak: free {self.host_alloc.free_tokens} + cached {host} + held {held} != total "
            f"{self.host_alloc.total_tokens}")
