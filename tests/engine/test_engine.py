"""Engine behaviour: cache accounting, reuse under memory pressure, concurrency, sampling knobs, errors."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import prefixrt
from prefixrt import InvalidRequest

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_cached_tokens_exact(make_engine):
    eng = make_engine("llama", page_size=1)
    eng.flush_cache()

    def cached(ids):
        return eng.generate(ids, {"max_new_tokens": 1, **GREEDY}).cached_tokens

    assert cached(list(range(10))) == 0
    assert cached(list(range(100))) == 10
    assert cached(list(range(100))) == 99
    assert cached(list(range(50))) == 49
    assert cached(list(range(110))) == 100


@pytest.mark.parametrize("hit", [1, 15, 16, 17, 31, 32, 33])
def test_hit_lengths_around_page_boundaries(hit, make_engine):
    """Resumed prefill at odd offsets must use the right RoPE positions: outputs equal a cold run."""
    eng = make_engine("qwen3", page_size=16)
    base = [1] + [random.Random(hit).randrange(3, 320) for _ in range(60)]
    cold = eng.generate(base, {"max_new_tokens": 6, **GREEDY}).token_ids
    eng.flush_cache()
    eng.cache_prefix(base[:hit + 1])
    warm = eng.generate(base, {"max_new_tokens": 6, **GREEDY})
    assert warm.token_ids == cold
    assert warm.cached_tokens == (hit + 1) // 16 * 16


def _tree_workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    roots = [[1] + [rng.randrange(3, 320) for _ in range(rng.randint(8, 30))] for _ in range(6)]
    prompts = []
    for _ in range(n):
        p = list(rng.choice(roots))
        for _ in range(rng.randint(0, 3)):  # descend: branch at a random depth and extend
            p = p[: rng.randint(1, len(p))] + [rng.randrange(3, 320) for _ in range(rng.randint(1, 10))]
        prompts.append(p[:70])
    return prompts


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_on_equals_cache_off_under_eviction_and_retraction(page_size, make_engine, underestimated_decode):
    prompts = _tree_workload(200, seed=page_size)
    params = {"max_new_tokens": 24, **GREEDY}
    ref = make_engine("llama", radix_cache=False, kv_cache_tokens=8192, chunked_prefill_tokens=16)
    want = [c.token_ids for c in ref.generate(prompts, params)]
    small = make_engine("llama", page_size=page_size, kv_cache_tokens=320, chunked_prefill_tokens=16)
    got = [c.token_ids for c in small.generate(prompts, params)]
    assert got == want
    s = small.stats()
    assert s.evicted_tokens_total > 0, "the pool was meant to be small enough to evict"
    assert s.retracted_requests_total > 0, "the pool was meant to be small enough to retract"
    assert s.cached_tokens_total > 0
    # And one by one, where every later request can reuse earlier ones.
    got_seq = [small.generate(p, params).token_ids for p in prompts[:40]]
    assert got_seq == want[:40]


def _run_held(eng, jobs: dict, monkeypatch) -> dict:
    """jobs: {name: (prompt, params)}, submitted from threads while the loop thread is held, so that one step
    admits them all; returns {name: Completion}."""
    gate, handle = threading.Event(), eng._handle
    monkeypatch.setattr(eng, "_handle", lambda msg: (gate.wait(30), handle(msg)))
    out = {}
    threads = [threading.Thread(target=lambda k=k, p=p, s=s: out.__setitem__(k, eng.generate(p, s)))
               for k, (p, s) in jobs.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while eng._inbox.qsize() < len(jobs) - 1:  # (the first message is held in _handle)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(eng, "_handle", handle)
    return out


def test_a_request_retracted_for_memory_resumes_on_its_own_kv(make_engine, underestimated_decode, monkeypatch):
    """Three requests on a pool that runs out while they decode (an estimate of one token each): the lowest
    priority one (b) is retracted, its computed K/V published; the other two finish on the free slots, and b
    resumes with all its 11 computed tokens reused (one forward of one token), then ends with the tokens of a
    run that never retracted. The forwards are recorded as (prefix lens, extend lens)."""
    from prefixrt.model.runner import ModelRunner

    prompts = {"a": list(range(100, 110)), "b": list(range(200, 210)), "c": list(range(300, 302))}
    params = {"a": {"max_new_tokens": 3, "priority": 1, **GREEDY}, "b": {"max_new_tokens": 5, **GREEDY},
              "c": {"max_new_tokens": 3, "priority": 1, **GREEDY}}
    jobs = {k: (prompts[k], params[k]) for k in prompts}
    want = {k: c.token_ids for k, c in _run_held(make_engine("llama"), jobs, monkeypatch).items()}

    forwards = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, fb: (forwards.append((fb.prefix_lens_cpu, fb.extend_lens_cpu)), forward(self, fb))[1])
    eng = make_engine("llama", kv_cache_tokens=27)  # 22 prompt tokens + 3 + 2 decode slots: no room for b's third
    got = _run_held(eng, jobs, monkeypatch)
    assert {k: c.token_ids for k, c in got.items()} == want
    assert eng.stats().retracted_requests_total == 1
    assert forwards == [
        ([0, 0, 0], [10, 2, 10]),  # a, c (priority 1), b: prefill
        ([10, 2, 10], [1, 1, 1]),  # decode
        ([11, 3], [1, 1]),  # b retracted (11 tokens computed, published); a and c take their last tokens
        ([11], [1]),  # b resumes: its 11 tokens' K/V from the tree, only its last sampled token computed
        ([12], [1]),
        ([13], [1]),
    ]


def test_32_threads_match_sequential(make_engine):
    eng = make_engine("qwen2")
    prompts = _tree_workload(32, seed=7)
    params = {"max_new_tokens": 6, **GREEDY}
    want = [eng.generate(p, params).token_ids for p in prompts]
    eng.flush_cache()
    got = [None] * 32
    barrier = threading.Barrier(32)

    def worker(i):
        barrier.wait()
        got[i] = eng.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_prefill_once_for_concurrent_shared_prefix(make_engine):
    """Requests submitted together that share an uncached prefix compute it once: all but one reuse it."""
    eng = make_engine("llama", radix_cache=True)
    shared = [1] + list(range(10, 74))
    prompts = [shared + [200 + i, 201 + i] for i in range(8)]
    outs = eng.generate(prompts, {"max_new_tokens": 2, **GREEDY})
    assert sorted(c.cached_tokens for c in outs)[1:] == [len(shared)] * 7
    n3 = eng.generate([1, 9, 9, 9, 9, 9] + shared, {"max_new_tokens": 2, "n": 3, **GREEDY})
    assert len(n3.outputs) == 3
    assert sorted(o.cached_tokens for o in n3.outputs) == [1, 70, 70]  # <bos> was cached already


def test_cache_salt_isolates(make_engine):
    eng = make_engine("llama")
    p = [1] + list(range(20, 60))
    eng.generate(p, {"max_new_tokens": 1, "cache_salt": "a", **GREEDY})
    assert eng.generate(p, {"max_new_tokens": 1, "cache_salt": "b", **GREEDY}).cached_tokens == 0
    assert eng.generate(p, {"max_new_tokens": 1, **GREEDY}).cached_tokens == 0
    assert eng.generate(p, {"max_new_tokens": 1, "cache_salt": "a", **GREEDY}).cached_tokens == len(p) - 1


def test_cache_prefix_and_flush(make_engine):
    eng = make_engine("llama")
    p = [1] + list(range(30, 80))
    assert eng.cache_prefix(p) == len(p)
    assert eng.stats().kv_evictable == len(p)
    assert eng.generate(p + [5], {"max_new_tokens": 1, **GREEDY}).cached_tokens == len(p)
    eng.flush_cache()
    assert eng.stats().kv_evictable == 0
    assert eng.generate(p + [5], {"max_new_tokens": 1, **GREEDY}).cached_tokens == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_strings_across_token_boundaries(make_engine, tiny_tokenizer, overlap):
    eng = make_engine("llama", overlap_schedule=overlap)
    prompt = "The quick brown"
    free = eng.generate(prompt, {"max_new_tokens": 24, **GREEDY})
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # chosen to straddle token boundaries of the free-running output
    c = eng.generate(prompt, {"max_new_tokens": 24, "stop": [stop, "\u2603never"], **GREEDY})
    assert c.finish_reason == "stop" and c.matched_stop == stop
    assert c.text == text[: text.index(stop)]
    chunks = list(eng.stream(prompt, {"max_new_tokens": 24, "stop": stop, **GREEDY}))
    assert "".join(ch.text for ch in chunks) == c.text
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_token_ids_and_eos(make_engine, overlap):
    eng = make_engine("llama", overlap_schedule=overlap)
    free = eng.generate([1, 50, 60, 70], {"max_new_tokens": 10, **GREEDY})
    target = free.token_ids[4]
    c = eng.generate([1, 50, 60, 70], {"max_new_tokens": 10, "stop_token_ids": [target], **GREEDY})
    assert c.finish_reason == "stop" and c.matched_stop == target
    assert c.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


@pytest.mark.parametrize("overlap", [True, False])
def test_n_samples_seed_and_logprobs(make_engine, overlap):
    eng = make_engine("qwen3", overlap_schedule=overlap)
    p = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "n": 3, "logprobs": 2, "ignore_eos": True}
    a = eng.generate([1, 40, 41, 42], p)
    b = eng.generate([1, 40, 41, 42], p)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1, "samples with different seeds should differ"
    for o in a.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for lp in o.logprobs:
            assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 2
            assert lp["top_logprobs"][0]["logprob"] >= lp["logprob"] - 1e-5
    g = eng.generate([1, 40, 41, 42], {"max_new_tokens": 5, "temperature": 0, "logprobs": 1, "ignore_eos": True})
    for lp in g.logprobs:  # greedy picks the top-1 token
        assert lp["top_logprobs"][0]["token_id"] == lp["token_id"]


def test_top_k_1_is_greedy_and_penalties_change_output(make_engine):
    eng = make_engine("llama")
    greedy = eng.generate([1, 40, 41], {"max_new_tokens": 16, **GREEDY}).token_ids
    k1 = eng.generate([1, 40, 41], {"max_new_tokens": 16, "top_k": 1, "temperature": 0.7, "ignore_eos": True})
    assert k1.token_ids == greedy
    rep = eng.generate([1, 40, 41], {"max_new_tokens": 16, "repetition_penalty": 5.0, **GREEDY}).token_ids
    if len(set(greedy)) < len(greedy):  # greedy repeats itself; a strong penalty must change that
        assert rep != greedy
    pres = eng.generate([1, 40, 41], {"max_new_tokens": 16, "presence_penalty": 2.0, "frequency_penalty": 2.0,
                                      "temperature": 0, "ignore_eos": True}).token_ids
    assert len(set(pres)) >= len(set(greedy))


@pytest.mark.parametrize("overlap", [True, False])
def test_streaming_and_async(make_engine, overlap):
    eng = make_engine("llama", overlap_schedule=overlap)
    p = {"max_new_tokens": 10, **GREEDY}
    want = eng.generate("The quick", p)
    chunks = list(eng.stream("The quick", p))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])

    async def go():
        one = await eng.agenerate("The quick", p)
        many = await eng.agenerate(["The quick", "A stitch"], p)
        got = [c async for c in eng.astream("The quick", p)]
        return one, many, got

    one, many, got = asyncio.run(go())
    assert one.token_ids == want.token_ids and many[0].token_ids == want.token_ids
    assert [t for c in got for t in c.token_ids] == want.token_ids


def test_token_id_prompts_are_submitted_on_the_event_loop(make_engine):
    """astream_open / aencode of token ids run on the caller's loop (no worker-thread hop: many requests arriving
    together reach the engine in arrival order, without each waiting behind the others' parsing); a text prompt
    (tokenization) and a constrained request still go to a worker thread. Both give the same tokens, and a bad
    token id is refused either way."""
    eng = make_engine("llama")
    ids = eng.encode("The quick")
    p = {"max_new_tokens": 6, **GREEDY}
    want = eng.generate(ids, p).token_ids
    threads = []
    submit = eng._submit
    eng._submit = lambda *a, **k: (threads.append(threading.current_thread()), submit(*a, **k))[1]

    async def go():
        loop_thread = threading.current_thread()
        assert await eng.aencode(ids) == ids
        got = [t async for c in await eng.astream_open(ids, p) for t in c.token_ids]
        text = [t async for c in await eng.astream_open("The quick", p) for t in c.token_ids]
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await eng.astream_open([1, 10**6], p)
        return loop_thread, got, text

    loop_thread, got, text = asyncio.run(go())
    assert got == want and text == want
    assert threads[0] is loop_thread and threads[1] is not loop_thread and threads[2] is loop_thread


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_midstream_releases_kv(make_engine, overlap):
    eng = make_engine("llama", overlap_schedule=overlap)
    it = eng.stream([1, 5, 6, 7], {"max_new_tokens": 100, **GREEDY})
    next(it)
    it.close()  # closing the iterator aborts the request
    it2 = eng.stream([1, 5, 6, 8], {"max_new_tokens": 100, "request_id": "to-abort", **GREEDY})
    first = next(it2)
    eng.abort("to-abort")
    rest = list(it2)
    assert (rest[-1] if rest else first).finish_reason == "abort"
    ok = eng.generate([1, 5, 6, 7], {"max_new_tokens": 4, **GREEDY})
    assert ok.finish_reason == "length"


def test_chat_messages_use_the_template(make_engine, tiny_tokenizer):
    eng = make_engine("llama")
    msgs = [{"role": "user", "content": "hello"}]
    c = eng.generate(msgs, {"max_new_tokens": 3, **GREEDY})
    ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    assert c.prompt_tokens == len(ids)
    assert eng.generate(ids, {"max_new_tokens": 3, **GREEDY}).token_ids == c.token_ids


@pytest.mark.parametrize("prompt, params, param", [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([1, 5, 100000], {}, "prompt"),
    ([1, -3], {}, "prompt"),
    ([1] * 200, {}, "prompt"),  # longer than the tiny model's 128-token context
    ("hi", {"max_new_tokens": -1}, "max_new_tokens"),
    ("hi", {"n": 0}, "n"),
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"top_p": 0}, "top_p"),
    ("hi", {"bogus": 1}, "bogus"),
    ("hi", {"regex": "a+", "choices": ["a"]}, "choices"),
    ("hi", {"logprobs": 99}, "logprobs"),
    (3.5, {}, "prompt"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(prompt, params, param, make_engine):
    eng = make_engine("llama")
    with pytest.raises(InvalidRequest) as e:
        eng.generate(prompt, params)
    assert e.value.param == param and str(e.value)
    assert isinstance(e.value, ValueError)
    assert eng.generate([1, 2, 3], {"max_new_tokens": 2, **GREEDY}).finish_reason == "length"


def test_sampling_params_object_and_public_names():
    sp = prefixrt.SamplingParams(max_new_tokens=3, stop="x")
    assert sp.stop == ["x"]
    with pytest.raises(InvalidRequest):
        prefixrt.SamplingParams(top_k=0)
    assert prefixrt.Engine.__name__ == "Engine"


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_during_chunked_prefill_leaves_cache_exact(make_engine, overlap):
    """Aborts racing chunked prefill (published chunks, private tail) never leave freed slots in the tree:
    freed slots are poisoned with NaN (debug mode), so any stale reuse would change the greedy output."""
    import time

    ref = make_engine("llama", overlap_schedule=overlap, radix_cache=False)
    prompt = [1] + [random.Random(3).randrange(3, 320) for _ in range(110)]
    want = ref.generate(prompt, {"max_new_tokens": 6, **GREEDY}).token_ids
    eng = make_engine("llama", overlap_schedule=overlap, chunked_prefill_tokens=16, debug=True)
    for i in range(8):
        rid = f"victim-{i}"
        it = eng.stream(prompt[: 40 + 9 * i], {"max_new_tokens": 50, "request_id": rid, **GREEDY})
        time.sleep(0.002 * i)
        eng.abort(rid)
        list(it)
    eng.check_integrity()
    got = eng.generate(prompt, {"max_new_tokens": 6, **GREEDY})
    assert got.token_ids == want
    assert got.cached_tokens > 0


def test_a_prefix_released_under_a_forward_in_flight_still_leads(make_engine):
    """With overlap, a request that finishes on the step that computed its prompt (a prefill-only prefix hint)
    publishes its K/V only after the next forward, already launched, is done. Requests sharing that prefix that
    are scheduled meanwhile must wait for it (it still leads the shared prefill), not compute it again."""
    eng = make_engine(overlap_schedule=True)
    background = eng.stream([3, 4, 5, 6], {"max_new_tokens": 30, **GREEDY})  # keeps a forward in flight each step
    next(background)
    shared = [7 + (i * 13) % 90 for i in range(80)]
    hint = eng.stream(shared, {"max_new_tokens": 0})
    followers = [eng.stream(shared + [100 + i, 101, 102], {"max_new_tokens": 2, **GREEDY}) for i in range(3)]
    finals = [list(f)[-1] for f in followers]
    assert list(hint)[-1].cached_tokens == 0
    list(background)
    assert all(f.cached_tokens >= 64 for f in finals), [f.cached_tokens for f in finals]  # all but a page
