"""OpenAI conformance of `prefixrt serve`, through the real `openai` client and checked against OpenAI's
published component schemas (tests/server/openai_spec/components.json, cut from openai/openai-openapi by
extract.py there; its commit and spec version are recorded in the file).

The cases port, in our own words, what the peer servers' suites check for the same behaviour: vLLM's
tests/entrypoints/openai (test_completion, test_chat, tool calling) and SGLang's test/srt/openai_server
(test_openai_server, tool_choice). The model is the tiny random-weights llama (session `server`), so checks
are about the protocol: shapes, counts, constraint adherence, errors. Assertions about answer quality (the
model answering "Paris", picking the right tool) are listed at the end as skipped, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import SERVED_NAME, needs_constrained_decoding

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
NO_TOOL_PROMPT = {"tool_prompt": False}  # the tiny model's context (128) has no room for the tools' description


def _nullable(node):
    """OpenAPI's `nullable: true` (which the published document still uses beside 3.1 `type: null`) as JSON
    Schema: null is allowed too."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


SPEC = _nullable(json.loads((Path(__file__).parent / "openai_spec" / "components.json").read_text()))


def conforms(name: str, instance) -> None:
    """instance validates against the published component schema `name` (refs resolved in the document)."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": SPEC["components"]}
    jsonschema.Draft202012Validator(schema).validate(instance)


def conforms_event(event: dict) -> None:
    """A Responses stream event validates against the member of ResponseStreamEvent for its type."""
    for ref in SPEC["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        if event["type"] in SPEC["components"]["schemas"][name]["properties"]["type"].get("enum", []):
            conforms(name, event)
            return
    raise AssertionError(f"no published event type {event['type']!r}")


@pytest.fixture(scope="module")
def server(long_server):
    """The tiny llama with room for tools' descriptions (tests/server/conftest.py `long_server`)."""
    return long_server


@pytest.fixture(scope="module")
def oai(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def sse_events(resp: httpx.Response) -> list[dict]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


# ---------------------------------------------------------------------------------------------- models


def test_models_list_and_retrieve(oai, http):
    models = oai.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    m = oai.models.retrieve(SERVED_NAME)  # SGLang test_retrieve_model
    assert m.id == SERVED_NAME and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    conforms("ListModelsResponse", http.get("/v1/models").json())
    conforms("Model", http.get(f"/v1/models/{SERVED_NAME}").json())
    err = http.get("/v1/models/no-such-model")
    assert err.status_code == 404
    conforms("ErrorResponse", err.json())


# ---------------------------------------------------------------------------------------------- completions


def test_completion_shape_and_usage(oai, http):
    out = oai.completions.create(model=SERVED_NAME, prompt="Hello, my name is", max_tokens=5, temperature=0)
    c = out.choices[0]
    assert c.finish_reason in ("length", "stop") and c.index == 0
    assert out.usage.completion_tokens <= 5 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    conforms("CreateCompletionResponse", http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "Hello", "max_tokens": 5, "logprobs": 2}).json())


def test_completion_logprobs_zero_some_and_too_many(oai):
    none = oai.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None
    zero = oai.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=4, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    # logprobs 0: top_logprobs still carries the sampled token (vLLM: exactly one entry).
    assert all(len(t) == 1 and tok in t for t, tok in zip(lp.top_logprobs, lp.tokens))
    assert all(abs(t[tok] - v) < 1e-6 for t, tok, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    some = oai.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=4, temperature=0, logprobs=5)
    # Up to 5 alternatives plus the sampled token, keyed by text: byte pieces of the tiny byte-level vocabulary
    # that decode to the same text ("\ufffd") share a key, so fewer keys can appear.
    slp = some.choices[0].logprobs
    assert all(1 <= len(t) <= 6 and tok in t for t, tok in zip(slp.top_logprobs, slp.tokens))
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=4, logprobs=21)


def test_completion_echo(oai):
    prompt = "The quick brown fox"
    plain = oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0)
    echoed = oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    with_lps = oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                      logprobs=1)
    lp = with_lps.choices[0].logprobs
    n_out = with_lps.usage.completion_tokens
    n_prompt = with_lps.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + n_out  # prompt tokens (BOS included) then the completion
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # The completion part's logprobs equal those of the request without echo.
    ref = oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(ref.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True) if ch.choices)
    assert streamed == echoed.choices[0].text


