"""Speculative decoding in the engine: greedy outputs with each drafter are token-identical to no speculation
(stop strings, constrained requests with and without jump-forward, n > 1, logprobs, aborts, eviction and
retraction under a small pool), max_tokens is never passed, sampled rows keep the target distribution, a
multi-turn workload keeps its cache hit rate, requests may opt out, and off by default changes nothing."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import _tree_workload
from tests.engine.test_overlap import SCHEMA, _logprobs, _run_mixed, _summary
from tests.speculative.test_rejection import chi_square_pvalue

GREEDY = {"temperature": 0, "ignore_eos": True}


def _params(i: int) -> dict:
    base = {"max_new_tokens": 20, **GREEDY}
    kind = i % 7
    if kind == 1:
        return {**base, "stop": ["e", "th"]}
    if kind == 2:
        return {**base, "json_schema": SCHEMA, "max_new_tokens": 32}
    if kind == 3:
        return {**base, "regex": r"[0-9]{3}-[0-9]{4}", "jump_forward": False}  # forced tokens become drafts
    if kind == 4:
        return {**base, "n": 2, "max_new_tokens": 9}
    if kind == 5:
        return {**base, "logprobs": 2, "repetition_penalty": 1.3}
    return base


def _run(eng, prompts, aborts=()):
    return _run_mixed(eng, prompts, set(aborts), _params)


def _repetitive(prompts):
    """Prompts whose tail repeats an earlier span, so the n-gram drafter has something to draft from the start."""
    return [p + p[1:12] + p[1:6] for p in prompts]


@pytest.mark.parametrize("spec", ["ngram", "fixed:0.7"])
def test_greedy_outputs_identical_to_no_speculation(spec, make_engine, underestimated_decode):
    prompts = _repetitive([p[:40] for p in _tree_workload(70, seed=5)])
    aborts = set(range(6, 70, 13))
    small = dict(kv_cache_tokens=240, chunked_prefill_tokens=16)
    ref = make_engine("llama", **small)
    want = _run(ref, prompts, aborts)
    eng = make_engine("llama", speculative=spec, **small)
    if spec.startswith("fixed"):  # the test drafter learns the target's greedy outputs from a first pass
        _run(eng, prompts)
        before = eng.stats()
    got = _run(eng, prompts, aborts)
    s = eng.stats()
    assert s.evicted_tokens_total > 0 and s.retracted_requests_total > 0  # the small pool was exercised
    assert s.spec_accepted_tokens_total > 50 and s.spec_draft_tokens_total > s.spec_accepted_tokens_total
    assert s.spec_tokens_per_forward > 1.2
    if spec.startswith("fixed"):
        assert s.spec_draft_tokens_total > before.spec_draft_tokens_total
    for i in range(len(prompts)):
        if i in aborts:
            continue
        assert _summary(got[i]) == _summary(want[i]), (i, _params(i))
        assert _logprobs(got[i]) == pytest.approx(_logprobs(want[i]), abs=1e-4)
        outs = got[i].outputs or [got[i]]
        assert all(len(o.token_ids) <= _params(i)["max_new_tokens"] for o in outs)
    assert any(c.finish_reason == "stop" and c.matched_stop in ("e", "th") for c in want if not isinstance(c, list))
    full_ref = make_engine("llama")
    for i in sorted(aborts)[:3]:  # aborted streams: each sample a prefix of the same request run to the end
        full = full_ref.generate(prompts[i], _params(i))
        for j, ref_out in enumerate(full.outputs or [full]):
            chunks = [ch for ch in got[i] if ch.index == j]
            toks = [t for ch in chunks for t in ch.token_ids]
            assert toks == ref_out.token_ids[: len(toks)]
            assert not chunks or chunks[-1].finish_reason in (None, "abort", ref_out.finish_reason)


@pytest.mark.parametrize("fast", [True, False])
def test_max_tokens_and_stop_token_inside_accepted_drafts(fast, make_engine, monkeypatch):
    """Drafts that would run past max_tokens are never drafted; a stop token accepted mid-chain ends the request
    there, the tokens after it are not emitted. Both with plain greedy rows on the fast path (argmaxes of the
    step at once) and on the reference (position by position through the sampler)."""
    if not fast:
        from prefixrt.engine.loop.speculate import Speculator

        monkeypatch.setattr(Speculator, "plain_greedy", staticmethod(lambda r: False))
    prompt = [1] + list(range(40, 60)) * 3
    ref = make_engine("llama")
    eng = make_engine("llama", speculative="ngram")
    for n in (1, 2, 3, 7):
        p = {"max_new_tokens": n, **GREEDY}
        assert eng.generate(prompt, p).token_ids == ref.generate(prompt, p).token_ids
    free = ref.generate(prompt, {"max_new_tokens": 16, **GREEDY}).token_ids
    stop_tok = free[5]
    p = {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [stop_tok]}
    a, b = eng.generate(prompt, p), ref.generate(prompt, p)
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"


def test_sampled_rows_keep_the_target_distribution(make_engine):
    """Engine level: the joint distribution of three sampled tokens (top_k 3, so 27 outcomes) with radix-lookahead
    drafts (the greedy answer is cached first, so drafts come from the tree) against plain decoding, over many
    seeds: a two-sample chi-square test."""
    prompt = [1, 17, 23, 99, 140, 7, 200, 31]
    params = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 3, "ignore_eos": True}
    counts = {}
    for spec in (None, "ngram"):
        eng = make_engine("llama", speculative=spec, speculative_max_batch=256)  # 200 rows at a time
        eng.generate(prompt, {"max_new_tokens": 8, **GREEDY})  # its continuation enters the tree
        outs = [o for seed in (1, 2) for o in eng.generate(prompt, {**params, "n": 200, "seed": seed}).outputs]
        c: dict = {}
        for o in outs:
            c[tuple(o.token_ids)] = c.get(tuple(o.token_ids), 0) + 1
        counts[spec] = c
        if spec:
            assert eng.stats().spec_draft_tokens_total > 100
    keys = sorted(set(counts[None]) | set(counts["ngram"]))
    table = torch.tensor([[counts[s].get(k, 0) for k in keys] for s in (None, "ngram")], dtype=torch.float64)
    keep = table.sum(0) >= 10  # pool the rare outcomes
    table = torch.cat([table[:, keep], table[:, ~keep].sum(1, keepdim=True)], 1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    # a 2 x m contingency table: m - 1 degrees of freedom
    p = chi_square_pvalue(table.flatten(), expected.flatten(), df=table.shape[1] - 1)
    assert p > 1e-3, (p, table)


def test_multi_turn_cache_hit_rate_kept(make_engine):
    """A multi-turn workload (each turn = the previous prompt + its answer + a new user message): the cache hit
    rate with speculation is within 1 point of without (here: equal), and the answers are the same."""
    import random

    rng = random.Random(0)
    rates, answers = {}, {}
    for spec in (None, "ngram"):
        eng = make_engine("llama", speculative=spec, kv_cache_tokens=2048)
        convs = [[1] + [rng.randrange(3, 320) for _ in range(12)] for _ in range(6)]
        rng = random.Random(0)
        convs = [[1] + [rng.randrange(3, 320) for _ in range(12)] for _ in range(6)]
        got = []
        for _turn in range(4):
            outs = eng.generate(convs, {"max_new_tokens": 12, **GREEDY})
            got.append([o.token_ids for o in outs])
            convs = [c + o.token_ids + [rng.randrange(3, 320) for _ in range(5)] for c, o in zip(convs, outs)]
        s = eng.stats()
        rates[spec], answers[spec] = s.cache_hit_rate, got
        if spec:
            assert s.spec_accepted_tokens_total > 0
    assert answers["ngram"] == answers[None]
    assert abs(rates["ngram"] - rates[None]) <= 0.01 and rates[None] > 0.5


def test_metrics_agree_with_stats(make_engine):
    """/metrics shows the speculation counters and rates, each equal to what stats() says."""
    from prometheus_client.parser import text_string_to_metric_families

    from prefixrt.engine.metrics import Metrics

    eng = make_engine("llama", speculative="ngram")
    eng.generate([1] + list(range(40, 60)) * 3, {"max_new_tokens": 24, **GREEDY})
    s = eng.stats()
    samples = {x.name: x.value for fam in text_string_to_metric_families(Metrics.for_engine(eng).render().decode())
               for x in fam.samples}
    assert samples["prefixrt_spec_draft_tokens_total"] == s.spec_draft_tokens_total > 0
    assert samples["prefixrt_spec_accepted_tokens_total"] == s.spec_accepted_tokens_total > 0
    assert samples["prefixrt_spec_emitted_tokens_total"] == s.spec_emitted_tokens_total
    assert samples["prefixrt_spec_acceptance_rate"] == pytest.approx(
        s.spec_accepted_tokens_total / s.spec_draft_tokens_total)
    assert samples["prefixrt_spec_tokens_per_forward"] == pytest.approx(
        s.spec_emitted_tokens_total / s.spec_verify_rows_total) and s.spec_tokens_per_forward > 1
    assert samples["prefixrt_spec_drafter_seconds_total"] > 0


def test_opt_out_and_off_by_default(make_engine):
    prompt = [1] + list(range(40, 60)) * 3
    p = {"max_new_tokens": 12, **GREEDY}
    eng = make_engine("llama", speculative="ngram")
    eng.generate(prompt, {**p, "speculative": False})
    assert eng.stats().spec_verify_rows_total == 0
    eng.generate(prompt, p)
    assert eng.stats().spec_verify_rows_total > 0
    off = make_engine("llama")
    off.generate(prompt, p)
    assert off.stats().spec_draft_tokens_total == 0 and off.core.spec is None
    from prefixrt.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        eng.generate(prompt, {**p, "speculative": "yes"})
    with pytest.raises(ValueError):
        make_engine("llama", speculative="draft:nothing")


@pytest.mark.parametrize("page_size", [1, 4])
def test_rejected_slots_freed_at_once(page_size, make_engine):
    """After each verification a running request holds pages for its accepted tokens only: the rejected drafts'
    slots are back in the allocator before the next step."""
    eng = make_engine("llama", speculative="fixed:0.5", page_size=page_size)
    prompt = [1] + list(range(40, 60)) * 2
    p = {"max_new_tokens": 40, **GREEDY}
    eng.generate(prompt, p)  # teaches the drafter
    spec = eng.core.spec
    orig, checked = spec.verify, []

    def verify(core, r, raw, drafts, epoch, now, argmax=None):
        orig(core, r, raw, drafts, epoch, now, argmax)
        if r.finish_reason is None:
            assert len(r.pages) == -(-r.kv_len // page_size) and r.kv_len == len(r.all_ids) - 1
            checked.append(len(drafts))

    spec.verify = verify
    eng.generate(prompt, p)
    assert len(checked) > 5 and eng.stats().spec_accepted_tokens_total < eng.stats().spec_draft_tokens_total


def test_speculative_flags_reach_the_engine_config():
    import argparse

    from prefixrt.config.engine_config import EngineConfig
    from prefixrt.config.flags import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    fields = EngineConfig.__dataclass_fields__
    for argv, want in (([], (None, 4)), (["--speculative", "ngram", "--speculative-num-tokens", "6"], ("ngram", 6))):
        kw = engine_kwargs(p.parse_args(argv))
        cfg = EngineConfig(**{k: v for k, v in kw.items() if k in fields})
        assert (cfg.speculative, cfg.speculative_num_tokens) == want
    with pytest.raises(ValueError):
        EngineConfig(speculative="eagle")


@pytest.mark.parametrize("cache", [dict(radix_cache=False), dict(prefix_cache="block"),
                                   dict(host_kv_cache_tokens=2048, kv_cache_tokens=300), dict(page_size=16)])
def test_other_caches(cache, make_engine):
    """No prefix cache, the block table cache, the host tier, whole pages: greedy outputs still equal plain
    decoding (the drafts then come from the request's own context where the cache has no continuation)."""
    prompts = _repetitive([p[:30] for p in _tree_workload(8, seed=9)])
    params = {"max_new_tokens": 16, **GREEDY}
    want = [c.token_ids for c in make_engine("llama").generate(prompts, params)]
    eng = make_engine("llama", speculative="ngram", **cache)
    assert [c.token_ids for c in eng.generate(prompts, params)] == want
    assert [c.token_ids for c in eng.generate(prompts, params)] == want  # again, the answers cached
    assert eng.stats().spec_accepted_tokens_total > 0
