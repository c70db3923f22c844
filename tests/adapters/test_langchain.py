"""ChatPrefixRT behaviour: invoke/ainvoke/stream/astream/batch/abatch, usage with cache reads, prefix sharing in
batch, timeouts, message lowering, tool schemas; structured output and tools on Gemma-3-270M (constrained)."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from prefixrt.adapters._lowering import ToolSpec, parse_tool_reply, tool_call_schema
from prefixrt.adapters.langchain import ChatPrefixRT, to_chat_messages


SYSTEM = "You answer questions about the city library's opening hours and loan rules. " * 8


def test_invoke_reports_usage_and_metadata(tiny_engine):
    model = ChatPrefixRT(engine=tiny_engine, max_tokens=6)
    msg = model.invoke([SystemMessage(SYSTEM), HumanMessage("When do you open?")])
    again = model.invoke([SystemMessage(SYSTEM), HumanMessage("When do you open?")])
    assert isinstance(msg, AIMessage) and msg.response_metadata["model_name"] == "tiny-llama"
    u = again.usage_metadata
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["input_token_details"]["cache_read"] == u["input_tokens"] - 1


def test_streams_agree_with_invoke(tiny_engine):
    model = ChatPrefixRT(engine=tiny_engine, max_tokens=10)
    full = model.invoke("Tell me about loans")
    chunks = list(model.stream("Tell me about loans"))
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] > 0
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert "".join(c.content for c in chunks) == full.content

    async def astream():
        return [c async for c in model.astream("Tell me about loans")]

    achunks = asyncio.run(astream())
    assert "".join(c.content for c in achunks) == full.content and isinstance(achunks[0], AIMessageChunk)
    assert asyncio.run(model.ainvoke("Tell me about loans")).content == full.content


def test_batch_and_abatch_share_the_prefix(tiny_engine):
    tiny_engine.flush_cache()
    model = ChatPrefixRT(engine=tiny_engine, max_tokens=4)
    inputs = [[SystemMessage(SYSTEM), HumanMessage(f"Question {i}: can I renew?")] for i in range(12)]
    out = model.batch(inputs)
    cached = [m.usage_metadata["input_token_details"]["cache_read"] for m in out]
    assert sum(c > 0 for c in cached) >= 11, cached
    tiny_engine.flush_cache()
    out = asyncio.run(model.abatch(inputs))
    cached = [m.usage_metadata["input_token_details"]["cache_read"] for m in out]
    assert sum(c > 0 for c in cached) >= 11, cached


def test_timeout_aborts(tiny_engine):
    model = ChatPrefixRT(engine=tiny_engine, max_tokens=4000, timeout=0.05, max_retries=0)
    with pytest.raises(TimeoutError):
        model.invoke("Go on and on")
    with pytest.raises(TimeoutError):
        asyncio.run(model.ainvoke("Go on and on"))


def test_stop_and_per_call_options(tiny_engine):
    model = ChatPrefixRT(engine=tiny_engine, max_tokens=3)
    assert model.invoke("hi", max_tokens=1).usage_metadata["output_tokens"] <= 1
    with pytest.raises(ValueError, match="no sampling option"):
        model.invoke("hi", bogus=True)
    with pytest.raises(ValueError, match="serves"):
        model.invoke("hi", model="another-model")


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
    tools = [ToolSpec("add", "", {"type": "object", "properties": {"x": {"type": "integer"}}}),
             ToolSpec("now", "", {"type": "object", "properties": {}})]
    forced = tool_call_schema(tools, "now")
    assert forced["properties"]["name"] == {"const": "now"}
    assert len(tool_call_schema(tools, "auto")["anyOf"]) == 3
    with pytest.raises(ValueError):
        tool_call_schema(tools, "missing")
    assert parse_tool_reply('{"name": "add", "arguments": {"x": 2}}').tool_arguments == {"x": 2}
    assert parse_tool_reply('{"response": "hi"}').text == "hi"


# ---------------------------------------------------------------------------------------------- Gemma


class Book(pydantic.BaseModel):
    title: str
    year: int
    fiction: bool


def test_structured_output_is_valid_every_time(gemma_provider):
    model = ChatPrefixRT(engine=gemma_provider, max_tokens=64).with_structured_output(Book)
    topics = ["a sea voyage", "a detective", "the moon", "gardening", "a dragon", "cooking", "war", "physics",
              "a love story", "a robot", "ancient Rome", "birds", "a haunted house", "chess", "music", "trains",
              "a desert", "a king", "the ocean", "mountains"]
    books = model.batch([f"Invent a book about {t}." for t in topics])
    assert len(books) == 20 and all(isinstance(b, Book) for b in books)


def test_structured_output_methods_and_include_raw(gemma_provider):
    model = ChatPrefixRT(engine=gemma_provider, max_tokens=64)
    raw = model.with_structured_output(Book, include_raw=True).invoke("Invent a book about cats.")
    assert isinstance(raw["parsed"], Book) and raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)
    assert isinstance(model.with_structured_output(Book, method="function_calling").invoke("A book on cats."), Book)
    assert isinstance(model.with_structured_output(None, method="json_mode").invoke("JSON about cats."), dict)


def test_bind_tools_with_tool_choice(gemma_provider):
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = ChatPrefixRT(engine=gemma_provider, max_tokens=48)
    msg = model.bind_tools([get_weather, add], tool_choice="add").invoke("What is 2 plus 3?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "add"
    assert set(msg.tool_calls[0]["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in msg.tool_calls[0]["args"].values())
    msg = model.bind_tools([get_weather, add], tool_choice="any").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] in ("get_weather", "add")
    streamed = None
    for chunk in model.bind_tools([get_weather], tool_choice="any").stream("Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "get_weather" and isinstance(streamed.tool_calls[0]["args"]["city"], str)
