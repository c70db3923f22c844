"""Engine death (issue 10, item 6 / build 4): the engine process is killed while requests run on every route.

Every in-flight client gets an OpenAI error naming the cause (an error object, or an error event then [DONE]
in a stream; never HTTP 200 with finish_reason "abort"), the engine process is reaped at once (no zombie), and
the server exits non-zero within 5 s so a supervisor restarts it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.reliability.conftest import assert_error_shape, sse_events
from tests.server.conftest import ServeProcess

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def _engine_pid(server_pid: int) -> int:
    """The spawned engine process (not multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{c}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(c)
    raise AssertionError("no engine process")


def _state(pid: int) -> str | None:
    """The process state letter (Z for a zombie), or None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):  # reaped between open and read
        return None


def _nonstream(url: str, path: str, body: dict):
    r = httpx.post(url + path, json=body, timeout=120)
    return r.status_code, r.json()


def _stream(url: str, path: str, body: dict, started: concurrent.futures.Future):
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and not started.done():
                started.set_result(True)
        return resp.status_code, sse_events(lines)


def _openai_stream(url: str, started: concurrent.futures.Future):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        for _ in client.chat.completions.create(model="tiny-llama", messages=MSGS, stream=True, max_tokens=3000,
                                                temperature=0, extra_body={"ignore_eos": True}):
            if not started.done():
                started.set_result(True)
        return "finished without an error"
    except openai.APIError as e:
        return e
    finally:
        client.close()


def test_engine_killed_mid_run(long_model_dir, tmp_path):
    args = ["--model", str(long_model_dir), "--served-model-name", "tiny-llama", "--device", "cpu", "--kv-cache-tokens", "32768", "--log-level", "warning"]
    with ServeProcess(args, tmp_path / "serve.log") as live, concurrent.futures.ThreadPoolExecutor(8) as pool:
        engine_pid = _engine_pid(live.proc.pid)
        started = [concurrent.futures.Future() for _ in range(4)]
        chat = {"model": "tiny-llama", "messages": MSGS, **LONG}
        cmpl = {"model": "tiny-llama", "prompt": "The quick brown", **LONG}
        gen = {"prompt": "The quick brown", "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                               "ignore_eos": True}}
        jobs = {
            "chat": pool.submit(_nonstream, live.url, "/v1/chat/completions", chat),
            "completions": pool.submit(_nonstream, live.url, "/v1/completions", cmpl),
            "generate": pool.submit(_nonstream, live.url, "/generate", gen),
            "chat stream": pool.submit(_stream, live.url, "/v1/chat/completions", chat, started[0]),
            "completions stream": pool.submit(_stream, live.url, "/v1/completions", cmpl, started[1]),
            "generate stream": pool.submit(_stream, live.url, "/generate", gen, started[2]),
            "openai chat stream": pool.submit(_openai_stream, live.url, started[3]),
        }
        concurrent.futures.wait(started, timeout=120)
        deadline = time.monotonic() + 60
        while live.stats()["requests_running"] < len(jobs):  # the three non-streaming requests are running too
            done = {name: f.exception() or f.result() for name, f in jobs.items() if f.done()}
            assert not done and time.monotonic() < deadline, (live.stats(), done)
            time.sleep(0.05)

        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        states = set()
        while live.proc.poll() is None and _state(engine_pid) is not None:
            states.add(_state(engine_pid))
            time.sleep(0.005)
        reaped_while_serving = live.proc.poll() is None and _state(engine_pid) is None
        code = live.proc.wait(timeout=30)
        exit_s = time.monotonic() - killed_at
        results = {name: f.result(timeout=30) for name, f in jobs.items()}

    assert reaped_while_serving, f"the engine process was not reaped while the server ran (states seen: {states})"
    assert code != 0, live.log()
    assert exit_s < 5.0, f"the server took {exit_s:.1f} s to exit"
    for name in ("chat", "completions", "generate"):
        status, body = results[name]
        err = assert_error_shape(body)
        assert status == 503 and err["code"] == "engine_dead", (name, status, body)
        assert "engine process died (killed by signal 9)" in err["message"], (name, err)
    for name in ("chat stream", "completions stream", "generate stream"):
        status, events = results[name]
        assert status == 200 and events[-1] == "[DONE]", (name, events[-3:])
        err = assert_error_shape(events[-2])
        assert err["code"] == "engine_dead" and "engine process died" in err["message"], (name, err)
        for e in events[:-2]:  # what came before the error: ordinary chunks, none claiming a finish
            assert e.get("error") is None and all(c.get("finish_reason") is None for c in e.get("choices", [e])), e
    e = results["openai chat stream"]
    assert isinstance(e, openai.APIError) and "engine process died" in e.message, e
    log = live.log()
    assert "engine process died (killed by signal 9)" in log and "exiting with status 1" in log, log


@pytest.mark.timeout(300)
def test_frozen_engine_health_names_its_reason(model_dirs):
    """Issue item 9: a stopped engine process makes /health answer 503 with a reason (it used to be empty)."""
    from starlette.testclient import TestClient

    from prefixrt.engine.process.client import ProcessEngine
    from prefixrt.server.app import create_app

    eng = ProcessEngine(str(model_dirs("llama")), device="cpu", kv_cache_tokens=1024)
    try:
        eng.heartbeat_timeout_s = 2.0
        http = TestClient(create_app(eng))
        assert http.get("/health").status_code == 200
        pid = eng._proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3.5)
            t0 = time.monotonic()
            r = http.get("/health")
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        err = assert_error_shape(r.json())
        assert r.status_code == 503 and "engine process has not answered for" in err["message"], r.json()
        assert took < 1.0, f"/health waited {took:.1f} s on a stopped engine"
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the resumed engine did not become healthy"
            time.sleep(0.1)
    finally:
        eng.shutdown()
