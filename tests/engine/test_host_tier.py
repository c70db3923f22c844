"""The host tier of the KV cache (cache/tiered_radix.py) end to end on tiny checkpoints (CPU, fp32).

Oracle: the same greedy requests on an engine whose pool holds everything and reuses nothing. The tiered
engine's pool is far smaller than the working set, so prefixes move to the host tier and load back; race mode
delays every layer of every copy and debug mode poisons freed slots with NaN, so a read of a slot whose load
is not done, or a slot reused while a copy is pending, changes the output (or trips the checker).
"""

from __future__ import annotations

import random
import time

import pytest

from tests.engine.test_engine import _tree_workload

GREEDY = {"temperature": 0, "ignore_eos": True}
POLICIES = ["write_through", "write_through_selective", "write_back"]


def _multi_turn(num_convs: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Conversations: each turn's prompt extends the previous turn's prompt by new user tokens."""
    rng = random.Random(seed)
    convs = []
    for _ in range(num_convs):
        p = [1] + [rng.randrange(3, 320) for _ in range(rng.randint(10, 20))]
        conv = []
        for _ in range(turns):
            conv.append(list(p))
            p = p + [rng.randrange(3, 320) for _ in range(rng.randint(4, 12))]
        convs.append(conv)
    return convs


def _tiered(make_engine, policy, **kw):
    kw.setdefault("kv_cache_tokens", 192)
    kw.setdefault("host_kv_cache_tokens", 4096)
    kw.setdefault("chunked_prefill_tokens", 16)
    return make_engine("llama", host_kv_write_policy=policy, host_kv_write_threshold=1, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_tree_workload_equals_unbounded_pool_in_race_mode(policy, make_engine, underestimated_decode):
    prompts = _tree_workload(60, seed=7)
    params = {"max_new_tokens": 16, **GREEDY}
    ref = make_engine("llama", radix_cache=False, kv_cache_tokens=8192, chunked_prefill_tokens=16)
    want = [c.token_ids for c in ref.generate(prompts, params)]
    eng = _tiered(make_engine, policy, host_kv_debug_delay_s=0.0005)
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert got == want
    # One by one: later requests hit prefixes the small pool evicted to the host tier long ago.
    got_seq = [eng.generate(p, params).token_ids for p in prompts[:30]]
    assert got_seq == want[:30]
    s = eng.stats()
    assert s.evicted_tokens_total > 0 and s.retracted_requests_total > 0
    assert s.host_hit_tokens_total > 0, "the workload was meant to load prefixes back from the host tier"
    assert s.host_load_bytes_total > 0 and s.host_backup_bytes_total > 0
    eng.check_integrity()


@pytest.mark.parametrize("policy, overlap", [(p, False) for p in POLICIES] + [("write_back", True)])
def test_multi_turn_equals_unbounded_pool_with_aborts_in_race_mode(policy, overlap, make_engine):
    """Turn t of every conversation runs together; between turns other conversations push the earlier turns'
    K/V out of the small pool, so turn t+1 finds its history in the host tier. Aborted streams are mixed in."""
    convs = _multi_turn(8, 4, seed=11)
    params = {"max_new_tokens": 6, **GREEDY}
    ref = make_engine("llama", radix_cache=False, kv_cache_tokens=8192)
    eng = _tiered(make_engine, policy, host_kv_debug_delay_s=0.0005, overlap_schedule=overlap)
    aborted = 0
    for t in range(4):
        prompts = [c[t] for c in convs]
        want = [c.token_ids for c in ref.generate(prompts, params)]
        victims = [eng.stream(p[: len(p) - 3] + [7, 7, 7], {"max_new_tokens": 40, "request_id": f"v{t}-{i}", **GREEDY})
                   for i, p in enumerate(prompts[:3])]
        for i, it in enumerate(victims):
            next(it)
            if i % 2:
                time.sleep(0.003)
            eng.abort(f"v{t}-{i}")
            aborted += [c.finish_reason for c in it][-1:] == ["abort"]  # (a fast one may finish first)
        got = [c.token_ids for c in eng.generate(prompts, params)]
        assert got == want, f"turn {t}"
    s = eng.stats()
    assert s.host_hit_tokens_total > 0 and s.aborted_requests_total == aborted >= 6
    assert s.cached_tokens_total > s.host_hit_tokens_total  # both tiers served hits
    eng.check_integrity()


def test_missing_layer_wait_reads_unloaded_slots(make_engine, monkeypatch):
    """The race the waits prevent: with the per-layer wait disabled, delayed loads and NaN-poisoned fresh
    slots, a hit on the host tier reads K/V that is not there yet and the output changes (or the forward
    fails its check and the request aborts)."""
    from prefixrt.cache.transfer import LoadWaiter

    prompt = [1] + [random.Random(5).randrange(3, 320) for _ in range(60)]
    params = {"max_new_tokens": 6, **GREEDY}
    ref = make_engine("llama", radix_cache=False)
    want = ref.generate(prompt, params).token_ids
    eng = make_engine("llama", kv_cache_tokens=96, host_kv_cache_tokens=1024, host_kv_write_policy="write_back",
                      host_kv_debug_delay_s=0.05, debug=False)
    eng.generate(prompt, params)
    eng.generate([1] + [random.Random(6).randrange(3, 320) for _ in range(80)], params)  # evicts to the host
    monkeypatch.setattr(LoadWaiter, "wait", lambda self, layer: None)
    got = eng.generate(prompt, params)
    assert got.cached_tokens > 0 and eng.stats().host_hit_tokens_total > 0
    assert got.token_ids != want


def test_flush_frees_pages_whose_backup_is_still_copying(make_engine):
    """flush_cache() evicts pool nodes whose backup to the host may still be copying (race mode makes every copy
    slow): their pages are free when it returns, not held until a step that an idle engine never runs."""
    eng = _tiered(make_engine, "write_through", host_kv_debug_delay_s=0.02)
    rng = random.Random(3)
    for _ in range(3):
        eng.generate([1] + [rng.randrange(3, 320) for _ in range(40)], {"max_new_tokens": 2, **GREEDY})
    eng.flush_cache()
    s = eng.stats()
    assert s.kv_locked == 0 and s.kv_free == s.kv_total, s
