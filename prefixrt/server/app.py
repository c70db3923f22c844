"""The FastAPI app: `create_app(engine)`. OpenAI routes live in openai_api.py; native routes and errors here.

Errors always have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (errors.py). Bad input is
a 400 (InvalidRequest from the engine, and request-body validation errors too, where FastAPI would say 422);
`x-should-retry: false` marks errors a retry cannot fix, so OpenAI clients do not retry them. Every request
first passes admission (admission.py: API keys, draining, body size); a large JSON body is then decoded in a
parser process (body.py), and routes check the body's text (validate.py) and tokenize off the event loop
(EngineAPI.aencode), so `/health` always answers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import Response

from prefixrt.engine.metrics import CONTENT_TYPE, Metrics
from prefixrt.engine.process.messages import PackedIds
from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.hub import generation as hub_generation
from prefixrt.lowering.reasoning import ReasoningParser
from prefixrt.params import SamplingParams
from prefixrt.server import sglang_api
from prefixrt.server.admission import DEFAULT_MAX_BODY_BYTES, Admission
from prefixrt.server.anthropic_api import router as anthropic_router
from prefixrt.server.body import BodyParser, OffloadedBodyRoute
from prefixrt.server.dashboard import router as dashboard_router
from prefixrt.server.errors import RequestFailed, error_response
from prefixrt.server.lifecycle import Lifecycle
from prefixrt.server.lora_routes import router as lora_router
from prefixrt.server.lora_routes import served_lora_names
from prefixrt.server.openai_api import router as openai_router
from prefixrt.server.protocol import AbortRequest, CachePrefixRequest, GenerateRequest
from prefixrt.server.sse import JSON, SSE_DONE, ClientDisconnected, EventStream, sse, until_disconnect
from prefixrt.server.tracing import make_tracer
from prefixrt.server.validate import check_body

__all__ = ["create_app", "error_response"]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_param(loc) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union member tags (str, list[int]) dropped."""
    parts = [str(p) for p in loc if p != "body"]
    while len(parts) > 1 and (parts[-1].lower() in _TYPE_TAGS or "[" in parts[-1] or "-" in parts[-1]):
        parts.pop()
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, e: InvalidRequest):
        return error_response(400, e.message, "invalid_request_error", e.param)

    @app.exception_handler(RequestFailed)
    async def request_failed(request: Request, e: RequestFailed):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request body"}
        if first.get("type") == "json_invalid":  # loc holds a byte offset, which is not a parameter
            where = [p for p in first.get("loc", ()) if isinstance(p, int)]
            at = f" at byte {where[0]}" if where else ""
            reason = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            return error_response(400, f"request body is not valid JSON{at}: {reason}", "invalid_request_error")
        param = _loc_param(first.get("loc", ()))
        msg = first.get("msg", "invalid request body")
        same_field = [x for x in errs if _loc_param(x.get("loc", ())) == param]
        if len(same_field) > 1:  # a union field: no single alternative's message is the useful one
            msg = f"invalid value {_short(first.get('input'))}; it matches none of the accepted types"
        others = len(errs) - len(same_field)
        more = f" (and {others} more error{'s' if others > 1 else ''})" if others > 0 else ""
        return error_response(400, f"{param}: {msg}{more}" if param else f"{msg}{more}",
                              "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(ImportError)
    async def missing_feature(request: Request, e: ImportError):
        return error_response(400, f"this server cannot serve that request: {e}", "invalid_request_error",
                              code="feature_unavailable")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return error_response(503, str(e) or "the engine is not running", "server_error", code="engine_dead",
                              retry=True)

    @app.exception_handler(TimeoutError)
    async def engine_timeout(request: Request, e: TimeoutError):
        return error_response(503, f"the engine did not answer in time (stopped, hung or overloaded){_detail(e)}",
                              "server_error", code="engine_timeout", retry=True)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, e: RecursionError):
        return error_response(400, "request body is nested too deeply", "invalid_request_error")

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # a bug: say so, and let the client retry
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error", retry=True)


