"""OpenAI-compatible routes: /v1/models[/{id}], /v1/chat/completions, /v1/completions (JSON or SSE);
/v1/responses lives in responses.py (included here).

Each route checks the body's text (validate.py), lowers the request (prefixrt/lowering/: chat.py, completion.py),
encodes the prompt (EngineAPI.aencode: text and chat in a worker thread, token ids on the loop), fits
max_new_tokens to the context (lowering/options.py), then submits the token ids (a constrained request in a
worker thread: it waits for its grammar to compile); the response objects are built by openai_format.py. A one-prompt request awaits
these steps in place, without a Task hop (see _each). A request the engine ends with finish_reason "abort" is never
returned as a success: it becomes an error object, or an error event and `[DONE]` in a stream (errors.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from prefixrt.engine.process.messages import PackedIds
from prefixrt.errors import InvalidRequest
from prefixrt.lowering.chat import lower_chat_request, request_reasoning
from prefixrt.lowering.completion import lower_completion_request
from prefixrt.lowering.prompt_cache import openai_cache_plan
from prefixrt.lowering.reasoning import Reasoning
from prefixrt.lowering.tool_stream import ArgumentsDelta, CallStarted, CallStreamer
from prefixrt.lowering.tools import ToolPlan, new_call_id
from prefixrt.server import images as server_images
from prefixrt.server import openai_format as fmt
from prefixrt.server import prompt_cache
from prefixrt.server.body import OffloadedBodyRoute
from prefixrt.server.errors import RequestFailed, check_model, model_not_found
from prefixrt.server.lora_routes import adapter_card
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest
from prefixrt.server.responses import router as responses_router
from prefixrt.server.sse import JSON, SSE_DONE, EventStream, merge_streams, sse, until_disconnect
from prefixrt.server.tracing import observe, observed, traced
from prefixrt.server.validate import check_body

router = APIRouter(route_class=OffloadedBodyRoute)
router.include_router(responses_router)


def _engine(request: Request):
    return request.app.state.engine


def _lifecycle(request: Request):
    return request.app.state.lifecycle


def _checked(body: ChatCompletionRequest | CompletionRequest, request: Request):
    """Checks the body's model and fields. -> (the engine, the lifecycle, the LoRA adapter the model names or
    None)"""
    lora = check_model(request.app.state, body.model)
    check_body(body)
    return _engine(request), _lifecycle(request), lora


def _raise_if_aborted(lc, cs) -> None:
    for c in cs:
        for s in fmt.samples(c):
            if s.finish_reason == "abort":
                raise RequestFailed.for_abort(lc, s.error)


def _stream_close(eng, lc, rids: list[str]):
    def close():
        for r in rids:
            eng.abort(r)
        lc.release(rids)

    return close


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE body that ends with an error event and [DONE] if producing it fails, rather than being cut."""
    try:
        async for e in events:
            yield e
    except Exception as e:
        yield RequestFailed(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").event()
        yield SSE_DONE


def _model_name(request: Request) -> str:
    return request.app.state.model_name


def _model_card(request: Request, name: str) -> dict:
    eng = _engine(request)
    return {"id": name, "object": "model", "created": request.app.state.created,
            "owned_by": "prefixrt", "max_model_len": getattr(eng, "max_context", None),
            "vocab_size": getattr(eng, "vocab_size", None), "revision": getattr(eng, "model_revision", None),
            "sampling_defaults": request.app.state.generation_defaults}


@router.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state
    base = [_model_card(request, n) for n in state.model_names]
    adapters = [adapter_card(base[0], n) for n in sorted(state.lora_names)]  # LoRA adapters: parent = the base
    return JSON({"object": "list", "data": base + adapters})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = request.app.state
    if model_id in state.lora_names:
        return JSON(adapter_card(_model_card(request, state.model_name), model_id))
    if model_id not in state.model_names:
        raise model_not_found(state, model_id)
    return JSON(_model_card(request, model_id))


@router.post("/v1/chat/completions")
@traced("chat.completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    eng, lc, lora = _checked(body, request)
    body, image_urls = server_images.without_images(body)
    fields = body.model_dump(exclude_none=True, by_alias=True)

    def lower(messages: list[dict]):
        return lower_chat_request({**fields, "messages": messages}, tokenizer=eng.tokenizer,
                                  max_context=eng.max_context, defaults=request.app.state.generation_defaults)

    chat = lower(fields["messages"])
    cache_plan = openai_cache_plan(fields)
    if image_urls:  # the prompt: the lowered messages with their images back (Engine.prepare renders them)
        if body.continue_final_message or chat.template_tools:
            raise InvalidRequest("images with continue_final_message or template tools are not supported",
                                 param="messages")
        prompt = server_images.with_images(chat.messages, image_urls)
        ids = await run_in_threadpool(eng.image_prompt_ids, prompt)
    else:
        ids = await run_in_threadpool(eng.encode_chat, chat.messages, chat.template_tools,
                                      body.continue_final_message, chat.template_kwargs)
        prompt = ids
    reasoning = await _reasoning(request, chat.template_kwargs, ids)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    kept = await prompt_cache.resolve(eng, None if image_urls else cache_plan, ids, lower)
    params = chat.options.fit_to_context(len(ids), eng.max_context, request_id=rid, prompt_cache=kept, lora=lora)
    model, created = lora or _model_name(request), int(time.time())
    if not body.stream:
        with lc.serving(eng, [rid]):
            c = await until_disconnect(request, eng.agenerate(prompt, params))
        observe(request, rid, [c])
        _raise_if_aborted(lc, [c])
        return prompt_cache.with_keep_header(fmt.with_warnings(JSON(fmt.chat_response(
            c, rid, model, created, chat.tools, reasoning)), chat.warnings), c.keep_report)
    # A bad request raises here, before any byte is sent. coalesce: a stream that falls behind sends what is
    # waiting as one event per sample (a multi-token delta, as OpenAI's clients accept), not one per token.
    chunks = observed(request, rid, await eng.astream_open(prompt, params, coalesce=True), n=params.n)
    lc.register(eng, [rid])
    first = None
    if kept is not None and kept.keep:  # the headers say what was kept: they wait for the first output
        first, chunks = await prompt_cache.first_output(request, chunks, _stream_close(eng, lc, [rid]))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = _guarded(_chat_events(chunks, rid, model, created, chat.tools, include_usage, lc, reasoning))
    return prompt_cache.with_keep_header(fmt.with_warnings(EventStream(gen, on_close=_stream_close(eng, lc, [rid])),
                                                           chat.warnings), getattr(first, "keep_report", None))


async def _reasoning(request: Request, template_kwargs: dict | None, ids: list[int]) -> Reasoning | None:
    """The request's Reasoning under the server's --reasoning-parser (None without one)."""
    parser = request.app.state.reasoning_parser
    if parser is None:
        return None
    return await run_in_threadpool(request_reasoning, parser, template_kwargs, _engine(request), ids)


async def _chat_events(chunks, rid: str, model: str, created: int, plan: ToolPlan | None,
                       include_usage: bool, lc, reasoning: Reasoning | None = None) -> AsyncIterator[str]:
    """Text streams as it comes. With tools, a sample's text is held while it may still be a call (it starts
    like one or is blank); once it begins as only a call can (ToolPlan.starts_call) its calls stream as OpenAI
    streams them: per call a first delta with its index, id, type and name, then its arguments' JSON text as it
    is generated (lowering/tool_stream.py), finish_reason "tool_calls" at the end. A reply that may be a call or
    a JSON answer is held whole and sent as calls (one delta each) or as content once it ends. With `reasoning`, a sample's thinking streams as `reasoning_content` deltas and only
    the rest goes through the above."""
    usage = fmt.StreamUsage()
    splitters: dict[int, object] = {}  # index -> its ReasoningSplitter
    started: set[int] = set()
    held: dict[int, str] = {}  # index -> text held back because it may be a tool call
    held_lps: dict[int, list] = {}
    plain: set[int] = set()  # indexes known to be plain text
    calling: dict[int, CallStreamer] = {}  # indexes whose reply is calls -> their streamer
    text_events = fmt.TextEvents(rid, model, created, "chat.completion.chunk")

    def chunk(i, delta, reason=None, lps=None):
        if lps is None and len(delta) == 1 and "content" in delta:  # the common event: text only
            return text_events.event(i, delta["content"], reason)
        return sse(fmt.chat_chunk(rid, model, created, i, delta, reason, fmt.chat_logprobs(lps)))

    def call_chunks(i, events, lps):
        """The deltas of a sample's call events; the chunk's logprobs ride on the first (held until one)."""
        for e in events:
            if isinstance(e, CallStarted):
                delta = {"index": e.index, "id": new_call_id(), "type": "function",
                         "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, ArgumentsDelta):
                delta = {"index": e.index, "function": {"arguments": e.text}}
            else:
                continue
            yield chunk(i, {"tool_calls": [delta]}, lps=lps)
            lps = None
        if lps:
            held_lps.setdefault(i, []).extend(lps)

    def calls_end(i, finish_reason):
        """A streamed-call sample's last chunks: "tool_calls" when its reply parses as calls. A reply cut before
        any call was named streamed nothing: it goes as content, as the unstreamed response has it."""
        text, lps = held.pop(i), held_lps.pop(i, None)
        if calling.pop(i).started == 0:
            yield chunk(i, {"content": text}, lps=lps)
            yield chunk(i, {}, finish_reason)
        else:
            yield chunk(i, {}, "tool_calls" if plan.parse(text) else finish_reason, lps=lps)

    async for ch in chunks:
        if ch.finish_reason == "abort":  # not an OpenAI finish reason: the stream ends with an error
            yield RequestFailed.for_abort(lc, ch.error).event()
            yield SSE_DONE
            return
        usage.add(0, ch)
        i = ch.index
        if i not in started:
            started.add(i)
            yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
        text, lps = ch.text, ch.logprobs
        if reasoning is not None:
            split = splitters.get(i) or splitters.setdefault(i, reasoning.splitter())
            thought, text = split.feed(text)
            if ch.finish_reason is not None:
                more_thought, more_text = split.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:  # the logprobs go with the content when the event has some
                yield chunk(i, {"reasoning_content": thought}, lps=None if text else lps)
                lps = lps if text else None
        if i in calling:
            held[i] += text
            for event in call_chunks(i, calling[i].feed(text), (held_lps.pop(i, []) + (lps or [])) or None):
                yield event
            if ch.finish_reason is not None:
                for event in calls_end(i, ch.finish_reason):
                    yield event
            continue
        if plan is not None and i not in plain:
            held[i] = held.get(i, "") + text
            if lps:
                held_lps.setdefault(i, []).extend(lps)
            if not plan.may_be_call(held[i]):  # clearly prose: stream it
                plain.add(i)
                yield chunk(i, {"content": held.pop(i)}, lps=held_lps.pop(i, None))
                if ch.finish_reason is not None:
                    yield chunk(i, {}, ch.finish_reason)
            elif plan.starts_call(held[i]):  # a call, streamed as it is generated
                calling[i] = CallStreamer(plan.syntax.key)
                for event in call_chunks(i, calling[i].feed(held[i]), held_lps.pop(i, None)):
                    yield event
                if ch.finish_reason is not None:
                    for event in calls_end(i, ch.finish_reason):
                        yield event
            elif ch.finish_reason is not None:  # blank, or a JSON answer that may be a call: the whole reply says
                text, lps = held.pop(i), held_lps.pop(i, None)
                calls = plan.parse(text)
                if calls:
                    for k, c in enumerate(calls):
                        yield chunk(i, {"tool_calls": [{"index": k, **c.to_openai()}]}, lps=lps if k == 0 else None)
                    yield chunk(i, {}, "tool_calls")
                else:
                    yield chunk(i, {"content": text}, lps=lps)
                    yield chunk(i, {}, ch.finish_reason)
            continue
        if text or lps:
            yield chunk(i, {"content": text}, lps=lps)
        if ch.finish_reason is not None:
            yield chunk(i, {}, ch.finish_reason)
    if include_usage:
        yield sse(fmt.usage_chunk(rid, model, created, "chat.completion.chunk", usage.to_dict()))
    yield SSE_DONE


@router.post("/v1/completions")
@traced("completions")
async def completions(body: CompletionRequest, request: Request):
    eng, lc, lora = _checked(body, request)
    fields = {name: getattr(body, name) for name in type(body).model_fields if name != "prompt"}
    prompts, options = lower_completion_request(fields, body.prompt, defaults=request.app.state.generation_defaults)
    # Token-id prompts are packed to int32 once, here: their bytes serve the range check and the engine's pipe.
    prompts = [p if isinstance(p, str) else PackedIds.of(p) for p in prompts]
    encoded = await _each([eng.aencode(p) for p in prompts])
    rid = f"cmpl-{uuid.uuid4().hex}"
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{k}" for k in range(len(prompts))]
    per_prompt = [options.fit_to_context(len(ids), eng.max_context, request_id=r, lora=lora)
                  for ids, r in zip(encoded, rids)]
    n = per_prompt[0].n
    model, created = lora or _model_name(request), int(time.time())
    if not body.stream:
        async def run():
            return await asyncio.gather(*(eng.agenerate(ids, sp) for ids, sp in zip(encoded, per_prompt)))

        with lc.serving(eng, rids):
            cs = await until_disconnect(request, run())
        observe(request, rid, list(cs))
        _raise_if_aborted(lc, cs)
        echo = await _echo_heads(eng, body, prompts, encoded)
        return fmt.with_warnings(JSON(fmt.completion_response(list(cs), rid, model, created, echo)),
                                 options.warnings)
    heads = await _echo_heads(eng, body, prompts, encoded)  # prompt logprobs go in the first chunk (as vLLM)
    opened = await _each([eng.astream_open(ids, sp, coalesce=True) for ids, sp in zip(encoded, per_prompt)],
                         return_exceptions=True)
    failed = [x for x in opened if isinstance(x, BaseException)]
    if failed:
        for r in rids:
            eng.abort(r)
        raise failed[0]
    lc.register(eng, rids)
    opened = [observed(request, rid, s, k, n) for k, s in enumerate(opened)]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = _guarded(_completion_events(list(opened), n, rid, model, created, include_usage, lc, heads))
    return fmt.with_warnings(EventStream(gen, on_close=_stream_close(eng, lc, rids)), options.warnings)


async def _each(awaitables: list, return_exceptions: bool = False) -> list:
    """asyncio.gather(*awaitables), with a single awaitable awaited in place. gather wraps each in a Task, which
    first runs on the loop's next turn, behind every other request's pending work: with many requests arriving
    together, each such hop put a request behind the parsing of all the others before it reached the engine."""
    if len(awaitables) != 1:
        return await asyncio.gather(*awaitables, return_exceptions=return_exceptions)
    try:
        return [await awaitables[0]]
    except Exception as e:
        if not return_exceptions:
            raise
        return [e]


async def _echo_heads(eng, body: CompletionRequest, prompts: list, encoded: list[list[int]]
                      ) -> list[tuple[str, list[dict] | None]] | None:
    """With echo: per prompt, its text (token-id prompts decoded) and, with logprobs, its tokens' logprob
    entries; None without echo."""
    if not body.echo:
        return None
    if body.logprobs is None:
        return [(fmt.prompt_text(eng, p), None) for p in prompts]
    scored = [await run_in_threadpool(fmt.prompt_entries, eng, ids) for ids in encoded]
    return [(fmt.prompt_text(eng, p), e) for p, (_, e) in zip(prompts, scored)]


async def _completion_events(streams, n: int, rid: str, model: str, created: int, include_usage: bool, lc,
                             heads: list[tuple[str, list[dict] | None]] | None = None) -> AsyncIterator[str]:
    """heads: with echo, each prompt's (text, logprob entries or None), sent first on each of its samples."""
    usage = fmt.StreamUsage()
    # choice index -> text_offset of its next token: the lengths of the token strings before it (and of the
    # echoed prompt), as the whole response counts them, so offsets do not depend on how tokens were chunked.
    next_offset: dict[int, int] = {}
    text_events = fmt.TextEvents(rid, model, created, "text_completion")
    async for k, ch in merge_streams(streams):
        if ch.finish_reason == "abort":  # not an OpenAI finish reason: the stream ends with an error
            yield RequestFailed.for_abort(lc, ch.error).event()
            yield SSE_DONE
            return
        usage.add(k, ch)
        index = k * n + ch.index
        text, entries = ch.text, ch.logprobs
        if index not in next_offset:
            head, head_entries = heads[k] if heads is not None else ("", None)
            text = head + text
            next_offset[index] = 0 if head_entries is not None else len(head)
            if head_entries is not None:
                entries = head_entries + (entries or [])
        lps = fmt.completion_logprobs(entries, next_offset[index])
        if entries:
            next_offset[index] += sum(len(e["token"]) for e in entries)
        if lps is None and (text or ch.finish_reason is not None):
            yield text_events.event(index, text, ch.finish_reason)
        elif text or entries or ch.finish_reason is not None:
            yield sse(fmt.completion_chunk(rid, model, created, index, text, ch.finish_reason, lps))
    if include_usage:
        yield sse(fmt.usage_chunk(rid, model, created, "text_completion", usage.to_dict()))
    yield SSE_DONE
