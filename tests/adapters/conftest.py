"""Fixtures for the adapter tests.

Two models, each reachable two ways (the `*_target` fixtures are parametrized "engine" / "remote"):
- a tiny llama with random weights (fast; its schemas in the tests carry bounds so it always stops), in-process
  and behind a live `prefixrt serve` started from the command line on its checkpoint folder;
- the real Gemma-3-270M, in-process (`prefixrt.LM("gemma-3-270m")` / `ChatPrefixRT(model="gemma-3-270m")`)
  and behind a live `prefixrt serve --model gemma-3-270m`: the session's one Gemma engine and one Gemma server
  (`gemma_engine_session`, `gemma_server_session` in tests/conftest.py), shared with every other Gemma test.

Servers are real subprocesses on 127.0.0.1, one per model and session, reached through `prefixrt.RemoteEngine`
(`base_url=`). DSPy's response cache is off, so every call reaches the engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.engines import check_and_shut_down

REPO = Path(__file__).resolve().parents[2]
TINY_NAME = "tiny-llama"
GEMMA = "gemma-3-270m"


@pytest.fixture(scope="session", autouse=True)
def _dspy_cache_off():
    """DSPy must not answer from its response cache (or write one to the home folder) during tests."""
    try:
        import dspy
    except ImportError:
        yield
        return
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    yield


# ---------------------------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m prefixrt.cli serve ...` on a free loopback port, as a subprocess."""

    def __init__(self, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixrt.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "warning"],
            env=env, stdout=self.log, stderr=subprocess.PIPE,
        )

    def wait_healthy(self, timeout: float = 180.0) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"prefixrt serve exited: {self.proc.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"prefixrt serve did not become healthy in {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        self.log.close()


def _check_server_clean(url: str) -> None:
    """The server's engine is idle and its KV accounting closed (the remote twin of assert_idle_and_clean)."""
    from prefixrt.remote import RemoteEngine

    with RemoteEngine(url) as remote:
        deadline = time.monotonic() + 30
        while True:
            s = remote.stats()
            if s.requests_running == 0 and s.requests_waiting == 0:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
        assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0, s


@dataclass
class Target:
    """One model, reached one way: `kind` is "engine" (in-process) or "remote" (through `prefixrt serve`)."""

    kind: str
    name: str
    provider: Any  # an Engine, or a RemoteEngine over base_url
    base_url: str | None = None

    def lm(self, **kwargs):
        """A prefixrt.LM as a user writes it: by model name in-process, by base_url for a server."""
        import prefixrt

        if self.kind == "remote":
            return prefixrt.LM(base_url=self.base_url, **kwargs)
        if self.name == GEMMA:
            return prefixrt.LM(GEMMA, **kwargs)  # the shared in-process engine (see gemma_engine)
        return prefixrt.LM(engine=self.provider, **kwargs)

    def chat(self, **kwargs):
        from prefixrt.adapters.langchain import ChatPrefixRT

        if self.kind == "remote":
            return ChatPrefixRT(base_url=self.base_url, **kwargs)
        if self.name == GEMMA:
            return ChatPrefixRT(model=GEMMA, **kwargs)
        return ChatPrefixRT(engine=self.provider, **kwargs)


# ---------------------------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer) -> Path:
    """A llama-architecture checkpoint folder with random weights, an 8k context (framework prompts are long in a
    byte-level vocabulary) and the tiny chat-template tokenizer: loadable by `prefixrt serve --model <folder>`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import tiny_config

    config = tiny_config("llama")
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt-adapters-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    tiny_tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint, tiny_tokenizer):
    """The tiny model in-process (CPU, fp32, debug checks on), named tiny-llama at revision "test"."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    model = load_model(tiny_checkpoint, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name=TINY_NAME, revision="test", extra_eos_token_ids=(), path=str(tiny_checkpoint))
    eng = Engine(TINY_NAME, _parts=(model, tiny_tokenizer, resolved), device="cpu", debug=True,
                 kv_cache_tokens=16384, seed=0)
    yield eng
    check_and_shut_down(eng)


@pytest.fixture(scope="session")
def tiny_server(tiny_checkpoint):
    """`prefixrt serve --model <tiny checkpoint folder>` on 127.0.0.1; yields its base URL."""
    server = Server("--model", str(tiny_checkpoint), "--served-model-name", TINY_NAME, "--device", "cpu",
                    "--kv-cache-tokens", "16384")
    try:
        url = server.wait_healthy(180)  # a busy 2-core machine: start-up alone can take a minute
        yield url
        _check_server_clean(url)
    finally:
        server.stop()


@pytest.fixture(scope="session", params=["engine", "remote"])
def tiny_target(request) -> Target:
    """The tiny model in-process, then through `prefixrt serve`."""
    if request.param == "engine":
        return Target("engine", TINY_NAME, request.getfixturevalue("tiny_engine"))
    import prefixrt

    url = request.getfixturevalue("tiny_server")
    return Target("remote", TINY_NAME, prefixrt.RemoteEngine(url), url)


# ---------------------------------------------------------------------------------------------- Gemma


@pytest.fixture(scope="session")
def gemma_engine(gemma_engine_session):
    """Gemma-3-270M in-process: the session's one Gemma engine (tests/conftest.py), which is also what
    `prefixrt.LM("gemma-3-270m")` and `ChatPrefixRT(model=...)` share."""
    return gemma_engine_session


@pytest.fixture(scope="session")
def gemma_server(gemma_server_session) -> str:
    """The session's one live `prefixrt serve --model gemma-3-270m` (tests/conftest.py); yields its base URL."""
    return gemma_server_session.url


@pytest.fixture(scope="session", params=["engine", "remote"])
def gemma_target(request) -> Target:
    """Gemma in-process, then through `prefixrt serve`."""
    if request.param == "engine":
        return Target("engine", GEMMA, request.getfixturevalue("gemma_engine"))
    import prefixrt

    url = request.getfixturevalue("gemma_server")
    return Target("remote", GEMMA, prefixrt.RemoteEngine(url), url)
