"""Routing fixtures: a tiny model folder as `--model` takes it, `prefixrt serve` workers started in parallel,
and `prefixrt router` processes (each in its own process group, killed whatever happens)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.serve import _LIVE_GROUPS, ServeProcess, _die_with_parent, cli, cli_env, free_port


@pytest.fixture(scope="session")
def routing_model_dir(tiny_checkpoints, tiny_tokenizer, tmp_path_factory) -> Path:
    src, _ = tiny_checkpoints("llama")
    dst = tmp_path_factory.mktemp("routing") / "tiny-llama"
    shutil.copytree(src, dst)
    tiny_tokenizer.save_pretrained(dst)
    return dst


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{url} did not come up:\n{log.read_text()}"
        time.sleep(0.2)


def start_workers(model_dir: Path, n: int, kv_tokens: int, log_dir: Path) -> list[ServeProcess]:
    """n `prefixrt serve` workers (engine on a thread of the server process: half the processes), started at
    once and waited for together. The caller exits each (kills its group)."""
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--device", "cpu", "--kv-cache-tokens", str(kv_tokens),
            "--engine-in-process", "--log-level", "warning"]
    workers = [ServeProcess(args, log_dir / f"worker{i}.log", wait_healthy=False) for i in range(n)]
    for w in workers:
        w.__enter__()
    for w in workers:
        wait_healthy(w.url, w.proc, w.log_path)
    return workers


class RouterProcess:
    """`prefixrt router ARGS` on a free loopback port, in its own process group."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log_path = [*args, "--port", str(self.port)], log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> RouterProcess:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cli("router", *self.args), env=cli_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        _LIVE_GROUPS.add(self.proc.pid)
        return self

    def wait_all_workers(self, n: int, timeout: float = 120) -> None:
        wait_healthy(self.url, self.proc, self.log_path, timeout)
        deadline = time.monotonic() + timeout
        while sum(v == "ok" for v in httpx.get(self.url + "/health").json()["workers"].values()) < n:
            assert time.monotonic() < deadline, httpx.get(self.url + "/health").text
            time.sleep(0.2)

    def stop(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        _LIVE_GROUPS.discard(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text()
