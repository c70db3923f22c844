"""Anthropic's Messages API: POST /v1/messages (JSON or its SSE events) and POST /v1/messages/count_tokens.

A request is lowered to an OpenAI-shaped chat request (prefixrt/lowering/anthropic.py) and from there the one way
every chat request is (lowering/chat.py), so tools, tool_choice, images and sampling options mean here what they
mean on /v1/chat/completions; its `cache_control` breakpoints become kept prefixes (lowering/prompt_cache.py,
server/prompt_cache.py) and its usage reports the cache fields (anthropic_format.py). Errors, the request-body
ones included, have Anthropic's shape `{"type": "error", "error": {"type", "message"}}` (AnthropicRoute);
admission.py takes the access key from `x-api-key` as well as `Authorization: Bearer`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.lowering.anthropic import lower_messages_request
from prefixrt.lowering.chat import lower_chat_request
from prefixrt.server import anthropic_format as afmt
from prefixrt.server import images as server_images
from prefixrt.server import prompt_cache
from prefixrt.server.body import OffloadedBodyRoute
from prefixrt.server.errors import RequestFailed, check_model
from prefixrt.server.openai_format import with_warnings
from prefixrt.server.protocol import ChatCompletionRequest
from prefixrt.server.sse import JSON, EventStream, until_disconnect
from prefixrt.server.tracing import observe
from prefixrt.server.validate import check_body

_HOUR_S = 3600.0


class AnthropicRoute(OffloadedBodyRoute):
    """An APIRoute whose errors have Anthropic's shape (the app's handlers give OpenAI's)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            try:
                return await handler(request)
            except InvalidRequest as e:
                return afmt.error_response(400, e.message)
            except RequestFailed as e:
                return afmt.error_response(e.status, e.message, retry=e.retry)
            except RequestValidationError as e:
                first = (e.errors() or [{}])[0]
                where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
                msg = first.get("msg", "invalid request body")
                return afmt.error_response(400, f"{where}: {msg}" if where else msg)
            except HTTPException as e:
                return afmt.error_response(e.status_code, str(e.detail))
            except EngineDeadError as e:
                return afmt.error_response(503, str(e) or "the engine is not running", retry=True)
            except TimeoutError:
                return afmt.error_response(503, "the engine did not answer in time", retry=True)
            except RecursionError:
                return afmt.error_response(400, "request body is nested too deeply")

        return route_handler


router = APIRouter(route_class=AnthropicRoute)


class _Lowered:
    """One Messages request lowered: the chat lowering of the whole conversation and how to lower a part of it."""

    def __init__(self, body: dict, request: Request):
        state = request.app.state
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        check_body(body)
        self.lora = check_model(state, body.get("model"))  # a LoRA adapter's name, or None
        self.eng = state.engine
        self.messages = lower_messages_request(body)
        self.chat_body = self._chat_body(self.messages.chat)
        self.chat_body, self.image_urls = server_images.without_images(self.chat_body)
        self.fields = self.chat_body.model_dump(exclude_none=True, by_alias=True)
        self.defaults = state.generation_defaults
        self.chat = self.lower(self.fields["messages"])

    @staticmethod
    def _chat_body(chat: dict) -> ChatCompletionRequest:
        from pydantic import ValidationError

        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # a value the chat request cannot take: the client's mistake
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise InvalidRequest(f"{where}: {err.get('msg', 'invalid value')}") from None

    def lower(self, messages: list[dict]):
        return lower_chat_request({**self.fields, "messages": messages}, tokenizer=self.eng.tokenizer,
                                  max_context=self.eng.max_context, defaults=self.defaults)

    async def prompt(self) -> tuple[list, list]:
        """(what the engine is given, its token ids)."""
        chat, eng = self.chat, self.eng
        if self.image_urls:
            if chat.template_tools:
                raise InvalidRequest("images with template-rendered tools are not supported")
            prompt = server_images.with_images(chat.messages, self.image_urls)
            ids = await run_in_threadpool(eng.image_prompt_ids, prompt)
            return prompt, ids
        ids = await run_in_threadpool(eng.encode_chat, chat.messages, chat.template_tools, False,
                                      chat.template_kwargs)
        return ids, ids


@router.post("/v1/messages")
async def create_message(body: dict, request: Request):
    low = _Lowered(body, request)
    eng, lc = low.eng, request.app.state.lifecycle
    prompt, ids = await low.prompt()
    mid = afmt.message_id()
    kept = await prompt_cache.resolve(eng, None if low.image_urls else low.messages.cache, ids, low.lower)
    params = low.chat.options.fit_to_context(len(ids), eng.max_context, request_id=mid, prompt_cache=kept,
                                             lora=low.lora)
    if params.n != 1:
        raise InvalidRequest("n is 1 on /v1/messages")
    long_ttl = bool(kept and kept.keep and max(k.ttl_s for k in kept.keep) >= _HOUR_S)
    model, plan, stops = low.lora or request.app.state.model_name, low.chat.tools, list(params.stop or [])
    warnings = low.messages.warnings + low.chat.warnings

    def usage_of(out, output_tokens: int) -> dict:
        return afmt.usage(out.prompt_tokens, out.cached_tokens, output_tokens, out.keep_report, long_ttl)

    if not body.get("stream"):
        with lc.serving(eng, [mid]):
            c = await until_disconnect(request, eng.agenerate(prompt, params))
        observe(request, mid, [c])
        if c.finish_reason == "abort":
            raise RequestFailed.for_abort(lc, c.error)
        content, calls = afmt.content_blocks(c.text, plan)
        reason, sequence = afmt.stop_reason(c.finish_reason, c.matched_stop, stops, calls)
        msg = afmt.message(mid, model, content, reason, sequence, usage_of(c, c.completion_tokens))
        return prompt_cache.with_keep_header(with_warnings(JSON(msg), warnings), c.keep_report)
    chunks = await eng.astream_open(prompt, params, coalesce=True)
    lc.register(eng, [mid])

    def close():
        eng.abort(mid)
        lc.release([mid])

    # message_start carries the cached tokens, known with the first output: the headers wait for it too
    first, chunks = await prompt_cache.first_output(request, chunks, close)
    if first is None:
        close()
        raise RequestFailed(500, "the engine ended the request without an output", retry=True)

    def failure(ch) -> tuple[int, str]:
        e = RequestFailed.for_abort(lc, ch.error)
        return e.status, e.message

    events = afmt.message_events(first, chunks, mid, model, plan, stops, usage_of, failure)
    return prompt_cache.with_keep_header(with_warnings(EventStream(events, on_close=close), warnings),
                                         first.keep_report)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: dict, request: Request):
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    low = _Lowered({"max_tokens": 1, **body}, request)
    _, ids = await low.prompt()
    return JSON({"input_tokens": len(ids)})
