"""Keyed agent sessions on the engine (CPU, fp32, tiny checkpoints): sessions whose turns carry a session key and
keep their prompts (SamplingParams.prompt_cache) on a pool a third of their working set with the host tier give
the unbounded pool's outputs token for token, keep their hits, and are ordered by attained service; a pool-only
engine holds pinned prefixes out of eviction and accounts for them (kv_pinned) at teardown."""

from __future__ import annotations

import asyncio

from prefixrt.prompt_cache import KeepPrefix, PromptCache
from tests.engine.test_memory_pressure import GREEDY, _pool, _run, _workload, unbounded  # noqa: F401 (a fixture)


def _keyed_sessions(eng, w, keep: bool):
    async def session(k, turns):
        history, outs = [], []
        for turn in turns:
            prompt = history + turn.new_tokens
            pc = PromptCache(f"s{k}", (KeepPrefix(len(prompt), 600.0),) if keep else ())
            c = await eng.agenerate(prompt, {"max_new_tokens": turn.max_new_tokens, "prompt_cache": pc, **GREEDY})
            outs.append(c)
            history = prompt + c.token_ids
        return outs

    async def go():
        return await asyncio.gather(*(session(k, s) for k, s in enumerate(w.sessions)))

    return asyncio.run(go())


def test_keyed_sessions_with_keeps_equal_the_unbounded_pool(unbounded, make_engine):  # noqa: F811
    w = _workload()
    want, hit = unbounded
    eng = make_engine("llama", kv_cache_tokens=_pool(w, 1 / 3), host_kv_cache_tokens=2048, chunked_prefill_tokens=16,
                      host_kv_debug_delay_s=0.0005, max_pinned_fraction_per_salt=1.0, max_pinned_fraction=1.0)
    sessions = _keyed_sessions(eng, w, keep=True)
    assert [[c.token_ids for c in s] for s in sessions] == want
    prompt_tokens = sum(c.prompt_tokens for s in sessions for c in s)
    assert sum(c.cached_tokens for s in sessions for c in s) / prompt_tokens >= 0.95 * hit
    assert all(c.keep_report == {"kept_tokens": c.prompt_tokens, "refused_tokens": 0, "reason": None}
               for s in sessions for c in s)
    s = eng.stats()
    assert s.pins > 0 and s.pins_granted_total == sum(len(x) for x in w.sessions) and s.kv_pinned == 0


def test_pool_only_pins_hold_the_pool_and_are_accounted(make_engine):
    eng = make_engine("llama", kv_cache_tokens=512)
    prompt = list(range(10, 60))
    c = eng.generate(prompt, {"max_new_tokens": 2, **GREEDY,
                              "prompt_cache": PromptCache("s", (KeepPrefix(len(prompt), 600.0),))})
    assert c.keep_report["kept_tokens"] == len(prompt)
    for k in range(12):  # a flood of the pool
        eng.generate([3 + (k * 7 + j) % 300 for j in range(80)], {"max_new_tokens": 1, **GREEDY})
    s = eng.stats()
    assert s.kv_pinned == len(prompt) and s.pinned_tokens_gpu == len(prompt) and s.pinned_tokens_host == 0
    again = eng.generate(prompt + [7], {"max_new_tokens": 1, **GREEDY})
    assert again.cached_tokens == len(prompt)
