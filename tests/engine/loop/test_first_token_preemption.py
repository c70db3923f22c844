"""First-token preemption (engine/loop/preemption.py) on the Scheduler step by step: hand-built requests over a tiered
KVManager (page size 1, a 40-page pool, write-through host tier), the loop's part played by the test.

The trace that once left the loop planning nothing forever: session P's prefix sits in the host tier only; R runs
(one request at a time) and has streamed; P's next turn P2 waits, its host prefix prefetched (locked in the pool);
a new request F does not fit beside R and preempts it. Then nothing runs, R is held back until F is admitted, and F
is first in line but cannot get its pages while P2's prefetch holds them: the prefetch of a request behind F must
give its pages up, else no request is ever admitted again.
"""

from __future__ import annotations

import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.cache.tiered_radix import TieredRadixCache
from prefixrt.cache.transfer import KVTransfer
from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.engine.loop.scheduler import Scheduler
from prefixrt.params import SamplingParams
from prefixrt.request import Req
from tests.helpers.scheduler_steps import run_all, step

POOL_PAGES = 40


def make_scheduler() -> Scheduler:
    pool = KVPool(POOL_PAGES + 1, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(POOL_PAGES + 1, 1)
    host = HostKVPool(128, 2, 1, 2, torch.float32, 1, pin=False)
    cache = TieredRadixCache(allocator, host, KVTransfer(pool, host, debug=True), policy="write_through", debug=True)
    kv = KVManager(pool, allocator, ReqToTokenTable(8, 128, "cpu"), cache, debug=True)
    settings = SchedulerSettings(aging_s=1e9, chunked_prefill_tokens=64, host_kv_prefetch="wait_complete",
                                 host_kv_preempt_after_s=0.0)
    return Scheduler(kv, settings, max_running_requests=1)


def req(ids, rid, max_new_tokens=2) -> Req:
    return Req(rid=rid, prompt_ids=list(ids), params=SamplingParams(max_new_tokens=max_new_tokens), sink=None)


def preempt_beside_a_prefetch(s: Scheduler) -> tuple[Req, Req, Req]:
    """Play the trace up to F's preemption of R (recorded, carried out on the next step). Returns (F, R, P2)."""
    kv, cache = s.kv, s.kv.cache
    p1 = req(range(100, 111), "p1")  # 11 prompt tokens
    run_all(s, p1)
    run_all(s, req(range(150, 188), "q", max_new_tokens=1))  # 38 tokens: the pool holds them, not P's path too
    m = cache.match_prefix(p1.all_ids)  # (read-only)
    assert (m.length, m.host_length) == (0, 12)  # P's prefix is on the host tier only

    r = req(range(200, 208), "r", max_new_tokens=8)
    s.add(r)
    step(s)
    assert r.output_ids and r in s.running  # R runs and has streamed
    p2 = req(p1.all_ids + [40, 41], "p2")
    s.add(p2)
    step(s)
    assert s.prefetch.requests == [p2] and kv.tiers.has_prefetch(p2)  # (one request at a time: P2 loads meanwhile)

    f = req(range(250, 282), "f")  # 32 tokens: more than the pool holds beside P2's prefetched 12
    s.add(f)
    step(s)
    assert s.preemption.pending is not None and s.preemption.pending[0] is f
    return f, r, p2


def test_a_prefetch_behind_the_request_preempted_for_gives_its_pages_up():
    s = make_scheduler()
    kv, cache = s.kv, s.kv.cache
    f, r, p2 = preempt_beside_a_prefetch(s)
    b = step(s)  # R preempted (held back until F is admitted); nothing runs
    assert b.retracted == [r] and r in s.waiting and p2 in s.waiting
    # F, first in line, gets its pages: P2's prefetch (behind it) let its path go.
    assert b.reqs == [f], "nothing admitted: F waits for the pages P2's prefetch holds, R waits for F"
    assert not kv.tiers.has_prefetch(p2) and s.prefetch.requests == []
    assert s.preemption.first is None and not s.preemption.holds_back(r)  # F admitted: R may run again

    steps = 0
    while s.has_work:
        step(s)
        steps += 1
        assert steps < 50, "the scheduler makes no progress"
    assert [len(x.output_ids) for x in (f, r, p2)] == [2, 8, 2]
    assert r.retractions == 1 and s.preempted_total == 1
    assert kv.allocator.free_tokens + cache.evictable_tokens == kv.allocator.total_tokens  # nothing stays locked


def test_debug_mode_aborts_requests_no_step_could_admit(monkeypatch):
    """The same trace with the prefetch kept (the bug undone): debug mode names the stuck requests and hands them
    back to be aborted instead of planning nothing forever."""
    from prefixrt.engine.loop.prefetch import HostPrefetch

    monkeypatch.setattr(HostPrefetch, "cancel_behind", lambda self, req, order: False)
    s = make_scheduler()
    f, r, p2 = preempt_beside_a_prefetch(s)
    b = s.schedule()
    assert b.reqs == [] and b.retracted == [r] and s.running == [] and b.stuck is None  # (R's copy to the host runs)
    s.kv.tiered.transfer.wait_all()
    b = s.schedule()
    assert b.reqs == []
    assert {x.rid for x in b.finished_early} == {"f", "r", "p2"}
    assert b.stuck.startswith("scheduler stuck: nothing runs or is in flight")
    for what in ("f (0 tokens out, preempted for", "r (3 tokens out, held back", "p2 (0 tokens out, prefetching"):
        assert what in b.stuck, b.stuck
