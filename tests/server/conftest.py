"""Server fixtures.

- `server`: `prefixrt serve` launched as users launch it (a subprocess, the engine in its own process) on a
  tiny local model folder, once per session; at the end it must be idle with its KV accounted for, and stop
  cleanly on SIGTERM.
- `engine`: an in-process Engine on the same weights: the reference for expected outputs, and the engine
  behind the in-process OpenAI shim.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.engines import check_and_shut_down
from tests.helpers.serve import ServeProcess, assert_clean, cli, cli_env, free_port  # noqa: F401 (re-exported)

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
    check_and_shut_down(eng)


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
