"""POST /v1/responses (OpenAI's Responses API), JSON or SSE with the Responses event types; GET and DELETE
/v1/responses/{id}.

A Responses request is lowered to a chat request and goes through the same lowering (prefixrt/lowering/chat.py
`lower_chat_request`): `instructions` -> a leading system message, `input` (text or items: messages,
`function_call`, `function_call_output`; lowering/messages.py `responses_input`) -> chat messages, `text.format`
-> response_format, function `tools` / `tool_choice` / `parallel_tool_calls` -> the tool plan;
`max_output_tokens` is one of OpenAI's names of max_new_tokens (lowering/options.py).

`previous_response_id`: every response is kept in memory (`ResponseStore`, bounded, least recently used
dropped first) as the conversation it ended: earlier input and output items, never instructions (which,
as in OpenAI's API, do not carry over). A follow-up renders that conversation again, so its prompt begins
with the tokens of the earlier turn and the radix cache reuses their K/V (usage.input_tokens_details.
cached_tokens shows it). `store: false` keeps a response out of the store.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.chat import lower_chat_request, request_reasoning
from prefixrt.lowering.messages import responses_input
from prefixrt.lowering.prompt_cache import responses_cache_plan
from prefixrt.lowering.tool_stream import ArgumentsDelta, CallEnded, CallStarted, CallStreamer
from prefixrt.lowering.tools import ToolCall, ToolPlan, new_call_id
from prefixrt.server import prompt_cache
from prefixrt.server.body import OffloadedBodyRoute
from prefixrt.server.errors import RequestFailed, check_model
from prefixrt.server.openai_format import with_warnings
from prefixrt.server.protocol import ChatCompletionRequest, _Body
from prefixrt.server.sse import JSON, EventStream, dumps, until_disconnect
from prefixrt.server.tracing import observe, observed, traced
from prefixrt.server.validate import check_body

router = APIRouter(route_class=OffloadedBodyRoute)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    # prefixrt / vLLM extras, as on chat
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    tool_prompt: bool = True  # as on chat: False when the input already describes the tools
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat (e.g. {"enable_thinking": false})
    # OpenAI's prompt caching, as on chat (breakpoints on input content blocks: prefixrt/lowering/prompt_cache.py)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class ResponseStore:
    """id -> (the conversation as chat messages, the response object), least recently used dropped first."""

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        with self._lock:
            self._items[rid] = (messages, response)
            self._items.move_to_end(rid)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


# ---------------------------------------------------------------------------------------------- input




def _chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    rf = None
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        rf = {"type": fmt.type}
        if fmt.type == "json_schema":
            rf["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    if body.top_logprobs is not None:
        raise InvalidRequest("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    tools = []
    for k, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            raise InvalidRequest(f"tools[{k}]: only function tools are supported, not {t.get('type')!r}",
                                 param=f"tools[{k}].type")
        tools.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": t.get("parameters"),
            "strict": t.get("strict")}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest(f"unsupported tool_choice {choice!r}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = dict(messages=system + messages, temperature=body.temperature,
                  top_p=body.top_p, response_format=rf, tools=tools or None, tool_choice=choice,
                  parallel_tool_calls=body.parallel_tool_calls, seed=body.seed, stop=body.stop, top_k=body.top_k,
                  min_p=body.min_p, repetition_penalty=body.repetition_penalty, cache_salt=body.cache_salt,
                  tool_prompt=body.tool_prompt, chat_template_kwargs=body.chat_template_kwargs)
    from pydantic import ValidationError

    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # a Responses field the chat request cannot take: the client's mistake (400)
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())[:1]) or None
        raise InvalidRequest(f"{param or 'request'}: {err.get('msg', 'invalid value')}", param=param) from None


# ---------------------------------------------------------------------------------------------- output


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    oc = call.to_openai(new_call_id())
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": oc["id"], "name": call.name,
            "arguments": oc["function"]["arguments"], "status": status}


def output_items(text: str, plan: ToolPlan | None, finish: str, streamed: list[dict] | None = None) -> list[dict]:
    """The response's output items for the reply `text`. streamed: the function_call items a stream already sent
    (their ids and argument text as generated): they are the items, each completed when its call closed, else
    incomplete (cut short)."""
    if streamed:
        return [{**item, "status": "completed" if item["status"] == "completed" else "incomplete"}
                for item in streamed]
    calls = plan.parse(text) if plan is not None else None
    if calls:
        return [_call_item(c) for c in calls]
    return [_message_item(text, "completed" if finish == "stop" else "incomplete")]


def output_messages(items: list[dict]) -> list[dict]:
    """Output items -> the chat messages they add to the conversation (for previous_response_id)."""
    return responses_input([{k: v for k, v in item.items() if k not in ("id", "status")} for item in items])


class _Shell:
    """The parts of a response object fixed at request time."""

    def __init__(self, body: ResponsesRequest, model: str, rid: str, created: int, params):
        self.body, self.model, self.rid, self.created = body, model, rid, created
        self.temperature = params.temperature
        self.top_p = params.top_p

    def response(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {
            "type": "text"}
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": None, "store": b.store,
            "temperature": self.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "top_p": self.top_p, "truncation": b.truncation or "disabled",
            "metadata": b.metadata or {}, **({"usage": usage} if usage is not None else {}),
            **({"user": b.user} if b.user is not None else {}),
        }


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    # cache_write_tokens: the prompt tokens computed now, which the radix cache keeps for later requests.
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": prompt_tokens - cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------------------------- routes


@router.post("/v1/responses")
@traced("responses")
async def create_response(body: ResponsesRequest, request: Request):
    eng = request.app.state.engine
    lora = check_model(request.app.state, body.model)
    store = _store(request)
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise InvalidRequest(f"previous response {body.previous_response_id!r} is not stored on this server",
                                 param="previous_response_id")
        history = prev[0]
    conversation = history + responses_input(body.input)
    cache_plan = responses_cache_plan(body.model_dump(exclude_none=True), body.input,
                                      lambda items: history + responses_input(items))

    def lower(conv: list[dict]):
        chat_body = _chat_request(body, conv)
        check_body(chat_body)
        chat_fields = {**chat_body.model_dump(exclude_none=True, by_alias=True),
                       "max_output_tokens": body.max_output_tokens}
        return lower_chat_request(chat_fields, tokenizer=eng.tokenizer, max_context=eng.max_context,
                                  defaults=request.app.state.generation_defaults)

    chat = lower(conversation)
    if chat.options.params.get("n", 1) != 1:
        raise InvalidRequest("n must be 1 on /v1/responses", param="n")
    ids = await run_in_threadpool(eng.encode_chat, chat.messages, chat.template_tools, False, chat.template_kwargs)
    parser = request.app.state.reasoning_parser
    reasoning = None if parser is None else await run_in_threadpool(
        request_reasoning, parser, chat.template_kwargs, eng, ids)
    reasoning_id = f"rs_{uuid.uuid4().hex}"
    rid = f"resp_{uuid.uuid4().hex}"
    kept = await prompt_cache.resolve(eng, cache_plan, ids, lower)
    params = chat.options.fit_to_context(len(ids), eng.max_context, request_id=rid, prompt_cache=kept, lora=lora)
    shell = _Shell(body, lora or request.app.state.model_name, rid, int(time.time()), params)
    lc = request.app.state.lifecycle

    def finish(text: str, reason: str, usage: dict, streamed: list[dict] | None = None) -> dict:
        thought, text = reasoning.split(text) if reasoning is not None else (None, text)
        items = output_items(text, chat.tools, reason, streamed)
        if thought is not None:  # the thinking comes first, as a reasoning item
            items.insert(0, _reasoning_item(reasoning_id, thought))
        status, incomplete = ("completed", None) if reason == "stop" else ("incomplete", "max_output_tokens")
        response = shell.response(status, items, usage, incomplete)
        if body.store:
            store.put(rid, conversation + output_messages(items), response)
        return response

    if not body.stream:
        with lc.serving(eng, [rid]):
            c = await until_disconnect(request, eng.agenerate(ids, params))
        observe(request, rid, [c])
        if c.finish_reason == "abort":
            raise RequestFailed.for_abort(lc, c.error)
        return prompt_cache.with_keep_header(with_warnings(JSON(finish(c.text, c.finish_reason, _usage(
            c.prompt_tokens, c.completion_tokens, c.cached_tokens))), chat.warnings), c.keep_report)
    chunks = await eng.astream_open(ids, params, coalesce=True)  # a bad request raises before any byte is sent
    chunks = observed(request, rid, chunks)
    lc.register(eng, [rid])

    def close():
        eng.abort(rid)
        lc.release([rid])

    first = None
    if kept is not None and kept.keep:  # the headers say what was kept: they wait for the first output
        first, chunks = await prompt_cache.first_output(request, chunks, close)
    split = reasoning.splitter() if reasoning is not None else None
    events = _events(chunks, shell, chat.tools, finish, lc, _ReasoningEvents(reasoning_id, split))
    return prompt_cache.with_keep_header(with_warnings(EventStream(events, on_close=close), chat.warnings),
                                         getattr(first, "keep_report", None))


def _event(seq: list[int], kind: str, **fields) -> str:
    seq[0] += 1
    return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq[0] - 1, **fields})}\n\n"


class _ReasoningEvents:
    """The reasoning item of a streamed response (output_index 0, before the answer's items): opened with the
    first thinking, its text streamed as response.reasoning_text.delta, closed when the answer begins."""

    def __init__(self, item_id: str, split):
        self.item_id, self.split = item_id, split
        self.text, self.opened, self.closed = "", False, False

    @property
    def base(self) -> int:
        """The output_index of the answer's first item."""
        return 1 if self.closed else 0

    def feed(self, seq: list[int], text: str, final: bool) -> tuple[list[str], str]:
        """(events, the answer's text) for a chunk's text."""
        if self.split is None:
            return [], text
        thought, text = self.split.feed(text)
        if final:
            more_thought, more_text = self.split.finish()
            thought, text = thought + more_thought, text + more_text
        out: list[str] = []
        if thought:
            out += self._open(seq)
            self.text += thought
            out.append(_event(seq, "response.reasoning_text.delta", item_id=self.item_id, output_index=0,
                              content_index=0, delta=thought))
        if (text or final) and self.split.saw_reasoning and not self.closed:
            out += self._open(seq) + self._close(seq)
        return out, text

    def _open(self, seq) -> list[str]:
        if self.opened:
            return []
        self.opened = True
        return [_event(seq, "response.output_item.added", output_index=0,
                       item=_reasoning_item(self.item_id, "", "in_progress"))]

    def _close(self, seq) -> list[str]:
        self.closed = True
        item = _reasoning_item(self.item_id, self.text)
        return [_event(seq, "response.reasoning_text.done", item_id=self.item_id, output_index=0, content_index=0,
                       text=self.text),
                _event(seq, "response.output_item.done", output_index=0, item=item)]


async def _events(chunks, shell: _Shell, plan: ToolPlan | None, finish, lc,
                  thinking: _ReasoningEvents | None = None) -> AsyncIterator[str]:
    """response.created, in_progress, then (with a reasoning parser) the reasoning item, then text deltas as
    they come (held while the reply may still be a tool call, as on chat), or, for a reply that begins like a
    call (which makes it one), each call as it is generated: its function_call item added, its arguments as
    response.function_call_arguments.delta events, their .done and the item's done when the call closes; then
    the items' done events and response.completed (or .incomplete / .failed)."""
    seq = [0]
    thinking = thinking or _ReasoningEvents("", None)
    yield _event(seq, "response.created", response=shell.response("in_progress", [], None))
    yield _event(seq, "response.in_progress", response=shell.response("in_progress", [], None))
    text, held, last = "", "", None
    msg: dict | None = None
    streamer: CallStreamer | None = None
    calls: list[dict] = []  # the function_call items streamed so far

    def open_message():
        item = _message_item("", "in_progress")
        item["content"] = []
        return item

    def call_events(events) -> list[str]:
        out = []
        for e in events:
            k = thinking.base + e.index
            if isinstance(e, CallStarted):
                calls.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": new_call_id(),
                              "name": e.name, "arguments": "", "status": "in_progress"})
                out.append(_event(seq, "response.output_item.added", output_index=k, item=dict(calls[-1])))
            elif isinstance(e, ArgumentsDelta):
                calls[e.index]["arguments"] += e.text
                out.append(_event(seq, "response.function_call_arguments.delta", item_id=calls[e.index]["id"],
                                  output_index=k, delta=e.text))
            elif isinstance(e, CallEnded):
                item = calls[e.index]
                item["status"] = "completed"
                out.append(_event(seq, "response.function_call_arguments.done", item_id=item["id"],
                                  output_index=k, name=item["name"], arguments=item["arguments"]))
                out.append(_event(seq, "response.output_item.done", output_index=k, item=dict(item)))
        return out

    try:
        async for ch in chunks:
            last = ch
            if ch.finish_reason == "abort":
                raise RequestFailed.for_abort(lc, ch.error)
            text += ch.text
            events, piece = thinking.feed(seq, ch.text, ch.finish_reason is not None)
            for e in events:
                yield e
            if streamer is not None:
                for e in call_events(streamer.feed(piece)):
                    yield e
                continue
            if plan is not None and msg is None:
                held += piece
                if plan.starts_call(held):
                    streamer = CallStreamer(plan.syntax.key)
                    for e in call_events(streamer.feed(held)):
                        yield e
                    held = ""
                    continue
                if plan.may_be_call(held):
                    continue
            if msg is None:
                if not piece and not held:
                    continue
                msg = open_message()
                yield _event(seq, "response.output_item.added", output_index=thinking.base, item=msg)
                yield _event(seq, "response.content_part.added", item_id=msg["id"], output_index=thinking.base,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []})
                delta, held = (held or piece), ""
            else:
                delta = piece
            if delta:
                yield _event(seq, "response.output_text.delta", item_id=msg["id"], output_index=thinking.base,
                             content_index=0, delta=delta, logprobs=[])
    except RequestFailed as e:
        failed = shell.response("failed", [], None)
        failed["error"] = {"code": "server_error", "message": e.message}
        yield _event(seq, "response.failed", response=failed)
        return
    if last is None:
        return
    reason = last.finish_reason
    usage = _usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    response = finish(text, reason, usage, calls or None)
    base = thinking.base
    items = response["output"][base:]
    if calls:
        for k, item in enumerate(items, start=base):
            if calls[k - base]["status"] != "completed":  # cut short: closed as the response has it
                yield _event(seq, "response.output_item.done", output_index=k, item=item)
    elif msg is not None or items[0]["type"] == "message":
        item = items[0]
        if msg is None:  # held text that turned out to be plain (or an incomplete call)
            item_open = {**item, "status": "in_progress", "content": []}
            yield _event(seq, "response.output_item.added", output_index=base, item=item_open)
            yield _event(seq, "response.content_part.added", item_id=item["id"], output_index=base, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            if item["content"][0]["text"]:
                yield _event(seq, "response.output_text.delta", item_id=item["id"], output_index=base,
                             content_index=0, delta=item["content"][0]["text"], logprobs=[])
        else:
            item["id"] = msg["id"]
        part = item["content"][0]
        yield _event(seq, "response.output_text.done", item_id=item["id"], output_index=base, content_index=0,
                     text=part["text"], logprobs=[])
        yield _event(seq, "response.content_part.done", item_id=item["id"], output_index=base, content_index=0,
                     part=part)
        yield _event(seq, "response.output_item.done", output_index=base, item=item)
    else:
        for k, item in enumerate(items, start=base):
            yield _event(seq, "response.output_item.added", output_index=k,
                         item={**item, "arguments": "", "status": "in_progress"})
            yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                         delta=item["arguments"])
            yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=k,
                         name=item["name"], arguments=item["arguments"])
            yield _event(seq, "response.output_item.done", output_index=k, item=item)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield _event(seq, kind, response=response)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    item = _store(request).get(response_id)
    if item is None:
        raise HTTPException(404, f"no stored response {response_id!r}")
    return JSON(item[1])


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not _store(request).delete(response_id):
        raise HTTPException(404, f"no stored response {response_id!r}")
    return JSON({"id": response_id, "object": "response.deleted", "deleted": True})


__all__ = ["router", "ResponsesRequest", "ResponseStore"]
