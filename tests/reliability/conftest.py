"""Fixtures for the HTTP reliability tests: `prefixrt serve` started as users start it (a subprocess of the CLI,
in its own process group, killed with the test process) on tiny local checkpoints.

- `model_dirs(arch)`: the tiny checkpoint folders the server tests use (128-token context).
- `long_model_dir`: the tiny llama with an 8192-token context, so requests can run long enough to be caught
  in flight (engine kill, drain).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.server.conftest import model_dirs  # noqa: F401  (a fixture)


@pytest.fixture(scope="session")
def long_model_dir(model_dirs, tmp_path_factory):  # noqa: F811
    dst = tmp_path_factory.mktemp("long") / "tiny-llama-8k"
    shutil.copytree(model_dirs("llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192  # rotary positions: no table to resize
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def sse_events(lines) -> list:
    """The JSON payloads of an SSE body's data lines, with "[DONE]" kept as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error_shape(body: dict) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err
