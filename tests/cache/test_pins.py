"""Kept prefixes (cache/pins.py) on hand-built requests: a pinned prefix survives floods of the pool (no host tier)
and of both tiers (host tier: it moves there and comes back with its K/V intact); an unpinned one is evicted;
lifetimes end; the per-tenant and total limits refuse keeps; a re-pin refreshes one pin; accounting
(free + evictable + locked + pinned + private == total, pinned tokens per salt) holds after every step."""

from __future__ import annotations

from prefixrt.prompt_cache import KeepPrefix, PromptCache
from tests.cache.test_kv_manager import compute as compute_pool
from tests.cache.test_kv_manager import make_kv as make_pool_kv
from tests.cache.test_kv_manager import req
from tests.cache.test_tiered_radix import assert_row_holds, compute
from tests.cache.test_tiered_radix import make_kv as make_tiered_kv


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def finish(kv, ids, rid, keep=(), salt=None):
    """A request through admission, its forward and its last release, with kept prefixes `keep` granted first."""
    r = req(ids, rid=rid, salt=salt)
    grant = kv.pins.grant(r.prompt_ids, r.salt, tuple(keep))
    r.keep_grant = grant if grant.kept else None
    kv.admit(r)
    (compute if kv.tiered is not None else compute_pool)(kv, r)
    kv.release(r, final=True)
    kv.check_integrity()
    return r, grant


def cached(kv, ids, salt=None):
    m = kv.cache.match_prefix(ids, salt)
    return m.length + m.host_length


def test_pinned_prefix_survives_a_pool_flood_and_the_unpinned_one_is_evicted():
    kv = make_pool_kv(num_slots=64)
    kv.pins.clock = clock = Clock()
    kept, other = list(range(1000, 1012)), list(range(2000, 2012))
    _, grant = finish(kv, kept, "a", keep=[KeepPrefix(12, 60.0)])
    assert grant.report() == {"kept_tokens": 12, "refused_tokens": 0, "reason": None}
    finish(kv, other, "b")
    assert kv.pinned_tokens == 12 and kv.pins.num_pins == 1
    for k in range(6):  # each flood request needs most of the pool
        finish(kv, list(range(3000 + 100 * k, 3040 + 100 * k)), f"f{k}")
    assert cached(kv, kept) == 12 and cached(kv, other) == 0
    clock.now += 61  # the lifetime ends: the prefix is an ordinary LRU entry again
    assert kv.pins.expire() == 1 and kv.pinned_tokens == 0 and kv.pins.num_pins == 0
    kv.check_integrity()
    finish(kv, list(range(5000, 5060)), "g")
    assert cached(kv, kept) == 0


def test_pinned_prefix_moves_to_the_host_tier_survives_its_flood_and_loads_back_exactly():
    kv = make_tiered_kv(pool_tokens=16, host_tokens=32)
    kept, other = list(range(100, 108)), list(range(200, 208))
    finish(kv, kept, "a", keep=[KeepPrefix(8, 60.0)])
    finish(kv, other, "b")
    for k in range(8):  # overflows the pool and the host tier several times over
        finish(kv, list(range(1000 + 100 * k, 1014 + 100 * k)), f"f{k}")
    assert cached(kv, kept) == 8 and cached(kv, other) == 0
    assert kv.pinned_tokens == 0  # a host tier keeps pins: they hold no pool memory
    gpu, host = kv.pins.tier_tokens()
    assert host == 8 and gpu in (0, 8)
    r = req(kept + [999], rid="again")
    kv.admit(r)
    assert r.cached_len == 8
    assert_row_holds(kv, r, kept)
    kv.release(r, final=True)
    kv.check_integrity()


