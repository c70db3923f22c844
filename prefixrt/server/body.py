"""Request bodies decoded off the event loop: large JSON bodies are parsed in a parser process.

`json.loads` of a 5 MB body holds the GIL for 5-10 ms of uninterrupted C (longer on a loaded machine), and a
worker thread would hold the same GIL: every coroutine on the event loop, `/health` included, would wait.
So every route is an `OffloadedBodyRoute`: its request's `json()` parses a body of at least `OFFLOAD_BYTES`
in a parser process (under `prefixrt serve`; see BodyParser): one spawned worker, started on first use; bodies
are independent, so a process pool's round trip of bytes in / objects out is the whole protocol. The server
process only unpickles the result (about 1 ms for a 5 MB prompt: a memcpy-like UTF-8 decode). Smaller bodies
parse inline, where the round trip would cost more than the parse.

Either place decodes with `loads_json`: pydantic's Rust JSON parser (pydantic_core.from_json, three times as
fast as json.loads on a prompt of token ids), and json.loads only for a body that parser refuses. Where it
accepts a body, it gives exactly json.loads's value (tests/server/test_body.py compares them); it refuses
everything json.loads refuses, and some bodies json.loads takes (a lone surrogate escape, a UTF-8 BOM, UTF-16,
nesting past its limit), which json.loads then decodes as before.

The result is exactly `json.loads(body)`'s, in either place, and so are the errors: a malformed body raises
the same `json.JSONDecodeError` (message and offset) and FastAPI turns it into the same RequestValidationError
as before; FastAPI's pydantic validation of the decoded value (cheap: it never copies the strings) is
unchanged. If the parser process dies, a new one is started and the body that was in it is parsed inline.

Invariants: FastAPI reads the body only through `request.json()` (fastapi.routing's request handler), so with
offloading on no JSON body of `OFFLOAD_BYTES` or more is decoded on the loop; Admission has already applied API
keys and the body-size limit (413) before any byte reaches a parser.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import signal
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic_core import from_json

OFFLOAD_BYTES = 256 * 1024  # json.loads of this much takes ~0.5 ms: below it, inline parsing is cheaper


def loads_json(body: bytes) -> Any:
    """json.loads(body): the same value, or the same exception. Decoded by pydantic_core.from_json, which is
    faster and refuses everything json.loads refuses; what it refuses goes to json.loads, whose verdict (a value
    or its JSONDecodeError) is then the answer."""
    try:
        return from_json(body)
    except ValueError:
        return json.loads(body)


class BodyParser:
    """`await parser.loads(body)` == `json.loads(body)` (decoded by loads_json), run in the parser process for
    bodies of at least `offload_bytes` (None: every body inline). Thread-safe; `close()` stops the parser process
    (a later large body starts a new one).

    The parser process is spawned, so it imports the server's `__main__` module: `prefixrt serve` (main module
    prefixrt.cli) turns offloading on; create_app's default parses inline, because an in-process app (the
    OpenAI shim in a user's script) cannot know that its main module is safe to import."""

    def __init__(self, offload_bytes: int | None = None):
        self.offload_bytes = offload_bytes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: never fork a server process that holds threads (and maybe CUDA)
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"), initializer=_parser_init,
                    initargs=(os.getpid(),))
            return self._pool

    async def loads(self, body: bytes) -> Any:
        if self.offload_bytes is None or len(body) < self.offload_bytes:
            return loads_json(body)
        pool = self._executor()
        try:
            future = pool.submit(loads_json, body)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:  # the parser process died (killed, out of memory): restart, parse here
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return loads_json(body)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _parser_init(parent_pid: int) -> None:
    """In the parser process: ignore SIGINT/SIGTERM (Ctrl-C or a supervisor signals the whole process group; the
    server stops the parser when it has drained), and exit when the server process is gone (a SIGKILLed server
    cannot stop it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch():
        while os.getppid() == parent_pid:
            threading.Event().wait(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="prefixrt-parser-watch", daemon=True).start()


class OffloadedBodyRequest(Request):
    """A Request whose json() decodes through the app's BodyParser (`app.state.body_parser`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parser = getattr(self.app.state, "body_parser", None)
            self._json = await parser.loads(body) if parser is not None else loads_json(body)
        return self._json


class OffloadedBodyRoute(APIRoute):
    """An APIRoute whose handler sees an OffloadedBodyRequest (FastAPI's documented custom-route hook)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(OffloadedBodyRequest(request.scope, request.receive))

        return route_handler
