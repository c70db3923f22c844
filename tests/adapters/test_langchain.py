"""ChatPrefixRT, each test in-process and through `prefixrt serve` (the `tiny_target` parameter): invoke/ainvoke/
stream/astream/batch/abatch, usage with cache reads, prefix sharing in batch, timeouts, options; structured output
valid on 20 of 20 calls and tool calls under tool_choice (constrained decoding: valid even from random weights,
given schemas with bounds); message lowering and tool schemas (no model)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from prefixrt.adapters.langchain import to_chat_messages
from pydantic import BaseModel, Field

from prefixrt.lowering.json_schema import SAFE_INTEGER, strict_schema
from prefixrt.lowering.tools import Tool, plan_tools, tools_prompt

SYSTEM = "You answer questions about the city library's opening hours and loan rules. " * 8


def test_invoke_reports_usage_and_metadata(tiny_target):
    model = tiny_target.chat(max_tokens=6)
    msg = model.invoke([SystemMessage(SYSTEM), HumanMessage("When do you open?")])
    again = model.invoke([SystemMessage(SYSTEM), HumanMessage("When do you open?")])
    assert isinstance(msg, AIMessage) and msg.response_metadata["model_name"] == "tiny-llama"
    u = again.usage_metadata
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["input_token_details"]["cache_read"] == u["input_tokens"] - 1


def test_streams_agree_with_invoke(tiny_target):
    model = tiny_target.chat(max_tokens=10)
    full = model.invoke("Tell me about loans")
    chunks = list(model.stream("Tell me about loans"))
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] > 0
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] > 0
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == full.content

    async def astream():
        return [c async for c in model.astream("Tell me about loans")]

    achunks = asyncio.run(astream())
    assert "".join(c.content for c in achunks) == full.content and isinstance(achunks[0], AIMessageChunk)
    assert achunks[-1].usage_metadata["input_token_details"]["cache_read"] > 0
    assert asyncio.run(model.ainvoke("Tell me about loans")).content == full.content


def test_batch_and_abatch_share_the_prefix(tiny_target):
    tiny_target.provider.flush_cache()
    model = tiny_target.chat(max_tokens=4)
    inputs = [[SystemMessage(SYSTEM), HumanMessage(f"Question {i}: can I renew?")] for i in range(12)]
    out = model.batch(inputs)
    cached = [m.usage_metadata["input_token_details"]["cache_read"] for m in out]
    assert sum(c > 0 for c in cached) >= 11, cached
    tiny_target.provider.flush_cache()
    out = asyncio.run(model.abatch(inputs))
    cached = [m.usage_metadata["input_token_details"]["cache_read"] for m in out]
    assert sum(c > 0 for c in cached) >= 11, cached


def test_timeout_aborts(tiny_target):
    model = tiny_target.chat(max_tokens=4000, timeout=0.05, max_retries=0)
    with pytest.raises(TimeoutError):
        model.invoke("Go on and on")
    with pytest.raises(TimeoutError):
        asyncio.run(model.ainvoke("Go on and on"))


def test_stop_and_per_call_options(tiny_target):
    model = tiny_target.chat(max_tokens=3)
    assert model.invoke("hi", max_tokens=1).usage_metadata["output_tokens"] <= 1
    with pytest.raises(ValueError, match="no sampling option"):
        model.invoke("hi", bogus=True)
    with pytest.raises(ValueError, match="serves"):
        model.invoke("hi", model="another-model")


# ---------------------------------------------------------------------------------------------- constrained


class Book(BaseModel):
    title: str = Field(max_length=16)
    year: int = Field(ge=1800, le=2030)
    fiction: bool
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


TOPICS = ["a sea voyage", "a detective", "the moon", "gardening", "a dragon", "cooking", "war", "physics",
          "a love story", "a robot", "ancient Rome", "birds", "a haunted house", "chess", "music", "trains",
          "a desert", "a king", "the ocean", "mountains"]


def test_structured_output_is_valid_every_time(tiny_target):
    model = tiny_target.chat(max_tokens=128).with_structured_output(Book, include_raw=True)
    replies = model.batch([f"Invent a book about {t}." for t in TOPICS])  # 20 calls, concurrently
    assert len(replies) == 20
    for r in replies:  # complete, schema-valid JSON every time (not a truncated reply the parser repaired)
        assert r["raw"].response_metadata["finish_reason"] == "stop" and r["parsing_error"] is None
        assert isinstance(r["parsed"], Book)
        jsonschema.validate(json.loads(r["raw"].content), Book.model_json_schema())
    assert sum(r["raw"].usage_metadata["input_token_details"]["cache_read"] > 0 for r in replies) >= 19


def test_structured_output_methods_and_include_raw(tiny_target):
    model = tiny_target.chat(max_tokens=128)
    raw = model.with_structured_output(Book, include_raw=True).invoke("Invent a book about cats.")
    assert isinstance(raw["parsed"], Book) and raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)
    assert raw["raw"].usage_metadata["input_token_details"]["cache_read"] >= 0
    assert isinstance(model.with_structured_output(Book, method="function_calling").invoke("A book on cats."), Book)
    assert isinstance(model.with_structured_output(Book, method="json_mode").invoke("JSON about cats."), Book)
    as_dict = model.with_structured_output(Book.model_json_schema()).invoke("A book on dogs.")
    jsonschema.validate(as_dict, Book.model_json_schema())
    assert set(as_dict) == {"title", "year", "fiction", "tags"}  # objects are closed: no invented keys


class Add(BaseModel):
    """Add two small integers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=12)


