"""Session prefetch (cache/session_prefetch.py): a finished session's prefix, pushed to the host tier by a flood,
is loaded back into the pool when room frees and before the session's next request arrives.

The trace, on the Scheduler step by step (hand-built requests over a tiered KVManager, page size 4) and on the
engine (tiny checkpoint): session A's turn ends; a flood of short requests (under a page each, so their K/V is
never published and their pages come back when they finish) runs all at once and pushes A's prefix off the pool to
the host tier; the flood ends. With prefetch on, A's prefix is in the pool before A's next request arrives, which is
then admitted on it with no load at admission; with it off the same trace loads at admission. A second flood after
the prefetch gives the prefetched pages up unused: counted as wasted. Prefetch takes free pages only: never a
running request's K/V or a cached prefix. Pool and host accounting is checked after every step.
"""

from __future__ import annotations

import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.cache.session_prefetch import SessionPrefetch
from prefixrt.cache.tiered_radix import TieredRadixCache
from prefixrt.cache.transfer import KVTransfer
from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.engine.loop.scheduler import Scheduler
from prefixrt.params import SamplingParams
from prefixrt.prompt_cache import KeepPrefix, PromptCache
from prefixrt.request import Req
from tests.helpers.scheduler_steps import run_all, step

PS = 4  # page size
A_PROMPT = list(range(10, 18))  # 8 tokens: two pages


