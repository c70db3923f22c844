"""OpenTelemetry tracing: one span per OpenAI request (chat, completions, responses), as vLLM and SGLang offer.

On with `prefixrt serve --otlp-traces-endpoint URL`, or with the standard environment alone
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL picks
"grpc" (the default) or "http/protobuf"; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service), or
with `create_app(tracer_provider=...)` (any OpenTelemetry TracerProvider: tests pass one with an in-memory
exporter). The SDK is an optional extra (`pip install 'prefixrt[tracing]'`): nothing of it is imported unless
tracing is asked for, and asking without it installed fails at start-up with the install line.

A span continues the W3C `traceparent` (and `tracestate`) of the incoming request. It starts when the request
arrives and ends when its response is complete (a stream: when its last event is sent or the client goes
away), and carries:
  gen_ai.request.id, gen_ai.request.model, gen_ai.request.max_tokens / temperature / top_p / n
  gen_ai.usage.prompt_tokens, gen_ai.usage.completion_tokens, prefixrt.cached_tokens
  gen_ai.response.finish_reasons
  gen_ai.latency.time_in_queue, .time_in_model_prefill, .time_in_model_decode (seconds, from the engine:
      arrival to admission, admission to first token, first token to finish; Completion.timing), .e2e
  prefixrt.tenant (the cache_salt, hashed as the per-salt metrics label it: `salt-` + 12 hex digits),
  prefixrt.priority
An aborted or failed request's span has an error status.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from typing import Any

from prefixrt.lowering.options import OUTPUT_BUDGET_NAMES
from prefixrt.server.sse import EventStream

INSTALL_HINT = "pip install 'prefixrt[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"


def env_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def _exporter(endpoint: str | None):
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc")
    try:
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise RuntimeError(f"OTLP tracing needs the OpenTelemetry OTLP exporter ({protocol}): {INSTALL_HINT}") from e
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def make_tracer(endpoint: str | None = None, tracer_provider: Any = None) -> RequestTracer | None:
    """A RequestTracer when tracing is asked for (an endpoint, the OTEL environment or a provider), else None
    (and nothing of OpenTelemetry imported). RuntimeError naming the extra when the SDK is missing."""
    if tracer_provider is None and endpoint is None and env_endpoint() is None:
        return None
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        if tracer_provider is None:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(f"tracing needs the OpenTelemetry SDK: {INSTALL_HINT}") from e
    if tracer_provider is None:
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "prefixrt"})
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    return RequestTracer(tracer_provider, TraceContextTextMapPropagator())


def tenant_label(salt: str | None) -> str:
    return "none" if salt is None else "salt-" + hashlib.sha256(str(salt).encode()).hexdigest()[:12]


class RequestTracer:
    def __init__(self, provider, propagator):
        self.provider, self.propagator = provider, propagator
        self.tracer = provider.get_tracer("prefixrt")

    def start(self, name: str, headers, attributes: dict[str, Any]) -> RequestSpan:
        """A span for one request, a child of the request's traceparent when it has one."""
        from opentelemetry.trace import SpanKind

        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        context = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(name, context=context, kind=SpanKind.SERVER,
                                      attributes={k: v for k, v in attributes.items() if v is not None})
        return RequestSpan(span)


