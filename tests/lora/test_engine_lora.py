"""LoRA adapters on the engine against transformers + peft itself (float32 tiny checkpoints, adapters written by
peft's save_pretrained): greedy tokens equal for every target set, a batch mixing adapters and the base model, no
K/V shared across adapters or with the base (crafted keys included), loads that never stall the batch, run-time
load / unload, and the scheduler's features with adapters."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

from prefixrt.errors import InvalidRequest
from prefixrt.prompt_cache import PromptCache
from prefixrt.request import AdapterNamespace
from tests.lora.conftest import TARGET_SETS, hf_greedy

pytest.importorskip("peft")

NEW = 8
# min_new_tokens masks EOS as transformers' min_new_tokens does in the oracle (hf_greedy)
GREEDY = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _prompts(seed: int = 0, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 320) for _ in range(20)]
    out = [shared + [rng.randrange(3, 320) for _ in range(rng.randint(1, 10))] for _ in range(n - 2)]
    out.append([1] + [rng.randrange(3, 320) for _ in range(33)])
    out.append(list(out[0]))  # an exact repeat: a hit of len - 1 under the same adapter
    return out


def _base_greedy(peft_model, prompts):
    with peft_model.disable_adapter():
        return [hf_greedy(peft_model, p, NEW) for p in prompts]


@pytest.mark.parametrize("arch,targets", [("llama", "attn"), ("llama", "mlp"), ("llama", "all"), ("llama", "qv"),
                                          ("qwen2", "all"), ("gemma3", "all")])
def test_greedy_tokens_equal_peft(arch, targets, make_engine, peft_adapters):
    folder, pm = peft_adapters(arch, targets, TARGET_SETS[targets], rank=8, seed=1)
    prompts = _prompts()
    want = [hf_greedy(pm, p, NEW) for p in prompts]
    assert want != _base_greedy(pm, prompts)  # the adapter moves the tokens: a test that can fail
    eng = make_engine(arch, lora_adapters={"ad": str(folder)}, chunked_prefill_tokens=16)
    seq = [eng.generate(p, {**GREEDY, "lora": "ad"}) for p in prompts]
    assert [c.token_ids for c in seq] == want
    assert seq[-1].cached_tokens == len(prompts[-1]) - 1
    assert [c.token_ids for c in eng.generate(prompts, {**GREEDY, "lora": "ad"})] == want


def test_rank_and_alpha_patterns_and_rslora(make_engine, peft_adapters):
    folder, pm = peft_adapters("llama", "patterns", TARGET_SETS["all"], rank=16, seed=3, use_rslora=True,
                               rank_pattern={"layers.1.self_attn.q_proj": 4, "down_proj": 8},
                               alpha_pattern={"v_proj": 40})
    prompts = _prompts(2, n=4)
    want = [hf_greedy(pm, p, NEW) for p in prompts]
    eng = make_engine("llama", lora_adapters={"p": str(folder)})
    assert [eng.generate(p, {**GREEDY, "lora": "p"}).token_ids for p in prompts] == want


MIX = [("a", "attn", 8, 11), ("b", "mlp", 16, 12), ("c", "all", 32, 13), ("d", "qv", 64, 14)]


def _mix(peft_adapters, prompts):
    """name -> (folder, greedy tokens of each prompt); None -> the base model's."""
    out = {}
    for name, targets, rank, seed in MIX:
        folder, pm = peft_adapters("llama", f"mix-{name}", TARGET_SETS[targets], rank=rank, seed=seed)
        out[name] = (folder, [hf_greedy(pm, p, NEW) for p in prompts])
    out[None] = (None, _base_greedy(pm, prompts))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_mixing_four_adapters_and_the_base(overlap, make_engine, peft_adapters):
    prompts = _prompts(5, n=6)
    mix = _mix(peft_adapters, prompts)
    assert len({tuple(map(tuple, v[1])) for v in mix.values()}) == 5  # five different models
    eng = make_engine("llama", lora_adapters={n: str(mix[n][0]) for n, *_ in MIX}, max_loras=4,
                      overlap_schedule=overlap, chunked_prefill_tokens=64)
    jobs = [(name, i) for i in range(len(prompts)) for name in [n for n, *_ in MIX] + [None]]
    random.Random(0).shuffle(jobs)

    async def run_all():
        return await asyncio.gather(*[eng.agenerate(prompts[i], {**GREEDY, "lora": name}) for name, i in jobs])

    forwards = eng.stats().forward_passes_total
    outs = asyncio.run(run_all())
    for (name, i), c in zip(jobs, outs):
        assert c.token_ids == mix[name][1][i], (name, i)
    # 30 requests of 8 tokens each in far fewer forwards than one request at a time: they shared batches
    assert eng.stats().forward_passes_total - forwards < len(jobs) * NEW // 2