def test_completion_echo_of_token_ids_and_streamed_prompt_logprobs(oai, tiny_tokenizer):
    """echo with a prompt given as token ids echoes the decoded prompt; echo with logprobs under stream: true
    is served, the prompt's logprobs in each sample's first chunk (as vLLM serves it)."""
    prompt = "The quick brown fox"
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == prompt
    plain = oai.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0)
    echoed = oai.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text

    kw = dict(model=SERVED_NAME, max_tokens=4, temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    for p in (prompt, ids):
        whole = oai.completions.create(prompt=p, **kw).choices[0]
        chunks = [c.choices[0] for c in oai.completions.create(prompt=p, stream=True, **kw) if c.choices]
        assert "".join(c.text for c in chunks) == whole.text
        first = chunks[0].logprobs
        n_prompt = len(whole.logprobs.tokens) - 4
        assert first.tokens[:n_prompt] == whole.logprobs.tokens[:n_prompt] and first.token_logprobs[0] is None
        streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        assert offsets == whole.logprobs.text_offset


def test_completion_streaming_matches_and_stream_options(oai, http):
    kw = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
    text = oai.completions.create(**kw).choices[0].text
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as e:  # vLLM and OpenAI: stream_options needs stream
        oai.completions.create(stream_options={"include_usage": True}, **kw)
    assert e.value.param == "stream_options"
    with http.stream("POST", "/v1/completions", json={**kw, "stream": True, "logprobs": 1}) as r:
        events = sse_events(r)
    # The document shares CreateCompletionResponse between streamed and whole responses and gives
    # finish_reason no null, which streamed chunks before the last have (OpenAI's API sends null there too).
    for ev in events:
        conforms("CreateCompletionResponse", ev) if ev["choices"][0]["finish_reason"] else None
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_completion_batch_and_n(oai):
    out = oai.completions.create(model=SERVED_NAME, prompt=["Hello", "Goodbye"], max_tokens=3, n=2, temperature=1,
                                 seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_logit_bias(oai, http):
    """vLLM test_logits_bias: a +100 bias on one token makes it every sampled token; -100 on the greedy token
    removes it; ids outside the vocabulary and values outside [-100, 100] are a 400."""
    def first_ids(bias=None) -> list[int]:
        sp = {"max_new_tokens": 5, "temperature": 1.0, "seed": 0, **({"logit_bias": bias} if bias else {})}
        return http.post("/generate", json={"prompt": "Hello", "sampling_params": sp}).json()["token_ids"]

    out = oai.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=5, temperature=1.0, seed=0,
                                 logit_bias={"100": 100}, logprobs=0)
    assert len(set(out.choices[0].logprobs.tokens)) == 1 and out.usage.completion_tokens == 5
    assert first_ids({"100": 100}) == [100] * 5
    def greedy(bias=None) -> int:
        sp = {"max_new_tokens": 1, "temperature": 0, **({"logit_bias": bias} if bias else {})}
        return http.post("/generate", json={"prompt": "Hello", "sampling_params": sp}).json()["token_ids"][0]

    top = greedy()
    assert greedy({str(top): -100}) != top
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=1, logit_bias={"1000000": 5})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=1, logit_bias={"5": 300})


def test_logit_bias_names_every_bad_key(oai, http):
    """One 400 names every offending logit_bias key, not only the first: keys that are not token ids, values
    outside [-100, 100], ids outside the vocabulary."""
    cases = [({"abc": 1, "-4": 2, "7": 3}, ["'abc'", "'-4'"]),
             ({"5": 300, "6": -101, "7": 1}, ["'5': 300", "'6': -101"]),
             ({"1000000": 5, "2000000": 5, "7": 1}, ["1000000", "2000000"])]
    for bias, named in cases:
        for call in (lambda b=bias: oai.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1,
                                                           logit_bias=b),
                     lambda b=bias: oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=1,
                                                                logit_bias=b)):
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.param == "logit_bias" and all(n in e.value.message for n in named), e.value.message
    r = http.post("/generate", json={"prompt": "Hi", "sampling_params": {"max_new_tokens": 1,
                                                                      "logit_bias": {"x": 1, "y": 2}}})
    assert r.status_code == 400 and "'x'" in r.text and "'y'" in r.text


