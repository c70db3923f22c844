"""PipeWriter (engine/process/pipe_writer.py): the frames it sends without blocking are the frames
multiprocessing.Connection reads, in order, whether a message goes whole, in part (its end on the writer thread),
or through the thread alone; an event-loop caller with room in the pipe uses no thread at all."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import socket
import threading
import time

import pytest

from prefixrt.engine.process import messages as M
from prefixrt.engine.process.pipe_writer import INLINE_MAX_BYTES, PipeWriter
from prefixrt.errors import EngineDeadError


def _messages() -> list[M.Abort]:
    """Aborts whose pickles span the sizes that matter: tiny, around Connection's 16 KiB split, past a socket
    buffer, around INLINE_MAX_BYTES, past it."""
    sizes = [1, 10, 16300, 16400, 70_000, 300_000, INLINE_MAX_BYTES - 100, INLINE_MAX_BYTES + 100, 3 << 20]
    return [M.Abort(f"{k}:" + "x" * n) for k, n in enumerate(sizes)]


def _flat(frames: list[bytes]) -> list:
    """The messages of the frames read, a Batch's parts in order (messages queued while one was written)."""
    out = []
    for f in frames:
        msg = pickle.loads(f)
        out += [pickle.loads(p) for p in msg.parts] if isinstance(msg, M.Batch) else [msg]
    return out


@pytest.fixture
def pipe():
    """(a PipeWriter on one end of a Pipe, the other end); both closed after the test."""
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    pw = PipeWriter(ours)
    yield pw, theirs
    pw.stop()
    ours.close()
    theirs.close()


def _on_a_loop(fn) -> None:
    """fn() called on a running asyncio event loop (as a server's request handler calls post)."""
    async def run():
        fn()

    asyncio.run(asyncio.wait_for(run(), 10))


def _read(conn, n: int, out: list, start: threading.Event) -> threading.Thread:
    def run():
        start.wait(30)
        while len(_flat(out)) < n:
            out.append(conn.recv_bytes())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("reader_waits", [False, True], ids=["reading", "reader-late"])
def test_frames_sent_from_an_event_loop_are_read_by_connection_in_order(pipe, reader_waits):
    """With the reader late, the pipe fills: a message goes in part and its end follows from the writer thread;
    post() never blocks the loop either way."""
    pw, theirs = pipe
    messages = _messages()
    got, start = [], threading.Event()
    if not reader_waits:
        start.set()
    reader = _read(theirs, len(messages), got, start)
    outcomes = []  # each send from the loop: "whole", "part" (its end left to the thread) or "thread"
    attempt = pw._write_without_blocking

    def recorded():
        done = attempt()
        outcomes.append("whole" if done else "part" if pw._tail is not None else "thread")
        return done

    pw._write_without_blocking = recorded
    pw._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # whatever the host's default: it fills
    _on_a_loop(lambda: [pw.post(M.pickled(m)) for m in messages])  # never blocks, even with nobody reading
    start.set()
    reader.join(30)
    assert _flat(got) == messages
    deadline = time.monotonic() + 10  # the writer thread ends its turn after its last write is read
    while pw.writing and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not pw.writing and not pw.queued
    assert outcomes[0] == "whole"
    if reader_waits:  # the socket buffer filled before the 300 KB message went
        assert "part" in outcomes


def test_a_small_message_from_an_event_loop_takes_no_thread(pipe):
    pw, theirs = pipe
    _on_a_loop(lambda: [pw.post(M.pickled(M.Abort(r))) for r in ("r1", "r2")])
    assert [theirs.recv(), theirs.recv()] == [M.Abort("r1"), M.Abort("r2")]
    assert pw.writes == 2 and not pw.writing
    assert not pw._thread._threads  # the writer thread was never started


def test_callers_without_a_loop_write_in_place_and_a_closed_writer_refuses(pipe):
    pw, theirs = pipe
    pw.post(M.pickled(M.Abort("r1")))
    assert theirs.recv() == M.Abort("r1")
    pw.post(M.pickled(M.Shutdown()), closing=True)
    assert theirs.recv() == M.Shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        pw.post(M.pickled(M.Abort("r2")))


def test_a_broken_pipe_on_an_event_loop_raises_engine_dead(pipe):
    pw, theirs = pipe
    theirs.close()
    with pytest.raises(EngineDeadError, match="gone"):
        _on_a_loop(lambda: pw.post(M.pickled(M.Abort("r1"))))
    assert not pw.writing and not pw.queued
