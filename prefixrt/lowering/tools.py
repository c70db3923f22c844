"""Function tools: `tools` + `tool_choice` + `parallel_tool_calls` -> a ToolPlan, and the plan's reply read back.

- `tools_from_openai`: chat's `[{"type": "function", "function": {...}}]` or the Responses API's flat form ->
  Tools (unique names, parameters an object schema);
- `plan_tools` -> a `ToolPlan`: the constraint (a JSON schema for exactly one call, else an llguidance Lark
  grammar), how calls are written (`CallSyntax`: the chat template's own family when it renders tools,
  lowering/tool_formats.py), and `parse` / `may_be_call` for the reply;
- `tools_prompt`: the fallback system text describing the tools when the chat template has no tool format.

Tool calls are JSON objects `{"name": <tool>, "arguments": {...}}`, one per call, separated by a newline
(inside `<tool_call>` tags when the template uses them). Decoding is constrained, so a call always names a
declared tool and its arguments match that tool's parameters (closed objects: no keys outside the schema).
`tool_choice`:
  "auto" (default)  plain text, or one or more calls: `start: TEXT | calls` — text may not begin with the
                    first character of a call, so anything that starts like a call is a well-formed call;
  "required"        one or more calls of any declared tool (exactly one when parallel_tool_calls is false);
  a named function  exactly one call of that tool;
  "none"            the tools are neither shown nor callable.
The grammar form needs the llguidance backend (the default); a single forced call is a JSON schema, which
both backends compile.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixrt.constrained.spec import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR
from prefixrt.errors import InvalidRequest
from prefixrt.lowering import tool_formats
from prefixrt.lowering.constraints import schema_types
from prefixrt.lowering.json_schema import embed, strict_schema, with_defs


@dataclass(frozen=True)
class Tool:
    """A function tool: its parameters are a JSON schema of an object (`strict` as the caller gave it)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


def tools_from_openai(tools: list[dict] | None, param: str = "tools", warnings: list[str] | None = None
                      ) -> list[Tool]:
    """Chat's [{"type": "function", "function": {...}}] or the Responses API's [{"type": "function", "name",
    ...}] -> Tools. Names must be unique; parameters must be an object schema (type names normalised, the
    renames appended to `warnings`)."""
    out: list[Tool] = []
    for t in tools or []:
        if t.get("type", "function") != "function":
            raise InvalidRequest(f"only function tools are supported, not {t.get('type')!r}", param=param)
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("every tool needs a name", param=param)
        params = fn.get("parameters")
        where = f"{param}[{len(out)}].function.parameters" if "function" in t else f"{param}[{len(out)}].parameters"
        if isinstance(params, dict):
            params = schema_types(params, where, warnings)
        check_tool_parameters(name, params, where)
        if params is None:
            params = {"type": "object", "properties": {}}
        out.append(Tool(name, fn.get("description") or "", params, fn.get("strict")))
    if len({t.name for t in out}) != len(out):
        raise InvalidRequest("tool names must be unique", param=param)
    return out


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


@dataclass(frozen=True)
class CallSyntax:
    """How the model writes calls: `open` + JSON + `close`, calls separated by `sep`; the JSON holds the
    arguments under `key`. `family`: the model family's own syntax (prefixrt/lowering/tool_formats.py) when the chat
    template renders the tools, whose parser then reads the reply."""

    open: str = ""
    close: str = ""
    sep: str = "\n"
    key: str = "arguments"
    family: str | None = None

    @property
    def lead(self) -> str:
        """The first character of every call: plain text may not start with it (nor with "{")."""
        return self.open[:1] or "{"


BARE = CallSyntax()
TAGGED = CallSyntax("<tool_call>\n", "\n</tool_call>", "\n", family="hermes")
# Llama 3.1/3.2 JSON tool calling: the template asks for {"name", "parameters"}, one JSON object per call.
LLAMA3 = CallSyntax("", "", "\n", key="parameters", family="llama3")
# Mistral: a JSON array of calls after the [TOOL_CALLS] special token (which decoding leaves out of the text).
MISTRAL = CallSyntax("[", "]", "\n", family="mistral")
FAMILY_SYNTAX = {"hermes": TAGGED, "llama3": LLAMA3, "mistral": MISTRAL}


