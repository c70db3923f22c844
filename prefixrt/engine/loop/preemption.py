"""FirstTokenPreemption: with a host tier, a new request that has waited too long for memory preempts running
requests that have already streamed (host_kv_preempt_after_s). The scheduler's admission pass records the request
(`consider`); the next step's planning retracts the victims first (Scheduler._preempt) and admits it first; the
victims are held back until it is admitted (else they would take the room back first).
"""

from __future__ import annotations

from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.request import Req


class FirstTokenPreemption:
    """With a host tier: a request that has produced nothing and has waited host_kv_preempt_after_s for memory takes
    the room of running requests that have already streamed (retracted to the host, resumed later; each at most
    max_preemptions times). Recorded during one admission pass (`consider`), carried out before the next step's
    planning (Scheduler._preempt, over `candidates`), the request then admitted first (`first`) and its victims
    held back (`holds_back`) until it is admitted or gone (`done`)."""

    def __init__(self, kv, settings: SchedulerSettings):
        self.kv = kv
        self.settings = settings
        self.pending: tuple[Req, int] | None = None  # (waiting request, pages it needs): preempt next step
        self.first: Req | None = None  # the request a preemption made room for
        self.held_back: set[int] = set()  # id() of its preemption's victims: not admitted before it is
        self.preempted_total = 0

    def candidates(self, req: Req, running: list[Req]) -> list[Req]:
        """Running requests that may make room for waiting req: they have streamed already, were preempted fewer
        than max_preemptions times, are not of a higher priority; most remaining decode first (they would hold
        their memory longest), then the latest arrival."""
        cands = [r for r in running if r.output_ids and r.retractions < self.settings.max_preemptions
                 and r.params.priority <= req.params.priority]
        return sorted(cands, key=lambda r: (-r.remaining_new_tokens, -r.arrival))

    def consider(self, req: Req, need: int, now: float, running: list[Req]) -> None:
        """req does not fit beside the running requests: record it for preemption if it may preempt."""
        after = self.settings.host_kv_preempt_after_s
        if (after is not None and self.kv.tiered is not None and not req.output_ids
                and now - req.arrival >= after and self.candidates(req, running)):
            self.pending = (req, need)

    def holds_back(self, req: Req) -> bool:
        return bool(self.held_back) and id(req) in self.held_back

    def done(self) -> None:
        """The request preempted for is admitted (or gone): its victims may run again."""
        self.first, self.held_back = None, set()