# ---------------------------------------------------------------------------------------------- chat


def test_chat_shape_refusal_and_schema(oai, http):
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=5, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.refusal is None and isinstance(msg.content, str)
    body = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": MSGS, "max_tokens": 5,
                                                   "logprobs": True, "top_logprobs": 2}).json()
    assert "refusal" in body["choices"][0]["message"]
    conforms("CreateChatCompletionResponse", body)
    with http.stream("POST", "/v1/chat/completions", json={"model": SERVED_NAME, "messages": MSGS,
                                                           "max_tokens": 5, "stream": True, "logprobs": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    for ev in events:
        conforms("CreateChatCompletionStreamResponse", ev)
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_chat_logprobs_zero_some_and_too_many(oai):
    none = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=3, logprobs=False)
    assert none.choices[0].logprobs is None
    zero = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=3, logprobs=True,
                                       top_logprobs=0)
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)
    some = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=3, logprobs=True,
                                       top_logprobs=5)
    assert all(len(e.top_logprobs) == 5 for e in some.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=30)


def test_chat_stream_options_and_streaming_matches(oai):
    kw = dict(model=SERVED_NAME, messages=MSGS, max_tokens=8, temperature=0)
    text = oai.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(stream_options={"include_usage": False}, **kw)


def test_chat_message_forms(oai):
    """vLLM test_complex_message_content, test_extra_fields_allowed; developer role; deprecated functions."""
    out = oai.chat.completions.create(model=SERVED_NAME, max_tokens=2, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
         "extra_field": 1}])
    assert out.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=2,
                                    functions=[{"name": "f", "parameters": {}}])


def test_errors_conform(http):
    for body in ({"model": SERVED_NAME, "messages": []}, {"model": SERVED_NAME, "messages": MSGS, "n": 0},
                 {"model": SERVED_NAME, "messages": MSGS, "stream_options": {"include_usage": True}},
                 {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 0},
                 {"model": SERVED_NAME, "messages": MSGS, "max_completion_tokens": 0},
                 {"model": SERVED_NAME, "messages": MSGS, "seed": 2**63}):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        conforms("ErrorResponse", r.json())


# ---------------------------------------------------------------------------------------------- structured output


PERSON_OPEN = {"type": "object", "required": ["name", "age"],  # no additionalProperties: closed all the same
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


@needs_constrained_decoding()
def test_json_schema_with_python_type_names(oai):
    """SGLang's server tests write schemas with Python's type names ("int", "str"); SGLang serves them, and so
    does prefixrt (normalised, with a warning header)."""
    schema = {"type": "object", "properties": {"name": {"type": "str", "maxLength": 8},
                                               "population": {"type": "int", "minimum": 0, "maximum": 10**6}},
              "required": ["name", "population"]}
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=48, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "city", "schema": schema}})
    if out.choices[0].finish_reason == "stop":
        value = json.loads(out.choices[0].message.content)
        assert isinstance(value["name"], str) and isinstance(value["population"], int)


@needs_constrained_decoding()
def test_json_schema_without_additional_properties_is_closed(oai):
    for seed in range(4):
        out = oai.chat.completions.create(
            model=SERVED_NAME, messages=MSGS, max_tokens=150, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_OPEN}})
        obj = json.loads(out.choices[0].message.content)
        assert set(obj) == {"name", "age"}
        jsonschema.validate(obj, {**PERSON_OPEN, "additionalProperties": False})


@needs_constrained_decoding()
def test_structured_outputs_choice_regex_json(oai):
    """vLLM test_structured_outputs_{choice,regex,json}_chat, through extra_body."""
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=8,
                                      extra_body={"choices": ["Paris", "London"]})
    assert out.choices[0].message.content in ("Paris", "London")
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=20, temperature=1, seed=1,
                                      extra_body={"regex": r"[A-Z][a-z]{2,5}"})
    assert 3 <= len(out.choices[0].message.content) <= 6
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=60,
                                      response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":  # any object is unbounded: random weights may run to the limit
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------------------------------------- tools

