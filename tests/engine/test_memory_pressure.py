"""Concurrent agent sessions on a pool far smaller than their working set (CPU, fp32, tiny checkpoints).

The agent workload (bench/workloads.agent, shrunk): sessions over one shared context, each with its own, each
turn appending to the whole history, every session in flight at once. Oracle: the same sessions on a pool that
holds everything. Under test: budgeted admission (no thrashing), the host tier with prefetch (wait_complete and
best_effort), retraction to the host (forced by an estimate that is too low), and the load/compute ordering
with delayed copies and NaN-poisoned free slots (debug mode), so a forward reading a slot whose load is not done
changes the output. Every engine's pool and tier accounting is checked at teardown (make_engine).
"""

from __future__ import annotations

import asyncio

import pytest

from prefixrt.bench import workloads as W

GREEDY = {"temperature": 0, "ignore_eos": True}


def _workload():
    return W.agent(320, sessions=6, turns=4, shared_len=24, own_len=16, append_len=8, output_len=4, seed=3)


def _sessions(eng, w) -> list[list]:
    """Every session at once, each turn's prompt = the history so far + its new tokens. Returns each session's
    Completion per turn."""

    async def session(turns):
        history, outs = [], []
        for turn in turns:
            prompt = history + turn.new_tokens
            c = await eng.agenerate(prompt, {"max_new_tokens": turn.max_new_tokens, **GREEDY})
            outs.append(c)
            history = prompt + c.token_ids
        return outs

    async def go():
        return await asyncio.gather(*(session(s) for s in w.sessions))

    return asyncio.run(go())


def _run(eng, w) -> tuple[list[list[list[int]]], float]:
    """_sessions' outputs: each session's token ids per turn, and the cache hit rate over all prompts."""
    sessions = _sessions(eng, w)
    prompt_tokens = sum(c.prompt_tokens for s in sessions for c in s)
    return [[c.token_ids for c in s] for s in sessions], sum(c.cached_tokens for s in sessions for c in s) / prompt_tokens


def _pool(w, fraction: float) -> int:
    return int(W.working_set_tokens(w) * fraction)


@pytest.fixture(scope="module")
def unbounded(tiny_checkpoints, tiny_tokenizer):
    from types import SimpleNamespace

    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    path, _ = tiny_checkpoints("llama")
    resolved = SimpleNamespace(name="tiny-llama", revision="test", extra_eos_token_ids=(), path=str(path))
    eng = Engine("tiny-llama", _parts=(load_model(path, dtype="float32", device="cpu"), tiny_tokenizer, resolved),
                 device="cpu", kv_cache_tokens=4096, chunked_prefill_tokens=16)
    try:
        yield _run(eng, _workload())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("prefetch", ["wait_complete", "best_effort", "off"])
def test_host_tier_under_pressure_equals_unbounded_pool(prefetch, unbounded, make_engine):
    w = _workload()
    want, hit = unbounded
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048,
                      chunked_prefill_tokens=16, host_kv_prefetch=prefetch, host_kv_debug_delay_s=0.0005)
    got, tier_hit = _run(eng, w)
    assert got == want
    assert tier_hit >= 0.95 * hit, (tier_hit, hit)
    s = eng.stats()
    assert s.host_hit_tokens_total > 0 and s.retracted_requests_total == 0 and s.host_load_failures_total == 0
    if prefetch == "wait_complete":  # (best_effort prefetches only what cannot run yet: none here, maybe)
        assert s.host_prefetch_hits_total > 0
    if prefetch == "off":
        assert s.host_prefetch_tokens_total == 0


def test_no_tier_under_pressure_equals_unbounded_pool_without_retraction(unbounded, make_engine):
    w = _workload()
    want, _ = unbounded
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), chunked_prefill_tokens=16)
    got, _ = _run(eng, w)
    assert got == want
    assert eng.stats().retracted_requests_total == 0  # admission within the budget: fewer at once, none retracted


def test_retract_to_host_keeps_the_retracted_kv(make_engine, underestimated_decode, monkeypatch):
    from prefixrt.cache.tiered_radix import TieredRadixCache

    """An estimate far too low lets too many in; they are retracted while decoding, and their K/V goes to the
    host tier (whatever the write policy: write_through_selective would drop a node hit fewer than 8 times) and
    loads back when they resume."""
    w = W.agent(320, sessions=6, turns=3, shared_len=16, own_len=12, append_len=8, output_len=20, seed=4)
    want, hit = _run(make_engine("llama", kv_cache_tokens=4096, chunked_prefill_tokens=16), w)
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16,
                      host_kv_write_policy="write_through_selective", host_kv_write_threshold=8,
                      host_kv_debug_delay_s=0.0005)
    got, tier_hit = _run(eng, w)
    assert got == want
    s = eng.stats()
    assert s.retracted_requests_total > 0 and s.retracted_to_host_tokens_total > 0
    # The same without the copy at retraction: the retracted K/V is dropped on eviction and recomputed.
    monkeypatch.setattr(TieredRadixCache, "backup_path", lambda self, handle: 0)
    eng2 = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16,
                       host_kv_write_policy="write_through_selective", host_kv_write_threshold=8)
    got2, dropped_hit = _run(eng2, w)
    assert got2 == want
    # (Which run hits more depends on when each retraction lands, so the two hit rates are not compared; what the
    # copy at retraction must do is give the retracted K/V a host copy that admissions load back.)
    assert s.host_hit_tokens_total > 0 and s.host_load_bytes_total > 0, (tier_hit, dropped_hit, hit)
    assert eng2.stats().retracted_to_host_tokens_total == 0


