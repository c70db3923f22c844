"""RemoteEngine has Engine's semantics: same outputs, same errors, same stats, through `prefixrt serve`
(compared with an in-process Engine on the same weights)."""

from __future__ import annotations

import pytest

import prefixrt
from prefixrt import InvalidRequest

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def remote(server):
    with prefixrt.RemoteEngine(server.url) as r:
        yield r


def test_is_a_provider(remote, engine):
    assert isinstance(remote, prefixrt.Provider)
    assert remote.model_name == engine.model_name and remote.vocab_size == engine.vocab_size
    assert remote.tokenizer is None


@pytest.mark.parametrize("prompt", ["The quick brown fox", [1, 50, 60, 70], [{"role": "user", "content": "hi"}]])
def test_generate_equals_engine(remote, engine, prompt):
    want = engine.generate(prompt, GREEDY)
    remote.generate(prompt, GREEDY)
    got = remote.generate(prompt, GREEDY)
    assert isinstance(got, prefixrt.Completion)
    assert (got.text, got.token_ids, got.finish_reason, got.prompt_tokens) == \
        (want.text, want.token_ids, want.finish_reason, want.prompt_tokens)
    assert got.cached_tokens == got.prompt_tokens - 1  # the server just computed it


def test_batch_n_and_logprobs(remote, engine):
    prompts = ["A stitch in time", "Question: what"]
    got = remote.generate(prompts, {**GREEDY, "n": 2, "logprobs": 2})
    assert isinstance(got, list) and len(got) == 2
    for c, p in zip(got, prompts):
        assert len(c.outputs) == 2 and c.outputs[0].token_ids == c.token_ids
        assert len(c.logprobs) == 8 and len(c.logprobs[0]["top_logprobs"]) == 2
        assert c.text == engine.generate(p, GREEDY).text


async def test_agenerate_and_astream(remote, engine):
    want = engine.generate("prefix caching", GREEDY)
    got = await remote.agenerate("prefix caching", GREEDY)
    assert got.token_ids == want.token_ids
    chunks = [c async for c in remote.astream("prefix caching", GREEDY)]
    assert all(isinstance(c, prefixrt.Chunk) for c in chunks)
    assert "".join(c.text for c in chunks) == want.text
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8


def test_stream_and_early_close_aborts(remote, engine, server):
    want = engine.generate("radix trees", GREEDY)
    chunks = list(remote.stream("radix trees", GREEDY))
    assert "".join(c.text for c in chunks) == want.text
    before = remote.stats().aborted_requests_total
    it = remote.stream("radix trees", {"max_new_tokens": 120, "ignore_eos": True})
    next(it)
    it.close()
    server.wait_idle()
    s = remote.stats()
    assert s.aborted_requests_total - before == 1
    assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0


def test_cache_prefix_stats_flush(remote, server):
    prompt = [1] + list(range(100, 140))
    server.wait_idle()
    remote.flush_cache()
    assert remote.stats().kv_evictable == 0
    assert remote.cache_prefix(prompt) == remote.stats().kv_evictable == len(prompt)
    c = remote.generate(prompt + [7, 8], GREEDY)
    assert c.cached_tokens == len(prompt)
    s = remote.stats()
    assert isinstance(s, prefixrt.EngineStats) and s.to_dict() == server.stats()
    assert remote.cache_prefix(prompt, cache_salt="tenant-b") == len(prompt)


@pytest.mark.parametrize("prompt, params, param", [
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"bogus": 1}, "bogus"),
    ("", {}, "prompt"),
    ([1, 10**6], {}, "prompt"),
    ("x " * 400, {}, "prompt"),
])
def test_invalid_request_same_as_engine(remote, engine, prompt, params, param):
    with pytest.raises(InvalidRequest) as local:
        engine.generate(prompt, params)
    with pytest.raises(InvalidRequest) as e:
        remote.generate(prompt, params)
    assert e.value.param == local.value.param == param
    with pytest.raises(InvalidRequest):
        remote.stream(prompt, params)
    assert remote.generate("ok", {"max_new_tokens": 1}).completion_tokens == 1
