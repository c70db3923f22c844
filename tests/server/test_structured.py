"""response_format and tools/tool_choice, through the real openai client (HTTP and shim)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.conftest import needs_constrained_decoding


@pytest.fixture(scope="module")
def gemma_client(gemma_engine_session):
    """Gemma-3-270M through the in-process shim, on the session's one Gemma engine (tests/conftest.py)."""
    from prefixrt.openai import OpenAI

    client = OpenAI(engine=gemma_engine_session)
    yield client
    client.close()

MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["city"],
                                                     "properties": {"city": {"type": "string", "maxLength": 6}}}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["a", "b"],
                                                     "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=150)


@needs_constrained_decoding()
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        kw = dict(model="tiny-llama", messages=MSGS, temperature=1.0, seed=seed, response_format=rf)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            out = client.chat.completions.create(**kw)
            assert out.choices[0].finish_reason == "stop"
            text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


@needs_constrained_decoding()
def test_json_object(client):
    out = client.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@needs_constrained_decoding()
def test_parse_pydantic(client):
    out = client.chat.completions.parse(model="tiny-llama", messages=MSGS, temperature=0.7, seed=1,
                                        response_format=Person)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150


@needs_constrained_decoding()
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_call(client, choice):
    out = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "add 2 and 3"}],
                                         temperature=0, tools=TOOLS, tool_choice=choice,
                                         parallel_tool_calls=False, extra_body={"tool_prompt": False})
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    # Streaming gives the same call: a first delta with its index, id, type and name, then its arguments' text
    # in pieces as they are generated (as OpenAI streams them).
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "add 2 and 3"}],
                                                 temperature=0, tools=TOOLS, tool_choice=choice,
                                                 parallel_tool_calls=False, stream=True,
                                                 extra_body={"tool_prompt": False}))
    deltas = [tc for ch in chunks for ch_c in ch.choices for tc in (ch_c.delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == call.function.name and first.function.arguments == ""
    assert len(rest) > 1 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in rest)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _call_view(message) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]


@needs_constrained_decoding()
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_accumulate_to_the_unstreamed_ones(client, choice):
    """The openai SDK's stream accumulator joins the argument deltas into the same calls (parallel ones included) and
    the same content as the unstreamed request gives; a call's arguments came in several deltas."""
    text_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kinds = set()
    for seed, rf in [(s, None) for s in range(4)] + [(s, text_schema) for s in range(2)]:
        kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "weather in Paris, and 2 + 3?"}],
                  temperature=1.0, seed=seed, max_tokens=70, tools=TOOLS, tool_choice=choice,
                  extra_body={"tool_prompt": False})
        if rf is not None:  # a JSON answer beside the tools: under auto it begins as a call does
            kw["response_format"] = rf
        want = client.chat.completions.create(**kw).choices[0]
        # The accumulator behind the SDK's chat.completions.stream() helper (whose final parse refuses a reply
        # cut by max_tokens, which random weights may write).
        state, events = ChatCompletionStreamState(input_tools=TOOLS), []
        for chunk in client.chat.completions.create(stream=True, **kw):
            events += state.handle_chunk(chunk)
        got = state.current_completion_snapshot.choices[0]
        if want.finish_reason == "length" and got.message.tool_calls:
            # cut inside a call: unstreamed it is no call (its text is the content); streamed, its deltas were sent
            assert got.finish_reason == "length" and want.message.content.lstrip()[:1] in "{<["
            kinds.add("cut")
            continue
        # (the stream's first delta, sent before the reply is known to be calls, has content "")
        assert (got.finish_reason, got.message.content or None, _call_view(got.message)) == \
            (want.finish_reason, want.message.content or None, _call_view(want.message)), (seed, rf is not None)
        pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
        if want.message.tool_calls:
            kinds.add("calls")
            assert want.finish_reason == "tool_calls"
            if rf is None:
                assert len(pieces) > len(want.message.tool_calls)
        else:
            kinds.add("text")
            assert not pieces
    assert "calls" in kinds or choice == "auto"  # under auto, which kinds occur depends on the random weights


