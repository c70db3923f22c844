"""Ecosystem clients against `prefixrt serve` (the tiny random-weights model, one session server): the
openai SDK's helpers, LangChain's ChatOpenAI, instructor and openai-agents, each used as its documentation
says, with nothing prefixrt-specific. Constrained decoding makes every structured result schema-valid even
from random weights (the schemas carry bounds so that decoding always ends); whether the *content* is right
is a question for a trained model (tests/adapters/test_clients_gemma.py)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import SERVED_NAME, needs_constrained_decoding

pytestmark = needs_constrained_decoding()


class City(BaseModel):
    name: str = Field(max_length=8)
    country: Literal["FR", "IT", "DE"]


class Trip(BaseModel):
    """A trip to a city."""

    city: City
    days: int = Field(ge=1, le=9)


MOVIE_SCHEMA = {"title": "Movie", "type": "object", "required": ["title", "year"],
                "properties": {"title": {"type": "string", "maxLength": 8},
                               "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}}


@pytest.fixture(scope="module")
def server(long_server):
    return long_server


@pytest.fixture(scope="module")
def oai(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    yield c
    c.close()


def test_pydantic_function_tool_with_nested_model(oai):
    """openai.pydantic_function_tool (strict, nested $defs) forced: the arguments parse as the model."""
    tool = openai.pydantic_function_tool(Trip)
    for seed in range(3):
        out = oai.chat.completions.parse(model=SERVED_NAME, messages=[{"role": "user", "content": "Plan a trip."}],
                                         tools=[tool], tool_choice={"type": "function", "function": {"name": "Trip"}},
                                         max_tokens=200, temperature=1.0, seed=seed)
        (call,) = out.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Trip)
        assert set(json.loads(call.function.arguments)) == {"city", "days"}


def test_langchain_chat_openai_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="test", model=SERVED_NAME,
                                      max_tokens=400, temperature=0.7, max_retries=0)
    for method in ("json_schema", "function_calling"):
        trip = llm.with_structured_output(Trip, method=method).invoke("Plan a trip.")
        assert isinstance(trip, Trip), method
    movie = llm.with_structured_output(MOVIE_SCHEMA, method="json_schema").invoke("A movie?")
    jsonschema.validate(movie, {**MOVIE_SCHEMA, "additionalProperties": False})
    assert set(movie) == {"title", "year"}
    # TypedDict and json_mode schemas carry no bounds, so random weights may write until max_tokens: they are
    # checked on Gemma (test_clients_gemma.py).


def test_langchain_chat_openai_tool_agent_loop(server):
    """bind_tools with the default tool_choice (auto): the reply is text or valid calls of the bound tools."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="test", model=SERVED_NAME,
                                      max_tokens=60, temperature=1.0, max_retries=0)
    forced = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    (call,) = forced.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    for seed in range(3):
        msg = llm.bind_tools([add]).invoke("What is 2 + 3?", seed=seed)
        for c in msg.tool_calls:
            assert c["name"] == "add" and set(c["args"]) == {"a", "b"}
        assert not msg.invalid_tool_calls


def test_instructor_modes(oai):
    instructor = pytest.importorskip("instructor")

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(oai, mode=mode)
        trip = client.chat.completions.create(model=SERVED_NAME, response_model=Trip, max_tokens=200,
                                              max_retries=0, messages=[{"role": "user", "content": "A trip?"}])
        assert isinstance(trip, Trip), mode
    # Iterable[...] (an unbounded list) is checked on Gemma (test_clients_gemma.py).


class Weather(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["C", "F"]
    days: int = Field(ge=1, le=9)


def test_instructor_create_partial_over_a_streamed_tool_call(oai):
    """instructor's create_partial (Mode.TOOLS) reads the streamed arguments as they grow: several partials, the
    earlier ones lacking what came later, the last one a whole Weather."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    partials = [p.model_dump() for p in client.chat.completions.create_partial(
        model=SERVED_NAME, response_model=Weather, max_tokens=100, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "Weather in Paris?"}])]
    assert len(partials) > 1
    Weather.model_validate(partials[-1])
    assert any(None in p.values() for p in partials[:-1])  # the earlier ones lack what came later


class Total(BaseModel):
    total: int = Field(ge=0, le=99)


def test_openai_agents_function_tool_agent(server):
    """openai-agents' default model (Responses API) runs a function-tool agent to its final output: a forced
    tool call first, then (tool_choice reset to auto) a call or the structured final answer."""
    agents = pytest.importorskip("agents")

    calls = []

    @agents.function_tool
    def add(a: Annotated[int, Field(ge=0, le=9)], b: Annotated[int, Field(ge=0, le=9)]) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    model = agents.OpenAIResponsesModel(model=SERVED_NAME, openai_client=client)
    agent = agents.Agent(name="calc", instructions="Use the add tool, then answer.", tools=[add], model=model,
                         output_type=Total,
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             max_tokens=120, temperature=0.0))
    result = agents.Runner.run_sync(agent, "What is 2 + 3?", max_turns=8)
    assert isinstance(result.final_output, Total)
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem"
    assert len(calls) >= 1 and all(0 <= a <= 9 and 0 <= b <= 9 for a, b in calls)


def test_responses_through_the_shim(engine):
    """client.responses.create, stream and not, through prefixrt.openai (in-process, no sockets)."""
    from prefixrt.openai import OpenAI

    client = OpenAI(engine=engine)
    try:
        r = client.responses.create(model="tiny-llama", input="Hello", instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
        assert r.output_text and r.status in ("completed", "incomplete")
        events = list(client.responses.create(model="tiny-llama", input="Hello", instructions="Be brief.",
                                              max_output_tokens=6, temperature=0, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        follow = client.responses.create(model="tiny-llama", input="And then?", previous_response_id=r.id,
                                         instructions="Be brief.", max_output_tokens=4, temperature=0)
        assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    finally:
        client.close()
