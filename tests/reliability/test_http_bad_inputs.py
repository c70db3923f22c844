"""Issue 10's bad-input matrix over HTTP, against `prefixrt serve` on a tiny checkpoint (128-token context).

Every case gets a clean answer in bounded time: a 4xx with an OpenAI error object naming the parameter, or a
normal completion whose finish_reason is one of OpenAI's; never a 5xx, a hang or finish_reason "abort".
Items 0-2 (sampling) are fixed in the engine; here they are checked end to end.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.reliability.conftest import assert_error_shape, sse_events
from tests.server.conftest import ServeProcess

FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}  # OpenAI's enum (chat adds function_call)
MSGS = [{"role": "user", "content": "hi"}]


def _deep_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.fixture(scope="module")
def live(model_dirs, tmp_path_factory):
    args = ["--model", str(model_dirs("llama")), "--served-model-name", "tiny-llama", "--device", "cpu", "--kv-cache-tokens", "8192", "--log-level",
            "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("bad") / "serve.log") as server:
        yield server
        log = server.log()
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
        assert server.stats()["requests_running"] == 0


def _post(live, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)  # json.dumps keeps lone surrogates
    return httpx.post(live.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=kw.pop("timeout", 60), **kw)


SURROGATE, NUL = "a\ud800b", "a\x00b"

# (path, body, expected param) -> 400 with an OpenAI error object
BAD_400 = [
    # item 3: lone surrogates and NUL on every text path
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", SURROGATE], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": NUL, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True, "stop": ["x", SURROGATE]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "regex": "a\ud800"}, "regex"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "grammar": 'start: "a\x00"'}, "grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 2},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "stream": True, "stop": NUL}, "stop"),
    ("/generate", {"prompt": SURROGATE, "sampling_params": {"max_new_tokens": 2}}, "prompt"),
    ("/generate", {"prompts": ["ok", NUL], "sampling_params": {"max_new_tokens": 2}}, "prompts[1]"),
    ("/generate", {"prompt": "hi", "sampling_params": {"regex": "\udfff"}}, "sampling_params.regex"),
    ("/generate", {"prompt": "hi", "stream": True, "sampling_params": {"stop": [SURROGATE]}},
     "sampling_params.stop[0]"),
    ("/cache_prefix", {"prompt": SURROGATE}, "prompt"),
    # item 4: a JSON schema nested 300 objects deep, on every way in
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "json_schema": _deep_schema(300)}, "json_schema"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(300)}}}, "response_format"),
    ("/generate", {"prompt": "hi", "sampling_params": {"json_schema": _deep_schema(300)}}, "sampling_params"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _deep_schema(300)}}]}, "tools"),
    # item 9: max_tokens above the context, invalid tool schemas under tool_choice auto
    ("/v1/completions", {"prompt": "hi", "max_tokens": 128}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 500}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 500, "stream": True},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    # item 1: a seed that does not fit in 64 bits (used to hang forever)
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 10**30, "n": 2}, "seed"),
    ("/generate", {"prompt": "hi", "sampling_params": {"seed": 2**64, "max_new_tokens": 4}}, "sampling_params.seed"),
]


@pytest.mark.parametrize("path, body, param", BAD_400, ids=[f"{p} {q}" for p, _, q in BAD_400])
def test_bad_input_is_a_400(live, path, body, param):
    r = _post(live, path, {"model": "tiny-llama", **body})
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = assert_error_shape(r.json())
    assert err["type"] == "invalid_request_error" and r.headers["x-should-retry"] == "false"
    assert err["param"] == param, err


def test_malformed_json_param_is_null(live):
    """Issue item 9: the error used to carry the byte offset as `param`."""
    for raw in (b'{"model": "tiny-llama", "prompt": "hi",', b"{not json}", b'{"prompt": "hi"} trailing'):
        r = _post(live, "/v1/completions", raw)
        assert r.status_code == 400, r.text
        err = assert_error_shape(r.json())
        assert err["param"] is None and "not valid JSON" in err["message"], err


def test_body_size_limit_is_a_413(live):
    """Build 2: an oversized body gets a clear 413 (declared length, and a chunked body without one)."""
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (33 * 2**20) + b'", "max_tokens": 2}'
    r = _post(live, "/v1/completions", big, timeout=120)
    assert r.status_code == 413, r.text[:300]
    err = assert_error_shape(r.json())
    assert err["code"] == "request_too_large" and "32 MiB" in err["message"], err

    def chunks():
        for i in range(0, len(big), 2**20):
            yield big[i:i + 2**20]

    r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and "request_too_large" in r.text, r.text[:300]


def test_five_megabyte_prompt_still_gets_an_answer(live):
    """Under the limit, a 5 MB prompt is tokenized and answered (here: it is longer than the 128-token context)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]
    for path, body in (("/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": prompt}]})):
        r = _post(live, path, body, timeout=300)
        assert r.status_code == 400, r.text[:300]
        err = assert_error_shape(r.json())
        assert "the model's context is 128" in err["message"] and err["param"] in ("prompt", "messages"), err


