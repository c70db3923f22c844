"""The OpenAI request vocabulary -> engine parameters and constraints: the one translation layer.

`prefixrt serve`'s routes (server/convert.py, server/responses.py), the in-process shim (which runs those
routes) and the DSPy and LangChain adapters all lower requests here:

- `sampling_options`: OpenAI option names (max_tokens, stop, logit_bias, ...) -> a SamplingParams dict;
- `response_format_constraint`: chat `response_format`, Responses `text.format`, lm15's form ->
  `{"json_schema": ...}` under the strict-mode rule of prefixrt/json_schema.py (whatever `strict` says);
- `plan_tools`: `tools` + `tool_choice` + `parallel_tool_calls` -> a `ToolPlan`: the constraint (a JSON schema
  for exactly one call, else an llguidance Lark grammar), how calls are written, and `parse` for the reply;
- `engine_messages` / `tools_prompt`: OpenAI chat messages -> what the chat template renders, with the
  tools given to the template when it has a tool format (`<tool_call>` tags, as Qwen and Hermes templates
  write them), else described in a system message (`tools_prompt`, the documented fallback);
- `lower_chat`: all of the above for one chat request (messages, tools, tool_choice, response_format) -> a
  `LoweredChat`. The server, the DSPy adapter and the LangChain adapter each turn their own request into
  OpenAI-shaped dicts and call it, so one request lowers the same way whichever door it came in by.

tools together with response_format (one rule, in `lower_chat`):
  no callable tool    the response format constrains the reply;
  "auto"              the reply is one or more calls, or an answer in the response format (the format takes
                      the place of plain text in the grammar);
  "required" / named  the reply is a call, so the response format has nothing to constrain and is unused.

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

Pure functions over plain dicts: nothing here imports pydantic request models, FastAPI, DSPy or LangChain.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixrt import tool_formats
from prefixrt.constrained.spec import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR
from prefixrt.errors import InvalidRequest
from prefixrt.json_schema import embed, normalized_types, strict_schema, to_json_schema, with_defs
from prefixrt.params import CONSTRAINT_FIELDS, checked_logit_bias

# ---------------------------------------------------------------------------------------------- options

# OpenAI / framework option name -> SamplingParams field. Anything else is refused (no silent drops).
OPTION_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_output_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "logprobs": "logprobs",
    "n": "n",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "regex": "regex",
    "grammar": "grammar",
    "choices": "choices",
    "json_schema": "json_schema",
    "json_object": "json_object",
    "cache_salt": "cache_salt",
    "priority": "priority",
    "speculative": "speculative",
}


# OpenAI's output limits: at least one token (as OpenAI and vLLM answer; the engine's own max_new_tokens may be 0).
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
OPENAI_SEED_MIN, OPENAI_SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM checks it


def check_output_limit(value: Any, param: str) -> None:
    """InvalidRequest naming `param` unless an OpenAI output limit (max_tokens, ...) is None or an integer >= 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{param} must be at least 1, got {value!r}", param=param)


def check_seed(value: Any, param: str = "seed") -> None:
    """InvalidRequest unless an OpenAI seed is None or a signed 64-bit integer."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not OPENAI_SEED_MIN <= value <= OPENAI_SEED_MAX:
        raise InvalidRequest(f"{param} must be an integer in [-2**63, 2**63 - 1], got {value!r}", param=param)


def sampling_options(options: dict[str, Any], *, what: str, warnings: list[str] | None = None) -> dict[str, Any]:
    """Options under OpenAI names -> a SamplingParams dict. None values mean "engine default".

    Raises InvalidRequest naming an option prefixrt has no meaning for, or an OpenAI output limit below 1 or a
    seed outside the signed 64-bit range; `what` says who passed it. A `json_schema` has its type names
    normalised (`json_schema.normalized_types`), each rename appended to `warnings`."""
    params: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        name = OPTION_NAMES.get(key)
        if name is None:
            raise InvalidRequest(f"{what}: prefixrt has no sampling option {key!r}", param=key)
        if key in OUTPUT_LIMITS:
            check_output_limit(value, key)
        if key == "seed":
            check_seed(value)
        if name == "stop":
            value = [value] if isinstance(value, str) else list(value)
            if not value:
                continue
        if name == "logit_bias":
            value = logit_bias(value)
        if name == "json_schema" and not isinstance(value, type):
            value = schema_types(to_json_schema(value), "json_schema", warnings)
        if name in params and params[name] != value:
            raise InvalidRequest(f"{what}: {key} conflicts with another option for {name}", param=key)
        params[name] = value
    return params


def logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias ({"<token id>": bias}, ids as JSON strings) -> {int id: float}; ids are checked
    against the vocabulary when the request is submitted, values here ([-100, 100], as OpenAI). One
    InvalidRequest names every offending key (prefixrt.params.checked_logit_bias)."""
    return checked_logit_bias(bias)


def schema_types(schema: Any, param: str, warnings: list[str] | None) -> Any:
    """`schema` with its type names normalised (Python's `int`, `str`, ... -> JSON Schema's), the renames
    appended to `warnings`; InvalidRequest naming the path of a type name that is neither."""
    out, renamed = normalized_types(schema, param)
    if warnings is not None:
        warnings.extend(renamed)
    return out