def test_tenant_limit_refuses_a_keep_and_the_total_limit_too():
    kv = make_pool_kv(num_slots=64)
    kv.pins.per_salt_tokens, kv.pins.capacity_tokens = 16, 32
    _, g = finish(kv, list(range(10, 22)), "a", keep=[KeepPrefix(12, 60.0)], salt="t1")
    assert g.report()["kept_tokens"] == 12
    _, g = finish(kv, list(range(30, 40)), "b", keep=[KeepPrefix(4, 60.0), KeepPrefix(10, 60.0)], salt="t1")
    assert g.report() == {"kept_tokens": 4, "refused_tokens": 10, "reason": "tenant_limit"}
    assert kv.pins.pinned_by_salt() == {"t1": 16}
    _, g = finish(kv, list(range(50, 66)), "c", keep=[KeepPrefix(16, 60.0)], salt="t2")
    assert g.report()["kept_tokens"] == 16
    _, g = finish(kv, list(range(70, 74)), "d", keep=[KeepPrefix(4, 60.0)], salt="t3")
    assert g.report() == {"kept_tokens": 0, "refused_tokens": 4, "reason": "capacity"}
    assert kv.pins.refused_total == 2 and kv.pins.granted_total == 3


def test_a_conversation_re_pins_its_growing_prefix_and_a_repeat_refreshes_one_pin():
    kv = make_pool_kv(num_slots=64)
    kv.pins.clock = clock = Clock()
    kv.pins.per_salt_tokens = 32
    turn1 = list(range(10, 20))
    finish(kv, turn1, "t1", keep=[KeepPrefix(10, 30.0)])
    clock.now += 20
    finish(kv, turn1, "t1b", keep=[KeepPrefix(10, 30.0)])  # the same prefix again: one pin, a later end
    assert kv.pins.num_pins == 1 and kv.pins.refreshed_total == 1
    clock.now += 20  # past the first end, before the refreshed one
    assert kv.pins.expire() == 0 and kv.pinned_tokens == 10
    turn2 = turn1 + list(range(50, 56))
    finish(kv, turn2, "t2", keep=[KeepPrefix(16, 30.0)])
    assert kv.pins.num_pins == 2 and kv.pinned_tokens == 16  # nested: the tokens count once
    assert kv.pins.pinned_by_salt() == {None: 16}
    clock.now += 31
    assert kv.pins.expire() == 2 and kv.pinned_tokens == 0


def test_a_keep_longer_than_what_ran_pins_only_the_published_part_and_an_abort_before_running_releases_it():
    kv = make_pool_kv(num_slots=64)
    r = req(list(range(10, 20)), rid="a")
    r.keep_grant = kv.pins.grant(r.prompt_ids, None, (KeepPrefix(10, 60.0),))
    assert kv.pins._reserved == {None: 10}
    kv.release(r, final=True)  # never admitted (aborted while waiting)
    assert kv.pins._reserved == {} and kv.pins.num_pins == 0
    kv.check_integrity()


def test_flush_drops_pins_and_the_idle_invariant_holds():
    kv = make_pool_kv(num_slots=64)
    finish(kv, list(range(10, 20)), "a", keep=[KeepPrefix(10, 60.0)])
    assert kv.free_tokens + kv.evictable_tokens + kv.pinned_tokens == kv.total_tokens
    kv.flush()
    assert kv.pins.num_pins == 0 and kv.pinned_tokens == 0 and kv.free_tokens == kv.total_tokens
    kv.check_integrity()


def test_prompt_cache_record_normalises_and_checks():
    pc = PromptCache("s", ({"num_tokens": 8, "ttl_s": 60}, KeepPrefix(4, 300.0), KeepPrefix(8, 3600.0)))
    assert pc.keep == (KeepPrefix(4, 300.0), KeepPrefix(8, 3600.0)) and pc.longest_keep == 8
    import pytest

    from prefixrt.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        PromptCache(None, tuple(KeepPrefix(k + 1, 1.0) for k in range(5)))
    with pytest.raises(InvalidRequest):
        PromptCache(None, (KeepPrefix(0, 1.0),))
    with pytest.raises(InvalidRequest):
        PromptCache("", ())
