"""Engine outputs -> Anthropic Messages API objects: the message, its content blocks (text, tool_use), usage with
the cache fields, the streaming events, and Anthropic's error shape.

Usage: `cache_read_input_tokens` are the prompt tokens whose K/V was reused (Completion.cached_tokens);
`cache_creation_input_tokens` the tokens this request computed up to the end of its longest kept prefix (the
cache write a breakpoint asks for; 0 when it keeps nothing or the keep was refused); `input_tokens` the rest of the
prompt. The three add up to the prompt. `cache_creation` splits the written tokens by lifetime (1h or 5m).

Streams: message_start (usage so far), ping, per block content_block_start / content_block_delta (text_delta,
input_json_delta) / content_block_stop, message_delta (stop_reason, stop_sequence, output_tokens), message_stop;
a failure mid-stream is an `error` event. With tools, text that may still be a call is held until it is known.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from prefixrt.lowering.tools import ToolCall, ToolPlan
from prefixrt.server.sse import JSON, dumps

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500
                                                                     else "invalid_request_error"),
                                       "message": message}}


def error_response(status: int, message: str, headers: dict | None = None, retry: bool = False) -> JSON:
    h = dict(headers or {})
    if not retry:
        h["x-should-retry"] = "false"
    return JSON(error_body(status, message), status_code=status, headers=h)


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n"


def error_event(status: int, message: str) -> str:
    return f"event: error\ndata: {dumps(error_body(status, message))}\n\n"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, keep_report: dict | None,
          long_ttl: bool) -> dict:
    """Anthropic's usage object (module docstring). long_ttl: the longest kept prefix lives an hour or more."""
    kept = min((keep_report or {}).get("kept_tokens") or 0, prompt_tokens)
    creation = max(0, kept - cached_tokens)
    return {"input_tokens": prompt_tokens - cached_tokens - creation,
            "cache_creation_input_tokens": creation, "cache_read_input_tokens": cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": 0 if long_ttl else creation,
                               "ephemeral_1h_input_tokens": creation if long_ttl else 0},
            "output_tokens": output_tokens, "service_tier": "standard"}


def stop_reason(finish_reason: str | None, matched_stop, stop_sequences: list[str], calls: bool
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an output."""
    if calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched_stop, str) and matched_stop in stop_sequences:
        return "stop_sequence", matched_stop
    return "end_turn", None


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": call.arguments}


def content_blocks(text: str, plan: ToolPlan | None) -> tuple[list[dict], bool]:
    """(the content blocks of a finished reply, whether it is tool calls)."""
    calls = plan.parse(text) if plan is not None else None
    if calls:
        return [_tool_use(c) for c in calls], True
    return ([{"type": "text", "text": text}] if text else []), False


def message(mid: str, model: str, content: list[dict], reason: str | None, sequence: str | None, use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}


async def message_events(first, chunks: AsyncIterator, mid: str, model: str, plan: ToolPlan | None,
                         stop_sequences: list[str], usage_of, failure) -> AsyncIterator[str]:
    """The SSE events of a streamed message. first: its first Chunk (already read; `chunks` yields it again: it
    carries the prompt's counts and the keep decision); usage_of(first, output_tokens): the usage object;
    failure(chunk): the (status, message) of an aborted one."""
    yield event("message_start", {"message": message(mid, model, [], None, None, usage_of(first, 0))})
    yield event("ping", {})
    index, text_open, held, plain, outputs = 0, False, "", plan is None, 0
    async for ch in chunks:
        if ch.finish_reason == "abort":
            yield error_event(*failure(ch))
            return
        outputs = ch.completion_tokens
        text = ch.text
        if not plain:
            held += text
            text = ""
            if not plan.may_be_call(held):  # clearly prose: stream it
                plain, text, held = True, held, ""
        final = ch.finish_reason is not None
        calls = plan.parse(held) if final and held else None
        if final and held and not calls:
            text, held = text + held, ""
        if text:
            if not text_open:
                yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                text_open = True
            yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})
        if not final:
            continue
        if text_open:
            yield event("content_block_stop", {"index": index})
            index += 1
        for call in calls or ():
            block = _tool_use(call)
            yield event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
            yield event("content_block_stop", {"index": index})
            index += 1
        reason, sequence = stop_reason(ch.finish_reason, ch.matched_stop, stop_sequences, bool(calls))
        final_usage = usage_of(first, outputs)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {k: final_usage[k] for k in (
                                          "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                                          "output_tokens")}})
        yield event("message_stop", {})
        return