def _detail(e: BaseException) -> str:
    return f": {e}" if str(e) else ""


def create_app(engine, served_model_name: str | list[str] | None = None, *, any_model_name: bool = False,
               generation_defaults: dict | None = None, api_key: str | None = None,
               admin_api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
               lifecycle: Lifecycle | None = None, reasoning_parser: str | None = None,
               otlp_traces_endpoint: str | None = None, tracer_provider=None) -> FastAPI:
    """An ASGI app serving `engine` (a prefixrt.Engine, or a ProcessEngine: the engine in its own process).
    The engine's lifetime is the caller's. `served_model_name`: the names (one or several aliases) requests may
    give as `model`, the first reported in responses (default: the engine's model name); another name is a 404
    `model_not_found` unless `any_model_name`. `generation_defaults`: sampling settings for OpenAI requests that
    leave them out (default: the model's generation config, prefixrt/hub/generation.py). `api_key` / `admin_api_key` / `max_request_bytes`: see
    admission.py; `lifecycle`: drain and engine-death state (the launcher passes its own). `reasoning_parser`:
    a reasoning model's form (prefixrt/lowering/reasoning.py: "qwen3", "deepseek-r1"), whose thinking then goes in chat's
    `reasoning_content` and the Responses API's reasoning items. `otlp_traces_endpoint` / `tracer_provider`: a span
    per OpenAI request (server/tracing.py; the OTEL_* environment turns it on too)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.body_parser.close()

    app = FastAPI(title="prefixrt", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.router.route_class = OffloadedBodyRoute  # large JSON bodies are decoded off the event loop (body.py)
    app.state.body_parser = BodyParser()
    lc = lifecycle or Lifecycle()
    app.state.engine = engine
    app.state.lifecycle = lc
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    app.state.model_names = names or [engine.model_name]
    app.state.model_name = app.state.model_names[0]
    app.state.model_path = getattr(engine, "model_path", None)  # /get_model_info's model_path, also a valid `model`
    app.state.any_model_name = any_model_name
    app.state.lora_names = served_lora_names(engine)  # LoRA adapters served as models (lora_routes.py)
    if generation_defaults is None:
        generation_defaults = hub_generation.generation_defaults(engine.model_name)
    app.state.generation_defaults = dict(generation_defaults)
    app.state.reasoning_parser = ReasoningParser(reasoning_parser) if reasoning_parser is not None else None
    app.state.tracer = make_tracer(otlp_traces_endpoint, tracer_provider)
    app.state.created = int(time.time())
    # A ProcessEngine renders its metrics in the engine process, where the latency histograms are observed.
    app.state.render_metrics = getattr(engine, "render_metrics", None) or Metrics.for_engine(engine).render
    app.add_middleware(Admission, lifecycle=lc, api_key=api_key, admin_api_key=admin_api_key,
                       max_body_bytes=max_request_bytes)
    _install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)  # /v1/messages (Anthropic's Messages API)
    app.include_router(lora_router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter: admin routes
    app.include_router(sglang_api.router)  # SGLang's /get_model_info, /get_server_info, /health_generate
    app.include_router(dashboard_router)  # /dashboard and /dashboard/data: admin routes (admission.py)

    @app.get("/health")
    async def health():
        """200 while the server admits requests and the engine is alive; 503 with the reason otherwise. Answers
        from local state only (no round trip to the engine), so it is never slowed down by the load."""
        reason = lc.refusal
        if reason is None:
            check = getattr(engine, "health", None)
            reason = check() if check is not None else None
        if reason is not None:
            return error_response(503, f"not healthy: {reason}", "server_error", code="unhealthy", retry=True)
        return JSON({"status": "ok"})

    @app.get("/stats")
    async def stats():
        s = await run_in_threadpool(engine.stats)
        return JSON(s.to_dict())

    @app.get("/metrics")
    async def metrics():
        body = await run_in_threadpool(app.state.render_metrics)
        return Response(body, media_type=CONTENT_TYPE)

    # SGLang's clients use both methods; one route per method, so that each has its own OpenAPI operation id
    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache():
        await run_in_threadpool(engine.flush_cache)
        return JSON({"status": "ok"})

    @app.post("/cache_prefix")
    async def cache_prefix(body: CachePrefixRequest):
        check_body(body)
        lora = {"lora": body.lora} if body.lora is not None else {}  # (engines without LoRA take no lora=)
        n = await run_in_threadpool(lambda: engine.cache_prefix(body.prompt, body.cache_salt, **lora))
        return JSON({"cached_tokens": n})

    @app.post("/abort")
    async def abort(body: AbortRequest):
        engine.abort(body.request_id)
        return JSON({"status": "ok"})

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        check_body(body)
        given = [name for name in ("prompt", "prompts", "text", "input_ids") if getattr(body, name) is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompts (prefixrt's), text, input_ids (SGLang's)",
                                 param="prompt")
        if given[0] in ("text", "input_ids"):
            return await sglang_api.generate(body, request)
        if not isinstance(body.sampling_params, dict):
            raise InvalidRequest("sampling_params must be one object with prompt / prompts", param="sampling_params")
        try:
            params = SamplingParams.coerce(body.sampling_params)
        except InvalidRequest as e:  # name the field as the body spells it
            raise InvalidRequest(e.message, param=f"sampling_params.{e.param}" if e.param else "sampling_params"
                                 ) from None
        rid = params.request_id or f"gen-{uuid.uuid4().hex}"
        if body.prompts is not None:
            if body.stream:
                raise InvalidRequest("stream needs a single prompt", param="stream")
            if not body.prompts:
                raise InvalidRequest("prompts is empty", param="prompts")
            rids = [f"{rid}-{k}" for k in range(len(body.prompts))]

            async def run():
                return await asyncio.gather(*(engine.agenerate(p, dataclasses.replace(params, request_id=r))
                                              for p, r in zip(body.prompts, rids)))

            with lc.serving(engine, rids):
                cs = await until_disconnect(request, run())
            _raise_if_failed(lc, cs)
            return JSON([c.to_dict() for c in cs])
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int:  # StrictInt ids: packed once
            prompt = PackedIds.of(prompt)
        params = dataclasses.replace(params, request_id=rid)
        if not body.stream:
            with lc.serving(engine, [rid]):
                c = await until_disconnect(request, engine.agenerate(prompt, params))
            _raise_if_failed(lc, [c])
            return JSON(c.to_dict())
        chunks = await engine.astream_open(prompt, params, coalesce=True)  # multi-token chunks when behind
        lc.register(engine, [rid])

        def close():
            engine.abort(rid)
            lc.release([rid])

        return EventStream(_native_events(chunks, lc), on_close=close)

    return app


def _raise_if_failed(lc: Lifecycle, cs) -> None:
    """Native routes: a request aborted by an error, a drain or the engine's death is an error response (one
    aborted through POST /abort stays a Completion with finish_reason "abort")."""
    for c in cs:
        for s in (c.outputs or [c]):
            if s.finish_reason == "abort" and (s.error or lc.drain_expired or lc.engine_death):
                raise RequestFailed.for_abort(lc, s.error)


async def _native_events(chunks, lc: Lifecycle) -> AsyncIterator[str]:
    try:
        async for ch in chunks:
            if ch.finish_reason == "abort" and (ch.error or lc.drain_expired or lc.engine_death):
                yield RequestFailed.for_abort(lc, ch.error).event()
                break
            yield sse(ch.to_dict())
    except Exception as e:  # a bug: end the stream with an error event rather than cutting it
        yield RequestFailed(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").event()
    yield SSE_DONE
