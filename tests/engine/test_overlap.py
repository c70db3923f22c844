"""Overlap scheduling is exact: the overlapped loop (schedule N+1 and post-process N while the device runs)
gives the same tokens as the synchronous loop, over the tree-shaped workload under eviction and retraction
with stop strings, constrained requests (jump-forward), n > 1, logprobs and aborts mixed in. Plus the units it
rests on: deferred KV release behind a fence, and samples that are discarded drawing nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.radix import RadixCache
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.params import SamplingParams
from prefixrt.request import Req
from prefixrt.sampling.sampler import Sampler
from tests.engine.test_engine import _tree_workload

SCHEMA = {"type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["customer_full_name", "ok"], "additionalProperties": False}


def _mixed_params(i: int) -> dict:
    """Greedy or per-request seeded (exact whatever the batch), with every knob the loop treats specially."""
    base = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    kind = i % 8
    if kind == 1:
        return {**base, "stop": ["e", "th"]}
    if kind == 2:
        return {**base, "json_schema": SCHEMA, "max_new_tokens": 32}  # jump-forward over the long key
    if kind == 3:
        return {**base, "regex": r"[0-9]{3}-[0-9]{4}"}
    if kind == 4:
        return {**base, "n": 2, "temperature": 1.0, "seed": i}
    if kind == 5:
        return {**base, "logprobs": 2}
    if kind == 6:
        return {**base, "repetition_penalty": 1.5, "temperature": 0.8, "seed": i}
    return base


def _summary(c):
    return [(o.token_ids, o.text, o.finish_reason, o.matched_stop,
             [(lp["token_id"], lp["token"], [t["token_id"] for t in lp["top_logprobs"]]) for lp in o.logprobs]
             if o.logprobs else None) for o in c.outputs]


def _logprobs(c):
    return [lp["logprob"] for o in c.outputs for lp in (o.logprobs or [])]


def _run_mixed(eng, prompts, aborts: set[int], params=_mixed_params):
    """Request i with params(i), all at once; those in aborts streamed and aborted after their second chunk."""
    async def go():
        async def aborted(i):
            chunks = []
            async for ch in eng.astream(prompts[i], {**params(i), "request_id": f"abort-{i}"}):
                chunks.append(ch)
                if len(chunks) == 2:
                    eng.abort(f"abort-{i}")
            return chunks

        tasks = [aborted(i) if i in aborts else eng.agenerate(prompts[i], params(i))
                 for i in range(len(prompts))]
        return await asyncio.gather(*tasks)

    return asyncio.run(go())


def test_overlap_on_equals_off_mixed_workload(make_engine, underestimated_decode):
    prompts = [p[:60] for p in _tree_workload(200, seed=11)]
    aborts = set(range(7, 200, 16))
    small = dict(kv_cache_tokens=320, chunked_prefill_tokens=16)
    results = {}
    for overlap in (False, True):
        eng = make_engine("llama", overlap_schedule=overlap, **small)
        results[overlap] = _run_mixed(eng, prompts, aborts)
        s = eng.stats()
        assert s.evicted_tokens_total > 0 and s.retracted_requests_total > 0, (overlap, s)
    off, on = results[False], results[True]
    for i in range(len(prompts)):
        if i in aborts:
            continue
        assert _summary(on[i]) == _summary(off[i]), (i, _mixed_params(i))
        assert _logprobs(on[i]) == pytest.approx(_logprobs(off[i]), abs=1e-4)  # batches differ: float noise
    # What the constrained ones produced is valid, and some finished by a stop string: the mix is real.
    assert any(c.finish_reason == "stop" and c.matched_stop in ("e", "th") for c in off if not isinstance(c, list))
    # Aborted streams: a prefix of the same request run to the end, and they end with "abort".
    ref = make_engine("llama", overlap_schedule=False)
    for i in sorted(aborts)[:6]:
        full = ref.generate(prompts[i], _mixed_params(i))
        for res in (on[i], off[i]):
            toks = [t for ch in res for t in ch.token_ids]
            assert toks == full.token_ids[: len(toks)]
            assert res[-1].finish_reason in ("abort", full.finish_reason)


@pytest.mark.parametrize("overlap", [True, False])
def test_jump_forward_and_stop_strings_exact_in_both_loops(overlap, make_engine):
    """Each loop against the synchronous loop with jump-forward off (forced tokens = greedy under the mask)."""
    eng = make_engine("llama", overlap_schedule=overlap)
    ref = make_engine("llama", overlap_schedule=False)
    # 40 rows, every fifth unconstrained: the overlapped loop starts the next step's masks in chunks while it
    # post-processes (GrammarMasks.early); each chunk may fill only rows whose matcher is already current.
    prompts = [[1, 30 + i, 31] for i in range(40)]
    p = {"max_new_tokens": 60, "temperature": 0, "json_schema": SCHEMA}
    free_p = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    parts: list[int] = []  # mask submissions of each drawn step
    orig = eng.core.draw

    def counted(step):
        parts.append(len(step.masks.parts) if step.masks is not None else 0)
        return orig(step)

    eng.core.draw = counted
    def run(e, params):
        async def go():
            return await asyncio.gather(*(e.agenerate(pr, pp) for pr, pp in zip(prompts, params)))
        return asyncio.run(go())

    got = run(eng, [free_p if i % 5 == 0 else p for i in range(40)])
    want = run(ref, [free_p if i % 5 == 0 else {**p, "jump_forward": False} for i in range(40)])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert (max(parts) > 1) == overlap  # chunked fills happen in the overlapped loop only
    free = ref.generate("The quick brown", {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    stop = free.text[5:8]
    c = eng.generate("The quick brown", {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": stop})
    assert c.finish_reason == "stop" and c.text == free.text[: free.text.index(stop)]
    assert c.token_ids == free.token_ids[: len(c.token_ids)]


# ---------------------------------------------------------------------------------------------- the units
class _Fence:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def wait(self):
        self.done = True


def _kv():
    pool = KVPool(65, 1, 1, 4, torch.float32, torch.device("cpu"))
    alloc = PageAllocator(65, 1)
    return KVManager(pool, alloc, ReqToTokenTable(4, 64, "cpu"), RadixCache(alloc))


def test_release_waits_for_the_fence():
    kv = _kv()
    r = Req(rid="a", prompt_ids=list(range(3, 23)), params=SamplingParams(), sink=None)
    kv.admit(r)
    kv.ensure_pages(kv.pages_for(r, 20))
    kv.extend(r, 20)
    r.kv_len = 20
    free0 = kv.free_tokens
    fence = kv.write_fence = _Fence()
    kv.release(r)
    assert r.row is None and r.pages == [] and r.kv_len == 0  # the request may be admitted again at once
    assert kv.free_tokens == free0 and kv.evictable_tokens == 0 and kv.has_deferred
    kv.check_integrity()  # held pages count as private
    kv.reclaim()
    assert kv.has_deferred  # the fence has not passed
    fence.done = True
    kv.reclaim()
    assert not kv.has_deferred and kv.evictable_tokens == 20  # published to the cache now
    kv.check_integrity()
    assert kv.free_tokens + kv.evictable_tokens == kv.total_tokens
    # Memory pressure waits for a pending fence instead of failing.
    r2 = Req(rid="b", prompt_ids=list(range(100, 140)), params=SamplingParams(), sink=None)
    kv.admit(r2)
    kv.ensure_pages(kv.pages_for(r2, 40))
    kv.extend(r2, 40)
    r2.kv_len = 40
    kv.write_fence = _Fence()
    kv.release(r2)
    assert kv.ensure_pages(kv.total_tokens) and not kv.has_deferred
    kv.check_integrity()


def test_discarded_rows_draw_nothing():
    s = Sampler(torch.device("cpu"))
    r = Req(rid="a", prompt_ids=[1], params=SamplingParams(temperature=1.0, seed=5), sink=None)
    r.generator = s.make_generator(5)
    logits = torch.randn(1, 50)
    before = r.generator.get_state().clone()
    s.sample_on_device(logits, [r], live=[False]).read()
    assert torch.equal(r.generator.get_state(), before)
    tok = s.sample_on_device(logits, [r]).read().token_ids[0]
    g = s.make_generator(5)
    assert tok == torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g).item()

