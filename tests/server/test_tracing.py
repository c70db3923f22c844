"""OpenTelemetry tracing through the real openai client over HTTP: one span per request, continuing the caller's
W3C traceparent, with the engine's queue/prefill/decode times, the token counts, tenant and priority; recorded
by the SDK's in-memory exporter. Without tracing asked for, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

pytest.importorskip("opentelemetry.sdk")

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def traced(engine):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from prefixrt.server.app import create_app
    from tests.helpers.live_server import LiveServer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with LiveServer(create_app(engine, any_model_name=True, tracer_provider=provider)) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0), exporter


def one_span(exporter):
    """The one span recorded (a stream's span ends as its response closes, just after the client has read it)."""
    import time

    deadline = time.monotonic() + 10
    while not exporter.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    exporter.clear()
    return spans[0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_span(traced, stream):
    from opentelemetry.trace import StatusCode

    c, exporter = traced
    exporter.clear()
    kw = dict(model="tiny-llama", messages=MSGS, max_tokens=6, temperature=0,
              extra_headers={"traceparent": TRACEPARENT}, extra_body={"cache_salt": "acme", "priority": 3})
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage, rid = chunks[-1].usage, chunks[0].id
    else:
        out = c.chat.completions.create(**kw)
        usage, rid = out.usage, out.id
    span = one_span(exporter)
    a = span.attributes
    assert span.name == "chat.completions" and span.status.status_code != StatusCode.ERROR
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_ID
    assert a["gen_ai.request.id"] == rid and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 6
    assert a["prefixrt.cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["prefixrt.tenant"].startswith("salt-") and "acme" not in a["prefixrt.tenant"]
    assert a["prefixrt.priority"] == 3 and a["prefixrt.stream"] is stream
    queue, prefill, decode = (a[f"gen_ai.latency.{k}"] for k in
                              ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"))
    assert min(queue, prefill, decode) >= 0 and decode > 0
    assert a["gen_ai.latency.e2e"] >= queue + prefill + decode


def test_completions_and_responses_spans(traced):
    c, exporter = traced
    exporter.clear()
    out = c.completions.create(model="tiny-llama", prompt=["one two", "three four five"], max_tokens=3, n=2)
    span = one_span(exporter)
    assert span.name == "completions" and span.parent is None  # no traceparent: a new trace
    assert span.attributes["gen_ai.usage.prompt_tokens"] == out.usage.prompt_tokens
    assert span.attributes["gen_ai.usage.completion_tokens"] == out.usage.completion_tokens == 12
    r = c.responses.create(model="tiny-llama", input="hi", max_output_tokens=4)
    span = one_span(exporter)
    assert span.name == "responses" and span.attributes["gen_ai.usage.completion_tokens"] == r.usage.output_tokens


def test_a_failed_request_has_an_error_span(traced):
    from opentelemetry.trace import StatusCode

    c, exporter = traced
    exporter.clear()
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=0)
    span = one_span(exporter)
    assert span.status.status_code == StatusCode.ERROR and "max_tokens" in span.status.description


def test_nothing_imported_without_tracing():
    """Without tracing asked for, prefixrt imports nothing of the SDK or an exporter (FastAPI itself depends on
    the bare OpenTelemetry API); without the SDK installed, the server still imports and asking for tracing names
    the extra."""
    head = ("import os, sys\n"
            "for k in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[k]\n")
    check = ("import prefixrt.server.app, prefixrt.server.launch\n"
             "from prefixrt.server.tracing import make_tracer\n"
             "assert make_tracer() is None\n")
    unused = ("assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))], "
              "'imported'\n")
    subprocess.run([sys.executable, "-c", head + check + unused], check=True)
    absent = ("class Block:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')): raise ModuleNotFoundError(name)\n"
              "sys.meta_path.insert(0, Block())\n")
    asked = ("try:\n    make_tracer('http://collector:4317')\nexcept RuntimeError as e:\n"
             "    assert 'prefixrt[tracing]' in str(e)\nelse:\n    raise AssertionError('no error')\n")
    subprocess.run([sys.executable, "-c", head + absent + check + asked], check=True)


def test_serve_flag_and_missing_exporter(monkeypatch):
    import argparse
    import importlib.util

    from prefixrt.server.launch import add_serve_args
    from prefixrt.server.tracing import make_tracer

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--otlp-traces-endpoint", "http://collector:4317"]).otlp_traces_endpoint == \
        "http://collector:4317"
    if importlib.util.find_spec("opentelemetry.exporter.otlp") is None:
        with pytest.raises(RuntimeError, match=r"prefixrt\[tracing\]"):
            make_tracer("http://collector:4317")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")  # the environment alone
        with pytest.raises(RuntimeError, match=r"prefixrt\[tracing\]"):
            make_tracer()