def _without_load_waits(monkeypatch, check: bool) -> None:
    """Forwards no longer wait for the loads in flight into their paths; check=False: nor does debug mode's
    LoadWaiter.check notice."""
    from prefixrt.cache.transfer import LoadWaiter

    monkeypatch.setattr(LoadWaiter, "wait", lambda self, layer: None)
    monkeypatch.setattr(LoadWaiter, "wait_all", lambda self: None)
    if not check:
        monkeypatch.setattr(LoadWaiter, "check", lambda self: None)


def _slow_loads_engine(make_engine, w):
    return make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16,
                       host_kv_prefetch="best_effort", host_kv_debug_delay_s=0.02)


def test_a_forward_not_waiting_for_its_load_reads_poisoned_slots(unbounded, make_engine, monkeypatch):
    """The contract the per-request waits keep: with them (and debug mode's check) disabled, a turn whose prefill
    reads fresh slots before their slow load lands reads debug mode's NaN poison. Its logits are NaN from its first
    token (greedy argmax: token 0), and so are every later turn's of that session (the history's K/V holds the
    NaN). So each session is the unbounded pool's turns up to some turn, then turns of zeros; at least one session
    has such a turn, and no request fails."""
    w = _workload()
    want, _ = unbounded
    _without_load_waits(monkeypatch, check=False)
    sessions = _sessions(_slow_loads_engine(make_engine, w), w)
    assert [c.error for s in sessions for c in s] == [None] * sum(len(s) for s in sessions)
    got = [[c.token_ids for c in s] for s in sessions]
    poisoned = 0
    for outs, ref in zip(got, want):
        k = next((i for i, (a, b) in enumerate(zip(outs, ref)) if a != b), len(ref))
        assert outs == ref[:k] + [[0] * len(t) for t in ref[k:]], (outs, ref)
        poisoned += k < len(ref)
    assert poisoned > 0, "no turn read a slot before its load landed"


def test_debug_mode_aborts_a_forward_that_did_not_wait_for_its_loads(make_engine, monkeypatch):
    """Debug mode's LoadWaiter.check: a forward launched with loads in flight that skipped their waits aborts its
    requests with an error naming the layers (no exception reaches the caller, no other error)."""
    w = _workload()
    _without_load_waits(monkeypatch, check=True)
    sessions = _sessions(_slow_loads_engine(make_engine, w), w)
    errors = [c.error for s in sessions for c in s if c.error is not None]
    assert errors, "no forward ran with a load in flight"
    assert set(errors) == {"internal error in forward: layers [0, 1] read the pool without waiting for the loads in "
                           "flight"}


def test_host_tier_larger_than_the_machine_is_refused(make_engine, monkeypatch):
    from prefixrt.cache import host_pool

    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: (6 * 2**30, 16 * 2**30))
    with pytest.raises(ValueError, match=r"needs .* GiB of host memory but this machine has 6.0 GiB available"):
        make_engine("llama", kv_cache_tokens=256, host_kv_cache_tokens=10**9)


def test_tier_metrics_agree_with_stats(make_engine):
    """/metrics shows the tier's figures an operator needs: per-tier hit rates, copy bandwidth, prefetch hits and
    misses, retract-to-host tokens, each equal to what stats() says."""
    from prometheus_client.parser import text_string_to_metric_families

    from prefixrt.engine.metrics import Metrics, tier_hit_rates

    w = _workload()
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16)
    _run(eng, w)
    s = eng.stats()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for fam in text_string_to_metric_families(Metrics.for_engine(eng).render().decode()) for x in fam.samples}
    assert samples[("prefixrt_host_prefetch_hits_total", ())] == s.host_prefetch_hits_total > 0
    assert samples[("prefixrt_host_prefetch_misses_total", ())] == s.host_prefetch_misses_total
    assert samples[("prefixrt_retracted_to_host_tokens_total", ())] == s.retracted_to_host_tokens_total
    rates = tier_hit_rates(s)
    assert rates["host"] > 0 and rates["pool"] > 0
    assert abs(sum(rates.values()) - s.cache_hit_rate) < 1e-9
    for tier, rate in rates.items():
        assert samples[("prefixrt_tier_hit_rate", (("tier", tier),))] == pytest.approx(rate)
    gbps = samples[("prefixrt_host_copy_gbps", (("direction", "load"),))]
    assert gbps == pytest.approx(s.host_load_bytes_total / s.host_load_seconds_total / 1e9)


def test_preemption_for_first_tokens_equals_unbounded_pool(unbounded, make_engine):
    """A new request that waited for memory preempts running requests that have streamed: they go to the host
    tier mid-decode and resume later, and every output stays exact."""
    w = _workload()
    want, hit = unbounded
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16,
                      host_kv_preempt_after_s=0.0, host_kv_debug_delay_s=0.0005)
    got, tier_hit = _run(eng, w)
    assert got == want
    s = eng.stats()
    assert s.preempted_requests_total > 0 and s.host_hit_tokens_total > 0  # (write_through: copies exist already)
    assert tier_hit >= 0.95 * hit, (tier_hit, hit)
