"""An Anthropic Messages API request -> an OpenAI-shaped chat request (which lowering/chat.py lowers the one way
every door does) and its CachePlan (lowering/prompt_cache.py).

- `system` (a string or text blocks) -> a leading system message;
- user blocks: `text`, `image` (base64 or url source -> an image_url part), `tool_result` (-> a `tool` message,
  before the rest of the user turn, as Anthropic orders them; `is_error` results say so in their text);
- assistant blocks: `text`, `tool_use` (-> tool_calls; input as JSON arguments); `thinking` blocks are dropped
  (prefixrt writes none back);
- `tools` (name, description, input_schema) -> function tools; `tool_choice` auto / any / tool / none
  (-> auto / required / the named function / none; `disable_parallel_tool_use` -> parallel_tool_calls false);
- `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k` (which older clients send) -> their OpenAI names;
  prefixrt's extras as on chat: `cache_salt`, `ignore_eos`, `priority`, `min_p`, `repetition_penalty`;
- `output_config.format` (a JSON schema) -> response_format json_schema (decoding held to it);
- `metadata.user_id` -> the session key (requests of one user id are one session for scheduling);
- `cache_control` on tools, system blocks, message blocks and the request itself -> breakpoints.
Pure functions over dicts: InvalidRequest (a 400 in Anthropic's error shape) for what prefixrt cannot serve.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.prompt_cache import Breakpoint, CachePlan, anthropic_ttl, check_breakpoint_count

# Messages API fields that have no meaning here but do not change the reply's contract: accepted, not used.
IGNORED_FIELDS = ("service_tier", "container", "mcp_servers", "context_management", "inference_geo", "speed",
                  "diagnostics", "user_profile_id", "workspace_id")


@dataclass
class LoweredMessages:
    """An Anthropic request lowered: the OpenAI chat request (body dict) and the cache plan."""

    chat: dict[str, Any]
    cache: CachePlan
    warnings: list[str]


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text: a text block needs a string `text`", param=f"{where}.text")
    return text


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source") or {}
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequest(f"{where}.source: a base64 image needs media_type and data",
                                 param=f"{where}.source")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise InvalidRequest(f"{where}.source: image sources are base64 or url, got {kind!r}", param=f"{where}.source")


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text":
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise InvalidRequest(f"{where}.content[{k}]: tool results hold text blocks only here, not {kind!r}",
                                     param=f"{where}.content[{k}]")
            parts.append(_text_of(b, f"{where}.content[{k}]"))
        text = "\n".join(parts)
    return f"Error: {text}" if block.get("is_error") else text


class _Conversation:
    """OpenAI chat messages built block by block, with a snapshot at each cache_control."""

    def __init__(self):
        self.messages: list[dict] = []
        self.breakpoints: list[tuple[list[dict], float]] = []  # (the conversation so far, ttl_s)

    def mark(self, cache_control, where: str) -> None:
        if cache_control is not None:
            self.breakpoints.append((copy.deepcopy(self.messages), anthropic_ttl(cache_control, where)))


def lower_messages_request(request: dict[str, Any]) -> LoweredMessages:
    """An Anthropic Messages request (body dict) -> LoweredMessages. InvalidRequest when malformed."""
    warnings: list[str] = []
    if not isinstance(request.get("max_tokens"), int) or isinstance(request.get("max_tokens"), bool):
        raise InvalidRequest("max_tokens: Field required (an integer)", param="max_tokens")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    conv = _Conversation()
    tools = _tools(request.get("tools"), conv)
    _system(request.get("system"), conv)
    for i, m in enumerate(messages):
        _message(m, i, conv)
    if request.get("cache_control") is not None:  # automatic caching: the whole prompt
        conv.breakpoints.append((copy.deepcopy(conv.messages), anthropic_ttl(request["cache_control"],
                                                                             "cache_control")))
    check_breakpoint_count(len(conv.breakpoints))
    thinking = request.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        warnings.append("thinking is not produced by this server; the request ran without it")
    for name in IGNORED_FIELDS:
        if request.get(name) is not None:
            warnings.append(f"{name} has no meaning here and was not used")
    chat: dict[str, Any] = {"messages": conv.messages, "max_tokens": request["max_tokens"]}
    if tools:
        chat["tools"] = tools
    output = request.get("output_config") or {}
    if not isinstance(output, dict):
        raise InvalidRequest("output_config must be an object", param="output_config")
    fmt = output.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                 param="output_config.format")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    if output.get("effort") is not None:
        warnings.append("output_config.effort has no meaning here and was not used")
    choice, parallel = _tool_choice(request.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    for ours, theirs in (("stop", "stop_sequences"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("cache_salt", "cache_salt"), ("ignore_eos", "ignore_eos"),
                         ("priority", "priority"), ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty")):
        if request.get(theirs) is not None:
            chat[ours] = request[theirs]
    total = len(conv.messages)
    bps = [Breakpoint(None if len(snap) == total and snap == conv.messages else snap, ttl)
           for snap, ttl in conv.breakpoints if snap]
    metadata = request.get("metadata") or {}
    session = metadata.get("user_id") if isinstance(metadata, dict) else None
    return LoweredMessages(chat, CachePlan(session if isinstance(session, str) and session else None, bps),
                           warnings)


def _tools(tools, conv: _Conversation) -> list[dict]:
    out = []
    for k, t in enumerate(tools or []):
        where = f"tools[{k}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{where}: a tool is an object", param=where)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(f"{where}: server tools ({kind!r}) are not available here; define a client tool "
                                 "with name, description and input_schema", param=f"{where}.type")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.name: Field required", param=f"{where}.name")
        out.append({"type": "function", "function": {"name": name, "description": t.get("description"),
                                                      "parameters": t.get("input_schema") or {"type": "object"}}})
        if t.get("cache_control") is not None:
            # The tools are rendered with the system prompt: their prefix ends where the system prompt does
            # (Anthropic orders tools, then system, then messages).
            conv.breakpoints.append((None, anthropic_ttl(t["cache_control"], f"{where}.cache_control")))
    return out


def _system(system, conv: _Conversation) -> None:
    tools_marks = [ttl for snap, ttl in conv.breakpoints if snap is None]
    conv.breakpoints = [(s, t) for s, t in conv.breakpoints if s is not None]
    if system is None or system == "" or system == []:
        return  # no system prompt: the tools' breakpoint falls before the first message, where nothing is kept
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    if not isinstance(blocks, list):
        raise InvalidRequest("system must be a string or a list of text blocks", param="system")
    conv.messages.append({"role": "system", "content": []})
    for j, b in enumerate(blocks):
        where = f"system[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text":
            raise InvalidRequest(f"{where}: system blocks are text blocks", param=where)
        conv.messages[-1]["content"].append({"type": "text", "text": _text_of(b, where)})
        conv.mark(b.get("cache_control"), f"{where}.cache_control")
    for ttl in tools_marks:
        conv.breakpoints.insert(0, (copy.deepcopy(conv.messages), ttl))


def _message(m, i: int, conv: _Conversation) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where}: a message is an object", param=where)
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant', got {role!r}", param=f"{where}.role")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{where}.content: a string or a list of content blocks", param=f"{where}.content")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": []}
        conv.messages.append(msg)
        for j, b in enumerate(blocks):
            bw = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                msg["content"].append({"type": "text", "text": _text_of(b, bw)})
            elif kind == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                    raise InvalidRequest(f"{bw}: tool_use needs id and name", param=bw)
                msg.setdefault("tool_calls", []).append({
                    "id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise InvalidRequest(f"{bw}: assistant blocks are text, tool_use or thinking, not {kind!r}", param=bw)
            conv.mark(b.get("cache_control"), f"{bw}.cache_control")
        return
    user: dict[str, Any] | None = None
    for j, b in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidRequest(f"{bw}.tool_use_id: Field required", param=f"{bw}.tool_use_id")
            if user is not None:  # Anthropic's rule: tool results come first in the user turn
                raise InvalidRequest(f"{bw}: tool_result blocks must come before any other content",
                                     param=bw)
            conv.messages.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                  "content": _tool_result_text(b, bw)})
        elif kind in ("text", "image"):
            if user is None:
                user = {"role": "user", "content": []}
                conv.messages.append(user)
            user["content"].append({"type": "text", "text": _text_of(b, bw)} if kind == "text"
                                   else _image_part(b, bw))
        else:
            raise InvalidRequest(f"{bw}: user blocks are text, image or tool_result here, not {kind!r}", param=bw)
        conv.mark(b.get("cache_control"), f"{bw}.cache_control")


def _tool_choice(choice) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise InvalidRequest("tool_choice must be an object with a type", param="tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest(f"tool_choice.type must be auto, any, tool (with a name) or none, got {kind!r}",
                         param="tool_choice")
