"""Tenant fairness in the cache (max_cached_fraction_per_salt): a tenant flooding unique prompts cannot push
another tenant's hot prefix out of the pool. Oracle: the hot tenant's reused tokens in a run without the flood
(the quota must keep >= 95% of them), and the same flood without a quota (which does push the prefix out)."""

from __future__ import annotations

import random

import pytest

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2}


def _hot_hits(eng, flood: bool, seed: int = 0) -> int:
    rng = random.Random(seed)
    hot = [1] + [rng.randrange(3, 320) for _ in range(64)]
    hits = 0
    for i in range(8):
        c = eng.generate(hot + [rng.randrange(3, 320) for _ in range(4)], {"cache_salt": "hot", **GREEDY})
        hits += c.cached_tokens if i else 0  # the first request fills the cache
        if flood:
            eng.generate([[1] + [rng.randrange(3, 320) for _ in range(90)] for _ in range(3)],
                         {"cache_salt": "flood", **GREEDY})
        eng.check_integrity()
    return hits


@pytest.mark.parametrize("host_tier", [False, True])
def test_flooding_tenant_cannot_evict_another_tenants_hot_prefix(host_tier, make_engine):
    kw = dict(kv_cache_tokens=320, chunked_prefill_tokens=64)
    if host_tier:  # the quota applies to the pool tier (a host tier too small for the hot prefix)
        kw.update(host_kv_cache_tokens=16, host_kv_write_policy="write_back")
    base = _hot_hits(make_engine("llama", **kw), flood=False)
    assert base == 7 * 65  # the hot prefix ([1] + 64 tokens) on every later request
    unfair = _hot_hits(make_engine("llama", **kw), flood=True)
    fair_eng = make_engine("llama", max_cached_fraction_per_salt=0.5, **kw)
    fair = _hot_hits(fair_eng, flood=True)
    assert unfair < 0.5 * base, "the flood was meant to push the hot prefix out without a quota"
    assert fair >= 0.95 * base
    usage = fair_eng._run_on_loop(lambda: fair_eng.core.kv.cache.salt_usage())
    assert set(usage) >= {"hot", "flood"}
