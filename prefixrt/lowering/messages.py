"""Chat messages in the callers' vocabularies -> the {role, content} dicts a chat template renders.

- `engine_messages`: OpenAI chat messages -> template messages: developer -> system; past tool calls and tool
  results passed on in the form HF templates read (when the template renders tools) or written as text;
- `responses_input`: the Responses API's `input` items -> OpenAI chat messages;
- `normalize_messages`: system text merged into one leading message (every chat template accepts that);
- `with_system_note` / `with_tools_prompt`: text added to the leading system message.
Content is text here (`content_text`); image parts are taken out before and put back after
(prefixrt/multimodal/messages.py).
"""

from __future__ import annotations

import json
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.tools import (
    BARE,
    CallSyntax,
    ToolCall,
    ToolPlan,
    format_call,
    format_tool_result,
    tools_prompt,
)


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


def responses_input(items: str | list[dict]) -> list[dict]:
    """Responses `input` -> OpenAI chat messages (function calls become assistant tool_calls, their outputs
    tool messages). Reasoning items are dropped (prefixrt models emit none)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"input[{k}]: unsupported role {role!r}", param=f"input[{k}].role")
            out.append({"role": role, "content": content_text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else content_text(output)})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(f"input[{k}]: unsupported item type {kind!r}", param=f"input[{k}].type")
    return out


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as every chat template accepts them: system text merged into one leading message (the
    rest kept as they are: prefixrt.lowering.lower_chat turns tool calls and results into text turns)."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    out = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    out.extend(rest)
    if not rest:
        raise InvalidRequest("the conversation has no user message", param="messages")
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