NESTED_TOOL = {"type": "function", "function": {"name": "book", "description": "Book a trip", "parameters": {
    "type": "object", "required": ["who", "to"],
    "properties": {"who": {"$ref": "#/$defs/Person"}, "to": {"type": "string", "enum": ["Paris", "Rome"]}},
    "$defs": {"Person": {"type": "object", "required": ["name"],
                         "properties": {"name": {"type": "string", "maxLength": 6}}}}}}}
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
TOOLS = [NESTED_TOOL, ADD_TOOL]


def _check_call(call) -> None:
    """A call names a declared tool and carries exactly its parameters (closed objects), schema-valid."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    args = json.loads(call.function.arguments)
    from prefixrt.lowering.json_schema import strict_schema

    jsonschema.validate(args, strict_schema(params))
    assert set(args) <= set(params["properties"])


@needs_constrained_decoding()
def test_named_tool_choice_with_defs(oai):
    """vLLM named tool choice / SGLang specific-function: parameters using $defs/$ref resolve under the
    call schema (the issue's 'forced tool calls reject $defs')."""
    for seed in range(3):
        out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=80, temperature=1.0,
                                          seed=seed, tools=TOOLS, extra_body=NO_TOOL_PROMPT,
                                          tool_choice={"type": "function", "function": {"name": "book"}})
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "book"
        _check_call(call)


@needs_constrained_decoding()
def test_required_tool_choice_parallel_and_not(oai, http):
    """vLLM required tool choice / SGLang tool_choice required; parallel_tool_calls false: exactly one call."""
    out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=80, temperature=0,
                                      tools=TOOLS, extra_body=NO_TOOL_PROMPT, tool_choice="required", parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    _check_call(call)
    for seed in range(3):
        out = oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=200, temperature=1.0,
                                          seed=seed, tools=TOOLS, extra_body=NO_TOOL_PROMPT, tool_choice="required")
        c = out.choices[0]
        if c.finish_reason == "tool_calls":  # one or more calls, each complete and valid
            assert len(c.message.tool_calls) >= 1
            for call in c.message.tool_calls:
                _check_call(call)
            assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)
        else:  # ran out of tokens while still writing calls: never a half call returned as a call
            assert c.finish_reason == "length" and not c.message.tool_calls
    body = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": MSGS, "max_tokens": 80,
                                                   "tools": TOOLS, "tool_choice": "required", "tool_prompt": False,
                                                   "parallel_tool_calls": False}).json()
    conforms("CreateChatCompletionResponse", body)


@needs_constrained_decoding()
def test_auto_tool_choice_is_text_or_valid_calls(oai):
    """SGLang tool_choice auto: the reply is plain text or well-formed calls of declared tools; anything that
    starts like a call is one (the grammar alternation), streamed or not."""
    kinds = set()
    for seed in range(6):
        kw = dict(model=SERVED_NAME, messages=MSGS, max_tokens=60, temperature=1.0, seed=seed, tools=TOOLS, extra_body=NO_TOOL_PROMPT)
        c = oai.chat.completions.create(**kw).choices[0]
        if c.message.tool_calls:
            kinds.add("call")
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                _check_call(call)
        else:
            kinds.add("text")
            assert not (c.message.content or "").lstrip().startswith("{")
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        streamed_calls = _assembled_calls(chunks)
        assert streamed_calls == [(t.function.name, json.loads(t.function.arguments))
                                  for t in c.message.tool_calls or []]
        if not streamed_calls:
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert kinds  # which kinds occur depends on the random weights


def _assembled_calls(chunks) -> list[tuple[str, dict]]:
    """Streamed tool-call deltas joined per call index, as OpenAI's clients join them: (name, arguments)."""
    calls: dict[int, list] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name  # the first delta names the call
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    return [(name, json.loads(args)) for name, args in (calls[k] for k in sorted(calls))]


