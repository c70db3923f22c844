"""One chat request, three doors: `prefixrt serve`'s chat route, the DSPy adapter and the LangChain adapter all
lower a request through prefixrt/lowering/chat.py `lower_chat`, so the same conversation, tools, tool_choice and
response_format give the same prompt messages, the same constraint and the same tool plan.

The server side runs `lower_chat_request` on the dict of the pydantic request model it parses bodies into; the adapters
run their own lowering (`dspy.lower_request`, `ChatPrefixRT._prepare`) on their own request types. No model is
loaded: the engine the server would render with is a stand-in with a tokenizer whose template has no tool
format (the adapters never give tools to a template).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("dspy")
pytest.importorskip("langchain_core")

from dspy.lm15 import (  # noqa: E402
    Config,
    FunctionTool,
    Message,
    Request,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from prefixrt.adapters.dspy import lower_request  # noqa: E402
from prefixrt.adapters.langchain import ChatPrefixRT  # noqa: E402

from prefixrt.lowering.chat import lower_chat_request  # noqa: E402
from prefixrt.server.protocol import ChatCompletionRequest  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
ANSWER = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40}},
          "required": ["summary"]}
SYSTEM, QUESTION, CALL_ID = "Be brief.", "Weather in Paris?", "call_1"


def _server(tool_choice, response_format, with_tools: bool = True) -> tuple[list[dict], dict, object]:
    body = {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"},
        {"role": "user", "content": "And now?"}],
        "max_tokens": 32, "temperature": 0, "parallel_tool_calls": False}
    if with_tools:
        body["tools"] = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city.",
                                                           "parameters": WEATHER}}]
        body["tool_choice"] = tool_choice
    if response_format is not None:
        body["response_format"] = response_format
    fields = ChatCompletionRequest.model_validate(body).model_dump(exclude_none=True, by_alias=True)
    lowered = lower_chat_request(fields, tokenizer=SimpleNamespace(chat_template="{{ messages }}"), max_context=4096)
    return lowered.messages, _constraint(vars(lowered.options.sampling_params())), lowered.tools


def _dspy(tool_choice, response_format, with_tools: bool = True):
    modes = {"auto": ToolChoice(mode="auto"), "required": ToolChoice(mode="required"),
             "weather": ToolChoice(mode="required", allowed=("weather",))}
    request = Request(
        model="m", system=SYSTEM,
        messages=(Message.user(QUESTION),
                  Message.assistant([ToolCallPart(id=CALL_ID, name="weather", input={"city": "Paris"})]),
                  Message(role="tool", parts=(ToolResultPart(id=CALL_ID, content=(TextPart("sunny"),)),)),
                  Message.user("And now?")),
        tools=(FunctionTool(name="weather", description="Weather of a city.", parameters=WEATHER),)
        if with_tools else (),
        config=Config(max_tokens=32, temperature=0, response_format=_flat(response_format),
                      tool_choice=modes[tool_choice] if with_tools else None))
    messages, params, plan = lower_request(request)
    return messages, _constraint(params), plan


def _langchain(tool_choice, response_format, with_tools: bool = True):
    model = ChatPrefixRT(engine=SimpleNamespace(model_name="m"), max_tokens=32)
    history = [SystemMessage(SYSTEM), HumanMessage(QUESTION),
               AIMessage("", tool_calls=[{"name": "weather", "args": {"city": "Paris"}, "id": CALL_ID}]),
               ToolMessage("sunny", tool_call_id=CALL_ID), HumanMessage("And now?")]
    kwargs: dict = {}
    if with_tools:
        kwargs["tools"] = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city.",
                                                             "parameters": WEATHER}}]
        kwargs["tool_choice"] = tool_choice
    if response_format is not None:
        kwargs["response_format"] = response_format
    messages, params, plan = model._prepare(history, None, kwargs)
    return messages, _constraint(params), plan


def _flat(response_format: dict | None) -> dict | None:
    """Chat's {"type": "json_schema", "json_schema": {...}} in the Responses API's flat form (lm15 takes only
    that one)."""
    if response_format is None or "json_schema" not in response_format:
        return response_format
    return {"type": "json_schema", **response_format["json_schema"]}


def _constraint(params: dict) -> dict:
    return {k: params.get(k) for k in ("json_schema", "json_object", "grammar", "regex", "choices")
            if params.get(k) not in (None, False)}


def _plan(plan) -> tuple | None:
    return None if plan is None else (plan.choice, plan.parallel, [t.name for t in plan.tools], plan.constraint)


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", "weather"])
@pytest.mark.parametrize("response_format", [None, RESPONSE_FORMAT])
def test_three_doors_lower_tools_and_response_format_alike(tool_choice, response_format):
    """Tools beside a response format, under each tool_choice: one rule (prefixrt/lowering.py's docstring)."""
    named = {"type": "function", "function": {"name": "weather"}} if tool_choice == "weather" else tool_choice
    server = _server(named, response_format)
    dspy_ = _dspy(tool_choice, response_format)
    lc = _langchain(tool_choice, response_format)
    assert server[0] == dspy_[0] == lc[0]  # the prompt messages (tools described in the system message)
    assert server[1] == dspy_[1] == lc[1]  # the constraint
    assert _plan(server[2]) == _plan(dspy_[2]) == _plan(lc[2])
    messages = server[0]
    assert messages[0]["role"] == "system" and "weather" in messages[0]["content"]
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in messages[2]["content"]  # the past call
    assert messages[3] == {"role": "user", "content": "Result of tool weather: sunny"}
    if tool_choice == "auto" and response_format is not None:
        # The answer branch is the response format's schema, beside the calls.
        assert json.dumps(ANSWER["properties"]["summary"]["maxLength"]) in server[1]["grammar"]
        assert "start: answer | calls" in server[1]["grammar"]


def test_three_doors_lower_a_response_format_alike():
    """No tools: the response format is the constraint at every door (LangChain also says the schema in the
    system message: its structured output sends no instructions of its own)."""
    server = _server(None, RESPONSE_FORMAT, with_tools=False)
    dspy_ = _dspy("auto", RESPONSE_FORMAT, with_tools=False)
    lc = _langchain("auto", RESPONSE_FORMAT, with_tools=False)
    assert server[1] == dspy_[1] == lc[1] and set(server[1]) == {"json_schema"}
    assert server[0] == dspy_[0]
    assert lc[0][1:] == server[0][1:] and lc[0][0]["content"].startswith(server[0][0]["content"])
    assert server[2] is dspy_[2] is lc[2] is None