class RequestSpan:
    """One request's span: `observe` each Completion or final Chunk, `end` once (later calls do nothing)."""

    def __init__(self, span):
        self.span, self.start = span, time.monotonic()
        self.prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, cached tokens)
        self.completion: dict[int, int] = {}  # sample index -> its completion tokens
        self.reasons: dict[int, str] = {}
        self.timing: dict | None = None
        self.error: str | None = None
        self.ended = False

    def observe(self, out, key: int = 0, prompt: int = 0) -> None:
        """Counts and timing from a Completion or a Chunk (key: the sample's index across prompts; prompt: its
        prompt's index)."""
        self.prompts[prompt] = (out.prompt_tokens, out.cached_tokens)
        self.completion[key] = out.completion_tokens
        if out.finish_reason is not None:
            self.reasons[key] = out.finish_reason
            if out.finish_reason == "abort":
                self.error = out.error or "aborted"
            if getattr(out, "timing", None) and (self.timing is None or key == 0):
                self.timing = out.timing

    def observe_all(self, completions: list) -> None:
        """Every sample of finished Completions (one per prompt)."""
        k = 0
        for p, c in enumerate(completions):
            for s in (c.outputs or [c]):
                self.observe(s, k, p)
                k += 1

    def fail(self, message: str) -> None:
        self.error = message

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        from opentelemetry.trace import Status, StatusCode

        s = self.span
        s.set_attribute("gen_ai.usage.prompt_tokens", sum(p for p, _ in self.prompts.values()))
        s.set_attribute("gen_ai.usage.completion_tokens", sum(self.completion.values()))
        s.set_attribute("prefixrt.cached_tokens", sum(c for _, c in self.prompts.values()))
        if self.reasons:
            s.set_attribute("gen_ai.response.finish_reasons", [self.reasons[k] for k in sorted(self.reasons)])
        t = self.timing or {}
        for key, name in (("queue_s", "time_in_queue"), ("prefill_s", "time_in_model_prefill"),
                          ("decode_s", "time_in_model_decode")):
            if t.get(key) is not None:
                s.set_attribute(f"gen_ai.latency.{name}", float(t[key]))
        s.set_attribute("gen_ai.latency.e2e", time.monotonic() - self.start)
        if self.error is not None:
            s.set_status(Status(StatusCode.ERROR, self.error))
        s.end()


# ---------------------------------------------------------------------------------------------- routes


def request_attributes(body) -> dict[str, Any]:
    """A request body's span attributes (chat, completions or responses)."""
    max_new_tokens = next((v for k in OUTPUT_BUDGET_NAMES if (v := getattr(body, k, None)) is not None), None)
    salt = getattr(body, "cache_salt", None)
    return {"gen_ai.system": "prefixrt", "gen_ai.request.model": getattr(body, "model", None),
            "gen_ai.request.max_tokens": max_new_tokens, "gen_ai.request.temperature": getattr(body, "temperature", None),
            "gen_ai.request.top_p": getattr(body, "top_p", None), "gen_ai.request.n": getattr(body, "n", None),
            "prefixrt.tenant": tenant_label(salt), "prefixrt.priority": getattr(body, "priority", None) or 0,
            "prefixrt.stream": bool(getattr(body, "stream", False))}


def traced(name: str):
    """Route decorator: the route's request gets a span (request.state.span) when the app traces; it ends
    with the response (a stream's when it closes), with an error status if the route raises."""
    def wrap(fn):
        @functools.wraps(fn)
        async def route(body, request):
            tracer = getattr(request.app.state, "tracer", None)
            if tracer is None:
                return await fn(body, request)
            span = tracer.start(name, request.headers, request_attributes(body))
            request.state.span = span
            try:
                response = await fn(body, request)
            except BaseException as e:
                span.fail(f"{type(e).__name__}: {e}")
                span.end()
                raise
            close = getattr(response, "on_close", None)
            if isinstance(response, EventStream):
                def on_close():
                    try:
                        if close is not None:
                            close()
                    finally:
                        span.end()

                response.on_close = on_close
            else:
                span.end()
            return response

        return route

    return wrap


def _span(request) -> RequestSpan | None:
    return getattr(request.state, "span", None)


def observe(request, rid: str, completions: list) -> None:
    """Record finished Completions (one per prompt) on the request's span, if it has one."""
    span = _span(request)
    if span is not None:
        span.span.set_attribute("gen_ai.request.id", rid)
        span.observe_all(completions)


def observed(request, rid: str, chunks, prompt: int = 0, n: int = 1):
    """`chunks` (an async iterator of Chunks), recorded on the request's span as they pass, if it has one."""
    span = _span(request)
    if span is None:
        return chunks
    span.span.set_attribute("gen_ai.request.id", rid)

    async def gen():
        async for ch in chunks:
            span.observe(ch, prompt * n + ch.index, prompt)
            yield ch

    return gen()