@needs_constrained_decoding()
def test_tool_history_round_trip(oai):
    """A call, its result as a tool message, and the next turn (vLLM test_chat_completion_with_tools)."""
    out = oai.chat.completions.create(model=SERVED_NAME, max_tokens=40, tools=TOOLS, extra_body=NO_TOOL_PROMPT, tool_choice="none",
                                      messages=[*MSGS, {"role": "assistant", "content": None, "tool_calls": [
                                          {"id": "c1", "type": "function",
                                           "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                                          {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_errors(oai):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=2, tools=TOOLS, extra_body=NO_TOOL_PROMPT,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=2, tool_choice="required")


# ---------------------------------------------------------------------------------------------- responses


def test_responses_text_and_schema(oai, http):
    r = oai.responses.create(model=SERVED_NAME, input="Say hi", instructions="Be brief.", max_output_tokens=6,
                             temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens <= 6
    body = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Say hi", "max_output_tokens": 6}).json()
    conforms("Response", body)
    assert oai.responses.retrieve(r.id).id == r.id


@needs_constrained_decoding()
def test_responses_json_schema_and_stream_events(oai, http):
    fmt = {"format": {"type": "json_schema", "name": "p", "schema": PERSON_OPEN}}
    r = oai.responses.create(model=SERVED_NAME, input=[{"role": "user", "content": "A person?"}], text=fmt,
                             max_output_tokens=60, temperature=0)
    obj = json.loads(r.output_text)
    jsonschema.validate(obj, {**PERSON_OPEN, "additionalProperties": False})
    events = list(oai.responses.create(model=SERVED_NAME, input="A person?", text=fmt, max_output_tokens=60,
                                       temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with http.stream("POST", "/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 5,
                                                    "stream": True}) as resp:
        for ev in sse_events(resp):
            conforms_event(ev)
            conforms("ResponseStreamEvent", ev)


@needs_constrained_decoding()
def test_responses_function_tools_and_previous_response(oai, http):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]
    r = oai.responses.create(model=SERVED_NAME, input="Add 2 and 3", tools=tools, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=80, temperature=0,
                             extra_body=NO_TOOL_PROMPT)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.name in ("add", "book")
    conforms("Response", http.get(f"/v1/responses/{r.id}").json())
    follow = oai.responses.create(model=SERVED_NAME, previous_response_id=r.id, tools=tools,
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
                                  max_output_tokens=8, temperature=0, tool_choice="none", extra_body=NO_TOOL_PROMPT)
    assert follow.output[0].type == "message"
    # The earlier turn is the prompt's prefix: its K/V comes from the radix cache.
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    streamed = list(oai.responses.create(model=SERVED_NAME, input="Add 2 and 3", tools=tools, stream=True,
                                         tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                         temperature=0, extra_body=NO_TOOL_PROMPT))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [(d.name, json.loads(d.arguments)) for d in done] == [(call.name, json.loads(call.arguments))]
    # The arguments stream as they are generated: several deltas between the item's added and done events.
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == call.name and added.item.arguments == ""
    deltas = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments
    final = next(e for e in streamed if e.type == "response.completed").response
    assert [(o.id, o.call_id, o.arguments) for o in final.output] == [(added.item.id, added.item.call_id,
                                                                       done[0].arguments)]
    for event in streamed:
        conforms_event(event.model_dump(mode="json", exclude_unset=True))
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=SERVED_NAME, input="x", previous_response_id="resp_missing")
    assert oai.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


# ---------------------------------------------------------------------------------------------- quality (skipped)

QUALITY = "asserts what a trained model answers; the tiny model has random weights (protocol checks run above)"


@pytest.mark.skip(reason=QUALITY)
def test_quality_chat_answers_paris():
    """vLLM test_single_chat_session / SGLang test_chat_completion: 'Paris' in the answer."""


@pytest.mark.skip(reason=QUALITY)
def test_quality_auto_tool_choice_picks_the_weather_tool():
    """vLLM test_chat_completion_with_tools / SGLang test_tool_choice_auto: the right tool and arguments."""


@pytest.mark.skip(reason=QUALITY)
def test_quality_parallel_calls_for_two_cities():
    """SGLang parallel tool calls: two calls for 'weather in Paris and Rome'."""
