"""Transport helpers: JSON that never fails on non-finite floats, server-sent events, several streams merged as
their items arrive, and disconnect handling.

A client that goes away aborts its request: streaming responses listen for `http.disconnect` next to the
stream and cancel it (the engine's stream iterator aborts on cancellation); non-streaming handlers race the
generation against the disconnect (`until_disconnect`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (-1e30 if obj < 0 else 1e30)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON; -inf logprobs (masked tokens) become -1e30 rather than invalid JSON. Text that cannot be
    encoded as UTF-8 (a lone surrogate echoed from a bad request) is written with \\u escapes."""
    try:
        out = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        obj = _finite(obj)
        out = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    if not out.isascii():
        try:
            out.encode("utf-8")
        except UnicodeEncodeError:
            out = json.dumps(obj, ensure_ascii=True, allow_nan=False)
    return out


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """SSE response that stops (and calls on_close) as soon as the client disconnects, whatever the ASGI
    spec version of the server (Starlette only listens for disconnects below spec 2.4)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        except OSError:  # the socket is gone
            pass
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:
                        pass
            if self.on_close is not None:
                self.on_close()


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its request has been aborted)."""


async def until_disconnect(request: Request, coro) -> Any:
    """Await coro, cancelling it if the client disconnects first (cancellation aborts the engine request)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def merge_streams(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from several async iterators as items arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k, it):
        try:
            async for item in it:
                await queue.put((k, item))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, it)) for k, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