@needs_constrained_decoding()
def test_regex_and_choices_extra_body(client):
    out = client.completions.create(model="tiny-llama", prompt="Phone:", max_tokens=20, temperature=1.0, seed=0,
                                    extra_body={"regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(out.choices[0].text) == 8 and out.choices[0].text[3] == "-"
    out = client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=5,
                                         extra_body={"choices": ["alpha", "beta"]})
    assert out.choices[0].message.content in ("alpha", "beta")


@needs_constrained_decoding()
def test_invalid_schema_is_400(client):
    import openai

    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=5, response_format=rf)
    assert e.value.param == "json_schema"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=5, extra_body={"regex": "(unclosed"})
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=1).choices


@needs_constrained_decoding()
def test_gemma_tool_call_with_tool_prompt(gemma_client):
    """The real model, with the tools described in the prompt: a forced call names a tool and valid args."""
    out = gemma_client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=40, temperature=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    # The tool descriptions went into the prompt (as signatures, lowering.tools_prompt): it is longer than the
    # same conversation without tools by at least the tools' names.
    plain = gemma_client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=1)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 2 * len(TOOLS)


@needs_constrained_decoding()
def test_python_type_names_are_read_as_json_schema_types(client):
    """Schemas as people write them (SGLang's own server tests send "int", "str", "float", "bool"): served, the
    names normalised and said in the x-prefixrt-warning header; an unknown name is a 400 naming its node."""
    schema = {"type": "object", "properties": {"name": {"type": "str", "maxLength": 6},
                                               "age": {"type": "int", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "bool"}, "w": {"type": ["Float", "null"]}},
              "required": ["name", "age", "ok", "w"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    raw = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MSGS, max_tokens=60,
                                                            temperature=0, response_format=fmt)
    warning = raw.headers.get("x-prefixrt-warning")
    assert warning and "'int' at /properties/age/type read as 'integer'" in warning, warning
    assert "'Float' at /properties/w/type/0 read as 'number'" in warning
    out = raw.parse().choices[0]
    if out.finish_reason == "stop":
        value = json.loads(out.message.content)
        assert isinstance(value["age"], int) and isinstance(value["ok"], bool) and isinstance(value["name"], str)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "int", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=MSGS, max_tokens=80, temperature=0, tools=[tool], tool_choice="required",
        extra_body={"tool_prompt": False})
    assert "tools[0].function.parameters: type 'int' at /properties/n/type" in raw.headers["x-prefixrt-warning"]
    call = raw.parse().choices[0].message.tool_calls[0]
    assert isinstance(json.loads(call.function.arguments)["n"], int)
    plain = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MSGS, max_tokens=2)
    assert "x-prefixrt-warning" not in plain.headers

    bad = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "strng"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    assert "'strng' at /properties/tags/items/type" in e.value.message and e.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2,
                                  extra_body={"json_schema": {"type": "integr"}})
    assert "'integr' at /type" in e.value.message


@needs_constrained_decoding()
def test_cached_tokens_of_repeated_forced_calls(client):
    """cached_tokens is at most prompt_tokens: a plain repeat reuses prompt_tokens - 1 (the last prompt token is
    computed); a repeat whose reply begins with forced tokens (a forced tool call's `{"name": "f", ...`) reuses
    the whole prompt, the forced tokens being computed instead, and counted as completion tokens."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "Call f, forced and cached."}],
              max_tokens=80, temperature=0, tools=[tool], tool_choice="required", extra_body={"tool_prompt": False})
    client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    u = again.usage
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens
    arguments = again.choices[0].message.tool_calls[0].function.arguments
    assert u.completion_tokens >= 4 and json.loads(arguments)["n"] in range(10)
    plain = dict(model="tiny-llama", messages=[{"role": "user", "content": "A plain repeat, cached."}], max_tokens=3)
    client.chat.completions.create(**plain)
    u = client.chat.completions.create(**plain).usage
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1
