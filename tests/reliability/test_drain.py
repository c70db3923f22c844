"""Graceful shutdown (issue 10, item 7 / build 5): SIGTERM to the server's process group (as a supervisor sends
it) with 16 requests in flight, streaming and not, chat and completions.

- `--drain-timeout 30`: new requests get 503 (an error object) while the 16 finish normally; exit status 0.
- `--drain-timeout 1`: each of the 16 gets a clean error after about a second (a 503 error object, or an error
  event then [DONE], every event whole); exit status 0.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx

from tests.reliability.conftest import assert_error_shape, sse_events
from tests.server.conftest import ServeProcess

MSGS = [{"role": "user", "content": "Tell me about prefix caching."}]


def _request(url: str, k: int, max_tokens: int, started: concurrent.futures.Future):
    """Request k of 16: chat or completions (k % 2), streaming or not (k // 2 % 2)."""
    path = "/v1/chat/completions" if k % 2 == 0 else "/v1/completions"
    body = {"model": "tiny-llama", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **({"messages": MSGS} if k % 2 == 0 else {"prompt": f"The quick brown fox {k}"})}
    if k // 2 % 2 == 0:
        started.set_result(True)
        r = httpx.post(url + path, json=body, timeout=120)
        return r.status_code, r.json()
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and not started.done():
                started.set_result(True)
        return resp.status_code, sse_events(lines)


def _drain(long_model_dir, tmp_path, drain_s: float, max_tokens: int):
    args = ["--model", str(long_model_dir), "--served-model-name", "tiny-llama", "--device", "cpu", "--kv-cache-tokens", "65536", "--log-level",
            "warning", "--drain-timeout", str(drain_s)]
    with ServeProcess(args, tmp_path / "serve.log") as live, concurrent.futures.ThreadPoolExecutor(16) as pool:
        started = [concurrent.futures.Future() for _ in range(16)]
        jobs = [pool.submit(_request, live.url, k, max_tokens, started[k]) for k in range(16)]
        concurrent.futures.wait(started, timeout=120)
        deadline = time.monotonic() + 60
        while live.stats()["requests_running"] < 16:
            assert time.monotonic() < deadline, live.stats()
            time.sleep(0.05)
        signal_at = time.monotonic()
        os.killpg(live.proc.pid, signal.SIGTERM)  # the whole group, as a supervisor does: the engine too
        time.sleep(0.3)
        refused = httpx.post(live.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                             timeout=30)
        health = httpx.get(live.url + "/health", timeout=30)
        code = live.proc.wait(timeout=drain_s + 60)
        exit_s = time.monotonic() - signal_at
        results = [f.result(timeout=30) for f in jobs]
    return code, exit_s, refused, health, results, live.log()


def _assert_refused(refused: httpx.Response, health: httpx.Response) -> None:
    err = assert_error_shape(refused.json())
    assert refused.status_code == 503 and err["code"] == "server_shutting_down", refused.text
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"], health.text


def test_sigterm_drain_lets_16_requests_finish(long_model_dir, tmp_path):
    code, exit_s, refused, health, results, log = _drain(long_model_dir, tmp_path, 30.0, max_tokens=400)
    assert code == 0, log
    _assert_refused(refused, health)
    for k, (status, out) in enumerate(results):
        assert status == 200, (k, out)
        if isinstance(out, dict):  # non-streaming
            assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 400, out
        else:
            assert out[-1] == "[DONE]" and not any("error" in e for e in out[:-1]), out[-3:]
            reasons = [c["finish_reason"] for e in out[:-1] for c in e["choices"] if c["finish_reason"]]
            assert reasons == ["length"], (k, reasons)
    assert exit_s < 30.0 + 10, exit_s


def test_sigterm_drain_timeout_aborts_cleanly(long_model_dir, tmp_path):
    code, exit_s, refused, health, results, log = _drain(long_model_dir, tmp_path, 1.0, max_tokens=3000)
    assert code == 0, log
    _assert_refused(refused, health)
    for k, (status, out) in enumerate(results):
        if isinstance(out, dict):
            err = assert_error_shape(out)
            assert status == 503 and err["code"] == "server_shutting_down", (k, status, out)
            assert "drain timeout" in err["message"], err
        else:
            assert status == 200 and out[-1] == "[DONE]", (k, out[-3:])  # sse_events parsed every event whole
            err = assert_error_shape(out[-2])
            assert err["code"] == "server_shutting_down", (k, err)
            assert not any(c.get("finish_reason") for e in out[:-2] for c in e["choices"]), (k, out[-4:])
    assert exit_s < 1.0 + 30, exit_s
    assert "Traceback" not in log, log
