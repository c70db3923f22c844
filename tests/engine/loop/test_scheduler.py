"""Scheduler on hand-built requests over a real (tiny, CPU) KVManager: chunking, decode, admission limits,
prefill-once, retraction, out-of-memory finishing. No model: a test plays the loop's part after each
schedule() (append a sampled token where the batch samples, publish prefill chunks as EngineCore does).
"""

from __future__ import annotations

import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.radix import RadixCache
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.engine.loop.scheduler import PREFIX_DEDUP_MIN_TOKENS, Scheduler
from prefixrt.params import SamplingParams
from prefixrt.request import Req, ReqState
from tests.helpers import scheduler_steps

SAMPLED = scheduler_steps.SAMPLED  # the token the fake loop "samples"


def make_scheduler(num_slots: int = 256, page_size: int = 1, rows: int = 8, **config) -> Scheduler:
    pool = KVPool(num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(num_slots, page_size)
    kv = KVManager(pool, allocator, ReqToTokenTable(rows, 512, "cpu"), RadixCache(allocator), debug=True)
    config.setdefault("aging_s", 1e9)
    max_running = config.pop("max_running_requests", 256)
    return Scheduler(kv, SchedulerSettings(**config), max_running)


def req(ids, rid: str, arrival: float = 0.0, **params) -> Req:
    params.setdefault("max_new_tokens", 16)  # small: admission reserves each request's expected decode growth
    return Req(rid=rid, prompt_ids=list(ids), params=SamplingParams(**params), sink=None, arrival=arrival)


def step(s: Scheduler):
    """schedule(), then what EngineCore does with the batch's requests (minus the forward), no request finished."""
    return scheduler_steps.step(s, finish=False)


def rows(b) -> list[tuple[str, int, int, bool]]:
    return [(r.rid, p, n, smp) for r, p, n, smp in zip(b.reqs, b.prefix_lens, b.num_tokens, b.sample)]


def finish(s: Scheduler, r: Req) -> None:
    s.remove(r)
    s.kv.check_integrity()


def test_long_prompt_is_chunked_to_the_budget_then_decodes_one_token_per_step():
    s = make_scheduler(chunked_prefill_tokens=8)
    a = req(range(10, 30), "a")  # 20 prompt tokens
    s.add(a)
    assert rows(step(s)) == [("a", 0, 8, False)]
    assert a.state is ReqState.RUNNING
    assert rows(step(s)) == [("a", 8, 8, False)]
    assert rows(step(s)) == [("a", 16, 4, True)]  # reaches the end of all_ids: a token is sampled
    assert rows(step(s)) == [("a", 20, 1, True)]  # decode
    assert a.output_ids == [SAMPLED, SAMPLED]
    finish(s, a)
    assert not s.has_work and a.state is ReqState.FINISHED


def test_budget_is_shared_running_first_and_decode_is_not_charged():
    s = make_scheduler(chunked_prefill_tokens=10)
    a = req(range(100, 104), "a")
    s.add(a)
    step(s)  # a prefilled (4 tokens), now decoding
    b, c = req(range(200, 216), "b", arrival=1.0), req(range(300, 316), "c", arrival=2.0)
    s.add(b)
    s.add(c)
    assert rows(step(s)) == [("a", 4, 1, True), ("b", 0, 10, False)]  # decode costs no prefill budget
    assert rows(step(s)) == [("a", 5, 1, True), ("b", 10, 6, True), ("c", 0, 4, False)]
    for r in (a, b, c):
        finish(s, r)


def test_max_running_requests_caps_admission():
    s = make_scheduler(max_running_requests=2)
    reqs = [req(range(10 * i, 10 * i + 5), f"r{i}", arrival=float(i)) for i in range(1, 4)]
    for r in reqs:
        s.add(r)
    b = step(s)
    assert [r.rid for r in b.reqs] == ["r1", "r2"] and [r.rid for r in s.waiting] == ["r3"]
    finish(s, reqs[0])
    assert [r.rid for r in step(s).reqs] == ["r2", "r3"]
    for r in reqs[1:]:
        finish(s, r)


def test_shared_uncached_prefix_is_prefilled_once():
    """Two arrivals share a 40-token prefix nobody has computed: the second waits one step, then reuses the
    first's published chunk instead of computing it again."""
    shared = list(range(1000, 1040))
    assert len(shared) >= PREFIX_DEDUP_MIN_TOKENS
    s = make_scheduler()
    a, b = req(shared + [1, 2], "a", arrival=1.0), req(shared + [5, 6], "b", arrival=2.0)
    s.add(a)
    s.add(b)
    assert [r.rid for r in step(s).reqs] == ["a"]  # b held back; a's prefill is published after the step
    b2 = step(s)
    assert rows(b2) == [("a", 42, 1, True), ("b", 40, 2, True)]
    assert b.num_cached_tokens == 40
    finish(s, a)
    finish(s, b)


def test_without_dedup_both_prefill_the_shared_prefix():
    shared = list(range(1000, 1040))
    s = make_scheduler(dedup_shared_prefill=False)
    a, b = req(shared + [1, 2], "a", arrival=1.0), req(shared + [5, 6], "b", arrival=2.0)
    s.add(a)
    s.add(b)
    assert rows(step(s)) == [("a", 0, 42, True), ("b", 0, 42, True)]
    finish(s, a)
    finish(s, b)


def test_out_of_memory_retracts_lowest_priority_and_it_resumes_on_its_published_kv():
    s = make_scheduler(num_slots=28, chunked_prefill_tokens=64)  # 27 usable slots
    s.estimate.ratio = 0.0  # an estimate that is too low (one token each): the pool runs out while they decode
    a = req(range(100, 110), "a", arrival=1.0, priority=1)
    b = req(range(200, 210), "b", arrival=2.0)
    c = req(range(300, 302), "c", arrival=3.0, priority=1)
    for r in (a, b, c):
        s.add(r)
    b1 = step(s)
    assert [r.rid for r in b1.reqs] == ["a", "c", "b"]  # priority first; 22 of 27 slots used, 1 reserved each
    step(s)  # 3 decode tokens: 25 of 27
    b_slots = s.kv.slots_of(b, 0, 11)  # b's K/V: 10 prompt tokens and its first output
    assert rows(step(s)) == [("a", 11, 1, True), ("c", 3, 1, True)]  # 3 more would make 28 > 27: one must go
    victims = [r.rid for r in s.waiting]
    assert victims == ["b"]  # lowest priority first
    assert b.retractions == 1 and b.state is ReqState.WAITING and b.row is None
    assert s.retracted_total == 1 and s.estimate.ratio > 0  # the estimate steps up after a retraction
    assert b.output_ids == [SAMPLED, SAMPLED]  # keeps its output
    # Its 11 computed tokens were published, not freed: a's and c's decode took the 2 free slots, none of them.
    assert s.kv.free_tokens == 0 and s.kv.evictable_tokens == 11
    finish(s, a)
    finish(s, c)
    resumed = step(s)
    assert rows(resumed) == [("b", 11, 1, True)]  # all 11 tokens' K/V reused: only its last output is computed
    assert b.cached_len == 11 and s.kv.slots_of(b, 0, 11) == b_slots  # the very slots it computed
    finish(s, b)


def test_retracted_kv_evicted_for_the_others_is_computed_again_whole():
    """The same three requests on 25 usable slots: a's and c's decode after the retraction needs 2 slots and
    none is free, so b's published node (11 tokens, one leaf) is evicted and b resumes from nothing."""
    s = make_scheduler(num_slots=26, chunked_prefill_tokens=64)
    s.estimate.ratio = 0.0
    a = req(range(100, 110), "a", arrival=1.0, priority=1)
    b = req(range(200, 210), "b", arrival=2.0)
    c = req(range(300, 302), "c", arrival=3.0, priority=1)
    for r in (a, b, c):
        s.add(r)
    step(s)
    step(s)
    assert rows(step(s)) == [("a", 11, 1, True), ("c", 3, 1, True)] and s.waiting == [b]
    assert s.kv.free_tokens == 9 and s.kv.evictable_tokens == 0  # b's 11 freed by eviction, 2 of them reused
    finish(s, a)
    finish(s, c)
    assert rows(step(s)) == [("b", 0, 12, True)]  # its prompt and both outputs' K/V computed again
    finish(s, b)


def test_retraction_picks_the_request_that_costs_least_to_resume():
    """Equal priority: the victim is the one with the fewest tokens of its own. A prefix shared with another
    running request is not its own (it stays in the pool), so a long request on a shared prefix can be the
    cheaper one to retract."""
    s = make_scheduler(num_slots=64, chunked_prefill_tokens=64)
    s.estimate.ratio = 0.0
    shared = list(range(1000, 1030))
    a = req(shared + [1, 2], "a", arrival=1.0)  # 30 shared + 2 own
    b = req(shared + [3, 4], "b", arrival=2.0)  # the same, arrived later
    c = req(range(300, 312), "c", arrival=0.5)  # 12 own tokens
    for r in (a, c):
        s.add(r)
    step(s)
    s.add(b)
    step(s)
    step(s)
    assert {r.rid for r in s.running} == {"a", "b", "c"}
    shared_of = s.kv.cache.shared_on_path
    own = {r.rid: r.kv_len - shared_of(r.cache_handle) for r in s.running}
    assert own["a"] < own["c"] and own["b"] < own["c"], own
    assert s._pick_victim() is b  # a and b cost the same: the latest arrival goes
    for r in (a, b, c):
        finish(s, r)


def test_admission_reserves_the_growth_of_running_requests():
    """A pool that cannot hold every request's prompt plus its decode runs fewer at once and never retracts
    (the old admission let them all in on their first chunk, then retracted while they decoded)."""
    s = make_scheduler(num_slots=101, chunked_prefill_tokens=64)  # 100 usable slots
    reqs = [req(range(100 * i, 100 * i + 20), f"r{i}", arrival=float(i), max_new_tokens=20, ignore_eos=True)
            for i in range(1, 5)]  # each needs 20 + 20 = 40 slots at its end
    for r in reqs:
        s.add(r)
    s.estimate.ratio = 1.0  # ignore_eos: every request uses its whole budget
    done = 0
    for _ in range(200):
        b = step(s)
        assert len(s.running) <= 2, "100 slots hold two requests' 40-slot futures, not three"
        for r in list(s.running):
            if len(r.output_ids) >= 20:
                finish(s, r)
                done += 1
        if not s.has_work:
            break
        assert not b.retracted
    assert done == 4 and s.retracted_total == 0


def test_a_request_alone_that_cannot_get_memory_is_finished_early():
    s = make_scheduler(num_slots=9, chunked_prefill_tokens=64)  # 8 usable slots
    a = req(range(100, 108), "a", ignore_eos=True)
    s.add(a)
    assert rows(step(s)) == [("a", 0, 8, True)]  # fills the pool exactly
    b = step(s)
    assert b.reqs == [] and b.finished_early == [a] and s.running == []
    finish(s, a)
    assert s.kv.free_tokens + s.kv.evictable_tokens == s.kv.total_tokens


def test_admission_stops_when_memory_runs_out_and_keeps_order():
    s = make_scheduler(num_slots=17, chunked_prefill_tokens=64)  # 16 usable slots
    a, b = req(range(100, 110), "a", arrival=1.0), req(range(200, 210), "b", arrival=2.0)
    s.add(a)
    s.add(b)
    assert [r.rid for r in step(s).reqs] == ["a"]  # b would need 10 more slots plus a's decode reserve
    assert s.waiting == [b] and b.row is None and s.kv.cache.locked_tokens == a.cached_len == 10  # only a holds locks
    finish(s, a)
    assert [r.rid for r in step(s).reqs] == ["b"]
    finish(s, b)


def test_uncached_prefix_index_answers_as_the_reference():
    """UncachedPrefixIndex.shares against Scheduler._shares_uncached_prefix over random leaders, requests,
    salts, lengths and matched positions, leaders added between questions."""
    import random

    from prefixrt.engine.loop.scheduler import UncachedPrefixIndex

    rng = random.Random(0)
    k = PREFIX_DEDUP_MIN_TOKENS
    for trial in range(40):
        base = [rng.randrange(3, 9) for _ in range(3 * k)]

        def make(i, base=base):
            cut = rng.randrange(len(base))
            ids = base[:cut] + [rng.randrange(3, 5) for _ in range(rng.randrange(2 * k))]
            r = req(ids or [3], f"r{i}")
            r.salt = rng.choice([None, "s"])
            return r

        leaders = [make(i) for i in range(rng.randrange(4))]
        index = UncachedPrefixIndex(leaders)
        for i in range(30):
            if rng.random() < 0.3:
                leader = make(100 + i)
                leaders.append(leader)
                index.add(leader)
            r = make(200 + i)
            matched = rng.choice([0, k, rng.randrange(len(r.all_ids) + 1)])
            assert index.shares(r, matched) == Scheduler._shares_uncached_prefix(r, matched, leaders), trial


def test_followers_of_a_shared_prefix_are_admitted_together_in_policy_order_with_their_rows():
    """The RAG shape: a leader prefills a shared prefix while its followers wait; the step after it is published
    admits every follower in policy order (lpm: equal matches, so arrival order), each row holding its cached
    prefix (copied from the first follower's row but the first) and its new tokens."""
    shared = list(range(1000, 1040))
    s = make_scheduler(num_slots=512, rows=8)
    leader = req(shared + [1, 2], "leader", arrival=0.0)
    followers = [req(shared + [10 + i, 20 + i], f"f{i}", arrival=1.0 + (5 - i) % 5) for i in range(5)]
    for r in [leader, *followers]:
        s.add(r)
    assert [r.rid for r in step(s).reqs] == ["leader"]
    b = step(s)
    expected = ["leader"] + [r.rid for r in sorted(followers, key=lambda r: r.arrival)]
    assert [r.rid for r in b.reqs] == expected
    assert all(r.num_cached_tokens == 40 for r in followers)
    assert s.waiting == []
    s.kv.table.flush()
    for r in followers:
        assert s.kv.table.table[r.row, :42].tolist() == s.kv.slots_of(r, 0, 42)
    for r in [leader, *followers]:
        finish(s, r)
    assert s.kv.cache.locked_tokens == 0
