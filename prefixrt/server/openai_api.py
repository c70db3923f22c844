"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (JSON or SSE)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from prefixrt.server import convert, structured
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest
from prefixrt.server.sse import JSON, SSE_DONE, EventStream, sse, until_disconnect

router = APIRouter()


def _engine(request: Request):
    return request.app.state.engine


def _model_name(request: Request) -> str:
    return request.app.state.model_name


@router.get("/v1/models")
async def list_models(request: Request):
    eng = _engine(request)
    return JSON({"object": "list", "data": [{
        "id": _model_name(request), "object": "model", "created": request.app.state.created,
        "owned_by": "prefixrt", "max_model_len": getattr(eng, "max_context", None),
        "vocab_size": getattr(eng, "vocab_size", None),
    }]})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    eng = _engine(request)
    messages, params, mode = convert.chat_params(body, eng.max_context)
    prompt = eng.chat_prompt_ids(messages, continue_final_message=True) if body.continue_final_message else messages
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = dataclasses.replace(params, request_id=rid)
    model, created = _model_name(request), int(time.time())
    if not body.stream:
        c = await until_disconnect(request, eng.agenerate(prompt, params))
        return JSON(convert.chat_response(c, rid, model, created, mode))
    chunks = eng.astream(prompt, params)  # submits now: a bad request raises here, before any byte is sent
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = _chat_events(chunks, rid, model, created, mode, include_usage)
    return EventStream(gen, on_close=lambda: eng.abort(rid))


async def _chat_events(chunks, rid: str, model: str, created: int, mode: structured.ToolMode,
                       include_usage: bool) -> AsyncIterator[str]:
    usage = convert.StreamUsage()
    started: set[int] = set()
    held: dict[int, str] = {}  # index -> text held back because it may be a tool call
    held_lps: dict[int, list] = {}
    plain: set[int] = set()  # indexes known to be plain text

    def chunk(i, delta, reason=None, lps=None):
        return sse(convert.chat_chunk(rid, model, created, i, delta, reason, convert.chat_logprobs(lps)))

    async for ch in chunks:
        usage.add(0, ch)
        i = ch.index
        if i not in started:
            started.add(i)
            yield chunk(i, {"role": "assistant", "content": ""})
        if mode.active and i not in plain:
            held[i] = held.get(i, "") + ch.text
            if ch.logprobs:
                held_lps.setdefault(i, []).extend(ch.logprobs)
            lead = held[i].lstrip()[:1]
            if not mode.forced and lead and lead not in "{<`":  # "auto" and clearly prose: stream it
                plain.add(i)
                yield chunk(i, {"content": held.pop(i)}, lps=held_lps.pop(i, None))
            elif ch.finish_reason is not None:
                text, lps = held.pop(i, ""), held_lps.pop(i, None)
                calls = structured.parse_tool_calls(text, mode)
                if calls:
                    delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                    yield chunk(i, delta, lps=lps)
                    yield chunk(i, {}, "tool_calls")
                else:
                    yield chunk(i, {"content": text}, lps=lps)
                    yield chunk(i, {}, ch.finish_reason)
            continue
        if ch.text or ch.logprobs:
            yield chunk(i, {"content": ch.text}, lps=ch.logprobs)
        if ch.finish_reason is not None:
            yield chunk(i, {}, ch.finish_reason)
    if include_usage:
        yield sse(convert.usage_chunk(rid, model, created, "chat.completion.chunk", usage.to_dict()))
    yield SSE_DONE


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    eng = _engine(request)
    prompts, params = convert.completion_params(body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{k}" for k in range(len(prompts))]
    per_prompt = [dataclasses.replace(params, request_id=r) for r in rids]
    model, created = _model_name(request), int(time.time())
    if not body.stream:
        async def run():
            return await asyncio.gather(*(eng.agenerate(p, sp) for p, sp in zip(prompts, per_prompt)))

        cs = await until_disconnect(request, run())
        return JSON(convert.completion_response(list(cs), rid, model, created))
    streams = []
    try:
        for p, sp in zip(prompts, per_prompt):
            streams.append(eng.astream(p, sp))
    except Exception:
        for r in rids:
            eng.abort(r)
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = _completion_events(streams, params.n, rid, model, created, include_usage)

    def close():
        for r in rids:
            eng.abort(r)

    return EventStream(gen, on_close=close)


async def _completion_events(streams, n: int, rid: str, model: str, created: int,
                             include_usage: bool) -> AsyncIterator[str]:
    usage = convert.StreamUsage()
    offsets: dict[int, int] = {}
    async for k, ch in _merge(streams):
        usage.add(k, ch)
        index = k * n + ch.index
        lps = convert.completion_logprobs(ch.logprobs, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(ch.text)
        if ch.text or ch.logprobs or ch.finish_reason is not None:
            yield sse(convert.completion_chunk(rid, model, created, index, ch.text, ch.finish_reason, lps))
    if include_usage:
        yield sse(convert.usage_chunk(rid, model, created, "text_completion", usage.to_dict()))
    yield SSE_DONE


async def _merge(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from several async iterators as items arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k, it):
        try:
            async for item in it:
                await queue.put((k, item))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, it)) for k, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
