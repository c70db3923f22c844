"""What the DSPy and LangChain adapters share: where the Provider comes from, and how framework requests are
lowered to Provider calls (chat messages, SamplingParams dicts, tool-call schemas).

Nothing here imports DSPy or LangChain. Everything speaks the Provider protocol (prefixrt/provider.py), so an
in-process Engine and a RemoteEngine over `prefixrt serve` are interchangeable.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from prefixrt.errors import InvalidRequest

# ---------------------------------------------------------------------------------------------- providers

_shared_engines: dict[tuple, Any] = {}
_shared_lock = threading.Lock()


def shared_engine(model: str, engine_kwargs: dict | None = None):
    """One in-process Engine per (model, engine kwargs) for the whole process.

    Loading weights is the expensive part, and several adapter objects (a DSPy LM, its copies, a LangChain
    model, a reloaded program) naming the same model should share one radix cache, which is what makes their
    shared prefixes hit. The engine lives until the process exits.
    """
    kwargs = dict(engine_kwargs or {})
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _shared_lock:
        eng = _shared_engines.get(key)
        if eng is None:
            from prefixrt.engine.engine import Engine

            eng = Engine(model, **kwargs)
            _shared_engines[key] = eng
        return eng


def remote_engine(base_url: str, api_key: str | None = None):
    """A RemoteEngine (Provider over a `prefixrt serve` server); an actionable error while it is missing."""
    try:
        from prefixrt.remote import RemoteEngine
    except ImportError as e:
        raise ImportError(
            "base_url= needs prefixrt.RemoteEngine (prefixrt/remote.py), which this installation does not have; "
            "pass model= or engine= to run in-process"
        ) from e
    return RemoteEngine(base_url, api_key=api_key)


class ProviderHandle:
    """Where an adapter's Provider comes from, built on first use and shared by copies of the adapter.

    Exactly one source: `provider` (an Engine, RemoteEngine or any Provider), `model` (a registry name or a
    local HF folder, loaded in-process once per process), or `base_url` (a `prefixrt serve` server).
    `model` together with `base_url` names the server's model without asking it.
    """

    def __init__(self, *, model: str | None = None, provider: Any = None, base_url: str | None = None,
                 api_key: str | None = None, engine_kwargs: dict | None = None):
        if provider is not None and (model is not None or base_url is not None):
            raise ValueError("pass engine= alone, or model= / base_url=, not both")
        if provider is None and model is None and base_url is None:
            raise ValueError("pass model= (a registry name or local folder), engine= or base_url=")
        self.model = model
        self.base_url = base_url
        self.api_key = api_key
        self.engine_kwargs = dict(engine_kwargs or {})
        self._provider = provider
        self._lock = threading.Lock()

    def get(self):
        """The Provider, built now if this is the first call (loads weights / opens the client)."""
        if self._provider is None:
            with self._lock:
                if self._provider is None:
                    if self.base_url is not None:
                        self._provider = remote_engine(self.base_url, self.api_key)
                    else:
                        self._provider = shared_engine(self.model, self.engine_kwargs)
        return self._provider

    @property
    def built(self) -> bool:
        return self._provider is not None

    @property
    def model_name(self) -> str:
        """The model's name, without building an in-process engine to learn it."""
        if self._provider is not None and getattr(self._provider, "model_name", None):
            return self._provider.model_name
        if self.model is not None:
            return self.model
        return self.get().model_name

    def model_id(self) -> str:
        """name@revision: identifies the weights, for caches keyed by model string (DSPy's response cache)."""
        name = self.model_name
        revision = None
        if self._provider is not None or self.base_url is not None:
            revision = getattr(self.get(), "model_revision", None)
        elif self.model is not None:
            from prefixrt.hub.registry import resolve_model

            revision = resolve_model(self.model).revision
        if not revision:
            return name
        return revision if str(revision).startswith(f"{name}@") else f"{name}@{revision}"

    def __deepcopy__(self, memo):
        return self  # engines are shared runtime objects, never copied


# ---------------------------------------------------------------------------------------------- parameters

# Framework option name -> SamplingParams field. Anything else a caller passes is refused (no silent drops).
_PARAM_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logprobs": "logprobs",
    "ignore_eos": "ignore_eos",
    "regex": "regex",
    "grammar": "grammar",
    "choices": "choices",
    "cache_salt": "cache_salt",
    "priority": "priority",
}


def sampling_params(options: dict[str, Any], *, what: str) -> dict[str, Any]:
    """Framework options (OpenAI-style names) -> a SamplingParams dict. None values mean "engine default".

    Raises InvalidRequest naming an option prefixrt has no meaning for; `what` says who passed it.
    """
    params: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        name = _PARAM_NAMES.get(key)
        if name is None:
            raise InvalidRequest(f"{what}: prefixrt has no sampling option {key!r}", param=key)
        if name == "stop":
            value = [value] if isinstance(value, str) else list(value)
            if not value:
                continue
        params[name] = value
    params.setdefault("request_id", f"req-{uuid.uuid4().hex[:12]}")
    return params


