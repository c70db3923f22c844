"""One chat request -> what the chat template renders, what decoding is held to, and how the reply reads.

`lower_chat` is the one lowering of a chat request's messages, tools and response format: the server's chat and
Responses routes (through `lower_chat_request`, which lowers the whole OpenAI request: options too) and the DSPy
and LangChain adapters (which turn their own requests into OpenAI-shaped dicts first) all call it, so one request
lowers the same way whichever door it came in by.

tools together with response_format (one rule, in `lower_chat`):
  no callable tool    the response format constrains the reply;
  "auto"              the reply is one or more calls, or an answer in the response format (the format takes
                      the place of plain text in the grammar);
  "required" / named  the reply is a call, so the response format has nothing to constrain and is unused.

Pure functions over plain dicts: nothing here imports pydantic request models, FastAPI, DSPy or LangChain.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.constraints import merge_constraint, response_format_constraint
from prefixrt.lowering.messages import engine_messages, with_system_note, with_tools_prompt
from prefixrt.lowering.options import (
    OPTION_NAMES,
    OUTPUT_BUDGET_NAMES,
    Options,
    check_stream_options,
    lower_options,
)
from prefixrt.lowering.reasoning import Reasoning, ReasoningParser, thinking_enabled
from prefixrt.lowering.tools import (
    BARE,
    CallSyntax,
    ToolPlan,
    plan_tools,
    template_call_syntax,
    template_tools,
    tools_from_openai,
)


@dataclass
class LoweredChat:
    """A chat request lowered: what the chat template renders, what decoding is held to, how the reply reads."""

    messages: list[dict]  # {role, content} dicts (plus tool_calls / tool messages when the template renders tools)
    constraint: dict  # {kind: spec} for SamplingParams ({} when the reply is free text)
    tools: ToolPlan | None  # the tool plan, when a tool may be called
    template_tools: list[dict] | None  # tools for apply_chat_template(tools=...), when the template renders them
    constraint_param: str = "response_format"  # the request field the constraint comes from (for errors)
    warnings: list[str] = field(default_factory=list)  # what was read other than as written (schema type names)
    # lower_chat_request only: the request's options with the constraint merged, its chat_template_kwargs
    options: Options | None = None
    template_kwargs: dict | None = None

    def apply(self, params: dict) -> dict:
        """params (a SamplingParams dict) with the constraint added; InvalidRequest if it already has one."""
        merge_constraint(params, self.constraint, self.constraint_param)
        return params


def lower_chat(messages: list[dict], *, tools: list[dict] | None = None, tool_choice: Any = None,
               parallel_tool_calls: bool | None = None, response_format: dict | None = None,
               syntax: CallSyntax | None = None, tool_prompt: bool = True, schema_note: bool = False) -> LoweredChat:
    """One chat request in OpenAI's vocabulary -> a LoweredChat (InvalidRequest when it is malformed).

    messages: OpenAI chat messages (dicts; assistant `tool_calls`, `tool` results). tools / tool_choice /
    parallel_tool_calls / response_format: as OpenAI's chat API takes them (tools also in the Responses API's
    flat form). syntax: the chat template's own call syntax when it renders tools (`template_call_syntax`),
    else None: calls are then written BARE and the tools are described in a system message, unless
    `tool_prompt` is False (the caller's prompt already describes them). schema_note: say the response
    format's JSON schema in the system message too (for callers whose prompt does not describe the reply).
    The rule for tools beside a response format is the module docstring's."""
    warnings: list[str] = []
    answer = response_format_constraint(response_format, warnings=warnings)
    specs = tools_from_openai(tools, warnings=warnings)
    syntax = syntax if specs else None
    text_schema = answer.get("json_schema") or ("json_object" if answer else None)
    plan = plan_tools(specs, tool_choice, parallel_tool_calls, syntax or BARE, text_schema=text_schema)
    in_template = syntax is not None and plan is not None
    out = engine_messages(messages, template_tools=in_template, syntax=syntax or BARE)
    if plan is not None and not in_template and tool_prompt:
        out = with_tools_prompt(out, plan)
    if plan is None:
        constraint = answer
        schema = answer.get("json_schema")
        if schema_note and isinstance(schema, dict):
            note = json.dumps(schema, separators=(",", ":"))
            out = with_system_note(out, f"Reply with a JSON object matching this JSON schema: {note}")
    else:
        constraint = plan.constraint
    return LoweredChat(out, constraint, plan, template_tools(plan.tools) if in_template else None,
                       "response_format" if plan is None else "tool_choice", warnings)


# Arguments of apply_chat_template that the server sets itself: not a request's to give.
_TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
                                "truncation", "max_length", "chat_template", "tokenizer_kwargs",
                                "return_assistant_tokens_mask"})


def lower_chat_request(request: dict[str, Any], *, tokenizer, max_context: int, defaults: dict | None = None
                       ) -> LoweredChat:
    """An OpenAI chat completions request (its body as a dict, None for a field not given) -> a LoweredChat with
    its `options` (the constraint merged) and `template_kwargs`. InvalidRequest when it is malformed.

    tokenizer: the engine's (its chat template says whether it renders tools itself, and in which syntax).
    max_context: the default max_new_tokens (no budget given: generate until EOS or the context is full).
    defaults: sampling settings for those the request leaves out (the model's generation config)."""
    for name in ("functions", "function_call"):
        if request.get(name) is not None:
            raise InvalidRequest("functions / function_call are deprecated; pass tools / tool_choice", param=name)
    options = {k: v for k, v in request.items() if k in OPTION_NAMES and k != "logprobs" or k in OUTPUT_BUDGET_NAMES}
    if request.get("top_logprobs") is not None and not request.get("logprobs"):
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if request.get("logprobs"):
        options["logprobs"] = request.get("top_logprobs") or 0
    lowered_options = lower_options(options, what="request", default_max_new_tokens=max_context, defaults=defaults)
    check_stream_options(request)
    tools = request.get("tools") or []
    tool_prompt = request.get("tool_prompt", True)
    syntax = template_call_syntax(tokenizer) if tools and tool_prompt else None
    lowered = lower_chat(request["messages"], tools=tools, tool_choice=request.get("tool_choice"),
                         parallel_tool_calls=request.get("parallel_tool_calls"),
                         response_format=request.get("response_format"), syntax=syntax, tool_prompt=tool_prompt)
    lowered.apply(lowered_options.params)
    lowered_options.warnings.extend(lowered.warnings)
    lowered.warnings = lowered_options.warnings
    lowered.options = lowered_options
    lowered.template_kwargs = template_kwargs(request.get("chat_template_kwargs"))
    return lowered


def template_kwargs(kwargs: dict | None) -> dict | None:
    """A request's `chat_template_kwargs` (None when absent); InvalidRequest naming a reserved key."""
    if not kwargs:
        return None
    bad = sorted(k for k in kwargs if k in _TEMPLATE_RESERVED)
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)} (the server sets "
                             f"{'it' if len(bad) == 1 else 'them'})", param="chat_template_kwargs")
    return dict(kwargs)


def request_reasoning(parser: ReasoningParser | None, kwargs: dict | None, eng, ids: list[int]
                      ) -> Reasoning | None:
    """The Reasoning of a chat request under the server's parser (None without one, or when the request
    switches thinking off). Reads the prompt's last tokens as text; call it off the event loop."""
    if parser is None or not thinking_enabled(kwargs):
        return None
    tok = getattr(eng, "tokenizer", None)
    if tok is None:
        return Reasoning(parser)
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        tail = tok.decode(ids[-8:])
    return Reasoning(parser, tail)
