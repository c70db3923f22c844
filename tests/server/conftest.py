"""Server fixtures: one tiny engine per module, served by uvicorn on a free loopback port (in a thread)."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from tests.conftest import assert_idle_and_clean


def build_engine(tiny_checkpoints, tiny_tokenizer, arch: str = "llama", **kwargs):
    from prefixrt.engine.engine import Engine
    from prefixrt.model.loader import load_model

    path, _ = tiny_checkpoints(arch)
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name=f"tiny-{arch}", revision="test", extra_eos_token_ids=(), path=str(path))
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("debug", True)
    kwargs.setdefault("kv_cache_tokens", 8192)
    return Engine(f"tiny-{arch}", _parts=(model, tiny_tokenizer, resolved), **kwargs)


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tiny_tokenizer):
    eng = build_engine(tiny_checkpoints, tiny_tokenizer, "llama")
    yield eng
    try:
        assert_idle_and_clean(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from prefixrt.server.app import create_app

    with LiveServer(create_app(engine)) as live:
        yield live


@pytest.fixture(params=["http", "shim"])
def client(request, server, engine):
    """A real openai.OpenAI: over HTTP to the live server, or the in-process shim (no sockets)."""
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