# Items 0 and 2: sampling extremes that used to crash the sampler and abort every request of the batch.
SAMPLING_EXTREMES = [
    {"n": 2, "temperature": 0.8, "top_p": 0.9},
    {"n": 2, "temperature": 0.8, "top_k": 5, "min_p": 0.1},
    {"temperature": 1e-300},
    {"top_k": 9223372036854775808},
    {"seed": 2**64 - 1, "n": 2, "temperature": 1.0},
    {"temperature": 1e-300, "top_p": 1e-9, "stream": True},
]


@pytest.mark.parametrize("extra", SAMPLING_EXTREMES, ids=[str(e) for e in SAMPLING_EXTREMES])
def test_sampling_extremes_finish_normally(live, extra):
    body = {"model": "tiny-llama", "messages": MSGS, "max_tokens": 6, **extra}
    r = _post(live, "/v1/chat/completions", body, timeout=60)
    if r.status_code == 400:  # refused up front is fine; a crash, a hang or an abort is not
        assert_error_shape(r.json())
        return
    assert r.status_code == 200, r.text[:300]
    if extra.get("stream"):
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    else:
        reasons = [c["finish_reason"] for c in r.json()["choices"]]
    assert len(reasons) == extra.get("n", 1) and set(reasons) <= FINISH_REASONS, reasons


# ---------------------------------------------------------------------------------------------- item 7
def test_engine_error_is_an_openai_error(make_engine, monkeypatch):
    """A request the engine aborts with an internal error: a 500 error object naming it, or an error event in a
    stream; its batch neighbour is unaffected. (The in-process shim runs the same app as `prefixrt serve`.)"""
    from prefixrt.openai import OpenAI

    eng = make_engine("llama")
    real = eng.core._post_process

    def poisoned(r, tok, lp, now):
        if r.params.stop == ["POISON"] and len(r.output_ids) >= 2:
            raise ValueError("post-processing poison")
        return real(r, tok, lp, now)

    monkeypatch.setattr(eng.core, "_post_process", poisoned)
    client = OpenAI(engine=eng)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=8, stop="POISON")
    assert e.value.status_code == 500 and "post-processing poison" in e.value.message
    assert e.value.body["code"] == "internal_error"
    with pytest.raises(openai.APIError, match="post-processing poison"):
        for _ in client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=8, stop="POISON", stream=True):
            pass
    ok = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=8, extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length"
    client.close()


def test_aborted_stream_ends_with_an_error_not_finish_reason_abort(live):
    """POST /abort on a running stream: OpenAI clients never see finish_reason "abort"."""
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 110, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        rid = json.loads(first[6:])["id"]
        assert httpx.post(live.url + "/abort", json={"request_id": rid}, timeout=30).status_code == 200
        events = sse_events([first, *lines])
    assert events[-1] == "[DONE]", events[-3:]
    if "error" in events[-2]:  # it may have finished before the abort landed
        assert events[-2]["error"]["code"] == "request_aborted"
    reasons = {c["finish_reason"] for e in events[:-1] if "choices" in e for c in e["choices"]}
    assert "abort" not in reasons
