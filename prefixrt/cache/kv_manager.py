"""KVManager: the one owner of KV memory for requests — allocator, request table and prefix cache together: the
pool's accounting. Two concerns beside it use its pages: the host and disk tiers' loads into the pool
(`tiers`, cache/tier_loads.py) and K/V another engine writes into it (`receiver`, cache/kv_receive.py).

Every slot is in exactly one of: free (allocator), cached (radix tree, locked or evictable), or private to a
running request (its pages past cached_len). check_integrity() verifies free + cached + private == total.
The scheduler asks this class for memory; it never touches pages or the tree itself.

Lifetimes (overlap scheduling): a slot returns to the allocator, and a released request's K/V enters the prefix
cache, only after every forward that may write or read it has completed. The loop sets `write_fence` to the
fence of the latest forward it launched; while that fence is pending, release() detaches the request's KV
(row, pages, lock) into a held record, and page frees wait in a queue; reclaim() finishes them once their fence
has passed. Held and queued pages count as private, so free + cached + private == total at all times; when
the loop is idle nothing is held (it calls reclaim(wait=True)).

Pending writes from outside the forward (the host tier's loads and backups, K/V received from a prefill engine
under disaggregation) are Transfers (cache/transfer.py): `track` maps each pool page to the latest Transfer
touching it, and a page goes back to the allocator only once that Transfer is done (`free_cached` holds it until
then). A receive (`receiver.begin`) owns its pages until `receiver.finish` publishes them or `receiver.abandon`
hands them to that hold: an aborted request's pages are never reused while the sender may still write them. The
checker: freeing or reallocating a page whose Transfer is pending raises (and counts `lifetime_violations`).

Kept prefixes (`pins`, cache/pins.py): a request's last release (`release(final=True)`) commits its granted keeps
once its K/V is published; pins that hold pool pages (no host tier) count beside the cached ones:
free + cached (evictable + locked + pinned) + private == total.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prefixrt.cache.allocator import AllocatorSizes, PageAllocator, pages_to_slots
from prefixrt.cache.base import MatchResult, PrefixCache
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.kv_receive import KVReceiver
from prefixrt.cache.pins import PinTable
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.cache.salt_stats import SaltCounters
from prefixrt.cache.tier_loads import TierLoads
from prefixrt.cache.tiered_radix import TieredRadixCache
from prefixrt.cache.transfer import Transfer
from prefixrt.request import Req


def _page_ids(slots: list[int], start: int, end: int, page_size: int) -> list[int]:
    """The pages holding slots[start:end] (start page-aligned), as a new list; a C-level slice when pages are
    single slots (an admitted request with a long cached prefix would otherwise loop over it in Python)."""
    if page_size == 1:
        return slots[start:end]
    return [slots[i] // page_size for i in range(start, end, page_size)]

class KVManager(AllocatorSizes):
    def __init__(
        self,
        pool: KVPool,
        allocator: PageAllocator,
        table: ReqToTokenTable,
        cache: PrefixCache,
        debug: bool = False,
        max_pinned_fraction: float = 0.5,
        max_pinned_fraction_per_salt: float = 0.25,
    ):
        self.pool = pool
        self.allocator = allocator
        self.table = table
        self.cache = cache
        self.page_size = allocator.page_size
        self.debug = debug
        self.evicted_tokens_total = 0
        self._running: dict[int, Any] = {}  # row -> request (or held record) holding it
        # Prefix rows (_write_cached_prefix): lock handle -> (row, cached tokens) of a running request admitted on it,
        # and the reverse map, to drop the entry when that request releases.
        self._prefix_rows: dict[Any, tuple[int, int]] = {}
        self._prefix_row_handles: dict[int, Any] = {}
        # Fence of the latest launched forward: an object with query() -> bool (done) and wait(). None: no
        # forward in flight, frees are immediate.
        self.write_fence = None
        self._deferred: deque = deque()  # (fence, _HeldKV | list of pages), fences in launch order
        self._deferred_pages = 0
        self._reclaiming = False
        # Host tier: the cache's copies, and the pool pages they touch (page -> its latest copy: one FIFO, so the
        # latest done means all done); pages out of the tree waiting for their copies.
        self.tiered = cache if isinstance(cache, TieredRadixCache) else None
        self._copying: dict[int, Transfer] = {}
        self._copy_held: list[tuple[Transfer, list[int]]] = []
        self.retracted_to_host_tokens_total = 0  # retracted requests' tokens copied to the host tier at retraction
        self.lifetime_violations = 0  # the checker's count: pages freed or reused while a write was pending
        if self.tiered is not None:
            self.tiered.tracker = self
        self.salts = SaltCounters()  # per cache_salt: prompt, hit and evicted tokens (bounded labels)
        if hasattr(cache, "salt_counters"):
            cache.salt_counters = self.salts
        # The host and disk tiers' loads into the pool (cache/tier_loads.py), and K/V another engine writes into
        # it (cache/kv_receive.py): their pages are accounted here.
        self.tiers = TierLoads(self)
        self.receiver = KVReceiver(self)
        # Kept prefixes: limits in tokens of the tier that keeps them (the host tier if any, else the pool).
        keeping = self.tiered.host_alloc.total_tokens if self.tiered is not None else allocator.total_tokens
        self.pins = PinTable(cache, int(max_pinned_fraction * keeping), int(max_pinned_fraction_per_salt * keeping))

    # ------------------------------------------------------------------ sizes (tokens; total and free: AllocatorSizes)
    @property
    def evictable_tokens(self) -> int:
        return self.cache.evictable_tokens

    @property
    def available_tokens(self) -> int:
        """Tokens obtainable now: free plus evictable."""
        return self.allocator.free_tokens + self.cache.evictable_tokens

    def pages_for(self, req: Req, num_new_tokens: int) -> int:
        """Pages req needs to store num_new_tokens more tokens."""
        ps = self.page_size
        return max(0, -(-(req.kv_len + num_new_tokens) // ps) - len(req.pages))

    @property
    def available_pages(self) -> int:
        """Pages obtainable without touching a running request: free, evictable, and those held only until a
        forward or a host copy in flight completes."""
        return (self.allocator.free_pages + self.cache.evictable_tokens // self.page_size + self._deferred_pages
                + self._held_copy_pages())

    def pages_to_finish(self, req: Req, extra_tokens: int) -> int:
        """Pages a running req still needs for the rest of its prompt and extra_tokens more tokens."""
        ps = self.page_size
        return max(0, -(-(req.seq_len + extra_tokens) // ps) - len(req.pages))

    def pages_to_admit(self, req: Req, m: MatchResult, extra_tokens: int) -> int:
        """Pages that admitting waiting req on its match m and running it to extra_tokens past its prompt takes
        from available_pages: its host part (loaded) and uncached tokens, the decode growth, and the pool part of m
        that no lock covers yet (locking it takes it out of the evictable pages). Read-only."""
        ps = self.page_size
        return (-(-(req.seq_len + extra_tokens) // ps) - m.length // ps
                + self.cache.unlocked_on_path(m) // ps)

    # ------------------------------------------------------------------ admission
    @staticmethod
    def reuse_cap(req: Req) -> int:
        """The longest prefix of req that may be reused: all of it but the last token (and, when its prompt
        tokens are scored, the token before the first scored one)."""
        cap = req.seq_len - 1  # at least the last token is recomputed
        if req.input_logprobs_from is not None:  # the logits of the token before the first scored one
            cap = min(cap, req.input_logprobs_from - 1)
        return cap

    def match(self, req: Req) -> MatchResult:
        """Read-only lookup of req's reusable prefix. At least the last token is always recomputed."""
        return self.cache.match_prefix(req.all_ids, req.salt, max_len=self.reuse_cap(req))

    def admit(self, req: Req, m: MatchResult | None = None) -> None:
        """Give req a table row and lock its cached prefix. m: req's match (self.match(req)) if the caller has
        one; it is used only if the cache has not changed since (else, and without one, req is re-matched), so
        the lock is never stale. With a host tier, a host-resident part of the match gets pool pages and a load
        (its forward waits for it)."""
        if m is None or m.version != getattr(self.cache, "version", None):
            m = self.match(req)
        if self.tiered is not None:  # its host part loads into the pool; its first forward waits for it
            m, req.cache_handle = self.tiers.admit(req, m)
        else:
            req.cache_handle = self.cache.lock(m)
        req.row = self.table.alloc_row()
        self._running[req.row] = req
        ps = self.page_size
        req.pages = _page_ids(m.slots, 0, m.length, ps)
        req.kv_len = req.cached_len = m.length
        self._write_cached_prefix(req, m)
        if req.num_cached_tokens is None:  # reported as prompt tokens reused (forced output is not prompt)
            req.num_cached_tokens = min(m.length, len(req.prompt_ids))
            req.admitted_time = time.monotonic()

    def _write_cached_prefix(self, req: Req, m: MatchResult) -> None:
        """table[req.row, :m.length] = m.slots, for a request just admitted on the locked match m.

        Fast path: the first request admitted on a tree node (its lock handle) registers its row as the node's
        prefix row; a later one admitted on the same node while that request runs copies that row's first
        m.length cells on the device instead of converting m.slots on the host (the RAG case: 3500 cached slots
        per follower). Exact because while the registered request runs, the node's path stays locked (its slots
        never change) and the row's first m.length cells are never rewritten (later writes start at cached_len
        >= m.length); release() drops the registration. The reference is the plain write (debug mode checks the
        two agree through the pages they were built from)."""
        handle = req.cache_handle
        source = self._prefix_rows.get(handle) if handle is not None else None
        if source is not None and source[1] == m.length:
            if self.debug:
                holder = self._running[source[0]]
                assert holder.pages[: len(req.pages)] == req.pages, "prefix row holds other slots than the match"
            self.table.copy_prefix(req.row, source[0], m.length, m.slots)
            return
        self.table.write(req.row, 0, m.slots)
        if handle is not None and source is None and m.length:
            self._prefix_rows[handle] = (req.row, m.length)
            self._prefix_row_handles[req.row] = handle

    def _forget_prefix_row(self, row: int) -> None:
        handle = self._prefix_row_handles.pop(row, None)
        if handle is not None:
            del self._prefix_rows[handle]

    # ------------------------------------------------------------------ host tier: copies and their pages
    def track(self, transfer: Transfer, slots: list[int]) -> None:
        """A copy into or out of these pool slots is in flight: their pages stay allocated until it is done."""
        ps = self.page_size
        for i in range(0, len(slots), ps):
            self._copying[slots[i] // ps] = transfer

    def untrack(self, transfer: Transfer, pages: list[int]) -> None:
        """transfer is done with these pages (a receive being published): they are no longer tracked by it."""
        for p in pages:
            if self._copying.get(p) is transfer:
                del self._copying[p]

    def pages_tracked_by(self, transfer: Transfer, pages: list[int]) -> bool:
        """Every page is allocated and tracked by transfer (no one freed or took it meanwhile)."""
        return all(self._copying.get(p) is transfer and not self.allocator.is_free(p) for p in pages)

    def held_receives(self) -> int:
        """Abandoned receives whose pages wait for their sender's confirmation."""
        return sum(1 for t, _ in self._copy_held if t.kind == "receive")

    def free_cached(self, slots: list[int]) -> None:
        """Pool slots leaving the tree: freed now, or once the copies touching them are done."""
        ps = self.page_size
        pages = [slots[i] // ps for i in range(0, len(slots), ps)]
        pending = [self._copying[p] for p in pages if p in self._copying and not self._copying[p].query()]
        if pending:
            self._copy_held.append((pending[-1], pages))  # FIFO: the latest copy done means all done
            self._deferred_pages += len(pages)
            return
        self.free_pages(pages)

    def _reclaim_copies(self, wait: bool) -> None:
        if not self._copy_held:
            return
        keep = []
        for t, pages in self._copy_held:
            if wait and t.kind != "receive":  # a receive is confirmed by another engine: never block the loop on it
                t.wait()
            if t.query():
                self._deferred_pages -= len(pages)
                self.free_pages(pages)
            else:
                keep.append((t, pages))
        self._copy_held = keep

    def check_no_copy_pending(self, pages: list[int]) -> None:
        for p in pages:
            t = self._copying.get(p)
            if t is not None and not t.query():
                self.lifetime_violations += 1
                raise AssertionError(f"KV page {p} reused while a {t.kind} copy into/out of it is pending")

    def close(self) -> None:
        """Shutdown (the loop has stopped): the tiers' workers stop (a disk tier writes what it lacks first)."""
        self.tiers.close()

    def ensure_pages(self, num_pages: int) -> bool:
        """Evict until num_pages are free. False if even full eviction cannot reach it (nothing evicted then
        beyond what was evictable)."""
        short = num_pages - self.allocator.free_pages
        if short <= 0:
            return True
        self.pins.expire()  # kept prefixes whose time is up may go now
        if self._deferred:  # memory held for forwards in flight: take back what is done, then wait for the rest
            self.reclaim()
            if num_pages > self.allocator.free_pages:
                self.reclaim(wait=True)
            short = num_pages - self.allocator.free_pages
            if short <= 0:
                return True
        if self._copy_held:  # pages out of the tree whose copies were pending
            self._reclaim_copies(wait=False)
            short = num_pages - self.allocator.free_pages
            if short <= 0:
                return True
        held = self._held_copy_pages()
        if short > held:
            if (short - held) * self.page_size > self.cache.evictable_tokens:
                return False
            self.evicted_tokens_total += self.cache.evict((short - held) * self.page_size)
        if self.allocator.free_pages < num_pages and self._held_copy_pages():
            self._reclaim_copies(wait=True)  # moved to the host: the pages come back once their backups are done
        return self.allocator.free_pages >= num_pages

    def _held_copy_pages(self) -> int:
        """Held pages that a wait brings back (a receive's come back when its sender confirms, not on a wait)."""
        return sum(len(p) for t, p in self._copy_held if t.kind != "receive")

    def extend(self, req: Req, num_new_tokens: int) -> list[int]:
        """Slots for positions [kv_len, kv_len + n) of req, allocating pages (call ensure_pages first) and
        writing them into req's table row. kv_len is advanced by the caller once the forward is issued."""
        start = req.kv_len
        need = self.pages_for(req, num_new_tokens)
        if need:
            new = self.allocator.alloc(need)
            if self.debug and self._copying:
                self.check_no_copy_pending(new)
            req.pages.extend(new)
        slots = req.pages[start:start + num_new_tokens] if self.page_size == 1 else \
            self.slots_of(req, start, start + num_new_tokens)
        self.table.write(req.row, start, slots)
        return slots

    def truncate(self, req: Req) -> None:
        """Free req's private pages past its kv_len (speculative decoding: the slots of rejected drafts, whose
        K/V was written by a forward that has completed or whose fence the free waits for). kv_len must be at
        least cached_len (the tree's part is never touched)."""
        ps = self.page_size
        keep = -(-req.kv_len // ps)
        assert req.kv_len >= req.cached_len, "truncating into the cached prefix"
        if len(req.pages) > keep:
            extra = req.pages[keep:]
            del req.pages[keep:]
            self._free_pages_after_fence(extra)

    def slots_of(self, req: Req, start: int, end: int) -> list[int]:
        ps = self.page_size
        pages = req.pages
        if ps == 1:
            return pages[start:end]
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    # ------------------------------------------------------------------ caching and release
    def cache_unfinished(self, req: Req, upto: int | None = None) -> None:
        """Publish req's computed K/V (whole pages of positions [0, upto), default kv_len) to the prefix cache
        while it keeps running, so requests arriving now can reuse it (prefill-once). upto must cover only
        K/V whose forward has completed. Private duplicates of what the tree already had are freed (after the
        forwards in flight) and req's table row is pointed at the tree's slots."""
        if not self.cache.retains:
            return
        ps = self.page_size
        # Only tokens the host knows are published (a request that failed before its last token was read
        # has K/V past all_ids: the tree must never hold K/V under a token it cannot name).
        align = self.cache.align_tokens  # a block cache keeps whole blocks only: the rest stays private
        n = min(req.kv_len if upto is None else min(upto, req.kv_len), len(req.all_ids)) // align * align
        if n <= req.cached_len:
            return
        tokens = req.all_ids[:n]
        start = req.cached_len
        if req.cache_handle is not None and self.cache.supports_insert_below:
            # from req's locked node: only the tokens past its cached prefix are compared (the reference below)
            existing, have, m = self.cache.insert_below(req.cache_handle, start, tokens,
                                                        self.slots_of(req, start, n))
        else:
            existing = self.cache.insert(tokens, self.slots_of(req, 0, n), req.salt)
            m = self.cache.match_prefix(tokens, req.salt)
            have = m.slots[start:existing]
        assert m.length == n, f"inserted {n} tokens but matched {m.length}"
        if existing > start:
            first, last = start // ps, existing // ps
            self._free_pages_after_fence(req.pages[first:last])
            req.pages[first:last] = _page_ids(have, 0, existing - start, ps)
            self.table.write(req.row, start, have[: existing - start])
        handle = self.cache.lock(m)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = handle
        req.cached_len = n

    def release(self, req: Req, to_host: bool = False, final: bool = False) -> None:
        """req stops running (finished, aborted or retracted): publish its computed K/V to the cache, free
        what the cache does not take, unlock, and give back the table row. req's KV fields are cleared at once
        (it may be admitted again); while a forward is in flight the rest waits for its fence (see reclaim).
        to_host (a retraction, with a host tier): every node of its published path gets a host copy whatever the
        write policy, so its K/V survives the pool's eviction and loads back when it resumes.
        final (the request is done: finished or aborted): its granted kept prefixes are pinned once published."""
        self.tiers.released(req)
        grant = req.keep_grant if final else None
        if grant is not None:
            req.keep_grant = None
        if req.row is None:
            if grant is not None:
                self.pins.drop(grant)
            return
        self._forget_prefix_row(req.row)
        fence = self.write_fence
        if fence is not None and not fence.query():
            held = _HeldKV(all_ids=req.all_ids[: req.kv_len], salt=req.salt, row=req.row,
                           pages=req.pages, kv_len=req.kv_len, cached_len=req.cached_len,
                           cache_handle=req.cache_handle, to_host=to_host, keep_grant=grant)
            self._running[req.row] = held
            self._deferred.append((fence, held))
            req.row, req.cache_handle, req.pages = None, None, []
            req.kv_len = req.cached_len = 0
            return
        self._release_now(req, to_host, grant)

    def reclaim(self, wait: bool = False) -> None:
        """Finish the releases and frees whose fence has passed (wait=True: wait for every fence first)."""
        if self._copy_held:
            self._reclaim_copies(wait)
        self.tiers.reclaim(wait)  # host copies on their way to the disk; reads whose request left
        while self._deferred:
            fence, what = self._deferred[0]
            if not fence.query():
                if not wait:
                    return
                fence.wait()
            self._deferred.popleft()
            self._reclaiming = True  # its fence has passed: nothing in flight can touch these pages
            try:
                if isinstance(what, _HeldKV):
                    self._release_now(what, what.to_host, what.keep_grant)
                else:
                    self._deferred_pages -= len(what)
                    self.free_pages(what)
            finally:
                self._reclaiming = False

    def held_releases(self) -> list:
        """Released requests whose K/V waits for a fence before it is published to the cache (see release). Their
        prefixes are in neither the cache nor the running set yet: the scheduler treats them as prefill leaders,
        so a request that shares one waits a step for the cache instead of computing the prefix again."""
        return [what for _, what in self._deferred if isinstance(what, _HeldKV)]

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred or self._copy_held)

    def _release_now(self, req, to_host: bool = False, grant=None) -> None:
        ps = self.page_size
        if self.cache.retains:
            self.cache_unfinished(req)
            if grant is not None:
                self.pins.commit(grant, req.all_ids, req.cached_len)
                grant = None
            private = req.pages[req.cached_len // ps :]
            if to_host and self.tiered is not None and req.cache_handle is not None:
                self.retracted_to_host_tokens_total += self.tiered.backup_path(req.cache_handle)
        else:
            private = req.pages
        if grant is not None:
            self.pins.drop(grant)
        self._free_pages_after_fence(private)
        self.cache.unlock(req.cache_handle)
        del self._running[req.row]
        self.table.free_row(req.row)
        req.row, req.cache_handle, req.pages = None, None, []
        req.kv_len = req.cached_len = 0

    def _free_pages_after_fence(self, pages: list[int]) -> None:
        fence = self.write_fence
        if pages and not self._reclaiming and fence is not None and not fence.query():
            self._deferred.append((fence, list(pages)))
            self._deferred_pages += len(pages)
            return
        self.free_pages(pages)

    def free_pages(self, pages: list[int]) -> None:
        if not pages:
            return
        if self._copying:  # the checker: no page goes back while a copy into/out of it is pending
            for p in pages:
                t = self._copying.pop(p, None)
                if t is not None and not t.query():
                    self.lifetime_violations += 1
                    raise AssertionError(f"KV page {p} freed while a {t.kind} copy into/out of it is pending")
        if self.debug:
            import torch

            self.pool.poison(torch.tensor(pages_to_slots(pages, self.page_size), device=self.pool.device))
        self.allocator.free(pages)

    def salt_stats(self) -> dict:
        """Per-salt counters and pool tokens cached now, by bounded label (EngineStats.salts)."""
        usage = getattr(self.cache, "salt_usage", None)
        return self.salts.snapshot(usage() if usage is not None else {})

    def flush(self) -> int:
        """Drop every unlocked cache entry, kept prefixes included; returns pool tokens freed. Pages whose backup
        to the host was still copying are waited for here, so they are free on return (no step may follow to
        reclaim them)."""
        self.pins.clear()
        freed = self.cache.flush()
        self.evicted_tokens_total += freed
        self._reclaim_copies(wait=True)
        return freed

    # ------------------------------------------------------------------ accounting
    @property
    def pinned_tokens(self) -> int:
        """Pool tokens that kept prefixes hold out of eviction (0 with a host tier: pins move there)."""
        return getattr(self.cache, "pinned_tokens", 0)

    @property
    def private_tokens(self) -> int:
        ps = self.page_size
        held = sum((len(r.pages) - r.cached_len // ps) * ps for r in self._running.values())
        incoming = len(self.receiver.private_pages) * ps
        return held + incoming + self._deferred_pages * ps

    def check_integrity(self) -> None:
        """free + cached (evictable + locked) + private == total, and no page owned twice."""
        self.cache.check_integrity()
        free = self.allocator.free_tokens
        cached = self.cache.evictable_tokens + self.cache.locked_tokens + self.pinned_tokens
        private = self.private_tokens
        assert free + cached + private == self.total_tokens, (
            f"KV leak: free {free} + cached {cached} (pinned {self.pinned_tokens}) + private {private} != total "
            f"{self.total_tokens}"
        )
        ps = self.page_size
        owned = [p for r in self._running.values() for p in r.pages[r.cached_len // ps :]]
        owned += [p for _, what in self._deferred if not isinstance(what, _HeldKV) for p in what]
        owned += [p for _, what in self._copy_held for p in what]
        owned += self.receiver.private_pages
        assert len(owned) == len(set(owned)), "a private page is owned by two requests"


@dataclass
class _HeldKV:
    """A released request's KV, held until the forwards in flight are done (duck-types the Req fields that
    _release_now and cache_unfinished read)."""

    all_ids: list[int]
    salt: Any
    row: int
    pages: list[int]
    kv_len: int
    cached_len: int
    cache_handle: Any
    to_host: bool = False  # a retraction: its path gets host copies (release's to_host)
    keep_grant: Any = None  # a last release: the kept prefixes to pin once published (cache/pins.py KeepGrant)
