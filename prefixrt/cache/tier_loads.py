"""TierLoads: the host and disk tiers' side of KV memory, beside KVManager's pool accounting.

A waiting request's prefix may live below the pool: in the host tier (cache/tiered_radix.py) or on the disk
(cache/disk_radix.py). TierLoads reads a disk part into the host tier off the loop (`disk_ready`), loads a host
part into pool pages, at admission (`admit`), ahead of it while the request waits (`prefetch`) or before a
session's next request arrives (`load_ahead`, for cache/session_prefetch.py), and says what
a forward must wait for, layer by layer (`load_waiter`). What it keeps about a request is held here, keyed by
the request: the lock of its prefetched path, the latest load into its path, its disk read in flight or the
match end it last looked up; `forget` drops it when the request leaves the scheduler.

Pool pages come from KVManager (ensure_pages, its allocator) and are tracked there while a copy touches them
(KVManager.track), so the accounting free + cached + private == total stays KVManager's alone. Without a host tier
every method is the no-op answer (nothing to load, nothing to wait for).
"""

from __future__ import annotations

from typing import Any

from prefixrt.cache.allocator import pages_to_slots
from prefixrt.cache.base import MatchResult
from prefixrt.cache.transfer import LoadWaiter, Transfer
from prefixrt.request import Req


