"""Server fixtures.

- `server`: `prefixrt serve` launched as users launch it (a subprocess, the engine in its own process) on a
  tiny local model folder, once per session; at the end it must be idle with its KV accounted for, and stop
  cleanly on SIGTERM.
- `engine`: an in-process Engine on the same weights: the reference for expected outputs, and the engine
  behind the in-process OpenAI shim.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.helpers.engines import assert_idle_and_clean

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny-llama"  # --served-model-name: the name the in-process engine reports too


def build_engine(tiny_checkpoints, tiny_tokenizer, arch: str = "llama", **kwargs):
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    path, _ = tiny_checkpoints(arch)
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name=f"tiny-{arch}", revision="test", extra_eos_token_ids=(), path=str(path))
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("debug", True)
    kwargs.setdefault("kv_cache_tokens", 8192)
    return Engine(f"tiny-{arch}", _parts=(model, tiny_tokenizer, resolved), **kwargs)


@pytest.fixture(scope="session")
def model_dirs(tiny_checkpoints, tiny_tokenizer, tmp_path_factory):
    """arch -> a local HF folder (config, weights, tokenizer), as `--model` takes it."""
    made = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            src, _ = tiny_checkpoints(arch)
            dst = tmp_path_factory.mktemp("served") / f"tiny-{arch}"
            shutil.copytree(src, dst)
            tiny_tokenizer.save_pretrained(dst)
            made[arch] = dst
        return made[arch]

    return get


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixrt.cli", *args]


def cli_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE_GROUPS: set[int] = set()  # process groups of servers still running: killed at exit, whatever happens


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGKILL if the test process dies (even by SIGKILL, where atexit cannot run)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServeProcess:
    """`prefixrt serve ARGS` in a subprocess on a free loopback port, in its own process group (as a supervisor
    starts it: a signal to the group reaches the engine process too); its output goes to `log_path`. The group
    is killed on exit from the block, at interpreter exit, and when the test process dies."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, wait_healthy: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [*args, "--port", str(self.port)]
        self.env = {**cli_env(), **(env or {})}
        self.wait_healthy = wait_healthy
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cli("serve", *self.args), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        _LIVE_GROUPS.add(self.proc.pid)
        if not self.wait_healthy:
            return self
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, "server did not come up:\n" + self.log()
            time.sleep(0.1)

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its engine process
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait()
        _LIVE_GROUPS.discard(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60, group: bool = False) -> int:
        """Signal the server (or its whole process group, as a supervisor does) and wait for its exit status."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["requests_running"] == 0 and s["requests_waiting"] == 0:
                return s
            assert time.monotonic() < deadline, f"server not idle: {s}"
            time.sleep(0.02)


def assert_clean(stats: dict) -> None:
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    assert stats["kv_free"] + stats["kv_evictable"] == stats["kv_total"], stats
    assert stats["kv_locked"] == 0, stats


@pytest.fixture(scope="session")
def server(model_dirs, tmp_path_factory):
    args = ["--model", str(model_dirs("llama")), "--served-model-name", SERVED_NAME, "--device", "cpu",
            "--kv-cache-tokens", "8192", "--debug", "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live
        assert_clean(live.wait_idle())
        assert live.stop() == 0, live.log()
        log = live.log()
        assert "in its own process" in log and "engine ready" in log and "shutting down" in log, log
        assert "scheduler loop error" not in log and "Traceback" not in log, log


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tiny_tokenizer):
    eng = build_engine(tiny_checkpoints, tiny_tokenizer, "llama")
    yield eng
    try:
        assert_idle_and_clean(eng)
    finally:
        eng.shutdown()


@pytest.fixture(params=["http", "shim"])
def client(request, server, engine):
    """A real openai.OpenAI: over HTTP to `prefixrt serve`, or the in-process shim on `engine` (no sockets)."""
    import openai

    from prefixrt.openai import OpenAI

    if request.param == "http":
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    else:
        c = OpenAI(engine=engine)
    yield c
    c.close()


@pytest.fixture(params=["http", "shim"])
async def aclient(request, server, engine):
    import openai

    from prefixrt.openai import AsyncOpenAI

    if request.param == "http":
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    else:
        c = AsyncOpenAI(engine=engine)
    yield c
    await c.close()


def needs_constrained_decoding():
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec("prefixrt.constrained.compiler") is None,
                              reason="prefixrt.constrained.compiler (constrained decoding) is not on this branch yet")


@pytest.fixture(scope="module")
def long_server(model_dirs, tmp_path_factory):
    """`prefixrt serve` on the tiny llama with a 2048-token context (its checkpoint says 128, too few for the
    tools' description the fallback prompt adds; RoPE has no learned positions, so only the limit changes)."""
    folder = tmp_path_factory.mktemp("long") / "tiny-llama"
    shutil.copytree(model_dirs("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    args = ["--model", str(folder), "--served-model-name", SERVED_NAME, "--device", "cpu",
            "--kv-cache-tokens", "16384", "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live
        assert_clean(live.wait_idle())
