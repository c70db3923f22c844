"""OpenAI structured outputs on top of constrained decoding: response_format and tools/tool_choice.

- response_format json_schema -> SamplingParams.json_schema = its schema; json_object ->
  SamplingParams.json_object (the "json_object" constraint: any JSON object, {"type": "object"}).
- tools are described to the model in a system message (the chat template is not asked to render them:
  templates differ too much in how, and many have no tool support at all). The extra body field
  `tool_prompt: false` leaves the messages alone (the caller has described the tools itself).
- tool_choice "required" or a named function -> the output is constrained to a JSON object
  {"name": <tool name>, "arguments": <that tool's parameters schema>} (anyOf over the allowed tools) and
  returned as `tool_calls` with finish_reason "tool_calls".
- tool_choice "auto" (the default when tools are given) decodes unconstrained; when the whole answer parses
  as such an object for a known tool (optionally inside ``` fences or <tool_call> tags) it is returned as a
  tool call, otherwise as plain text. "none": tools are not shown and never called.
"""

from __future__ import annotations

import importlib.util
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.params import CONSTRAINT_FIELDS
from prefixrt.server.protocol import ChatCompletionRequest, ChatMessage

TOOL_PROMPT = (
    "You can call the following tools. To call one, answer with only a JSON object of the form "
    '{{"name": <tool name>, "arguments": <object of arguments>}} and nothing else.\nTools:\n{tools}'
)


@dataclass
class ToolMode:
    """How the response should be read back: `forced` outputs are always tool calls; `auto` may be."""

    names: list[str] = field(default_factory=list)
    forced: bool = False

    @property
    def active(self) -> bool:
        return bool(self.names)


def constrained_decoding_available() -> bool:
    return importlib.util.find_spec("prefixrt.constrained.compiler") is not None


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(part.text for part in m.content)


def to_engine_messages(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> the {role, content} dicts chat templates understand."""
    out = []
    for m in req.messages:
        text = message_text(m)
        role = m.role
        if role == "developer":
            role = "system"
        elif role == "tool":
            # Few templates know a tool role; the result goes back to the model as a user turn.
            role, text = "user", f"Tool result{f' ({m.name})' if m.name else ''}: {text}"
        if m.role == "assistant" and m.tool_calls:
            calls = [json.dumps({"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)})
                     for c in m.tool_calls]
            text = "\n".join([text, *calls]) if text else "\n".join(calls)
        out.append({"role": role, "content": text})
    return out


def apply(req: ChatCompletionRequest, messages: list[dict], params: dict) -> ToolMode:
    """Fold response_format and tools into messages (in place) and params (in place); return the tool mode."""
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            _set_constraint(params, "json_object", True, "response_format")
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequest("response_format json_schema needs json_schema.schema",
                                     param="response_format")
            _set_constraint(params, "json_schema", rf.json_schema.schema_, "response_format")

    mode = ToolMode()
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return mode
    for i, t in enumerate(req.tools):  # checked whatever tool_choice is, as OpenAI does
        check_tool_parameters(t.function.name, t.function.parameters, f"tools[{i}].function.parameters")
    if choice == "none":
        return mode
    tools = {t.function.name: t.function for t in req.tools}
    if len(tools) != len(req.tools):
        raise InvalidRequest("tool names must be unique", param="tools")
    if choice is None or choice == "auto":
        mode = ToolMode(names=list(tools), forced=False)
    else:
        allowed = list(tools) if choice == "required" else [choice.function.name]
        for name in allowed:
            if name not in tools:
                raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        branches = [_call_schema(n, tools[n].parameters) for n in allowed]
        schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
        _set_constraint(params, "json_schema", schema, "tool_choice")
        mode = ToolMode(names=allowed, forced=True)
    if not req.tool_prompt:
        return mode
    described = "\n".join(json.dumps({"name": n, "description": tools[n].description or "",
                                      "parameters": tools[n].parameters or {"type": "object"}})
                          for n in mode.names)
    system = TOOL_PROMPT.format(tools=described)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{system}"}
    else:
        messages.insert(0, {"role": "system", "content": system})
    return mode


def check_tool_parameters(name: str, parameters: Any, param: str) -> None:
    """A tool's parameters must be a valid JSON schema of an object, whatever tool_choice is (as OpenAI checks
    it): InvalidRequest otherwise. The schema is checked against its JSON Schema meta-schema (with the
    `jsonschema` package; without it only the shape is checked)."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"tool {name!r}: parameters must be a JSON schema object", param=param)
    kind = parameters.get("type")
    if kind is not None and kind != "object":
        raise InvalidRequest(f"tool {name!r}: parameters must be a JSON schema of type 'object', got "
                             f"type {kind!r}", param=param)
    try:
        from jsonschema import Draft202012Validator, validators
        from jsonschema.exceptions import SchemaError
    except ImportError:
        return
    try:
        validators.validator_for(parameters, default=Draft202012Validator).check_schema(parameters)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise InvalidRequest(f"tool {name!r}: invalid parameters schema{f' at {where}' if where else ''}: "
                             f"{e.message}", param=param) from None


def parse_tool_calls(text: str, mode: ToolMode) -> list[dict] | None:
    """The tool calls in a finished output, or None when it is plain text (or not a valid call)."""
    if not mode.active:
        return None
    body = text.strip()
    body = re.sub(r"^<tool_call>\s*|\s*</tool_call>$", "", body)
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", body)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and obj.get("name") in mode.names and isinstance(obj.get("arguments", {}), dict)):
        return None
    return [{
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))},
    }]


def _call_schema(name: str, parameters: dict | None) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _set_constraint(params: dict, kind: str, value: Any, param: str) -> None:
    if any(params.get(k) not in (None, False) for k in CONSTRAINT_FIELDS):
        raise InvalidRequest(f"{param} cannot be combined with another constraint (regex, json_schema, "
                             "grammar, choices, response_format, forced tool_choice)", param=param)
    params[kind] = value


def _loads_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s