def template_call_syntax(tokenizer) -> CallSyntax | None:
    """The call syntax of the tokenizer's chat template when it renders `tools` itself, in its family's own form
    (tool_formats.detect: Hermes/Qwen `<tool_call>` tags, Llama 3.1/3.2 JSON with "parameters", Mistral
    `[TOOL_CALLS]` arrays), else None (tools go in a system message, calls are BARE). Pythonic templates
    (tool_formats' "pythonic") have no constrained form here: they get the system message too."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return FAMILY_SYNTAX.get(tool_formats.detect(template))


def tool_choice_name(choice: Any, param: str = "tool_choice") -> str | None:
    """tool_choice as "auto" | "required" | "none" | a tool name (chat's and the Responses API's forms, or a
    bare name)."""
    if choice is None:
        return None
    if isinstance(choice, str):
        return choice  # "auto" | "required" | "none", or a tool's name (checked against the tools)
    if isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        if isinstance(fn.get("name"), str):
            return fn["name"]
    raise InvalidRequest(f"unsupported tool_choice {choice!r}", param=param)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def to_openai(self, call_id: str | None = None) -> dict:
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ToolPlan:
    """What a request with tools decodes under and how its reply reads back."""

    tools: list[Tool]  # the callable ones
    choice: str  # "auto" | "required" | a tool name
    parallel: bool
    syntax: CallSyntax
    constraint: dict  # {"json_schema": ...} or {"grammar": ...}
    json_answer: bool = False  # under "auto", the non-call answer is JSON (a response format), not free text

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def starts_call(self, text: str) -> bool:
        """Whether a reply that begins with `text` is a call, known before it ends (False: it may be plain text).
        The plan's constraint lets plain text begin neither with "{" nor with the syntax's lead, so a reply that
        does is a call; not so when the answer is JSON (a response format), which begins as a call does."""
        head = text.lstrip()
        return not self.json_answer and bool(head) and head[0] in ("{", self.syntax.lead)

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in a finished reply, or None when it is plain text (or an incomplete call)."""
        return parse_tool_calls(text, {t.name for t in self.tools}, self.syntax)

    def may_be_call(self, text: str) -> bool:
        """Whether a reply that begins with `text` may still be a call (False: stream it as text)."""
        if self.syntax.family is not None:
            return tool_formats.may_be_call(self.syntax.family, text, {t.name for t in self.tools})
        head = text.lstrip()
        return not head or head[0] in ("{", self.syntax.lead)


def _json_options() -> dict:
    # llguidance's per-schema options inside Lark `%json`: the same compact layout as json_schema requests.
    return {"whitespace_flexible": False, "item_separator": JSON_ITEM_SEPARATOR, "key_separator": JSON_KEY_SEPARATOR}


