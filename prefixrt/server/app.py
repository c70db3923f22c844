"""The FastAPI app: `create_app(engine)`. OpenAI routes live in openai_api.py; native routes and errors here.

Errors always have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`. Bad input is a 400
(InvalidRequest from the engine, and request-body validation errors too, where FastAPI would say 422);
`x-should-retry: false` marks errors a retry cannot fix, so OpenAI clients do not retry them.
"""

from __future__ import annotations

import asyncio
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
from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.params import SamplingParams
from prefixrt.server.openai_api import router as openai_router
from prefixrt.server.protocol import AbortRequest, CachePrefixRequest, GenerateRequest
from prefixrt.server.sse import JSON, SSE_DONE, ClientDisconnected, EventStream, sse, until_disconnect


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   retry: bool = False) -> JSON:
    headers = {} if retry else {"x-should-retry": "false"}
    return JSON({"error": {"message": message, "type": type_, "param": param, "code": code}},
                status_code=status, headers=headers)


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

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request body"}
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
        return error_response(503, str(e), "server_error", code="engine_dead")

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # a bug: say so, and let the client retry
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error", retry=True)


def create_app(engine, served_model_name: str | None = None) -> FastAPI:
    """An ASGI app serving `engine` (a prefixrt.Engine, or a ProcessEngine: the engine in its own process).
    The engine's lifetime is the caller's."""
    app = FastAPI(title="prefixrt", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.model_name = served_model_name or engine.model_name
    app.state.created = int(time.time())
    # A ProcessEngine renders its metrics in the engine process, where the latency histograms are observed.
    app.state.render_metrics = getattr(engine, "render_metrics", None) or Metrics.for_engine(engine).render
    _install_error_handlers(app)
    app.include_router(openai_router)

    @app.get("/health")
    async def health():
        try:
            await asyncio.wait_for(run_in_threadpool(engine.stats), timeout=10)
        except Exception as e:
            return error_response(503, f"engine not responding: {e}", "server_error", retry=True)
        return JSON({"status": "ok"})

    @app.get("/stats")
    async def stats():
        s = await run_in_threadpool(engine.stats)
        return JSON(s.to_dict())

    @app.get("/metrics")
    async def metrics():
        body = await run_in_threadpool(app.state.render_metrics)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache():
        await run_in_threadpool(engine.flush_cache)
        return JSON({"status": "ok"})

    @app.post("/cache_prefix")
    async def cache_prefix(body: CachePrefixRequest):
        n = await run_in_threadpool(engine.cache_prefix, body.prompt, body.cache_salt)
        return JSON({"cached_tokens": n})

    @app.post("/abort")
    async def abort(body: AbortRequest):
        engine.abort(body.request_id)
        return JSON({"status": "ok"})

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        given = [x for x in (body.prompt, body.prompts, body.input_ids) if x is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompts, input_ids", param="prompt")
        params = SamplingParams.coerce(body.sampling_params)
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

            cs = await until_disconnect(request, run())
            return JSON([c.to_dict() for c in cs])
        prompt = body.prompt if body.prompt is not None else body.input_ids
        params = dataclasses.replace(params, request_id=rid)
        if not body.stream:
            c = await until_disconnect(request, engine.agenerate(prompt, params))
            return JSON(c.to_dict())
        chunks = engine.astream(prompt, params)
        return EventStream(_native_events(chunks), on_close=lambda: engine.abort(rid))

    return app


async def _native_events(chunks) -> AsyncIterator[str]:
    async for ch in chunks:
        yield sse(dataclasses.asdict(ch))
    yield SSE_DONE

