"""HostPrefetch: the scheduler's host-tier prefetch (host_kv_prefetch). Waiting requests next in line get their
host-resident prefix loaded into the pool ahead of admission, overlapped with the running batch; the loads
themselves, and the lock each prefetched path holds, are cache/tier_loads.py's. The scheduler's admission pass
(Scheduler._admit) asks this class which waiting requests prefetch, and keeps their pages out of what others take.
"""

from __future__ import annotations

from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.request import Req


class HostPrefetch:
    """Waiting requests next in line whose host-tier prefix is loaded into the pool ahead of their admission
    (host_kv_prefetch), and the pages each will need once admitted (kept out of what others may take)."""

    def __init__(self, kv, settings: SchedulerSettings):
        self.kv = kv
        self.settings = settings
        self.requests: list[Req] = []  # waiting requests whose prefix is loaded (or loading) for them

    @property
    def on(self) -> bool:
        return self.kv.tiered is not None and self.settings.host_kv_prefetch != "off"

    @property
    def wait_complete(self) -> bool:
        return self.settings.host_kv_prefetch == "wait_complete"

    def needs(self, match, remaining) -> dict[int, int]:
        """id(request) -> the pages each prefetching request takes once admitted (its match, its decode)."""
        return {id(r): self.kv.pages_to_admit(r, match(r), remaining(r)) for r in self.requests}

    def still_loading(self, req: Req, running: bool) -> bool:
        """Under wait_complete, with other work running: req's prefetched prefix is still loading (others first)."""
        return (self.wait_complete and running and self.kv.tiers.has_prefetch(req)
                and not self.kv.tiers.prefetch_ready(req))

    def should_wait(self, req: Req, host_length: int, running: bool) -> bool:
        """Under wait_complete, with other work running: req (whose match has a host part) loads before it runs."""
        return self.on and self.wait_complete and running and bool(host_length)

    def start(self, req: Req, m) -> bool:
        """Start loading req's host part now, if there is one and room for another prefetch."""
        if not (self.on and m.host_length and len(self.requests) < self.settings.max_prefetching):
            return False
        if not self.kv.tiers.prefetch(req, m):
            return False
        self.requests.append(req)
        return True

    def admitted(self, req: Req) -> None:
        if req in self.requests:
            self.requests.remove(req)

    def cancel_last(self) -> bool:
        """Memory is needed for running work: the latest prefetch lets its path go. False: none to cancel."""
        if not self.requests:
            return False
        self.kv.tiers.cancel_prefetch(self.requests.pop())
        return True

    def cancel_behind(self, req: Req, order: list[Req]) -> bool:
        """req cannot get its pages to be admitted: the prefetches of the requests after it in this pass's `order`
        let their paths go (they are not admitted before it, so their locks would only keep it out; with nothing
        running nothing else ever would let them go). Their loaded K/V stays cached. False: none to cancel."""
        at = next(i for i, r in enumerate(order) if r is req)
        behind = {id(r) for r in order[at + 1:]}
        cancelled = [r for r in self.requests if id(r) in behind]
        if not cancelled:
            return False
        self.requests = [r for r in self.requests if id(r) not in behind]
        for r in cancelled:
            self.kv.tiers.cancel_prefetch(r)
        return True

    def removed(self, req: Req) -> None:
        if req in self.requests:
            self.requests.remove(req)