def make_scheduler(pool_pages=4, host_tokens=64, **config) -> Scheduler:
    num_slots = (pool_pages + 1) * PS
    pool = KVPool(num_slots, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(num_slots, PS)
    host = HostKVPool(host_tokens, 2, 1, 2, torch.float32, PS, pin=False)
    cache = TieredRadixCache(allocator, host, KVTransfer(pool, host, debug=True), policy="write_through", debug=True)
    kv = KVManager(pool, allocator, ReqToTokenTable(16, 128, "cpu"), cache, debug=True)
    config.setdefault("aging_s", 1e9)
    return Scheduler(kv, SchedulerSettings(**config), 16)


def req(ids, rid, session=None, max_new_tokens=2) -> Req:
    pc = PromptCache(session) if session is not None else None
    return Req(rid=rid, prompt_ids=list(ids), params=SamplingParams(max_new_tokens=max_new_tokens, prompt_cache=pc),
               sink=None)


def flood(s: Scheduler, tag: str) -> list[Req]:
    """Four requests at once, 2 prompt tokens and 1 output each: a page each while they run, nothing published."""
    reqs = [req([200 + i, 201 + i], f"{tag}{i}", max_new_tokens=1) for i in range(4)]
    run_all(s, *reqs)
    return reqs


def a_turn(s: Scheduler) -> Req:
    a = req(A_PROMPT, "a1", session="A")
    run_all(s, a)
    assert s.kv.cache.match_prefix(a.all_ids, touch=False).length == 8  # its 8 prompt tokens published
    return a


def next_turn(a: Req) -> Req:
    return req(a.all_ids + [40, 41, 42, 43], "a2", session="A")


def test_a_prefix_pushed_to_host_is_back_before_its_next_request():
    s = make_scheduler()
    kv, cache = s.kv, s.kv.cache
    a = a_turn(s)
    flood(s, "f")
    m = cache.match_prefix(a.all_ids, touch=False)
    assert (m.length, m.host_length) == (0, 8)  # the flood pushed A's prefix to the host tier
    assert s.session_prefetch.prefetched_tokens_total == 0  # (the flood held the pool until it ended)
    step(s)  # nothing to run: the room the flood left is used for A
    assert s.session_prefetch.prefetched_tokens_total == 8
    m = cache.match_prefix(a.all_ids, touch=False)
    assert (m.length, m.host_length) == (8, 0)
    assert cache.host_hit_tokens_total == 0  # a load ahead is not a hit
    a2 = next_turn(a)
    s.add(a2)
    step(s)
    assert a2.num_cached_tokens == 8 and a2.row is not None
    assert kv.tiers.prefetch_misses_total == 0 and cache.host_hit_tokens_total == 0  # no load at admission
    assert cache.ahead_used_tokens_total == 8 and cache.ahead_wasted_tokens_total == 0
    assert s.session_prefetch.used_total == 1
    while s.has_work:
        step(s)


def test_without_prefetch_the_same_trace_loads_at_admission():
    s = make_scheduler(session_prefetch=False)
    kv, cache = s.kv, s.kv.cache
    assert s.session_prefetch is None
    a = a_turn(s)
    flood(s, "f")
    step(s)
    m = cache.match_prefix(a.all_ids, touch=False)
    assert (m.length, m.host_length) == (0, 8)  # still on the host
    a2 = next_turn(a)
    s.add(a2)
    step(s)
    assert a2.num_cached_tokens == 8
    assert kv.tiers.prefetch_misses_total == 1 and cache.host_hit_tokens_total == 8  # loaded at admission
    assert cache.ahead_used_tokens_total == 0
    while s.has_work:
        step(s)


def test_a_prefetch_given_up_before_use_is_counted_as_wasted():
    s = make_scheduler()
    cache = s.kv.cache
    a = a_turn(s)
    flood(s, "f")
    step(s)
    assert s.session_prefetch.prefetched_tokens_total == 8
    flood(s, "g")  # takes the pool again before A comes back: the prefetched pages go first (oldest use)
    assert cache.ahead_wasted_tokens_total == 8 and cache.ahead_used_tokens_total == 0
    m = cache.match_prefix(a.all_ids, touch=False)
    assert m.host_length == 8  # back on the host only, and loaded again once room frees
    step(s)
    assert s.session_prefetch.prefetched_tokens_total == 16
    a2 = next_turn(a)
    run_all(s, a2)
    assert a2.num_cached_tokens == 8 and cache.ahead_used_tokens_total == 8 and cache.ahead_wasted_tokens_total == 8


def test_a_kept_prefix_without_a_session_key_is_prefetched_too():
    s = make_scheduler()
    cache = s.kv.cache
    k = Req(rid="k", prompt_ids=A_PROMPT, sink=None,
            params=SamplingParams(max_new_tokens=2, prompt_cache=PromptCache(None, (KeepPrefix(8, 600.0),))))
    run_all(s, k)
    assert s.kv.pins.num_pins == 1
    flood(s, "f")
    assert cache.match_prefix(A_PROMPT, touch=False).host_length == 8  # kept: moved to the host, not dropped
    step(s)
    assert s.session_prefetch.prefetched_tokens_total == 8
    k2 = Req(rid="k2", prompt_ids=A_PROMPT + [50, 51], sink=None,
             params=SamplingParams(max_new_tokens=1, prompt_cache=PromptCache(None, (KeepPrefix(8, 600.0),))))
    run_all(s, k2)
    assert k2.num_cached_tokens == 8 and cache.host_hit_tokens_total == 0 and s.session_prefetch.used_total == 1


def test_a_pass_loads_at_most_max_pass_tokens_the_next_one_the_rest():
    s = make_scheduler()
    s.session_prefetch = SessionPrefetch(s.kv, max_pass_tokens=PS)
    cache = s.kv.cache
    a = a_turn(s)
    flood(s, "f")
    step(s)
    assert s.session_prefetch.prefetched_tokens_total == 4
    m = cache.match_prefix(a.all_ids, touch=False)
    assert (m.length, m.host_length) == (4, 4)
    step(s)  # the next pass, its predecessor's load done
    assert s.session_prefetch.prefetched_tokens_total == 8
    assert cache.match_prefix(a.all_ids, touch=False).length == 8


def test_the_table_holds_at_most_the_host_tiers_tokens():
    s = make_scheduler(host_tokens=16)
    run_all(s, req(A_PROMPT, "a1", session="A"))  # 10 token ids (8 prompt, 2 output)
    assert len(s.session_prefetch) == 1
    run_all(s, req(list(range(30, 38)), "b1", session="B"))  # 20 > 16: A's, the oldest turn end, is forgotten
    assert len(s.session_prefetch) == 1 and s.session_prefetch._entries.get(("session", None, "A")) is None


def test_prefetch_takes_free_pages_only_never_a_running_request_or_a_cached_prefix():
    s = make_scheduler(pool_pages=6)
    kv, cache = s.kv, s.kv.cache
    a = a_turn(s)
    b = req(list(range(100, 108)), "b", max_new_tokens=2)  # a cached prefix used after A's turn
    run_all(s, b)
    r = req(list(range(60, 70)), "r", max_new_tokens=6)  # runs on; with x, takes A's pages (A to the host)
    x = req([90, 91], "x", max_new_tokens=1)  # a page while it runs, given back when it ends
    s.add(r)
    s.add(x)
    step(s)
    assert x.finish_reason == "length" and r.row is not None
    assert cache.match_prefix(a.all_ids, touch=False).host_length == 8
    assert kv.allocator.free_pages == 1  # x's page came back: room freed
    r_pages, evicted = list(r.pages), kv.evicted_tokens_total
    step(s)  # a pass: the free page is less than what r still needs (its expected decode), so nothing is loaded
    assert s.session_prefetch.prefetched_tokens_total == 0 and kv.allocator.free_pages == 1
    # Asked for more than is free, a load ahead takes the free page alone (A's head) and evicts nothing.
    load, start, n = kv.tiers.load_ahead(a.all_ids, None, max_pages=8)
    assert (start, n) == (0, PS) and kv.allocator.free_pages == 0 and kv.evicted_tokens_total == evicted
    m = cache.match_prefix(a.all_ids, touch=False)
    assert (m.length, m.host_length) == (4, 4)
    assert r.pages == r_pages and cache.match_prefix(b.all_ids, touch=False).length == 8
    kv.check_integrity()
    while s.has_work:  # r grows into a fourth page: the prefetched head (oldest use) goes, B's prefix stays
        step(s)
        assert r.pages[:len(r_pages)] == r_pages or r.row is None
    assert cache.ahead_wasted_tokens_total == 4 and cache.match_prefix(b.all_ids, touch=False).length == 8


def test_prefetch_keeps_the_prefix_recency():
    """A load ahead is not a use: the loaded path keeps its last use's recency, so it goes before a prefix used
    after it but before the load (B's), when the pool needs room again."""
    s = make_scheduler(pool_pages=5)
    cache = s.kv.cache
    a = a_turn(s)
    b = req(list(range(100, 104)), "b", max_new_tokens=1)  # one page, used after A's turn
    run_all(s, b)
    flood(s, "f")  # A (least recently used) to the host; B stays
    assert cache.match_prefix(a.all_ids, touch=False).host_length == 8
    assert cache.match_prefix(b.prompt_ids, touch=False).length == 4
    step(s)
    assert s.session_prefetch.prefetched_tokens_total == 8 and s.kv.allocator.free_pages == 2
    c = req(list(range(120, 132)), "c", max_new_tokens=1)  # three pages, one more than is free
    run_all(s, c)
    assert cache.ahead_wasted_tokens_total == 8 and cache.ahead_used_tokens_total == 0
    assert cache.match_prefix(b.prompt_ids, touch=False).length == 4  # B's prefix stays


# ---------------------------------------------------------------------------------------------- the engine
GREEDY = {"temperature": 0, "ignore_eos": True}


def _engine_trace(make_engine, prefetch: bool, delay_s: float = 0.0, wait_loads: bool = True):
    """On a tiny checkpoint, page size 4, a pool of 12 pages with the host tier: A's turn (32 prompt tokens, keyed),
    a flood (one request of 8 samples, 2 prompt tokens and 1 output each: a page each while running, nothing
    published), then A's next turn once the loads in flight are done (wait_loads; else at once). delay_s: race
    mode, every layer of every host copy delayed. Returns (A's next Completion, stats before it, stats after it)."""
    eng = make_engine("llama", kv_cache_tokens=48, page_size=4, host_kv_cache_tokens=256, chunked_prefill_tokens=64,
                      session_prefetch=prefetch, host_kv_debug_delay_s=delay_s)
    a_prompt = [5 + (7 * i) % 290 for i in range(32)]
    key = {"prompt_cache": PromptCache("A")}
    a1 = eng.generate(a_prompt, {"max_new_tokens": 2, **GREEDY, **key})
    eng.generate([300, 301], {"max_new_tokens": 1, "n": 8, **GREEDY})
    eng.wait_idle()

    def loads_done():
        w = eng.core.kv.tiers.load_waiter()
        if w is not None:
            w.wait_all()

    if wait_loads:
        eng._run_on_loop(loads_done)  # (the agent's time in tools: the prefetch, if any, has finished)
    before = eng.stats()
    a2 = eng.generate(a_prompt + a1.token_ids + [9, 10, 11, 12], {"max_new_tokens": 3, **GREEDY, **key})
    eng.wait_idle()
    return a2, before, eng.stats()


def test_engine_session_prefix_is_back_before_the_next_turn(make_engine):
    a2, before, after = _engine_trace(make_engine, prefetch=True)
    assert before.evicted_tokens_total >= 32  # the flood pushed A's prefix to the host tier
    assert before.session_prefetch_tokens_total == 32  # and it came back when the flood ended
    assert before.host_hit_tokens_total == 0
    assert a2.cached_tokens == 32
    assert after.host_hit_tokens_total == 0 and after.host_prefetch_misses_total == 0  # no load at admission
    assert after.session_prefetch_used_tokens_total == 32 and after.session_prefetch_wasted_tokens_total == 0
    assert after.session_prefetch_arrivals_total == 1 and after.session_prefetch_lead_seconds_total > 0


def test_engine_without_session_prefetch_loads_at_admission_with_the_same_output(make_engine):
    on, _, _ = _engine_trace(make_engine, prefetch=True)
    off, before, after = _engine_trace(make_engine, prefetch=False)
    assert before.evicted_tokens_total >= 32 and before.session_prefetch_tokens_total == 0
    assert off.cached_tokens == 32
    assert after.host_hit_tokens_total == 32 and after.host_prefetch_misses_total == 1  # loaded at admission
    assert after.session_prefetch_used_tokens_total == 0
    assert off.token_ids == on.token_ids  # exact reuse either way


def test_engine_next_turn_during_the_prefetch_waits_for_its_load(make_engine):
    """Race mode (each layer of each copy delayed, freed slots poisoned with NaN by debug mode): A's next turn
    arrives while its prefix is still loading; its forward waits for the load, so its output is unchanged."""
    want, _, _ = _engine_trace(make_engine, prefetch=False)
    # (a quarter second per layer: the next turn is submitted well before the load is done; the check holds either way)
    got, before, after = _engine_trace(make_engine, prefetch=True, delay_s=0.25, wait_loads=False)
    assert before.session_prefetch_tokens_total == 32 and got.cached_tokens == 32
    assert after.host_prefetch_misses_total == 0 and after.session_prefetch_used_tokens_total == 32
    assert got.token_ids == want.token_ids