class Lookup(BaseModel):
    """Look a book up."""

    book: Book


def test_bind_tools_with_tool_choice(tiny_target):
    model = tiny_target.chat(max_tokens=160)
    for choice in ["Add", "GetWeather", "Lookup", "any", "required", {"type": "function", "function": {"name": "Add"}}]:
        msg = model.bind_tools([Add, GetWeather, Lookup], tool_choice=choice).invoke("What is 2 plus 3?")
        # "tool_calls", as OpenAI and ChatOpenAI report a message that carries tool calls
        assert msg.response_metadata["finish_reason"] == "tool_calls" and not msg.invalid_tool_calls, (choice, msg)
        (call,) = msg.tool_calls
        expected = choice if isinstance(choice, str) and choice not in ("any", "required") else \
            (choice["function"]["name"] if isinstance(choice, dict) else call["name"])
        assert call["name"] == expected and call["id"]
        schema = {"Add": Add, "GetWeather": GetWeather, "Lookup": Lookup}[call["name"]].model_json_schema()
        jsonschema.validate(call["args"], schema)
        assert set(call["args"]) == set(schema["properties"])
    streamed = None
    for chunk in model.bind_tools([GetWeather], tool_choice="GetWeather").stream("Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "GetWeather" and isinstance(streamed.tool_calls[0]["args"]["city"], str)
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    if tiny_target.kind == "remote":  # ChatOpenAI against the same server says the same
        from langchain_openai import ChatOpenAI

        peer = ChatOpenAI(base_url=tiny_target.base_url + "/v1", api_key="x", model="tiny-llama", max_tokens=160)
        msg = peer.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Oslo?")
        assert msg.tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    assert streamed.usage_metadata["input_tokens"] > 0
    tool_result = model.bind_tools([Add], tool_choice="Add").invoke([
        HumanMessage("2 + 3?"), AIMessage("", tool_calls=[{"name": "Add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
        ToolMessage("5", tool_call_id="c1", name="Add"), HumanMessage("And 4 + 4?")])
    assert tool_result.tool_calls[0]["name"] == "Add"


# ---------------------------------------------------------------------------------------------- no model


def test_message_lowering():
    msgs = to_chat_messages([
        SystemMessage("a"), SystemMessage("b"), HumanMessage("q"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"x": 1}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("3", name="add", tool_call_id="c1"),
    ])
    assert msgs[0] == {"role": "system", "content": "a\n\nb"}
    assert json.loads(msgs[2]["content"]) == {"name": "add", "arguments": {"x": 1}}
    assert msgs[3] == {"role": "user", "content": "Result of tool add: 3"}


def test_tool_schema_shapes():
    tools = [Tool("add", "Add.", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
             Tool("now", "", {"type": "object", "properties": {}})]
    forced = plan_tools(tools, "now").constraint["json_schema"]
    assert forced["properties"]["name"] == {"const": "now"}
    args = forced["$defs"]["now.arguments"]
    assert args["additionalProperties"] is False  # a call carries declared args only
    assert "grammar" in plan_tools(tools, "auto").constraint  # text, or one or more calls
    with pytest.raises(ValueError):
        plan_tools(tools, "missing")
    plan = plan_tools(tools, "required")
    assert plan.parse('{"name": "add", "arguments": {"x": 2}}')[0].arguments == {"x": 2}
    assert plan.parse("hi") is None
    assert "add(x: integer): Add." in tools_prompt(plan)


def test_tool_schema_keeps_definitions_resolving():
    """Nested models ($defs, or pydantic v1's definitions) keep resolving inside the call schema, each tool's
    under its own name (two tools may define different schemas of one name)."""
    v2 = Tool("lookup", "", Lookup.model_json_schema())
    v1 = Tool("old", "", {"type": "object", "properties": {"b": {"$ref": "#/definitions/Old"}},
                          "definitions": {"Old": {"type": "object", "properties": {"n": {"type": "integer"}}}}})
    clash = Tool("clash", "", {"type": "object", "properties": {"b": {"$ref": "#/$defs/Book"}},
                               "$defs": {"Book": {"type": "string"}}})
    schema = plan_tools([v2, v1, clash], "required", False).constraint["json_schema"]
    assert set(schema["$defs"]) == {"lookup.arguments", "old.arguments", "clash.arguments"}
    assert schema["$defs"]["lookup.arguments"]["$defs"]["Book"]["additionalProperties"] is False
    jsonschema.validate({"name": "old", "arguments": {"b": {"n": 1}}}, schema)
    jsonschema.validate({"name": "clash", "arguments": {"b": "x"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "old", "arguments": {"b": {"n": 1, "extra": 2}}}, schema)


def test_closed_schema_keeps_explicit_choices():
    schema = {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}},
                                               "o": {"type": "object", "properties": {}, "additionalProperties": True}}}
    closed = strict_schema(schema)
    assert closed["additionalProperties"] is False
    # (the explicit value schema is kept; an unbounded integer gets JSON's interoperable range, json_schema.py)
    assert closed["properties"]["m"]["additionalProperties"] == {"type": "integer", "minimum": -SAFE_INTEGER,
                                                                 "maximum": SAFE_INTEGER}
    assert closed["properties"]["o"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the input is not modified