def merge_constraint(params: dict, constraint: dict, param: str) -> None:
    """Add `constraint` ({kind: spec}) to params in place; two constraints on one request are refused."""
    if not constraint:
        return
    if any(params.get(k) not in (None, False) for k in CONSTRAINT_FIELDS):
        raise InvalidRequest(f"{param} cannot be combined with another constraint (regex, json_schema, grammar, "
                             "choices, response_format, tool_choice)", param=param)
    params.update(constraint)


# ---------------------------------------------------------------------------------------------- response_format


def response_format_constraint(response_format: dict | None, param: str = "response_format",
                               warnings: list[str] | None = None) -> dict[str, Any]:
    """A response format -> {"json_schema": ...} for constrained decoding ({} for plain text).

    Accepts chat's {"type": "json_schema", "json_schema": {"schema", "strict"}}, the Responses API's
    {"type": "json_schema", "schema", "strict"} (also lm15's form), and {"type": "json_object"} (any JSON
    object). The strict-mode rule applies whatever `"strict"` says; explicit `additionalProperties` is kept."""
    if not response_format:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        holder = inner if isinstance(inner, dict) else response_format
        schema = holder.get("schema")
        if schema is None:
            raise InvalidRequest(f"{param} json_schema needs a schema", param=param)
        # Decoding is strict whatever "strict" says (as vLLM and xgrammar do): clients send "strict": false for
        # schemas they cannot make strict-valid (LangChain's TypedDicts), and an open object lets a small model
        # invent keys until max_tokens.
        return {"json_schema": strict_schema(schema_types(to_json_schema(schema), param, warnings))}
    raise InvalidRequest(f"unsupported {param} type {kind!r}", param=param)


# ---------------------------------------------------------------------------------------------- tools


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
    arguments under `key`. `family`: the model family's own syntax (prefixrt/tool_formats.py) when the chat
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

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

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
    return ToolPlan(list(callable_), choice, parallel, syntax, constraint)


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


# ---------------------------------------------------------------------------------------------- prompts


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


def content_text(content: Any) -> str:
    """A message's content as text: a string, or a list of text parts (chat's and the Responses API's)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
            texts.append(part.get("text") or "")
        elif isinstance(part, dict) and part.get("type") == "refusal":
            texts.append(part.get("refusal") or "")
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"prefixrt models read text only; got a content part of type {kind!r}",
                                 param="messages")
    return "".join(texts)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def engine_messages(messages: list[dict], *, template_tools: bool = False,
                    syntax: CallSyntax = BARE) -> list[dict]:
    """OpenAI chat messages (dicts) -> {role, content} dicts the chat template renders.

    developer -> system. With `template_tools` (the template renders tools), assistant `tool_calls` and `tool`
    messages are passed on in the form HF templates read (arguments as objects); otherwise past calls become
    the assistant's text in `syntax` and tool results become user turns."""
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> tool name
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "developer":
            role = "system"
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            parsed = []
            for c in calls:
                fn = c.get("function") or {}
                names[c.get("id") or ""] = fn.get("name")
                parsed.append(ToolCall(fn.get("name"), _arguments(fn.get("arguments", "{}"))))
            if template_tools:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": c.get("id"), "type": "function",
                     "function": {"name": p.name, "arguments": p.arguments}} for c, p in zip(calls, parsed)]})
                continue
            written = syntax.sep.join(format_call(p, syntax) for p in parsed)
            out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
            continue
        if role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if template_tools:
                out.append({"role": "tool", "content": text, "tool_call_id": m.get("tool_call_id"),
                            **({"name": name} if name else {})})
            else:
                out.append({"role": "user", "content": format_tool_result(name, text)})
            continue
        out.append({"role": role, "content": text})
    return out


def with_system_note(messages: list[dict], note: str, first: bool = False) -> list[dict]:
    """Append `note` to the leading system message (creating one), keeping everything else as is; with
    `first`, put it before that message's text instead."""
    if messages and messages[0]["role"] == "system":
        parts = (note, messages[0]["content"]) if first else (messages[0]["content"], note)
        return [{**messages[0], "content": "\n\n".join(parts)}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def with_tools_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """`messages` with the fallback tools prompt (`tools_prompt`) in the system message: at its start under
    "auto" (the call skeletons must open the prompt to be picked up), else at its end."""
    return with_system_note(messages, tools_prompt(plan), first=plan.choice == "auto")


def template_tools(tools: list[Tool]) -> list[dict]:
    """Tools in the form chat templates read (`apply_chat_template(tools=...)`)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


# ---------------------------------------------------------------------------------------------- one chat request


@dataclass
class LoweredChat:
    """A chat request lowered: what the chat template renders, what decoding is held to, how the reply reads."""

    messages: list[dict]  # {role, content} dicts (plus tool_calls / tool messages when the template renders tools)
    constraint: dict  # {kind: spec} for SamplingParams ({} when the reply is free text)
    tools: ToolPlan | None  # the tool plan, when a tool may be called
    template_tools: list[dict] | None  # tools for apply_chat_template(tools=...), when the template renders them
    constraint_param: str = "response_format"  # the request field the constraint comes from (for errors)
    warnings: list[str] = field(default_factory=list)  # what was read other than as written (schema type names)

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
