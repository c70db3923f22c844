"""Driving a Scheduler step by step with the loop's bookkeeping and no forward, for tests of admission over the
host tier (tests/engine/loop/test_first_token_preemption.py, tests/cache/test_session_prefetch.py) and of the
scheduler alone (tests/engine/loop/test_scheduler.py)."""

from __future__ import annotations

from prefixrt.engine.loop.scheduler import Scheduler
from prefixrt.request import Req

SAMPLED = 3  # the token every sampled row "samples"


def step(s: Scheduler, finish: bool = True):
    """schedule(), then the loop's part: append a sampled token where the batch samples, publish prefill chunks,
    finish requests at their max_new_tokens (finish_reason "length", released as EngineCore does; finish=False
    keeps them running, for tests that watch the budget alone), wait for the loads in flight; then the cache's
    integrity check. Returns the batch."""
    b = s.schedule()
    for r, n, sample in zip(b.reqs, b.num_tokens, b.sample):
        if sample:
            r.append_output([SAMPLED])
        if n > 1:
            s.kv.cache_unfinished(r)
    for r in list(b.reqs) if finish else ():
        if len(r.output_ids) >= r.params.max_new_tokens:
            r.finish_reason = "length"
            s.remove(r)
    w = s.kv.tiers.load_waiter()
    if w is not None:
        w.wait_all()
    s.kv.check_integrity()
    return b


def run_all(s: Scheduler, *reqs: Req) -> None:
    """Add reqs and step until the scheduler has no work."""
    for r in reqs:
        s.add(r)
    while s.has_work:
        step(s)
