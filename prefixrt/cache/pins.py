"""PinTable: the kept prefixes (pins) of one engine's prefix cache: which prefix is kept until when, for which
tenant (cache_salt), and the limits that keep one tenant's pins from starving the others.

A request's kept prefixes (PromptCache.keep, prefixrt/prompt_cache.py) go through three steps:
1. `grant`, when the loop receives the request: each keep is granted or refused against the limits, and the
   tokens a grant may add are reserved. The decision is known before the request's first token, so its
   response can say so (KeepGrant.report: a header and a metric).
2. `commit`, when the request releases its K/V for the last time (its prompt is published to the tree then):
   each granted prefix is pinned in the tree (RadixCache.pin) until now + its lifetime; a prefix already kept
   by an earlier request gets the later of the two ends (one pin per prefix). The reservation is released.
3. `expire`, before the pool evicts and on every stats snapshot: pins whose time is up are unpinned; their
   nodes go back to the LRU.

Limits, in tokens of the tier that keeps pins (the host tier when there is one, where pinned nodes go when the
pool evicts them; else the pool, which then never evicts them):
- all pins together (committed and reserved) at most `capacity_tokens` (EngineConfig.max_pinned_fraction);
- one cache_salt's at most `per_salt_tokens` (EngineConfig.max_pinned_fraction_per_salt).
A keep over a limit is refused; the shorter keeps of the same request that fit are granted.
The tokens a keep adds are estimated at grant time as its length less what a pin already keeps on its path.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any

from prefixrt.prompt_cache import KeepPrefix

TENANT_LIMIT = "tenant_limit"  # the salt's pins would go over per_salt_tokens
CAPACITY = "capacity"  # all pins would go over capacity_tokens
NO_CACHE = "no_prefix_cache"  # this engine's prefix cache keeps nothing (or cannot pin)


@dataclass
class KeepGrant:
    """The decision on one request's kept prefixes (Req.keep_grant until its last release)."""

    kept: tuple[KeepPrefix, ...]  # granted, shortest first
    refused: tuple[KeepPrefix, ...]  # refused
    reason: str | None  # why the refused ones were: TENANT_LIMIT, CAPACITY or NO_CACHE
    salt: Any = None
    reserved_tokens: int = 0  # held against the limits until commit

    def report(self) -> dict:
        """What the response says: {"kept_tokens", "refused_tokens", "reason"} (0 / None where nothing)."""
        return {"kept_tokens": self.kept[-1].num_tokens if self.kept else 0,
                "refused_tokens": self.refused[-1].num_tokens if self.refused else 0,
                "reason": self.reason}


@dataclass
class _Pin:
    salt: Any
    ids: tuple  # the prefix's tokens (a pin is found again by comparing them, never by a hash alone)
    handle: Any
    expires: float


