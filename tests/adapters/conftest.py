"""Fixtures for the adapter tests: a tiny in-process engine (fast, random weights), the real Gemma-3-270M engine
(loaded once per session), the same Gemma behind a live `prefixrt serve` (once RemoteEngine exists), and a
DSPy response cache that is off, so every call reaches the engine.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import assert_idle_and_clean

REPO = Path(__file__).resolve().parents[2]


def constraints_available() -> bool:
    """The engine compiles constraints through prefixrt.constrained.compiler.make_compiler."""
    try:
        from prefixrt.constrained.compiler import make_compiler  # noqa: F401
    except ImportError:
        return False
    return True


def remote_available() -> bool:
    try:
        return importlib.util.find_spec("prefixrt.remote") is not None
    except ImportError:
        return False


needs_constraints = pytest.mark.skipif(
    not constraints_available(),
    reason="the engine's constrained decoding (prefixrt.constrained.compiler.make_compiler) is not in this tree yet",
)


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


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_tokenizer):
    """A llama-architecture Engine with random weights, an 8k context (framework prompts are long in a byte-level
    vocabulary) and the tiny chat-template tokenizer (CPU, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixrt.engine.engine import Engine
    from prefixrt.model.loader import load_model
    from tests.model.checkpoints import tiny_config

    config = tiny_config("llama")
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt-adapters-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name="tiny-llama", revision="test", extra_eos_token_ids=(), path=str(path))
    eng = Engine("tiny-llama", _parts=(model, tiny_tokenizer, resolved), device="cpu", debug=True,
                 kv_cache_tokens=16384, seed=0)
    yield eng
    try:
        assert_idle_and_clean(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def gemma_engine():
    """The real Gemma-3-270M, in-process (loaded once per test session; ~15 s)."""
    import prefixrt

    try:
        eng = prefixrt.Engine("gemma-3-270m", kv_cache_tokens=32768)
    except ImportError as e:
        pytest.skip(f"gemma-3-270m is unavailable: {e}")
    yield eng
    try:
        assert_idle_and_clean(eng)
    finally:
        eng.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gemma_server():
    """A live `prefixrt serve --model gemma-3-270m` on 127.0.0.1; yields its base URL."""
    if not remote_available():
        pytest.skip("prefixrt.RemoteEngine (prefixrt/remote.py) is not in this tree yet")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixrt.cli", "serve", "--model", "gemma-3-270m", "--host", "127.0.0.1",
         "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefixrt serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prefixrt serve did not become healthy in 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session", params=["engine", "remote"])
def gemma_provider(request):
    """Gemma as a Provider: the in-process Engine, then a RemoteEngine over a live server."""
    if request.param == "engine":
        return request.getfixturevalue("gemma_engine")
    url = request.getfixturevalue("gemma_server")
    import prefixrt

    return prefixrt.RemoteEngine(url)