def response_format_constraint(response_format: dict | None) -> dict[str, Any]:
    """An OpenAI/lm15 response_format -> {"json_schema": ...} for constrained decoding ({} for none).

    Accepts {"type": "json_object"} (any JSON object: SamplingParams.json_object),
    {"type": "json_schema", "schema": ...} (lm15) and {"type": "json_schema", "json_schema": {"schema": ...}}
    (OpenAI). The schema is sent as given.
    """
    if not response_format:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = response_format.get("schema")
        if schema is None and isinstance(response_format.get("json_schema"), dict):
            schema = response_format["json_schema"].get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs a 'schema' object", param="response_format")
        return {"json_schema": schema}
    raise InvalidRequest(f"unsupported response_format type {kind!r}", param="response_format")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object that lists its properties allows no others.

    JSON Schema leaves objects open by default, and a small model under constrained decoding happily fills an
    open object with invented keys (often copied from the schema text it was shown). Schemas derived from
    pydantic models, TypedDicts and function signatures mean "exactly these fields", so objects that declare
    `properties` get `additionalProperties: false` unless they say otherwise (what OpenAI's strict mode does).
    """
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if is_object and "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict


_DEF_KEYS = ("$defs", "definitions")


def _hoist_defs(schema: dict, defs: dict) -> dict:
    """Move a tool's `$defs` / `definitions` to the root of the combined schema, where its refs point.

    Refs of the form `#/definitions/X` are rewritten to `#/$defs/X`. Two tools may share a definition name only
    when they define it identically.
    """
    schema = dict(schema)
    for key in _DEF_KEYS:
        for name, sub in (schema.pop(key, None) or {}).items():
            sub = _rewrite_refs(sub)
            if name in defs and defs[name] != sub:
                raise InvalidRequest(f"two tools define different schemas named {name!r}", param="tools")
            defs[name] = sub
    return _rewrite_refs(schema)


def _rewrite_refs(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_rewrite_refs(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rewrite_refs(v) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/definitions/"):
        out["$ref"] = "#/$defs/" + ref[len("#/definitions/"):]
    elif isinstance(ref, str) and not ref.startswith("#/$defs/"):
        raise InvalidRequest(f"tool parameters may only refer to their own definitions, not {ref!r}", param="tools")
    return out


def tool_call_schema(tools: list[ToolSpec], choice: str) -> dict:
    """The JSON schema a reply must match when tools are bound.

    choice: "required" (call one of the tools), "auto" (call a tool or answer in text), or a tool name (call
    exactly that tool). A call is {"name": <tool>, "arguments": {...}}; a text answer (auto only) is
    {"response": "..."}. Decoding is constrained to this schema, so a reply always parses. Argument objects
    are closed (`closed_schema`): a call carries exactly the parameters the tool declares.
    """
    if choice not in ("required", "auto") and choice not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names {choice!r}, which is not a bound tool", param="tool_choice")
    chosen = [t for t in tools if choice in ("required", "auto") or t.name == choice]
    defs: dict = {}
    variants = []
    for t in chosen:
        params = _hoist_defs(closed_schema(t.parameters or {"type": "object", "properties": {}}), defs)
        params.pop("title", None)
        params.pop("description", None)
        variants.append({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    if choice == "auto":
        variants.append({
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        })
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _type_name(schema: dict) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type_name(s) for s in schema[key] if isinstance(s, dict))
    kind = schema.get("type", "any")
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"list of {_type_name(schema['items'])}"
    return " | ".join(kind) if isinstance(kind, list) else str(kind)


def _signature(tool: ToolSpec) -> str:
    props = (tool.parameters or {}).get("properties") or {}
    required = set((tool.parameters or {}).get("required") or [])
    args = []
    for name, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        arg = f"{name}: {_type_name(sub)}" + ("" if name in required else " (optional)")
        if sub.get("description"):
            arg += f" - {sub['description']}"
        args.append(arg)
    return f"{tool.name}({', '.join(args)})"


def tools_instruction(tools: list[ToolSpec], choice: str) -> str:
    """The system text that tells the model which tools exist and how a call is written.

    Tools are shown as signatures (`add(a: integer, b: integer)`), not as raw JSON schemas: the reply's shape
    is enforced by decoding, and a small model shown a schema tends to copy it into the arguments.
    """
    lines = ["You can call these tools:"]
    for t in tools:
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {_signature(t)}{desc}")
    lines.append('To call a tool, reply with JSON: {"name": "<tool name>", "arguments": {<argument values>}}.')
    if choice == "auto":
        lines.append('To answer without a tool, reply with JSON: {"response": "<your answer>"}.')
    elif choice != "required":
        lines.append(f"Call the tool {choice}.")
    return "\n".join(lines)


def format_tool_call(name: str, arguments: dict) -> str:
    """How a past tool call appears in the transcript (the same shape the model is asked to produce)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def format_tool_result(name: str | None, content: str) -> str:
    return f"Result of tool {name}: {content}" if name else f"Tool result: {content}"


@dataclass
class ParsedReply:
    text: str  # the text answer ("" when the reply is a tool call)
    tool_name: str | None = None
    tool_arguments: dict | None = None


def parse_tool_reply(text: str) -> ParsedReply:
    """Read a reply generated under `tool_call_schema`. Raises ValueError if it does not match (truncated)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool-call reply is not complete JSON ({e}); raise max_tokens") from e
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
        return ParsedReply("", obj["name"], obj["arguments"])
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return ParsedReply(obj["response"])
    raise ValueError(f"the reply does not match the tool-call schema: {text[:200]!r}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


# ---------------------------------------------------------------------------------------------- messages


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as every chat template accepts them: system text merged into one leading message,
    roles limited to system/user/assistant (callers turn tool results into user turns first)."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    out = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    out.extend(rest)
    if not rest:
        raise InvalidRequest("the conversation has no user message", param="messages")
    return out


def with_system_note(messages: list[dict], note: str) -> list[dict]:
    """Append `note` to the system message (creating one), keeping everything else as is."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
