"""SessionPrefetch: a session's K/V back in the pool before its next request arrives.

An agent's turn ends, it spends time in tools, and it comes back with the whole history as its next prompt. While it
is away the pool may give its K/V to others (the host tier keeps a copy: tiered_radix.py). This table remembers the
sessions likely to come back and loads their prefixes from the host tier into the pool as room frees, so the next
request finds them resident instead of waiting for a load at admission.

- Which sessions: a request that finished (stop or length) with a session key (PromptCache.session: OpenAI's
  prompt_cache_key, Anthropic's metadata.user_id) leaves its whole sequence (prompt and reply) as the session's
  prefix (a chat client's next prompt holds the reply re-rendered: where its tokens differ, the reply's loaded K/V
  goes unused and counts as wasted once the pool gives it up); one with granted kept prefixes (cache/pins.py) leaves each kept prefix. A later turn of the same session
  (or a request keeping the same prefix) replaces the entry; at most `max_sessions` are remembered, holding at most
  as many tokens as the host tier (oldest turn end forgotten first: the host tier could not hold more anyway).
- When: `run(room_pages)`, called by the scheduler only when no request waits, with the free pages that the running
  requests' remaining need leaves (so prefetch never takes room an admission or a running request needs), and only
  when the pool's free pages have grown since the last pass (room freed) or a turn has ended since; at most
  `max_checks` remembered prefixes are looked up and `max_pass_tokens` loaded per pass, and no pass starts while
  the last one's loads are in flight (host loads share one FIFO with admissions' loads).
- How: TierLoads.load_ahead (cache/tier_loads.py), most recent turn end first: free pages only (nothing is evicted:
  neither a running request's K/V, which is locked, nor any cached prefix), the path's recency untouched (a
  prefetched prefix is as old as its last use, so it is the first to go if the pool needs room again).
- What it reports: tokens loaded ahead (`prefetched_tokens_total`); for each request arriving on a session whose
  load has completed and whose prompt finds loaded tokens still in the pool, the lead time (arrival minus the
  load's completion: its start plus its copy time); the tree counts the tokens loaded ahead that an admission
  used or that left the pool unused (wasted).
Runs on the loop thread, like KVManager.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.transfer import Transfer
from prefixrt.request import Req


@dataclass
class _Entry:
    salt: Any
    ids: list[int]  # the prefix to have in the pool
    load: Transfer | None = None  # its latest load ahead
    issued_at: float = 0.0  # when that load was started
    start: int = 0  # the tokens of ids in the pool before it (it loaded the ones after)
    loaded_at: float | None = None  # when it completed (see _poll), once seen done


def _keys(req: Req, keep_lengths) -> list[tuple]:
    """The table keys of req: its session key, else one per kept prefix length (salt and tokens)."""
    pc = req.params.prompt_cache
    if pc is not None and pc.session is not None:
        return [("session", req.salt, pc.session)]
    return [("kept", req.salt, tuple(req.prompt_ids[:n])) for n in keep_lengths]


class SessionPrefetch:
    def __init__(self, kv: KVManager, max_sessions: int = 4096, max_checks: int = 64, max_pass_tokens: int = 8192,
                 clock=time.monotonic):
        """max_checks: remembered prefixes looked up per pass at most (a pass costs a tree walk per lookup).
        max_pass_tokens: tokens one pass loads at most; no pass starts while the last one's loads are in flight.
        Host loads run in one FIFO (transfer.py), so a request's own load waits behind at most this much."""
        if kv.tiered is None:
            raise ValueError("session prefetch needs the host tier (host_kv_cache_tokens > 0)")
        self.kv = kv
        self.max_sessions = max_sessions
        self.max_checks = max_checks
        self.max_pass_tokens = max_pass_tokens
        self._capped = False  # the last pass stopped at max_pass_tokens: another is due once its loads are done
        self.clock = clock
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # most recent turn end last
        self._tokens = 0  # token ids the entries hold
        self.max_tokens = kv.tiered.host_alloc.total_tokens
        self._in_flight: list[_Entry] = []  # entries whose load ahead is not seen done yet
        self._free_seen = -1  # the allocator's free pages after the last pass (-1: a pass is due)
        self.prefetched_tokens_total = 0
        self.prefetches_total = 0
        self.used_total = 0  # arrivals that found their session's prefetched prefix resident
        self.lead_seconds_total = 0.0  # sum of their lead times

    # ------------------------------------------------------------------ the session's events
    def turn_ended(self, req: Req) -> None:
        """req finished: remember its session's prefix (whole sequence) or its granted kept prefixes."""
        grant = req.keep_grant
        pc = req.params.prompt_cache
        if pc is not None and pc.session is not None:
            entries = [(_keys(req, ())[0], list(req.all_ids))]
        elif grant is not None:
            entries = [(("kept", req.salt, tuple(req.prompt_ids[:k.num_tokens])), list(req.prompt_ids[:k.num_tokens]))
                       for k in grant.kept]
        else:
            return
        for key, ids in entries:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.ids)
            self._entries[key] = _Entry(req.salt, ids)
            self._tokens += len(ids)
        while self._entries and (len(self._entries) > self.max_sessions or self._tokens > self.max_tokens):
            self._tokens -= len(self._entries.popitem(last=False)[1].ids)
        self._free_seen = -1

    def arrived(self, req: Req) -> None:
        """A request arrived: if its session's prefix was loaded ahead, the load is done and the request's prompt
        finds some of the loaded tokens in the pool, count the lead time (its arrival minus the load's completion).
        The entry stays until the turn ends again."""
        keep = req.params.prompt_cache.keep if req.params.prompt_cache is not None else ()
        for key in _keys(req, [k.num_tokens for k in keep]):
            e = self._entries.get(key)
            if e is None or e.load is None:
                continue
            self._poll(e)
            if e.loaded_at is None:
                continue  # still loading: its first forward waits for it (counted as neither)
            e.load = None
            if self.kv.tiered.match_prefix(req.prompt_ids, req.salt, touch=False).length > e.start:
                self.used_total += 1
                self.lead_seconds_total += max(0.0, req.arrival - e.loaded_at)
            e.loaded_at = None

    # ------------------------------------------------------------------ the pass
    def due(self) -> bool:
        """Whether a pass may load anything: the last pass's loads are done, and the pool's free pages grew since
        it, or a turn ended, or it stopped at max_pass_tokens. Also notes the loads ahead seen done by now (their
        completion time, for the lead time). Cheap: no tree walk."""
        if self._in_flight:
            for e in self._in_flight:
                self._poll(e)
            self._in_flight = [e for e in self._in_flight if e.loaded_at is None and e.load is not None]
            if self._in_flight:
                return False
        free = self.kv.allocator.free_pages
        if free > self._free_seen or self._capped:
            return True
        self._free_seen = free  # room taken since: the next growth counts from here
        return False

    def run(self, room_pages: int) -> int:
        """Load remembered prefixes into at most room_pages free pool pages, most recent turn end first (call when
        due()). Returns the tokens loaded. Mutates: the tree and allocator (TierLoads.load_ahead), this table."""
        loaded, ps = 0, self.kv.page_size
        cap = self.max_pass_tokens // ps
        self._capped = room_pages > cap
        room_pages = min(room_pages, cap)
        if room_pages <= 0:
            self._free_seen = self.kv.allocator.free_pages
            return 0
        for i, e in enumerate(reversed(self._entries.values())):
            if room_pages <= 0 or i == self.max_checks:
                break
            got = self.kv.tiers.load_ahead(e.ids, e.salt, room_pages)
            if got is None:
                continue
            e.load, e.start, n = got
            e.issued_at, e.loaded_at = self.clock(), None
            self._in_flight.append(e)
            room_pages -= n // ps
            loaded += n
            self.prefetches_total += 1
        self._capped = self._capped and room_pages == 0
        self.prefetched_tokens_total += loaded
        self._free_seen = self.kv.allocator.free_pages
        return loaded

    def _poll(self, e: _Entry) -> None:
        """Note e's load as done, at the start time plus the copy's own time (the loop may see it done much later,
        e.g. when idle); that misses a wait behind earlier copies of the FIFO, so it is the earliest it can have
        completed. Without a copy time: when seen."""
        if e.load is not None and e.loaded_at is None and e.load.query():
            now = self.clock()
            t = e.load.seconds
            e.loaded_at = now if t is None else min(now, e.issued_at + t)

    def __len__(self) -> int:
        return len(self._entries)