class PinTable:
    def __init__(self, cache, capacity_tokens: int, per_salt_tokens: int, clock=time.monotonic):
        self.cache = cache
        self.capacity_tokens = capacity_tokens
        self.per_salt_tokens = per_salt_tokens
        self.clock = clock
        self.can_pin = getattr(cache, "retains", False) and hasattr(cache, "pin")
        self._pins: dict[tuple, _Pin] = {}  # (salt, num_tokens, hash of ids) -> pin
        self._expiry: list[tuple[float, int, tuple]] = []  # (expires, seq, key), lazy: stale entries skipped
        self._seq = itertools.count()
        self._reserved: dict[Any, int] = {}  # salt -> tokens reserved by grants not yet committed
        self.granted_total = 0  # keeps granted
        self.refused_total = 0  # keeps refused (any reason)
        self.expired_total = 0  # pins whose lifetime ended
        self.refreshed_total = 0  # commits that extended an existing pin

    # ------------------------------------------------------------------ grant
    def grant(self, ids: list, salt: Any, keep: tuple[KeepPrefix, ...]) -> KeepGrant:
        """Decide on a request's kept prefixes (its prompt `ids`, its `salt`) and reserve what is granted.
        Mutates: the reservations, the counters; touches the recency of the matched path (a read)."""
        if not keep:
            return KeepGrant((), (), None, salt)
        if not self.can_pin:
            self.refused_total += len(keep)
            return KeepGrant((), tuple(keep), NO_CACHE, salt)
        self.expire()
        longest = keep[-1].num_tokens
        m = self.cache.match_prefix(list(ids[:longest]), salt)
        end = m.host_handle if m.host_length else m.handle
        already = self.cache.pinned_on_path(end) if end is not None else 0
        by_salt = self.cache.pinned_by_salt()
        salt_used = by_salt.get(salt, 0) + self._reserved.get(salt, 0)
        total_used = sum(by_salt.values()) + sum(self._reserved.values())
        kept, refused, reason, extra = [], [], None, 0
        for k in keep:
            add = max(0, k.num_tokens - already)
            if salt_used + add > self.per_salt_tokens:
                refused.append(k)
                reason = reason or TENANT_LIMIT
            elif total_used + add > self.capacity_tokens:
                refused.append(k)
                reason = reason or CAPACITY
            else:
                kept.append(k)
                extra = max(extra, add)
        if extra:
            self._reserved[salt] = self._reserved.get(salt, 0) + extra
        self.granted_total += len(kept)
        self.refused_total += len(refused)
        return KeepGrant(tuple(kept), tuple(refused), reason, salt, extra)

    # ------------------------------------------------------------------ commit / release
    def commit(self, grant: KeepGrant, ids: list, cached_len: int) -> int:
        """Pin each granted prefix of `ids` that the tree holds (at most `cached_len` tokens: the request's
        published K/V), until now + its lifetime; release the grant's reservation. Returns the tokens of the
        longest prefix pinned. Mutates: the tree's pins, this table."""
        self._release_reservation(grant)
        now, ps, pinned = self.clock(), self.cache.page_size, 0
        for k in grant.kept:
            n = min(k.num_tokens, cached_len) // ps * ps
            if n == 0:
                continue
            prefix = tuple(ids[:n])
            key = (grant.salt, n, hash(prefix))
            pin = self._pins.get(key)
            expires = now + k.ttl_s
            if pin is not None and pin.ids == prefix:
                if expires > pin.expires:
                    pin.expires = expires
                    heapq.heappush(self._expiry, (expires, next(self._seq), key))
                self.refreshed_total += 1
                pinned = n
                continue
            if pin is not None:  # a hash collision: keep the first pin, leave this prefix to the LRU
                continue
            m = self.cache.match_prefix(list(prefix), grant.salt)
            if m.length + m.host_length < n:
                continue  # not all in the tree (it never is short right after publication; stay safe)
            self._pins[key] = _Pin(grant.salt, prefix, self.cache.pin(m), expires)
            heapq.heappush(self._expiry, (expires, next(self._seq), key))
            pinned = n
        return pinned

    def _release_reservation(self, grant: KeepGrant) -> None:
        if grant.reserved_tokens:
            left = self._reserved.get(grant.salt, 0) - grant.reserved_tokens
            if left > 0:
                self._reserved[grant.salt] = left
            else:
                self._reserved.pop(grant.salt, None)
            grant.reserved_tokens = 0

    def drop(self, grant: KeepGrant) -> None:
        """A granted request ends without committing (its K/V never reached the tree): release its reservation."""
        self._release_reservation(grant)

    # ------------------------------------------------------------------ expiry
    def expire(self, now: float | None = None) -> int:
        """Unpin every pin whose lifetime has ended; returns how many. Mutates: the tree's pins, this table."""
        now = self.clock() if now is None else now
        done = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires, _, key = heapq.heappop(self._expiry)
            pin = self._pins.get(key)
            if pin is None or pin.expires != expires:
                continue  # refreshed (a later entry stands for it) or gone
            del self._pins[key]
            self.cache.unpin(pin.handle)
            self.expired_total += 1
            done += 1
        return done

    def clear(self) -> int:
        """Unpin everything (flush_cache); returns how many pins there were."""
        n = len(self._pins)
        for pin in self._pins.values():
            self.cache.unpin(pin.handle)
        self._pins.clear()
        self._expiry.clear()
        return n

    # ------------------------------------------------------------------ figures
    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def tier_tokens(self) -> tuple[int, int]:
        """(tokens of pinned nodes with pool slots, tokens of pinned nodes with a host copy). Read-only."""
        if not self._pins:
            return 0, 0
        pool = host = 0
        for node in self.cache.pinned_nodes():
            if node.slots is not None:
                pool += len(node.key)
            if getattr(node, "host_slots", None) is not None:
                host += len(node.key)
        return pool, host

    def pinned_by_salt(self) -> dict:
        return self.cache.pinned_by_salt() if self.can_pin else {}
