"""Scheduling policies: lpm prefers cached prefixes, dfs keeps a subtree together, fcfs keeps arrival order,
aging puts any request waiting past the bound first, priority beats the policy key."""

from __future__ import annotations

from prefixrt.cache.allocator import PageAllocator, pages_to_slots
from prefixrt.cache.radix import RadixCache
from prefixrt.engine.loop.schedule_policy import order_waiting
from prefixrt.params import SamplingParams
from prefixrt.request import Req


def _req(rid, ids, arrival, priority=0):
    return Req(rid=rid, prompt_ids=ids, params=SamplingParams(priority=priority), sink=None, arrival=arrival)


def _cache(*prefixes):
    a = PageAllocator(4096, 1)
    c = RadixCache(a)
    for p in prefixes:
        c.insert(p, pages_to_slots(a.alloc(len(p)), 1))
    return c


def test_lpm_fcfs_and_aging():
    c = _cache(list(range(100, 140)))
    reqs = [_req("cold", [1, 2, 3], 0.0), _req("warm", list(range(100, 140)) + [7], 1.0),
            _req("half", list(range(100, 120)) + [8, 9], 2.0)]

    def match(r):
        return c.match_prefix(r.prompt_ids, None, len(r.prompt_ids) - 1)

    now = 3.0
    assert [r.rid for r in order_waiting(reqs, "lpm", match, now, aging_s=10)] == ["warm", "half", "cold"]
    assert [r.rid for r in order_waiting(reqs, "fcfs", match, now, aging_s=10)] == ["cold", "warm", "half"]
    # "cold" has waited 3 s: past a 2.5 s aging bound it goes first whatever the policy says.
    assert [r.rid for r in order_waiting(reqs, "lpm", match, now, aging_s=2.5)][0] == "cold"
    reqs.append(_req("urgent", [5, 5], 2.5, priority=5))
    assert order_waiting(reqs, "lpm", match, now, aging_s=10)[0].rid == "urgent"


def test_dfs_groups_requests_by_subtree():
    a_pre, b_pre = list(range(200, 230)), list(range(300, 330))
    c = _cache(a_pre, b_pre)
    reqs = [_req("a1", a_pre + [1], 0.0), _req("b1", b_pre + [1], 0.1), _req("a2", a_pre + [2], 0.2),
            _req("b2", b_pre + [2], 0.3), _req("a3", a_pre + [3], 0.4), _req("x", [9, 9, 9], 0.5)]

    def match(r):
        return c.match_prefix(r.prompt_ids, None, len(r.prompt_ids) - 1)

    order = [r.rid for r in order_waiting(reqs, "dfs", match, 1.0, aging_s=10)]
    assert order == ["a1", "a2", "a3", "b1", "b2", "x"]  # heavier subtree first, unmatched last


def test_keyed_sessions_go_least_attained_service_first():
    from prefixrt.engine.loop.sessions import SessionService
    from prefixrt.prompt_cache import PromptCache

    def keyed(rid, session, arrival):
        return Req(rid=rid, prompt_ids=[1, 2, 3], params=SamplingParams(prompt_cache=PromptCache(session)),
                   sink=None, arrival=arrival)

    c = _cache()

    def match(r):
        return c.match_prefix(r.prompt_ids, None, len(r.prompt_ids) - 1)

    svc = SessionService(max_sessions=3)
    long_turn, short_turn, plain = keyed("long", "agent-long", 0.0), keyed("short", "agent-short", 1.0), \
        _req("plain", [4, 5, 6], 2.0)
    svc.charge(keyed("l0", "agent-long", 0.0), 5000)  # the long agent's earlier turns
    svc.charge(keyed("s0", "agent-short", 0.0), 300)
    assert svc.service(long_turn) == 5000 and svc.service(plain) == 0
    for policy in ("lpm", "fcfs"):
        order = [r.rid for r in order_waiting([long_turn, short_turn, plain], policy, match, 3.0, 10, svc.service)]
        assert order == ["plain", "short", "long"], policy
        # without the service, arrival (fcfs) or the cached prefix (lpm, none here) decides
        assert [r.rid for r in order_waiting([long_turn, short_turn, plain], policy, match, 3.0, 10)] == [
            "long", "short", "plain"]
    # priority still beats service, and aging beats both
    urgent = Req(rid="urgent", prompt_ids=[1], sink=None, arrival=2.5,
                 params=SamplingParams(priority=1, prompt_cache=PromptCache("agent-long")))
    assert order_waiting([short_turn, urgent], "lpm", match, 3.0, 10, svc.service)[0].rid == "urgent"
    assert order_waiting([short_turn, long_turn], "lpm", match, 3.0, 2.5, svc.service)[0].rid == "long"
    for k in range(4):  # bounded: the least recently charged sessions are forgotten
        svc.charge(keyed(f"n{k}", f"new-{k}", 0.0), 1)
    assert len(svc) == 3 and svc.service(long_turn) == 0
