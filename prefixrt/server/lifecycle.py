"""The server's life: serving, draining after SIGTERM, or going down because the engine process died.

One `Lifecycle` per app (`app.state.lifecycle`). The admission middleware counts the HTTP requests in flight
and turns new ones away (503) once `draining` or `engine_death` is set; routes register the engine request
ids they are serving (`serving`), so a drain that runs out of time can abort exactly those.

Drain (SIGTERM/SIGINT, `drain()`): stop admission; let in-flight requests finish for up to `drain_timeout`
seconds; then abort the rest — each gets a clean error (a 503 error object, or an error event and `[DONE]` in
a stream; see errors.py) — wait until their responses are out, and ask the launcher to stop with exit status 0.

Engine death (`engine_died`, called from ProcessEngine's reader thread): in-flight requests have already been
failed with the cause; once their error responses are out (at most DEATH_FLUSH_S), the launcher stops the
server with exit status 1 so a supervisor restarts it (fail fast, as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("prefixrt")

DEATH_FLUSH_S = 2.0  # after an engine death: how long in-flight error responses get before the server exits
ABORT_FLUSH_S = 5.0  # after a drain runs out: how long aborted requests get to send their errors


class Lifecycle:
    def __init__(self, drain_timeout: float = 30.0):
        self.drain_timeout = drain_timeout
        self.draining = False  # SIGTERM received: new requests are refused
        self.drain_expired = False  # the drain timeout ran out: what is left is being aborted
        self.engine_death: str | None = None  # why the engine process died
        self.in_flight = 0  # HTTP requests being served (the admission middleware counts them)
        self.exit_code = 0
        self.request_exit: Callable[[int], None] | None = None  # set by the launcher: stop serving, exit(code)
        self._engine_rids: dict[str, object] = {}  # engine request id -> the engine serving it
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ what routes and middleware call
    @property
    def refusal(self) -> str | None:
        """Why new requests are refused now, or None."""
        if self.engine_death is not None:
            return f"{self.engine_death}; the server is exiting"
        if self.draining:
            return "the server is shutting down and accepts no new requests"
        return None

    @contextlib.contextmanager
    def serving(self, engine, rids: list[str]) -> Iterator[None]:
        """Register engine request ids for the duration of the block (a drain that runs out aborts them)."""
        self.register(engine, rids)
        try:
            yield
        finally:
            self.release(rids)

    def register(self, engine, rids: list[str]) -> None:
        for r in rids:
            self._engine_rids[r] = engine
        if self.drain_expired:  # came in while the rest was being aborted
            for r in rids:
                engine.abort(r)

    def release(self, rids: list[str]) -> None:
        for r in rids:
            self._engine_rids.pop(r, None)

    # ------------------------------------------------------------------ drain
    async def drain(self) -> None:
        """Stop admission, wait for in-flight requests (up to drain_timeout), abort the rest, then exit 0."""
        if self.draining:
            return
        self.draining = True
        log.warning("shutting down: draining %d in-flight request(s) for up to %g s", self.in_flight,
                    self.drain_timeout)
        if not await self._wait_idle(self.drain_timeout):
            self.drain_expired = True
            log.warning("drain timeout: aborting %d request(s)", len(self._engine_rids))
            deadline = time.monotonic() + ABORT_FLUSH_S
            while self.in_flight and time.monotonic() < deadline:
                for rid, engine in list(self._engine_rids.items()):  # again and again: some may just be in
                    engine.abort(rid)
                await self._wait_idle(0.1)
        self._exit(0)

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # ------------------------------------------------------------------ engine death
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server runs on (engine_died schedules the exit there)."""
        self._loop = loop
        if self.engine_death is not None:  # died before the server was up
            loop.call_soon(lambda: asyncio.ensure_future(self._die()))

    def engine_died(self, reason: str) -> None:
        """Called from any thread. Refuse new requests at once; exit 1 once in-flight errors are out."""
        self.engine_death = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._die()))

    async def _die(self) -> None:
        log.error("%s: the server exits (a supervisor should restart it)", self.engine_death)
        await self._wait_idle(DEATH_FLUSH_S)
        self._exit(1)

    def _exit(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)
        if self.request_exit is not None:
            self.request_exit(self.exit_code)
