"""OpenAI-compatible routes: /v1/models[/{id}], /v1/chat/completions, /v1/completions (JSON or SSE).

/v1/responses lives in responses.py (included here)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from prefixrt.lowering import ToolPlan
from prefixrt.server import convert
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest
from prefixrt.server.responses import router as responses_router
from prefixrt.server.sse import JSON, SSE_DONE, EventStream, sse, until_disconnect

router = APIRouter()
router.include_router(responses_router)


def _engine(request: Request):
    return request.app.state.engine


def _model_name(request: Request) -> str:
    return request.app.state.model_name


def _model_card(request: Request) -> dict:
    eng = _engine(request)
    return {"id": _model_name(request), "object": "model", "created": request.app.state.created,
            "owned_by": "prefixrt", "max_model_len": getattr(eng, "max_context", None),
            "vocab_size": getattr(eng, "vocab_size", None), "revision": getattr(eng, "model_revision", None)}


@router.get("/v1/models")
async def list_models(request: Request):
    return JSON({"object": "list", "data": [_model_card(request)]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    if model_id != _model_name(request):
        raise HTTPException(404, f"the model {model_id!r} does not exist; this server serves "
                                 f"{_model_name(request)!r}")
    return JSON(_model_card(request))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    eng = _engine(request)
    lowered = await run_in_threadpool(convert.chat_params, body, eng)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = dataclasses.replace(lowered.params, request_id=rid)
    model, created = _model_name(request), int(time.time())
    if not body.stream:
        c = await until_disconnect(request, eng.agenerate(lowered.prompt, params))
        return JSON(convert.chat_response(c, rid, model, created, lowered.tools))
    chunks = eng.astream(lowered.prompt, params)  # submits now: a bad request raises here, before any byte is sent
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = _chat_events(chunks, rid, model, created, lowered.tools, include_usage)
    return EventStream(gen, on_close=lambda: eng.abort(rid))


async def _chat_events(chunks, rid: str, model: str, created: int, plan: ToolPlan | None,
                       include_usage: bool) -> AsyncIterator[str]:
    """Text streams as it comes. With tools, a sample's text is held while it may still be a call (it starts
    like one); a call is sent whole, as one delta per call, once the sample ends."""
    usage = convert.StreamUsage()
    started: set[int] = set()
    held: dict[int, str] = {}  # index -> text held back because it may be a tool call
    held_lps: dict[int, list] = {}
    plain: set[int] = set()  # indexes known to be plain text

    def chunk(i, delta, reason=None, lps=None):
        return sse(convert.chat_chunk(rid, model, created, i, delta, reason, convert.chat_logprobs(lps)))

    try:
        async for ch in chunks:
            usage.add(0, ch)
            i = ch.index
            finish = convert.check_finished(ch.finish_reason)
            if i not in started:
                started.add(i)
                yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
            if plan is not None and i not in plain:
                held[i] = held.get(i, "") + ch.text
                if ch.logprobs:
                    held_lps.setdefault(i, []).extend(ch.logprobs)
                if not plan.may_be_call(held[i]):  # clearly prose: stream it
                    plain.add(i)
                    yield chunk(i, {"content": held.pop(i)}, lps=held_lps.pop(i, None))
                    if finish is not None:
                        yield chunk(i, {}, finish)
                elif finish is not None:
                    text, lps = held.pop(i, ""), held_lps.pop(i, None)
                    calls = plan.parse(text)
                    if calls:
                        for k, c in enumerate(calls):
                            yield chunk(i, {"tool_calls": [{"index": k, **c.to_openai()}]}, lps=lps if k == 0 else None)
                        yield chunk(i, {}, "tool_calls")
                    else:
                        yield chunk(i, {"content": text}, lps=lps)
                        yield chunk(i, {}, finish)
                continue
            if ch.text or ch.logprobs:
                yield chunk(i, {"content": ch.text}, lps=ch.logprobs)
            if finish is not None:
                yield chunk(i, {}, finish)
    except convert.RequestFailed as e:
        yield sse(convert.error_event(str(e)))
        return
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
        echo = None
        if body.echo:
            if body.logprobs is not None:
                echo = [await run_in_threadpool(convert.prompt_entries, eng, p) for p in prompts]
            else:
                echo = [(convert.prompt_text(eng, p), None) for p in prompts]
        return JSON(convert.completion_response(list(cs), rid, model, created, echo))
    streams = []
    try:
        for p, sp in zip(prompts, per_prompt):
            streams.append(eng.astream(p, sp))
    except Exception:
        for r in rids:
            eng.abort(r)
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    heads = [convert.prompt_text(eng, p) for p in prompts] if body.echo else None
    gen = _completion_events(streams, params.n, rid, model, created, include_usage, heads)

    def close():
        for r in rids:
            eng.abort(r)

    return EventStream(gen, on_close=close)


async def _completion_events(streams, n: int, rid: str, model: str, created: int,
                             include_usage: bool, heads: list[str] | None = None) -> AsyncIterator[str]:
    """heads: with echo, each prompt's text, sent first on each of its samples."""
    usage = convert.StreamUsage()
    offsets: dict[int, int] = {}
    try:
        async for k, ch in _merge(streams):
            usage.add(k, ch)
            index = k * n + ch.index
            finish = convert.check_finished(ch.finish_reason)
            text = ch.text
            if heads is not None and index not in offsets:
                text = heads[k] + text
            lps = convert.completion_logprobs(ch.logprobs, offsets.get(index, 0) + len(text) - len(ch.text))
            offsets[index] = offsets.get(index, 0) + len(text)
            if text or ch.logprobs or finish is not None:
                yield sse(convert.completion_chunk(rid, model, created, index, text, finish, lps))
    except convert.RequestFailed as e:
        yield sse(convert.error_event(str(e)))
        return
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