class TierLoads:
    def __init__(self, kv):
        self.kv = kv  # the KVManager whose pool the loads fill
        self.tiered = kv.tiered  # the TieredRadixCache, or None (no host tier)
        self.disk = getattr(self.tiered, "disk", None)
        self._prefetched: dict[Req, Any] = {}  # request -> the lock handle of its path, loaded while it waits
        self._loads: dict[Req, Transfer] = {}  # request -> the latest load into its path its forward waits for
        self._disk_lookups: dict[Req, Any] = {}  # request -> its disk read in flight, or the match end looked up
        self._fetches: list = []  # disk reads in flight
        self.load_failures_total = 0  # admissions whose host part could not get pool pages (recomputed)
        self.prefetch_tokens_total = 0  # host-tier tokens loaded for waiting requests (prefetch)
        self.prefetch_hits_total = 0  # admissions of requests whose host part a prefetch had loaded
        self.prefetch_misses_total = 0  # admissions that started loading their host part themselves

    # ------------------------------------------------------------------ admission
    def admit(self, req: Req, m: MatchResult):
        """Lock req's match m for its admission, its host-resident part first given pool pages and a load (None
        pages: the part is recomputed). Returns (the match on the pool, the lock handle); req's forward waits for
        the load (load_waiter). A prefetch's lock is taken over by the admission's."""
        cache = self.tiered
        m, handle = self._lock_on_pool(req, m)
        load = cache.load_on_path(handle)
        if load is None:
            self._loads.pop(req, None)
        else:
            self._loads[req] = load
        prefetched = self._prefetched.pop(req, None)
        if prefetched is not None:  # the prefetch's lock is now covered by the admission's
            cache.unlock(prefetched)
            self.prefetch_hits_total += 1
        return m, handle

    def _lock_on_pool(self, req: Req, m: MatchResult):
        cache = self.tiered
        if m.host_length:
            end = m.length + m.host_length
            handle = self._load_host_part(m)
            if handle is not None:
                self.prefetch_misses_total += 1
                m = cache.match_prefix(req.all_ids, req.salt, max_len=end)  # the locked path, now on the pool
                assert m.length == end and m.handle is handle, "load_back did not make the locked path pool-resident"
                cache.record_hit(handle)
                return m, handle
            self.load_failures_total += 1
            m = self.kv.match(req)
        handle = cache.lock(m)
        cache.record_hit(handle)
        return m, handle

    def _load_host_part(self, m: MatchResult):
        """Lock m's whole path (host part included), give its host-only part pool pages and start loading it
        there. Returns the lock handle, or None (nothing locked) when the pool cannot make room."""
        kv, cache = self.kv, self.tiered
        ps = kv.page_size
        handle = cache.lock_host(m)  # neither tier may evict the path while pages are found for it
        ok = kv.ensure_pages(cache.host_tokens_on_path(handle) // ps)
        need = cache.host_tokens_on_path(handle) // ps  # a reclaim may have published part of it meanwhile
        if not (ok and kv.allocator.can_alloc(need)):
            cache.unlock(handle)
            return None
        pages = kv.allocator.alloc(need)
        if kv.debug:
            kv.check_no_copy_pending(pages)
        slots = pages_to_slots(pages, ps)
        if slots:
            kv.track(cache.load_back(handle, slots), slots)
        return handle

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, req: Req, m: MatchResult) -> bool:
        """Start loading the host-resident part of waiting req's match m into the pool now, ahead of its
        admission, so the copy overlaps the running batch. The loaded path stays locked for req until admit()
        takes it over or cancel_prefetch() lets it go. False: nothing to load, or no room."""
        if self.tiered is None or not m.host_length or req in self._prefetched:
            return False
        handle = self._load_host_part(m)
        if handle is None:
            return False
        self._prefetched[req] = handle
        self.prefetch_tokens_total += m.host_length
        return True

    def has_prefetch(self, req: Req) -> bool:
        return req in self._prefetched

    def prefetch_ready(self, req: Req) -> bool:
        """req has no prefetch, or its load has completed."""
        handle = self._prefetched.get(req)
        if handle is None:
            return True
        load = self.tiered.load_on_path(handle)
        return load is None or load.query()

    def cancel_prefetch(self, req: Req) -> None:
        """req will not be admitted on its prefetch (aborted, or its room is needed): unlock its prefetched path
        (it stays cached)."""
        handle = self._prefetched.pop(req, None)
        if handle is not None:
            self.tiered.unlock(handle)

    # ------------------------------------------------------------------ ahead of a request's arrival
    def load_ahead(self, ids: list[int], salt: Any, max_pages: int) -> tuple[Transfer, int, int] | None:
        """Load the host-only part of the cached prefix of `ids` into free pool pages before any request asks for
        it (session prefetch, cache/session_prefetch.py): at most max_pages and the allocator's free pages, the
        head of that part if not all of it fits. Evicts nothing, and the path keeps its recency (a lookahead is
        not a use), so the loaded nodes are the first the pool gives up when it needs room. They are unlocked at
        once (evictable; a page leaving the tree waits for its load, KVManager.free_cached). Returns (the load,
        start, n): positions [start, start + n) of ids were loaded; or None: nothing on the host for ids, or no
        room. Mutates: the tree, the allocator."""
        kv, cache = self.kv, self.tiered
        ps = kv.page_size
        room = min(max_pages, kv.allocator.free_pages)
        if cache is None or room <= 0:
            return None
        m = cache.match_prefix(ids, salt, touch=False)
        if not m.host_length:
            return None
        if m.host_length > room * ps:
            m = cache.match_prefix(ids, salt, max_len=m.length + room * ps, touch=False)
        handle = cache.lock_host(m)
        pages = kv.allocator.alloc(cache.host_tokens_on_path(handle) // ps)
        if kv.debug:
            kv.check_no_copy_pending(pages)
        slots = pages_to_slots(pages, ps)
        load = cache.load_back(handle, slots, ahead=True)
        kv.track(load, slots)
        cache.unlock(handle)
        return load, m.length, len(slots)

    # ------------------------------------------------------------------ disk tier
    def disk_ready(self, req: Req, m: MatchResult) -> bool:
        """Admission check of the disk tier (True without one). If the disk holds the continuation of req's match
        m, start reading it off the loop and return False (req keeps waiting); once read, attach it to the tree
        as host-only nodes and return True (admit() then loads it like any host hit)."""
        if self.disk is None:
            return True
        look = self._disk_lookups.get(req)
        if look is not None and not isinstance(look, int):  # a read in flight
            if not look.done.is_set():
                return False
            self.disk.finish_fetch(look)
            self.tiered.attach_from_disk(req.salt, req.all_ids, look)
            m = self.kv.match(req)
            self._disk_lookups[req] = m.length + m.host_length  # (a segment only partly read: the rest recomputed)
            return True
        end = m.length + m.host_length
        if look == end:
            return True
        cap = self.kv.reuse_cap(req)
        entries = self.disk.lookup(req.salt, req.all_ids, end, cap)
        if not entries:
            self._disk_lookups[req] = end
            return True
        for f in self._fetches:  # another request reads the same file for the same position: wait for it to attach
            if f.salt == req.salt and f.start == end and f.entries[0].name == entries[0].name:
                return False
        fetch = self.disk.fetch(req.salt, req.all_ids, end, cap, entries)
        self._disk_lookups[req] = fetch
        self._fetches.append(fetch)
        return False

    @property
    def in_flight(self) -> bool:
        """A disk read not attached yet (in flight, or done; its request's or one whose request left) or a
        host<->pool copy under way: what admission can do may change when it ends."""
        return (bool(self._fetches) or any(not isinstance(look, int) for look in self._disk_lookups.values())
                or (self.tiered is not None and self.tiered.transfer.busy()))

    def wait_disk(self, timeout_s: float) -> None:
        """Nothing else to run: wait (up to timeout_s) for a disk read in flight, instead of spinning."""
        self._fetches = [f for f in self._fetches if not f.done.is_set()]
        if self._fetches:
            self._fetches[0].done.wait(timeout_s)

    def reclaim(self, wait: bool) -> None:
        """Host copies on their way to the disk go on; reads whose request left (aborted) let their staged K/V go."""
        if self.disk is None:
            return
        self.tiered.spill(wait)
        if self._fetches:
            self._fetches = [f for f in self._fetches if not f.done.is_set()]

    # ------------------------------------------------------------------ what a forward waits for
    def load_waiter(self, reqs: list[Req] | None = None) -> LoadWaiter | None:
        """What a forward over reqs must wait on, layer by layer: the loads into their paths that may still be in
        flight (None: nothing). The copies run in one FIFO, so the latest of them passing means all have: one
        Transfer is enough. reqs None: every load in flight (a reader of arbitrary cached slots)."""
        if self.tiered is None:
            return None
        layers = self.kv.pool.num_layers
        if reqs is None:
            loads = self.tiered.transfer.pending_loads()
            return LoadWaiter(list(loads), layers) if loads else None
        latest = None
        for r in reqs:
            t = self._loads.get(r)
            if t is None:
                continue
            if t.query():
                del self._loads[r]
            elif latest is None or t.seq > latest.seq:
                latest = t
        return LoadWaiter([latest], layers) if latest is not None else None

    # ------------------------------------------------------------------ a request leaving
    def released(self, req: Req) -> None:
        """req stops running or leaves the queue: its forward waits for nothing more, and a prefetch it still holds
        (it was never admitted on it) is let go."""
        self._loads.pop(req, None)
        self.cancel_prefetch(req)

    def forget(self, req: Req) -> None:
        """req left the scheduler for good (finished or aborted): drop everything kept about it."""
        self.released(req)
        self._disk_lookups.pop(req, None)

    def close(self) -> None:
        """Shutdown (the loop has stopped): a disk tier writes what it lacks, then the workers stop."""
        if self.disk is not None:
            self.tiered.close()
        if self.tiered is not None:
            self.tiered.transfer.close()
