"""PipeWriter (engine/process/pipe_writer.py): the frames it sends without blocking are the frames
multiprocessing.Connection reads, in order, whether a message goes whole, in part (its end on the writer thread),
or through the thread alone; an event-loop caller with room in the pipe uses no thread at all."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import threading

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


def _pipe():
    return multiprocessing.get_context("spawn").Pipe()


def _read(conn, n: int, out: list, start: threading.Event) -> threading.Thread:
    def run():
        start.wait(30)
        while len(_flat(out)) < n:
            out.append(conn.recv_bytes())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("reader_waits", [False, True], ids=["reading", "reader-late"])
def test_frames_sent_from_an_event_loop_are_read_by_connection_in_order(reader_waits):
    """With the reader late, the pipe fills: a message goes in part and its end follows from the writer thread;
    post() never blocks the loop either way."""
    ours, theirs = _pipe()
    pw = PipeWriter(ours)
    messages = _messages()
    got, start = [], threading.Event()
    if not reader_waits:
        start.set()
    reader = _read(theirs, len(messages), got, start)

    async def post_all():
        for m in messages:
            pw.post(M.pickled(m))

    try:
        asyncio.run(asyncio.wait_for(post_all(), 10))  # never blocks, even with nobody reading
        start.set()
        reader.join(30)
        assert _flat(got) == messages
        assert pw.writes >= 1 and not pw.writing and not pw.queued
    finally:
        pw.stop()
        ours.close()
        theirs.close()


def test_a_small_message_from_an_event_loop_takes_no_thread():
    ours, theirs = _pipe()
    pw = PipeWriter(ours)
    try:
        async def post():
            pw.post(M.pickled(M.Abort("r1")))
            pw.post(M.pickled(M.Abort("r2")))

        asyncio.run(post())
        assert [theirs.recv(), theirs.recv()] == [M.Abort("r1"), M.Abort("r2")]
        assert pw.writes == 2 and not pw.writing
        assert not pw._thread._threads  # the writer thread was never started
    finally:
        pw.stop()
        ours.close()
        theirs.close()


def test_callers_without_a_loop_write_in_place_and_a_closed_writer_refuses():
    ours, theirs = _pipe()
    pw = PipeWriter(ours)
    try:
        pw.post(M.pickled(M.Abort("r1")))
        assert theirs.recv() == M.Abort("r1")
        pw.post(M.pickled(M.Shutdown()), closing=True)
        assert theirs.recv() == M.Shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            pw.post(M.pickled(M.Abort("r2")))
    finally:
        pw.stop()
        ours.close()
        theirs.close()


def test_a_broken_pipe_on_an_event_loop_raises_engine_dead():
    ours, theirs = _pipe()
    pw = PipeWriter(ours)
    theirs.close()
    try:
        async def post():
            pw.post(M.pickled(M.Abort("r1")))

        with pytest.raises(EngineDeadError, match="gone"):
            asyncio.run(post())
        assert not pw.writing and not pw.queued
    finally:
        pw.stop()
        ours.close()
