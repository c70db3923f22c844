"""The OpenAI-compatible API through the real `openai` client: over HTTP and through the in-process shim."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]


def test_chat_nonstream_and_stream_agree(client):
    full = client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    u = full.usage
    assert u.completion_tokens == 12 and u.total_tokens == u.prompt_tokens + 12
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_completions_nonstream_and_stream_agree(client):
    full = client.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=10, **GREEDY)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_completions_batch_of_prompts(client):
    prompts = ["The quick brown", "A stitch in time", "prefix caching"]
    out = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in out.choices] == list(range(6))
    solo = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=4, **GREEDY).choices[0].text for p in prompts]
    assert [out.choices[2 * k].text for k in range(3)] == solo


def test_n_samples(client):
    out = client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(1 for _ in range(3)) * 0 + out.usage.completion_tokens
    assert len({c.message.content for c in out.choices}) > 1, "3 samples at temperature 1 should differ"
    stream = client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=8, n=3, temperature=1.0, seed=3,
                                            stream=True)
    texts = {0: "", 1: "", 2: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]


def test_stop_string(client):
    ref = client.completions.create(model="tiny-llama", prompt="Question: what", max_tokens=30, **GREEDY).choices[0].text
    stop = ref[8:11]
    assert stop and stop in ref
    out = client.completions.create(model="tiny-llama", prompt="Question: what", max_tokens=30, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref[: ref.index(stop)]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_length(client, field):
    out = client.chat.completions.create(model="tiny-llama", messages=MSGS, **{field: 7}, **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 7


def test_logprobs(client):
    out = client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=5, logprobs=True, top_logprobs=3,
                                         **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for lp in content:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.logprob == pytest.approx(max(t.logprob for t in lp.top_logprobs))  # greedy picks the top
    assert "".join(lp.token for lp in content) == out.choices[0].message.content
    cmp = client.completions.create(model="tiny-llama", prompt="The quick", max_tokens=4, logprobs=2, **GREEDY)
    lps = cmp.choices[0].logprobs
    assert len(lps.tokens) == 4 and all(len(t) <= 2 for t in lps.top_logprobs)
    assert lps.text_offset[0] == 0


def test_same_seed_same_text(client):
    kw = dict(model="tiny-llama", prompt="A stitch", max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=99, **kw).choices[0].text
    assert a == b
    assert a != c


def test_same_chat_twice_is_cached(client):
    msgs = [{"role": "user", "content": f"radix trees index token sequences {time.monotonic_ns()}"}]
    client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2, **GREEDY)
    second = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_streaming_is_incremental(request, client):
    """Text arrives while the request is still generating: when the first chunk is read, the engine still runs
    the request (a buffered stream would deliver its first chunk only after the last token). No wall-clock bound,
    so a loaded machine cannot fail it."""
    if "http" in request.node.callspec.id:
        running = lambda: request.getfixturevalue("server").stats()["requests_running"]  # noqa: E731
    else:
        running = lambda: request.getfixturevalue("engine").stats().requests_running  # noqa: E731
    texts, running_at_first = [], None
    for ch in client.completions.create(model="tiny-llama", prompt="hi", max_tokens=110, stream=True, **GREEDY):
        if ch.choices and ch.choices[0].text:
            if not texts:
                running_at_first = running()
            texts.append(ch.choices[0].text)
    assert len(texts) > 20
    assert running_at_first >= 1, "the first chunk arrived after the request had finished: the stream was buffered"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"extra_body": {"top_k": 0}}, "top_k"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"extra_body": {"regex": "a", "choices": ["x"]}}, "choices"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_params_are_400_with_param(client, kwargs, param):
    body = {"model": "tiny-llama", "messages": MSGS, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.param == param, e.value.body
    assert e.value.response.headers.get("x-should-retry") == "false"
    assert client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=1).choices  # still serving


def test_zero_output_limits_and_seeds_outside_int64_are_400(client):
    """max_tokens / max_completion_tokens / max_output_tokens 0 and a seed outside the signed 64-bit range are
    a 400 naming the parameter (as OpenAI and vLLM answer), on chat, completions and responses."""
    calls = [
        ("max_tokens", lambda: client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=0)),
        ("max_completion_tokens",
         lambda: client.chat.completions.create(model="tiny-llama", messages=MSGS, max_completion_tokens=0)),
        ("max_tokens", lambda: client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=0)),
        ("max_output_tokens", lambda: client.responses.create(model="tiny-llama", input="Hi", max_output_tokens=0)),
        ("max_tokens", lambda: client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=-3)),
        ("seed", lambda: client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=1, seed=2**63)),
        ("seed", lambda: client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=1, seed=-(2**63) - 1)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.param == param, e.value.body
    for seed in (2**63 - 1, -(2**63)):  # the ends of the range are served
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=1, seed=seed).choices


def test_prompt_too_long_and_bad_token_ids(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x " * 400, max_tokens=1)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=[1, 99999], max_tokens=1)
    assert e.value.param == "prompt"


async def test_async_chat_and_completions(aclient):
    out = await aclient.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=6, **GREEDY)
    assert out.usage.completion_tokens == 6
    text = ""
    stream = await aclient.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=6, stream=True, **GREEDY)
    async for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
    assert text == out.choices[0].message.content
    cmp = await aclient.completions.create(model="tiny-llama", prompt="The quick", max_tokens=3, **GREEDY)
    assert cmp.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        await aclient.completions.create(model="tiny-llama", prompt="x", max_tokens=-1)


def _prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_agree_with_stats(server):
    http = httpx.Client(base_url=server.url, timeout=30)
    http.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3}).raise_for_status()
    stats = server.wait_idle()
    m = _prometheus(http.get("/metrics").text)
    assert m["prefixrt_prompt_tokens_total"] == stats["prompt_tokens_total"]
    assert m["prefixrt_cached_tokens_total"] == stats["cached_tokens_total"]
    assert m["prefixrt_generated_tokens_total"] == stats["generated_tokens_total"]
    assert m["prefixrt_evicted_tokens_total"] == stats["evicted_tokens_total"]
    assert m["prefixrt_requests_total"] == stats["requests_total"]
    for g in ("kv_total", "kv_free", "kv_evictable", "kv_locked"):
        assert m[f"prefixrt_{g}_tokens"] == stats[g]
    assert m["prefixrt_requests_running"] == 0 and m["prefixrt_requests_waiting"] == 0
    assert m["prefixrt_time_to_first_token_seconds_count"] > 0
    assert m["prefixrt_inter_token_latency_seconds_count"] > 0
    assert m["prefixrt_e2e_request_latency_seconds_count"] > 0
    assert http.get("/health").json() == {"status": "ok"}
    err = http.get("/nope")
    assert err.status_code == 404 and err.json()["error"]["type"] == "not_found_error"


def test_unknown_model_is_404_naming_the_served_names(client, engine):
    """Over HTTP a `model` the server does not serve is a 404 model_not_found naming what it serves (as OpenAI
    and vLLM answer); the in-process shim serves any name (its drop-in promise)."""
    calls = [lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1),
             lambda: client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1),
             lambda: client.responses.create(model="gpt-4o", input="Hi", max_output_tokens=1)]
    for call in calls:
        if client.base_url.host == "prefixrt.local":  # the shim
            call()
            continue
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert repr(engine.model_name) in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_served_model_name_aliases_and_any_model_name(engine):
    """--served-model-name takes several aliases (all listed, each served, the first reported); with
    --any-model-name every name is served."""
    import argparse

    from prefixrt.server.app import create_app
    from prefixrt.server.launch import add_serve_args
    from tests.helpers.live_server import LiveServer

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--served-model-name", "main", "alias", "--any-model-name"])
    assert args.served_model_name == ["main", "alias"] and args.any_model_name
    assert p.parse_args([]).served_model_name is None and not p.parse_args([]).any_model_name

    with LiveServer(create_app(engine, served_model_name=["main", "alias"])) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["main", "alias"]
        assert c.models.retrieve("alias").id == "alias"
        out = c.chat.completions.create(model="alias", messages=MSGS, max_tokens=1)
        assert out.model == "main"
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1)
        assert "'main', 'alias'" in e.value.message
    with LiveServer(create_app(engine, served_model_name="main", any_model_name=True)) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1).choices
