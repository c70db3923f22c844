"""`prefixrt chat` driven through a pseudo-terminal as a person would: two turns; the second reports that the
first turn's tokens came from the radix cache."""

from __future__ import annotations

import os
import pty
import re
import select
import time

from tests.server.conftest import cli, cli_env

STATUS = re.compile(r"\[(\d+) prompt tokens, (\d+) cached, (\d+) generated; finish_reason=(\w+)\]")


def _read_until(fd: int, pattern: re.Pattern | str, seen: list[str], timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    rx = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
    while True:
        text = "".join(seen)
        m = rx.search(text)
        if m:
            del seen[:]
            seen.append(text[m.end():])
            return m
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out waiting for {rx.pattern!r}; screen so far:\n{text}"
        ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            assert data, f"chat exited while waiting for {rx.pattern!r}; screen:\n{text}"
            seen.append(data.decode(errors="replace"))


def test_chat_two_turns_second_reports_cached_tokens(model_dirs):
    argv = cli("chat", "--model", str(model_dirs("llama")), "--device", "cpu", "--max-tokens", "6",
               "--kv-cache-tokens", "4096")
    pid, fd = pty.fork()
    if pid == 0:  # the child: prefixrt chat on the terminal's slave side
        os.execvpe(argv[0], argv, cli_env())
    seen: list[str] = []
    try:
        _read_until(fd, ">>> ", seen)
        os.write(fd, b"hello there\n")
        first = _read_until(fd, STATUS, seen)
        _read_until(fd, ">>> ", seen)
        os.write(fd, b"and again\n")
        second = _read_until(fd, STATUS, seen)
        _read_until(fd, ">>> ", seen)
        os.write(fd, b"/exit\n")
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    prompt1, cached1, gen1, _ = (int(first[1]), int(first[2]), int(first[3]), first[4])
    prompt2, cached2 = int(second[1]), int(second[2])
    assert cached1 == 0 and gen1 > 0
    # The second turn's prompt holds the whole first turn: its prompt tokens (at least) come from the cache.
    assert prompt2 > prompt1
    assert cached2 >= prompt1 - 1
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
