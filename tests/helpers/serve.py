"""`prefixrt serve` as a subprocess for tests: started as users start it (the CLI, a free loopback port), in its
own process group, and killed with the test process.

- ServeProcess: the server as a context manager; its output goes to a log file.
- cli / cli_env: the command line and environment of the repository's `python -m prefixrt.cli`.
- assert_clean: a server's /stats say idle, with every KV slot free or evictable and none locked.

tests/server/conftest.py re-exports these names (`from tests.server.conftest import ServeProcess` keeps working).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


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
    is killed on exit from the block, at interpreter exit, and when the test process dies. `ready_timeout`:
    seconds to wait for /health (a real model loads for a minute or more on a busy 2-core machine)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, wait_healthy: bool = True,
                 ready_timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [*args, "--port", str(self.port)]
        self.env = {**cli_env(), **(env or {})}
        self.wait_healthy = wait_healthy
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cli("serve", *self.args), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        _LIVE_GROUPS.add(self.proc.pid)
        if self.wait_healthy:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Wait until /health answers 200 (the server exiting or `ready_timeout` passing fails the test). On
        failure the server's group is killed at once."""
        deadline = time.monotonic() + self.ready_timeout
        try:
            while True:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                assert self.proc.poll() is None, self.log()
                assert time.monotonic() < deadline, "server did not come up:\n" + self.log()
                time.sleep(0.1)
        except BaseException:
            self.__exit__(None, None, None)
            raise

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