def test_same_prompt_under_two_adapters_reuses_nothing(make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    eng = make_engine("llama", lora_adapters={"a": str(fa), "b": str(fb), "a-again": str(fa)}, max_loras=2)
    p = _prompts(7)[0]
    first = eng.generate(p, {**GREEDY, "lora": "a"})
    assert first.cached_tokens == 0 and first.token_ids == hf_greedy(pa, p, NEW)
    other = eng.generate(p, {**GREEDY, "lora": "b"})
    assert other.cached_tokens == 0 and other.token_ids == hf_greedy(pb, p, NEW)
    base = eng.generate(p, GREEDY)
    assert base.cached_tokens == 0 and base.token_ids == _base_greedy(pa, [p])[0]
    again = eng.generate(p, {**GREEDY, "lora": "a"})
    assert again.cached_tokens == len(p) - 1 and again.token_ids == first.token_ids
    # the same files under another name are the same model: its K/V is shared (the digest is the identity)
    assert eng.generate(p, {**GREEDY, "lora": "a-again"}).cached_tokens == len(p) - 1
    s = eng.stats()
    assert s.lora_adapters["a"]["requests_total"] == 2 and s.lora_adapters["b"]["cached_tokens_total"] == 0
    assert s.lora_adapters["a"]["cached_tokens_total"] == len(p) - 1
    assert s.lora_resident_adapters == 2 and s.lora_slots == 2


def test_crafted_keys_never_reach_another_adapters_kv(make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    eng = make_engine("llama", lora_adapters={"a": str(fa), "b": str(fb)})
    p = _prompts(8)[1]
    eng.generate(p, {**GREEDY, "lora": "a"})
    eng.generate(p, {**GREEDY, "lora": "a", "cache_salt": "tenant"})
    digest = eng.core.scheduler.adapters.lookup("a").digest
    ns = AdapterNamespace(digest, None)
    crafted = [digest, json.dumps(ns.to_json()), repr(ns), str(ns.to_json()), json.dumps([digest, None]), "tenant"]
    want_base, want_b = _base_greedy(pa, [p])[0], hf_greedy(pb, p, NEW)
    for salt in crafted:
        for lora, want in ((None, want_base), ("b", want_b)):
            c = eng.generate(p, {**GREEDY, "lora": lora, "cache_salt": salt})
            assert c.cached_tokens == 0 and c.token_ids == want, (salt, lora)
            c = eng.generate(p, {**GREEDY, "lora": lora, "prompt_cache": PromptCache(session=salt)})
            assert c.token_ids == want, (salt, lora)
    # the base model and b reused only what they computed themselves (the same ids, their own namespaces)
    assert eng.generate(p, {**GREEDY, "lora": "b"}).cached_tokens == len(p) - 1
    # tenants' salts still apply under an adapter
    assert eng.generate(p, {**GREEDY, "lora": "a", "cache_salt": "other"}).cached_tokens == 0
    assert eng.generate(p, {**GREEDY, "lora": "a", "cache_salt": "tenant"}).cached_tokens == len(p) - 1


def test_a_request_waits_for_its_adapters_load_while_the_batch_runs(make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    eng = make_engine("llama", lora_adapters={"a": str(fa), "b": str(fb)}, max_loras=1, lora_debug_load_delay_s=2.0)
    p = _prompts(9)[2]
    done = {}

    def run(name, lora, n):
        c = eng.generate(p, {**GREEDY, "max_new_tokens": n, "min_new_tokens": n, "lora": lora})
        done[name] = (time.monotonic(), c)

    threads = [threading.Thread(target=run, args=("adapter", "a", NEW)),
               threading.Thread(target=run, args=("base", None, 24))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # the base request ran to its end while the adapter's load (2 s) was in flight
    assert done["base"][0] < done["adapter"][0]
    assert done["adapter"][1].token_ids == hf_greedy(pa, p, NEW)
    assert done["base"][1].token_ids[:NEW] == _base_greedy(pa, [p])[0]
    # one slot: b evicts a, a comes back; every answer stays its own model's
    assert eng.generate(p, {**GREEDY, "lora": "b"}).token_ids == hf_greedy(pb, p, NEW)
    assert eng.generate(p, {**GREEDY, "lora": "a"}).token_ids == hf_greedy(pa, p, NEW)
    s = eng.stats()
    assert s.lora_loads_total == 3 and s.lora_load_seconds_total >= 3 * 2.0
    # one slot: the loads never overlapped, so the seconds with a load in flight are their sum
    assert 3 * 2.0 <= s.lora_load_busy_seconds_total <= s.lora_load_seconds_total + 1e-6
    assert s.lora_adapters["a"]["loads_total"] == 2 and s.lora_resident_adapters == 1


def test_two_adapters_over_one_slot_take_turns(make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    eng = make_engine("llama", lora_adapters={"a": str(fa), "b": str(fb)}, max_loras=1)
    prompts = _prompts(10, n=4)
    jobs = [(lora, p) for p in prompts for lora in ("a", "b", None)]

    async def run_all():
        return await asyncio.gather(*[eng.agenerate(p, {**GREEDY, "lora": lora}) for lora, p in jobs])

    want = {"a": pa, "b": pb}
    for (lora, p), c in zip(jobs, asyncio.run(run_all())):
        assert c.token_ids == (hf_greedy(want[lora], p, NEW) if lora else _base_greedy(pa, [p])[0])


def test_runtime_load_and_unload(make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    big, _ = peft_adapters("llama", "big", rank=32, seed=23)
    eng = make_engine("llama", enable_lora=True, max_lora_rank=16, max_loras=2)
    p = _prompts(11)[0]
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'x'"):
        eng.generate(p, {**GREEDY, "lora": "x"})
    eng.load_lora_adapter("x", str(fa))
    assert eng.lora_adapters() == ["x"]
    assert eng.generate(p, {**GREEDY, "lora": "x"}).token_ids == hf_greedy(pa, p, NEW)
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_lora_adapter("x", str(fb))
    with pytest.raises(ValueError, match="rank 32, above the engine's max_lora_rank 16"):
        eng.load_lora_adapter("big", str(big))
    # refused while a request uses it
    stream = eng.stream(p, {**GREEDY, "max_new_tokens": 60, "min_new_tokens": 60, "lora": "x"})
    next(iter(stream))
    with pytest.raises(ValueError, match="in use"):
        eng.unload_lora_adapter("x")
    for _ in stream:
        pass
    eng.unload_lora_adapter("x")
    assert eng.lora_adapters() == []
    with pytest.raises(InvalidRequest):
        eng.generate(p, {**GREEDY, "lora": "x"})
    with pytest.raises(KeyError):
        eng.unload_lora_adapter("x")
    # the name again, other files: nothing of the old adapter's K/V is reused
    eng.load_lora_adapter("x", str(fb))
    c = eng.generate(p, {**GREEDY, "lora": "x"})
    assert c.cached_tokens == 0 and c.token_ids == hf_greedy(pb, p, NEW)


def test_adapters_made_in_memory(make_engine):
    """Benchmarks register adapters built in memory (random weights shaped by the engine's projections, and copies
    with lora_A scaled): a zero-scaled copy computes the base model exactly, an unscaled copy the same tokens as
    its source under a digest of its own (no K/V shared), and every load leaves its interval for the load share."""
    from prefixrt.lora.peft_format import random_adapter, scaled_adapter
    from prefixrt.lora.registry import target_dims

    eng = make_engine("llama", enable_lora=True, max_lora_rank=8, max_loras=2)
    manager = eng.core.scheduler.adapters
    dims = target_dims(manager.linears)
    assert set(dims) == set(TARGET_SETS["all"])
    num_layers = 1 + max(layer for layer, _ in manager.linears)
    src = random_adapter("r", num_layers, dims, rank=8, seed=3, std=0.5)
    same, zero = scaled_adapter(src, "r1", 1.0), scaled_adapter(src, "r0", 0.0)
    assert len({src.digest, same.digest, zero.digest}) == 3
    for adapter in (src, same, zero):
        eng.load_lora_adapter(adapter.name, adapter)
    p = _prompts(12)[0]
    base = eng.generate(p, GREEDY)
    first = eng.generate(p, {**GREEDY, "lora": "r"})
    assert first.token_ids != base.token_ids
    copy = eng.generate(p, {**GREEDY, "lora": "r1"})
    assert copy.cached_tokens == 0 and copy.token_ids == first.token_ids
    assert eng.generate(p, {**GREEDY, "lora": "r0"}).token_ids == base.token_ids
    s = eng.stats()
    assert s.lora_adapters["r1"]["rank"] == 8 and s.lora_loads_total == 3
    intervals = list(manager.slots.load_intervals)
    assert len(intervals) == 3 and all(start <= end for start, end in intervals)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_slots_do_not_thrash_when_adapters_outnumber_them(make_engine, policy):
    """More adapters than slots, requests spread over all of them (round-robin, 4 in flight): an adapter loaded for
    a waiting request stays until that request runs, so the loads are about one per request (every request's
    adapter is evicted by others before its turn comes back). Before loads skipped the adapters of the requests
    ahead in line, this run took ~8 loads a request: loads completing between two passes were evicted by the next
    pass's loads for requests behind. lpm reorders the waiting requests as their prefixes get cached (an adapter
    loaded for a request may go to one that moved ahead of it): still at most one load a request here."""
    from prefixrt.lora.peft_format import random_adapter
    from prefixrt.lora.registry import target_dims

    eng = make_engine("llama", enable_lora=True, max_lora_rank=8, max_loras=2, schedule_policy=policy)
    manager = eng.core.scheduler.adapters
    num_layers = 1 + max(layer for layer, _ in manager.linears)
    names = [f"t{i}" for i in range(6)]
    for i, name in enumerate(names):
        eng.load_lora_adapter(name, random_adapter(name, num_layers, target_dims(manager.linears), 8, seed=i))
    rng = random.Random(4)
    prefixes = [[1] + [rng.randrange(3, 320) for _ in range(20)] for _ in names]
    jobs = [(name, prefixes[i] + [rng.randrange(3, 320) for _ in range(4)]) for _ in range(2)
            for i, name in enumerate(names)]

    async def run_all():
        sem = asyncio.Semaphore(4)

        async def one(name, p):
            async with sem:
                return await eng.agenerate(p, {**GREEDY, "lora": name})

        return await asyncio.gather(*[one(name, p) for name, p in jobs])

    outs = asyncio.run(run_all())
    assert all(len(c.token_ids) == NEW for c in outs)
    s = eng.stats()
    assert len(names) <= s.lora_loads_total <= len(jobs), s.lora_loads_total
    assert sum(c["requests_total"] for c in s.lora_adapters.values()) == len(jobs)


def test_load_busy_seconds_count_overlapping_loads_once():
    """Two loads in flight together count once in load_busy_seconds_total (the union of their intervals, from the
    first start to the last completion seen), unlike load_seconds_total (their sum); a later load adds its own."""
    import torch

    from prefixrt.lora.slots import AdapterSlots

    slots = AdapterSlots(2, torch.device("cpu"), load_delay_s=0.2)  # one worker: the second load ends ~0.2 s later
    written = []

    def wait_ready(*digests):
        deadline = time.monotonic() + 10
        while not all(slots.ready(d) for d in digests):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    assert slots.request("a", written.append) and slots.request("b", written.append)
    assert slots.load_busy_seconds_total > 0  # (a load in flight counts up to now)
    wait_ready("a", "b")
    (s0, e0), (s1, e1) = slots.load_intervals
    assert sorted(written) == [0, 1] and slots.loads_total == 2
    assert slots.load_busy_seconds_total == pytest.approx(max(e0, e1) - min(s0, s1), abs=1e-9)
    assert slots.load_busy_seconds_total < slots.load_seconds_total - 0.15  # the overlap counted once
    first = slots.load_busy_seconds_total
    time.sleep(0.05)
    assert slots.load_busy_seconds_total == first  # nothing in flight: no time counts
    slots.drop("a")
    assert slots.request("c", written.append)
    wait_ready("c")
    s2, e2 = slots.load_intervals[-1]
    assert slots.load_busy_seconds_total == pytest.approx(first + (e2 - s2), abs=1e-9)
    slots.close()


def test_lora_over_fp8_refuses_smoothing():
    """FP8 smoothing rescales the projections' inputs (model/smoothing.py), which an adapter was not trained on."""
    from prefixrt.config import EngineConfig

    with pytest.raises(ValueError, match="fp8_smoothing=0"):
        EngineConfig(quantization="fp8", enable_lora=True)
    with pytest.raises(ValueError, match="fp8_smoothing=0"):
        EngineConfig(quantization="fp8", fp8_smoothing=0.5, lora_adapters={"a": "/x"})
    EngineConfig(quantization="fp8", fp8_smoothing=0, enable_lora=True)
    EngineConfig(enable_lora=True)  # smoothing applies only to quantize-at-load


def test_an_engine_without_lora_refuses_adapter_requests(make_engine):
    eng = make_engine("llama")
    with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
        eng.generate([1, 5, 6], {**GREEDY, "lora": "x"})
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        eng.load_lora_adapter("x", "/nonexistent")
    assert eng.lora_adapters() == []


@pytest.mark.parametrize("options", [
    dict(page_size=16),
    dict(page_size=4, kv_cache_tokens=256, host_kv_cache_tokens=4096, chunked_prefill_tokens=16),
    dict(speculative="ngram"),
    dict(schedule_policy="fcfs"),
    dict(schedule_policy="dfs", overlap_schedule=True),
], ids=["page16", "host-tier", "speculative", "fcfs", "dfs-overlap"])
def test_scheduler_features_with_adapters(options, make_engine, peft_adapters):
    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    prompts = _prompts(12, n=6)
    want = {"a": [hf_greedy(pa, p, NEW) for p in prompts], "b": [hf_greedy(pb, p, NEW) for p in prompts],
            None: _base_greedy(pa, prompts)}
    eng = make_engine("llama", lora_adapters={"a": str(fa), "b": str(fb)}, **options)
    rng = random.Random(1)
    for _ in range(2):  # the second round hits what the first cached (in the pool or the host tier)
        jobs = [(lora, i, rng.randint(-1, 1)) for i in range(len(prompts)) for lora in ("a", "b", None)]
        rng.shuffle(jobs)

        async def run_all(jobs=jobs):
            return await asyncio.gather(*[eng.agenerate(prompts[i], {**GREEDY, "lora": lora, "priority": prio})
                                          for lora, i, prio in jobs])

        for (lora, i, _), c in zip(jobs, asyncio.run(run_all())):
            assert c.token_ids == want[lora][i], (lora, i)
    if options.get("host_kv_cache_tokens"):
        assert eng.stats().host_hit_tokens_total > 0


def test_constrained_decoding_under_an_adapter(make_engine, peft_adapters):
    (fa, pa) = peft_adapters("llama", "iso-a", seed=21)
    eng = make_engine("llama", lora_adapters={"a": str(fa)})
    c = eng.generate([1, 40, 41, 42], {"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]{3}-[a-z]{2}",
                                       "lora": "a"})
    assert c.finish_reason == "stop"
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.text), c.text
    picked = eng.generate([1, 40, 41, 42], {"max_new_tokens": 4, "temperature": 0, "choices": ["yes", "no"],
                                            "lora": "a"})
    assert picked.text in ("yes", "no")


def test_the_disk_tier_keeps_adapters_apart(make_engine, peft_adapters, tmp_path, monkeypatch):
    """A restarted engine finds an adapter's prefix on disk under that adapter only: not under another adapter, the
    base model, nor a cache_salt spelling the adapter's namespace, even with every file key hashing alike (only the
    files' headers tell them apart)."""
    from prefixrt.cache import disk_store

    (fa, pa), (fb, pb) = peft_adapters("llama", "iso-a", seed=21), peft_adapters("llama", "iso-b", seed=22)
    opts = dict(lora_adapters={"a": str(fa), "b": str(fb)}, kv_cache_tokens=96, host_kv_cache_tokens=64,
                kv_disk_dir=str(tmp_path / "kv"), chunked_prefill_tokens=32)
    rng = random.Random(13)
    prompts = [[1] + [rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
    first = make_engine("llama", **opts)
    for p in prompts:
        first.generate(p, {**GREEDY, "lora": "a"})
    digest = first.core.scheduler.adapters.lookup("a").digest
    first.wait_idle()
    first.check_integrity()
    first.shutdown()
    monkeypatch.setattr(disk_store, "_digest", lambda h: "0" * 32)
    eng = make_engine("llama", **opts)
    spelled = json.dumps(AdapterNamespace(digest, None).to_json())
    for lora, salt, model in (("b", None, pb), (None, None, None), (None, spelled, None), ("b", spelled, pb)):
        for p in prompts[:2]:
            c = eng.generate(p + [5], {**GREEDY, "lora": lora, "cache_salt": salt})
            assert c.token_ids == (hf_greedy(model, p + [5], NEW) if model else _base_greedy(pa, [p + [5]])[0])
    assert eng.stats().disk_hit_tokens_total == 0
    c = eng.generate(prompts[2] + [5], {**GREEDY, "lora": "a"})
    assert c.token_ids == hf_greedy(pa, prompts[2] + [5], NEW)
    assert c.cached_tokens > 1 and eng.stats().disk_hit_tokens_total > 0
