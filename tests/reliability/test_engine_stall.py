"""Health reflects progress: an engine that is alive but stuck (its process stopped with SIGSTOP, or its loop hung
in a step while it has work) turns /health to 503 within the stall bound (`--engine-stall-timeout`), and the
requests in flight end with a 503 `engine_unresponsive` error instead of hanging; once the engine moves again,
/health is 200, new requests are served and the failed ones are aborted in the engine."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import threading
import time

import httpx
import pytest

from tests.reliability.conftest import assert_error_shape, sse_events
from tests.reliability.test_engine_death import _engine_pid
from tests.server.conftest import ServeProcess

STALL_S = 3.0
LONG = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 3000,
        "temperature": 0, "ignore_eos": True, "stream": True}


def test_progress_watch_counts_only_a_busy_loop_that_stands_still():
    from prefixrt.engine.progress import ProgressWatch

    w = ProgressWatch(stall_timeout_s=5)
    w.observe(3, busy=False, now=0)
    assert w.stall(now=100) is None  # idle: never stuck
    w.observe(3, busy=True, now=100)
    w.observe(4, busy=True, now=103)
    assert w.stall(now=107) is None  # stepped 4 s ago
    w.observe(4, busy=True, now=107)
    reason = w.stall(now=109)
    assert reason is not None and "no progress for 6 s" in reason
    w.observe(5, busy=True, now=110)
    assert w.stall(now=110) is None


def _stream_until_error(url: str, body: dict, started: threading.Event) -> tuple[int, list, float]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: {"):
                started.set()
        return r.status_code, sse_events(lines), time.monotonic()


def _wait_health(url: str, status: int, within: float) -> float:
    t0 = time.monotonic()
    while httpx.get(url + "/health", timeout=5).status_code != status:
        assert time.monotonic() - t0 < within, f"/health did not become {status} within {within} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _assert_unresponsive_error(events: list) -> dict:
    assert events[-1] == "[DONE]", events[-3:]
    err = assert_error_shape(events[-2])
    assert err["code"] == "engine_unresponsive", err
    return err


@pytest.mark.timeout(300)
def test_stopped_engine_process_fails_in_flight_requests(long_model_dir, tmp_path):
    args = ["--model", str(long_model_dir), "--served-model-name", "tiny-llama", "--device", "cpu",
            "--kv-cache-tokens", "32768", "--log-level", "warning", "--engine-stall-timeout", str(STALL_S)]
    with ServeProcess(args, tmp_path / "serve.log") as live, concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = threading.Event()
        stream = pool.submit(_stream_until_error, live.url, LONG, started)
        assert started.wait(60)
        pid = _engine_pid(live.proc.pid)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            status, events, ended_at = stream.result(timeout=60)
            assert status == 200
            err = _assert_unresponsive_error(events)
            assert "has not answered" in err["message"], err
            assert ended_at - stopped_at < STALL_S + 3, "the stream hung past the stall bound"
            r = httpx.get(live.url + "/health", timeout=5)
            assert r.status_code == 503 and "has not answered" in r.json()["error"]["message"]
            r = httpx.post(live.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 4},
                           timeout=30)  # a new request fails fast too
            assert r.status_code == 503 and assert_error_shape(r.json())["code"] == "engine_unresponsive"
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait_health(live.url, 200, within=10)
        r = httpx.post(live.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        live.wait_idle(timeout=30)  # the failed stream was aborted in the engine: nothing left running


@pytest.mark.timeout(300)
def test_hung_loop_with_work_turns_health_503(long_model_dir):
    """The loop is stuck in one step while it has work (here: a sleep run on the loop thread while a request
    runs; the engine in the server's process, as `--engine-in-process`): unhealthy after the stall bound,
    healthy again once it moves."""
    from prefixrt.engine.engine import Engine
    from prefixrt.server.app import create_app
    from tests.helpers.live_server import LiveServer

    eng = Engine(str(long_model_dir), device="cpu", kv_cache_tokens=16384)
    eng.progress.stall_timeout_s = 2.0
    try:
        with LiveServer(create_app(eng, "tiny-llama")) as live, concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = threading.Event()
            stream = pool.submit(_stream_until_error, live.url, {**LONG, "max_tokens": 400}, started)
            assert started.wait(60)
            assert httpx.get(live.url + "/health").status_code == 200
            hang = pool.submit(eng._run_on_loop, functools.partial(time.sleep, 6.0))
            assert _wait_health(live.url, 503, within=5) < 4.5
            msg = httpx.get(live.url + "/health").json()["error"]["message"]
            assert "no progress" in msg, msg
            hang.result(timeout=30)
            _wait_health(live.url, 200, within=10)
            status, events, _ = stream.result(timeout=120)
            assert status == 200 and events[-1] == "[DONE]"
    finally:
        eng.shutdown()


def test_engine_process_heartbeats_carry_its_progress(long_model_dir):
    """ProcessEngine's watch is fed by the engine process's heartbeats: the loop's step count and whether it
    has work (a stuck loop stops the count while the heartbeat goes on)."""
    from prefixrt.engine.process.client import ProcessEngine

    eng = ProcessEngine(str(long_model_dir), device="cpu", kv_cache_tokens=16384)
    try:
        eng.generate("Count", {"max_new_tokens": 2})
        time.sleep(1.5)
        idle_steps = eng.progress._steps
        assert idle_steps > 0 and not eng.progress._busy
        seen = []  # until a heartbeat says busy with more steps (a short stream can end between two heartbeats)
        it = eng.stream("Count on", {"max_new_tokens": 6000, "ignore_eos": True})
        for _chunk in it:
            seen.append((eng.progress._steps, eng.progress._busy))
            if any(busy for _, busy in seen) and max(s for s, _ in seen) > idle_steps:
                break
        it.close()  # aborts the rest
        assert any(busy for _, busy in seen) and max(s for s, _ in seen) > idle_steps
        assert eng.health() is None
    finally:
        eng.shutdown()


@pytest.mark.timeout(300)
def test_a_stopped_engine_process_never_blocks_the_submitting_event_loop(long_model_dir):
    """Token-id prompts are submitted on the caller's event loop (EngineAPI._inline), but never write the pipe
    there: with the engine process stopped (SIGSTOP: it reads nothing), 64 submissions of 1 MB in all, past what the
    pipe buffers, return at once; after SIGCONT each request completes with the tokens a running engine gives."""
    import asyncio

    from prefixrt.engine.process.client import ProcessEngine

    greedy = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    prefix = [1] + [3 + j % 300 for j in range(3899)]
    prompts = [prefix + [3 + (i * 7 + j) % 300 for j in range(100)] for i in range(64)]
    eng = ProcessEngine(str(long_model_dir), device="cpu", kv_cache_tokens=32768)
    submitted, resumed, out = threading.Event(), threading.Event(), {}

    async def go():
        t0 = time.monotonic()
        streams = [await eng.astream_open(p, greedy) for p in prompts]
        out["submit_s"] = time.monotonic() - t0
        submitted.set()
        await asyncio.to_thread(resumed.wait, 120)
        out["tokens"] = []
        for s in streams:
            out["tokens"].append([t async for ch in s for t in ch.token_ids])

    try:
        pid = eng._proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            runner = threading.Thread(target=lambda: asyncio.run(go()), daemon=True)
            runner.start()
            assert submitted.wait(30), "submitting to a stopped engine blocked the event loop"
            assert out["submit_s"] < 10, out
        finally:
            os.kill(pid, signal.SIGCONT)
            resumed.set()
        runner.join(120)
        assert out["tokens"] == [c.token_ids for c in eng.generate(prompts, greedy)]
    finally:
        eng.shutdown()
