"""KVReceiver: K/V that another engine writes into this pool (prefill/decode disaggregation's receive side,
disagg/decode.py), beside KVManager's pool accounting.

A receive owns private pages of the pool (`begin`) until it publishes them to the prefix cache (`finish`) or
hands them back (`abandon`); its Transfer (kind "receive", one mark per layer, set by the receiving thread) is
tracked on those pages by KVManager, so a page of an abandoned receive returns to the allocator only once the
sender has confirmed it will not write it. KVManager counts the pages of receives in flight as private.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixrt.cache.allocator import pages_to_slots
from prefixrt.cache.transfer import Transfer


@dataclass(eq=False)
class IncomingKV:
    """K/V another engine writes into this pool (KVReceiver.begin): positions [start, len(tokens)) of tokens go to
    `slots`; positions [0, start) were already cached here (prefix_slots, locked by handle)."""

    tokens: list[int]
    salt: Any
    start: int
    prefix_slots: list[int]
    pages: list[int]
    slots: list[int]
    handle: Any
    transfer: Transfer
    meta: dict = field(default_factory=dict)  # the receiver's bookkeeping (peer, transfer id, timings)


class KVReceiver:
    def __init__(self, kv):
        self.kv = kv  # the KVManager whose pool receives
        self.incoming: dict[int, IncomingKV] = {}  # id -> a receive whose pages it owns (not yet published)

    def begin(self, tokens: list[int], salt: Any) -> IncomingKV | None:
        """Pages for K/V another engine will write into this pool: positions [start, n) of tokens, n = len(tokens)
        rounded down to a page, start = what the prefix cache already holds (that path stays locked until the
        receive ends). The pages are private to the receive and tracked by its Transfer (kind "receive"), whose
        per-layer marks the receiving thread sets. None when nothing is missing, the cache keeps nothing, or the
        pages cannot be had (the caller then computes the prompt itself). Mutates: the lock, the allocator."""
        kv = self.kv
        ps = kv.page_size
        n = len(tokens) // ps * ps
        if not kv.cache.retains or n == 0:
            return None
        m = kv.cache.match_prefix(tokens, salt, max_len=n)
        if m.length >= n:
            return None
        handle = kv.cache.lock(m)
        need = (n - m.length) // ps
        if not kv.ensure_pages(need):
            kv.cache.unlock(handle)
            return None
        pages = kv.allocator.alloc(need)
        if kv.debug:
            kv.check_no_copy_pending(pages)
        slots = pages_to_slots(pages, ps)
        inc = IncomingKV(tokens=list(tokens[:n]), salt=salt, start=m.length, prefix_slots=list(m.slots),
                         pages=pages, slots=slots, handle=handle,
                         transfer=Transfer("receive", kv.pool.num_layers, len(slots), cuda=False))
        kv.track(inc.transfer, slots)
        self.incoming[id(inc)] = inc
        return inc

    def finish(self, inc: IncomingKV) -> int:
        """The receive is complete (every layer written): publish tokens[:n] to the prefix cache with the received
        slots, free the ones that duplicate what the cache gained meanwhile, unlock. Returns tokens now cached."""
        assert inc.transfer.query(), "KVReceiver.finish before the transfer completed"
        kv = self.kv
        del self.incoming[id(inc)]
        kv.untrack(inc.transfer, inc.pages)
        existing = kv.cache.insert(inc.tokens, inc.prefix_slots + inc.slots, inc.salt)
        dup = max(0, existing - inc.start) // kv.page_size
        kv.free_pages(inc.pages[:dup])
        kv.cache.unlock(inc.handle)
        return len(inc.tokens)

    def abandon(self, inc: IncomingKV) -> None:
        """The receive's request is gone (aborted) or its sender failed: unlock the prefix; the pages return to the
        allocator only once the transfer is done (the sender confirmed it never started or has finished), at a
        later KVManager.reclaim() if it is still pending now."""
        del self.incoming[id(inc)]
        self.kv.cache.unlock(inc.handle)
        self.kv.free_cached(inc.slots)

    def target_ok(self, inc: IncomingKV) -> bool:
        """Debug check, from the receiving thread before it writes a layer: every destination page still belongs
        to this receive (not freed, not handed to anyone else). A False is counted as a lifetime violation."""
        ok = self.kv.pages_tracked_by(inc.transfer, inc.pages)
        if not ok:
            self.kv.lifetime_violations += 1
        return ok

    @property
    def pending(self) -> int:
        """Receives not yet published or abandoned, plus abandoned ones whose transfer is still pending."""
        return len(self.incoming) + self.kv.held_receives()

    @property
    def private_pages(self) -> list[int]:
        """The pages of the receives in flight (private to them)."""
        return [p for inc in self.incoming.values() for p in inc.pages]
