"""`prefixrt serve` / `generate` / `models` as a user runs them (subprocesses on a tiny local model folder)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixrt.cli", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints, tiny_tokenizer, tmp_path_factory):
    """A local HF folder (config, weights, tokenizer) as `--model` takes it."""
    src, _ = tiny_checkpoints("llama")
    dst = tmp_path_factory.mktemp("served") / "tiny-llama"
    shutil.copytree(src, dst)
    tiny_tokenizer.save_pretrained(dst)
    return dst


def test_serve_answers_then_stops_on_sigterm(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(_cli("serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu",
                                 "--kv-cache-tokens", "2048", "--log-level", "warning"),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "engine ready" in out and "serving" in out and "shutting down" in out


def test_generate_and_models(model_dir):
    r = subprocess.run(_cli("generate", "The quick brown", "--model", str(model_dir), "--device", "cpu",
                            "--kv-cache-tokens", "1024", "--max-tokens", "4"),
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "completion_tokens=4" in r.stderr and "cached_tokens=" in r.stderr
    r = subprocess.run(_cli("models"), env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "gemma-3-270m" in r.stdout
    r = subprocess.run(_cli("serve", "--model", "/nonexistent/model"), env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
