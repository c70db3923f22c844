"""PipeWriter: the server process's writes to its engine process (engine/process/client.py's ProcessEngine).

- Group commit: `post(data)` queues a pickled message and writes the queue. The first caller to find the pipe free
  writes; later callers only queue, and what they queued crosses next as one Batch. One writer at a time keeps
  the order.
- An event loop is never blocked. A caller on an asyncio event loop sends the message with MSG_DONTWAIT: whole
  when the pipe has room (the common case, with no thread hop before the engine process sees the request). What
  is left (the unsent end of that message, messages queued meanwhile, a message of more than INLINE_MAX_BYTES)
  goes to the writer thread, whose write blocks only while the engine process reads nothing. A broken pipe there
  reaches the requests through the reader, as the engine's death does.
- Other callers (threads without a loop) write in place.
- `closed`: why nothing more may be posted (post raises EngineDeadError). `post(data, closing=True)` (the
  Shutdown) is the last message and sets it.

The non-blocking send writes multiprocessing.Connection's frame itself (a 4-byte big-endian signed length, then
the bytes: what Connection.send_bytes writes for messages under 2 GiB, and what the engine process's
Connection.recv reads) on the Pipe's socket. tests/engine/process/test_pipe_writer.py checks that Connection reads
those frames back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import struct
import threading

from prefixrt.engine.process.messages import Batch, pickled
from prefixrt.errors import EngineDeadError

INLINE_MAX_BYTES = 1 << 20  # larger messages (a prompt of ~250k ids) always go through the writer thread
_LENGTH = struct.Struct("!i")  # multiprocessing.Connection's length header for messages under 2 GiB


class PipeWriter:
    """Writes pickled messages to `conn` (the server end of a multiprocessing Pipe) in order, never blocking an
    event loop. `writes`: writes to the pipe; `batched`: messages that crossed inside a Batch."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()  # guards queued, writing and closed
        self.queued: list[bytes] = []  # pickled messages waiting to be written
        self.writing = False  # a caller, or the writer thread, is writing the queue
        self.closed: str | None = None
        self.writes = self.batched = 0
        self._tail: memoryview | None = None  # the unsent end of a frame begun on an event loop: written first
        self._sock = _socket_of(conn)  # None: every event-loop write goes through the thread
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixrt-engine-writer")

    def post(self, data: bytes, closing: bool = False) -> None:
        """Queue a pickled message and write the queue (see the module docstring). Raises EngineDeadError if
        closed (unless closing) or if the pipe is broken (a caller without an event loop)."""
        with self.lock:
            if self.closed is not None and not closing:
                raise EngineDeadError(self.closed)
            self.queued.append(data)
            if closing:  # nothing may follow the Shutdown
                self.closed = self.closed or "engine is shut down"
            if self.writing:
                return
            self.writing = True
        if not _on_event_loop():
            self._write_queue()
        elif not self._write_without_blocking():
            self._thread.submit(self._write_queue)

    def close(self, reason: str) -> None:
        """Refuse every later post with EngineDeadError(reason) (the first reason given stays)."""
        with self.lock:
            self.closed = self.closed or reason

    def stop(self) -> None:
        """Let the writer thread end (after what it is writing); the caller closes conn."""
        self._thread.shutdown(wait=False)
        if self._sock is not None:
            self._sock.close()

    def _take(self) -> bytes | None:
        """The queued messages as one message (a Batch for several); None, ending the writing, when none."""
        with self.lock:
            parts, self.queued = self.queued, []
            if not parts:
                self.writing = False
                return None
        if len(parts) == 1:
            return parts[0]
        self.batched += len(parts)
        return pickled(Batch(parts))

    def _write_without_blocking(self) -> bool:
        """On an event loop, with writing set: send the one queued message if the pipe takes it now. True when
        it did and nothing else was queued meanwhile (writing is then over); False leaves the rest (the
        message, its unsent end, or later ones) to the writer thread."""
        with self.lock:
            if self._sock is None or len(self.queued) != 1 or len(self.queued[0]) > INLINE_MAX_BYTES:
                return False
            data = self.queued.pop()
        frame = _LENGTH.pack(len(data)) + data
        try:
            sent = self._sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._broken(e)
        if sent < len(frame):
            self._tail = memoryview(frame)[sent:]
            return False
        self.writes += 1
        with self.lock:
            if self.queued:
                return False
            self.writing = False
            return True

    def _write_queue(self) -> None:
        """Write the unsent end of a frame, then the queue until it is empty (the caller set writing)."""
        try:
            if self._tail is not None:
                tail, self._tail = self._tail, None
                self._sock.sendall(tail)
                self.writes += 1
            while (data := self._take()) is not None:
                self.conn.send_bytes(data)
                self.writes += 1
        except OSError as e:
            self._broken(e)

    def _broken(self, e: OSError):
        with self.lock:
            self.writing = False
            self.queued.clear()  # their senders' streams and calls fail through the reader (_fail_all)
        raise EngineDeadError(f"the engine process is gone: {e}") from e


def _on_event_loop() -> bool:
    """Whether this thread is running an asyncio event loop."""
    return asyncio._get_running_loop() is not None


def _socket_of(conn) -> socket.socket | None:
    """A socket object on a duplicate of conn's descriptor (the Pipe's socketpair end), for sends with
    MSG_DONTWAIT; None where conn is no socket (a one-way os.pipe, Windows)."""
    try:
        fd = os.dup(conn.fileno())
    except (OSError, AttributeError, ValueError):
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    sock.settimeout(None)  # blocking (shared with conn's descriptor), whatever socket.setdefaulttimeout says
    return sock
