"""Fuzz the OpenAPI schema (schemathesis): >= 500 generated requests, no 5xx, and the server still answers.

Runs against the ASGI app in this process (schemathesis' ASGI client) serving a ProcessEngine (the engine in
its own process, as `prefixrt serve` runs it) with a 40-token context, so that whatever max_tokens/n the
fuzzer picks, every request is short.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.engines import assert_idle_and_clean

CALLS: list[tuple[str, str, int]] = []


@pytest.fixture(scope="module")
def fuzz_engine(model_dirs):
    from prefixrt.engine.process.client import ProcessEngine

    eng = ProcessEngine(str(model_dirs("llama")), device="cpu", max_context=40, kv_cache_tokens=4096, debug=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def fuzz_app(fuzz_engine):
    from prefixrt.server.app import create_app

    return create_app(fuzz_engine)


def _check(case) -> None:
    response = case.call()
    CALLS.append((case.method, case.path, response.status_code))
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):
            # Anthropic's Messages API answers with Anthropic's error shape (server/anthropic_api.py)
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
        else:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_no_server_errors(fuzz_app):
    api = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [r.ok() for r in api.get_all_operations()]
    assert len(operations) >= 10
    for op in operations:
        # Bodies are where bad input lives; operations without one have a handful of distinct cases.
        examples = 110 if op.method.upper() == "POST" else 5

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        @given(case=op.as_strategy())
        def run(case):
            _check(case)

        run()


def test_fuzz_volume_and_server_alive(fuzz_app, fuzz_engine):
    from starlette.testclient import TestClient

    assert len(CALLS) >= 500, f"only {len(CALLS)} generated requests"
    assert any(code == 200 for _, path, code in CALLS if path == "/v1/chat/completions")
    assert any(code == 400 for _, path, code in CALLS if path == "/v1/chat/completions")
    with TestClient(fuzz_app) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert_idle_and_clean(fuzz_engine)
