"""`prefixrt serve` / `generate` / `models` as a user runs them (subprocesses on a tiny local model folder).

The default `prefixrt serve` (engine in its own process) is the session `server` fixture every HTTP test
uses; here: the in-thread mode, and what happens when either process dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServeProcess, cli, cli_env


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # reaped between open and read
        return False


def _complete(url: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": max_tokens},
                      timeout=30)


def test_serve_in_process_answers_then_stops_on_sigterm(model_dirs, tmp_path):
    args = ["--model", str(model_dirs("llama")), "--served-model-name", "x", "--device", "cpu", "--kv-cache-tokens", "2048",
            "--log-level", "warning", "--engine-in-process"]
    with ServeProcess(args, tmp_path / "serve.log") as live:
        r = _complete(live.url)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert live.stop() == 0, live.log()
    out = live.log()
    assert "in this process" in out and "engine ready" in out and "serving" in out and "shutting down" in out


def test_engine_process_death(model_dirs, tmp_path):
    """The engine process dies: a running stream ends with an error event naming the cause and [DONE], and the
    server exits non-zero (fail fast). The server process dies: the engine process follows it."""
    args = ["--model", str(model_dirs("llama")), "--served-model-name", "x", "--device", "cpu", "--kv-cache-tokens", "2048",
            "--log-level", "warning"]
    # The second case's server starts at once and loads while the first case runs (on two cores the two
    # start-ups overlap; one after the other they were most of this test's time).
    with ServeProcess(args, tmp_path / "serve2.log", wait_healthy=False) as second:
        with ServeProcess(args, tmp_path / "serve.log") as live:
            engine_pid = max(_children(live.proc.pid))  # the resource tracker, if any, started first
            body = {"model": "x", "prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(engine_pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]", rest
            error = json.loads(rest[-2][len("data: "):])["error"]
            assert error["code"] == "engine_dead" and "engine process died" in error["message"], error
            assert '"finish_reason":"abort"' not in "".join(rest).replace(" ", "")
            assert live.proc.wait(timeout=30) == 1, live.log()

        second.wait_ready()
        children = _children(second.proc.pid)
        assert _complete(second.url).status_code == 200
        second.proc.kill()
        second.proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(c) for c in children):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.1)


def test_generate_and_models(model_dirs):
    r = subprocess.run(cli("generate", "The quick brown", "--model", str(model_dirs("llama")), "--device", "cpu",
                           "--kv-cache-tokens", "1024", "--max-tokens", "4"),
                       env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "completion_tokens=4" in r.stderr and "cached_tokens=" in r.stderr
    r = subprocess.run(cli("models"), env=cli_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "gemma-3-270m" in r.stdout
    r = subprocess.run(cli("serve", "--model", "/nonexistent/model"), env=cli_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "nonexistent" in r.stderr


@pytest.mark.timeout(300)
def test_the_engine_process_starts_before_the_caller_waits_for_it(model_dirs):
    """`prefixrt serve` starts the engine process, then imports its HTTP stack while it builds
    (ProcessEngine.start): the progress arrives meanwhile, ready() gives a serving engine, and cancel() ends a
    start-up the caller gives up on."""
    import multiprocessing
    import threading

    from prefixrt.engine.process.client import ProcessEngine

    said = []
    first = threading.Event()

    def progress(text):
        said.append(text)
        first.set()

    ready = ProcessEngine.start(str(model_dirs("llama")), progress=progress, device="cpu", kv_cache_tokens=1024)
    assert first.wait(120), "no progress before ready() was called"  # read on its own thread
    eng = ready()
    try:
        assert any(text.startswith("start-up:") for text in said)
        out = eng.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert out.completion_tokens == 4
    finally:
        eng.shutdown()

    ready = ProcessEngine.start(str(model_dirs("llama")), device="cpu", kv_cache_tokens=1024)
    assert [p for p in multiprocessing.active_children() if p.name == "prefixrt-engine"]
    ready.cancel()
    assert not [p for p in multiprocessing.active_children() if p.name == "prefixrt-engine"]