def call_schema(tools: list[Tool], key: str = "arguments") -> dict:
    """The JSON schema of one call of any of `tools`: {"name": const, "arguments": <its parameters>} (the
    arguments under `key`: Llama 3's templates ask for "parameters").
    Each tool's parameters are embedded under `$defs` (their own `$defs`/`$ref`s keep resolving) with the
    strict-mode rule applied (whatever the tool's `strict` says, as for response formats)."""
    defs: dict = {}
    variants = []
    for t in tools:
        ref, d = embed(strict_schema(t.parameters), f"{t.name}.arguments")
        defs.update(d)
        variants.append({"type": "object", "properties": {"name": {"const": t.name}, key: ref},
                         "required": ["name", key], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return with_defs(schema, defs)


def plan_tools(tools: list[Tool], tool_choice: Any = None, parallel_tool_calls: bool | None = None,
               syntax: CallSyntax = BARE, text_schema: Any = None) -> ToolPlan | None:
    """The ToolPlan for a request, or None when no tool can be called (no tools, or tool_choice "none").

    text_schema: the response format's schema (a dict, or "json_object") when the request asks for structured
    output beside its tools: under "auto" the non-call branch is then that JSON instead of free text."""
    choice = tool_choice_name(tool_choice)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    choice = choice or "auto"
    by_name = {t.name: t for t in tools}
    if choice not in ("auto", "required") and choice not in by_name:
        raise InvalidRequest(f"tool_choice names {choice!r}, which is not in tools", param="tool_choice")
    callable_ = tools if choice in ("auto", "required") else [by_name[choice]]
    parallel = parallel_tool_calls is not False and choice in ("auto", "required")
    one = call_schema(callable_, syntax.key)
    if choice != "auto" and not parallel and syntax is BARE:
        constraint: dict = {"json_schema": one}
    else:
        call = json.dumps({**one, "x-guidance": _json_options()}, ensure_ascii=False)
        lines = []
        if choice == "auto" and text_schema is not None:
            # A reply that reads as a call of a declared tool is one (parse); anything else is the answer.
            schema = {"type": "object"} if text_schema == "json_object" else text_schema
            answer = json.dumps({**schema, "x-guidance": _json_options()}, ensure_ascii=False)
            lines += ["start: answer | calls", f"answer: %json {answer}"]
        elif choice == "auto":
            # Plain text may not start like a call (nor like bare JSON), so anything that does is a call.
            lead = "\\" + syntax.lead if syntax.lead in "[]^-\\" else syntax.lead  # (in a character class)
            leads = "\\{" + ("" if syntax.lead == "{" else lead)
            text = "/([^" + leads + r"\s][\s\S]*)?/"
            lines += ["start: TEXT | calls", f"TEXT: {text}"]
        else:
            lines.append("start: calls")
        lines.append(f"calls: call ({json.dumps(syntax.sep)} call)*" if parallel else "calls: call")
        parts = [json.dumps(syntax.open)] if syntax.open else []
        parts.append(f"%json {call}")
        if syntax.close:
            parts.append(json.dumps(syntax.close))
        lines.append("call: " + " ".join(parts))
        constraint = {"grammar": "\n".join(lines)}
    return ToolPlan(list(callable_), choice, parallel, syntax, constraint,
                    json_answer=choice == "auto" and text_schema is not None)


def parse_tool_calls(text: str, names: set[str], syntax: CallSyntax = BARE) -> list[ToolCall] | None:
    """Calls written as the plan asks (optionally inside `<tool_call>` tags whatever the syntax; in the model
    family's own forms when the syntax is a family's, tool_formats.parse), or None."""
    if syntax.family is not None:
        calls = tool_formats.parse(syntax.family, text, names)
        return [ToolCall(n, a) for n, a in calls] if calls else None
    decoder = json.JSONDecoder()
    s, i, calls = text, 0, []
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i == len(s):
            break
        tagged = s.startswith("<tool_call>", i)
        if tagged:
            i += len("<tool_call>")
            while i < len(s) and s[i].isspace():
                i += 1
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        if tagged:
            while i < len(s) and s[i].isspace():
                i += 1
            if not s.startswith("</tool_call>", i):
                return None
            i += len("</tool_call>")
        if not (isinstance(obj, dict) and obj.get("name") in names
                and isinstance(obj.get("arguments", {}), dict)):
            return None
        calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls or None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _type_name(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type_name(s) for s in schema[key])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type_name(schema.get('items'))}"
    if kind == "object" and isinstance(schema.get("properties"), dict):
        return "{" + ", ".join(f"{k}: {_type_name(v)}" for k, v in schema["properties"].items()) + "}"
    return " | ".join(kind) if isinstance(kind, list) else str(kind)


def tool_signature(tool: Tool) -> str:
    """`add(a: integer, b: integer)`, with descriptions and `(optional)` markers."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    args = []
    for name, sub in props.items():
        arg = f"{name}: {_type_name(sub)}" + ("" if name in required else " (optional)")
        if isinstance(sub, dict) and sub.get("description"):
            arg += f" - {sub['description']}"
        args.append(arg)
    return f"{tool.name}({', '.join(args)})"


def call_skeleton(tool: Tool, syntax: CallSyntax = BARE) -> str:
    """A call of `tool` as the model writes one, its argument values left as "...":
    `{"name": "add", "arguments": {"a": "...", "b": "..."}}`."""
    args = ", ".join(f'{json.dumps(k, ensure_ascii=False)}: "..."' for k in tool.parameters.get("properties") or {})
    return f'{syntax.open}{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": {{{args}}}}}{syntax.close}'


def tools_prompt(plan: ToolPlan) -> str:
    """The fallback system text describing the callable tools and the call syntax (used when the chat
    template has no tool format). Tools are shown as signatures, not raw JSON schemas: the call's shape is
    enforced by decoding, and a small model shown a schema tends to copy it into the arguments.

    Under "auto" the text opens with one call skeleton per tool (`call_skeleton`), then the signatures: a
    model that continues its prompt (a base model's habit) then begins its reply with a call where one fits,
    and otherwise still may answer in text (Gemma-3-270M: `{` is not among its 20 likeliest first tokens after
    the signatures-first text, and its first choice after this one; docs/adapters.md)."""
    if plan.choice == "auto":
        lines = [call_skeleton(t, plan.syntax) for t in plan.tools]
        lines.append("")
        lines.append("These are the calls of the tools you can use:")
        lines += [f"- {tool_signature(t)}" + (f": {t.description}" if t.description else "") for t in plan.tools]
        lines.append("To call a tool, reply with only its call, the arguments filled in.")
        if plan.parallel:
            lines.append("To call several tools, write one call per line.")
        lines.append("To answer without a tool, reply in plain text.")
        return "\n".join(lines)
    lines = ["You can call these tools:"]
    for t in plan.tools:
        lines.append(f"- {tool_signature(t)}" + (f": {t.description}" if t.description else ""))
    example = plan.syntax.open + '{"name": "<tool name>", "arguments": {<argument values>}}' + plan.syntax.close
    lines.append(f"To call a tool, reply with only {example}.")
    if plan.parallel:
        lines.append("To call several tools, write one call per line.")
    if plan.choice == "auto":
        lines.append("To answer without a tool, reply in plain text.")
    elif plan.choice != "required":
        lines.append(f"Call the tool {plan.choice}.")
    return "\n".join(lines)


def format_call(call: ToolCall, syntax: CallSyntax = BARE) -> str:
    """A past call as the model is asked to write it."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{syntax.open}{body}{syntax.close}"


def format_tool_result(name: str | None, content: str) -> str:
    return f"Result of tool {name}: {content}" if name else f"Tool result: {content}"


def template_tools(tools: list[Tool]) -> list[dict]:
    """Tools in the form chat templates read (`apply_chat_template(tools=...)`)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]
