"""httpx transports that call an ASGI app in-process (no sockets), streaming the response body as the app
produces it. httpx's own ASGITransport buffers the whole body, which would turn a stream into one late blob.

- `AsyncASGIStreamTransport`: runs the app as a task on the caller's event loop.
- `SyncASGIStreamTransport`: runs the app on a private event-loop thread and hands body chunks to the
  calling thread through a queue.
Closing a response early (breaking out of a stream) delivers `http.disconnect` to the app, which aborts the
request exactly as a dropped TCP connection does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable

import httpx

_END = object()


def _scope(request: httpx.Request) -> dict:
    url = request.url
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": url.scheme, "path": url.path, "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query, "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "client": ("127.0.0.1", 0), "server": (url.host, url.port or 80),
    }


class _Exchange:
    """One request/response with the app, on the loop it runs on. on_start(status, headers) and
    on_body(bytes | _END | Exception) are called from that loop."""

    def __init__(self, app, request: httpx.Request, body: bytes, on_start: Callable, on_body: Callable):
        self.app, self.scope, self.body = app, _scope(request), body
        self.on_start, self.on_body = on_start, on_body
        self.disconnected: asyncio.Event | None = None
        self.started = False

    async def run(self) -> None:
        self.disconnected = asyncio.Event()
        sent_request = False

        async def receive():
            nonlocal sent_request
            if not sent_request:
                sent_request = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                self.started = True
                self.on_start(message["status"], message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    self.on_body(bytes(message["body"]))
                if not message.get("more_body", False):
                    self.on_body(_END)

        try:
            await self.app(self.scope, receive, send)
        except BaseException as e:
            if not self.started:
                self.on_start(None, e)
            else:
                self.on_body(e if isinstance(e, Exception) else _END)
            if not isinstance(e, Exception):
                raise
        else:
            if not self.started:
                self.on_start(None, RuntimeError("the app sent no response"))
        finally:
            self.on_body(_END)

    def disconnect(self) -> None:
        if self.disconnected is not None:
            self.disconnected.set()


def _chunk(body, item) -> bytes | None:
    """An item from the exchange's queue as a body yields it: the bytes, or None at the end (body.ended set);
    an exception from the app ends the body as a read error."""
    if item is _END:
        body.ended = True
        return None
    if isinstance(item, Exception):
        body.ended = True
        raise httpx.ReadError(str(item)) from item
    return item


# ---------------------------------------------------------------------------------------------- async
class _AsyncBody(httpx.AsyncByteStream):
    def __init__(self, chunks: asyncio.Queue, exchange: _Exchange, task: asyncio.Task):
        self.chunks, self.exchange, self.task = chunks, exchange, task
        self.ended = False

    async def __aiter__(self):
        while not self.ended:
            chunk = _chunk(self, await self.chunks.get())
            if chunk is not None:
                yield chunk

    async def aclose(self) -> None:
        self.exchange.disconnect()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=10)
        except (asyncio.TimeoutError, Exception):
            pass


class AsyncASGIStreamTransport(httpx.AsyncBaseTransport):
    def __init__(self, app, on_close: Callable[[], None] | None = None):
        self.app = app
        self.on_close = on_close

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        loop = asyncio.get_running_loop()
        start: asyncio.Future = loop.create_future()
        chunks: asyncio.Queue = asyncio.Queue()

        def on_start(status, headers):
            if not start.done():
                start.set_result((status, headers))

        ex = _Exchange(self.app, request, body, on_start, chunks.put_nowait)
        task = asyncio.ensure_future(ex.run())
        status, headers = await start
        if status is None:
            raise httpx.ConnectError(f"in-process app failed: {headers!r}") from headers
        return httpx.Response(status, headers=headers, stream=_AsyncBody(chunks, ex, task), request=request)

    async def aclose(self) -> None:
        if self.on_close is not None:
            self.on_close()


# ---------------------------------------------------------------------------------------------- sync
class _LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prefixrt-shim-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class _SyncBody(httpx.SyncByteStream):
    def __init__(self, chunks: queue.Queue, exchange: _Exchange, fut: concurrent.futures.Future, lt: _LoopThread):
        self.chunks, self.exchange, self.fut, self.lt = chunks, exchange, fut, lt
        self.ended = False

    def __iter__(self):
        while not self.ended:
            chunk = _chunk(self, self.chunks.get())
            if chunk is not None:
                yield chunk

    def close(self) -> None:
        self.lt.loop.call_soon_threadsafe(self.exchange.disconnect)
        try:
            self.fut.result(timeout=10)
        except Exception:
            pass


class SyncASGIStreamTransport(httpx.BaseTransport):
    def __init__(self, app, on_close: Callable[[], None] | None = None):
        self.app = app
        self.on_close = on_close
        self.lt = _LoopThread()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        start: concurrent.futures.Future = concurrent.futures.Future()
        chunks: queue.Queue = queue.Queue()

        def on_start(status, headers):
            if not start.done():
                start.set_result((status, headers))

        ex = _Exchange(self.app, request, body, on_start, chunks.put)
        fut = self.lt.submit(ex.run())
        status, headers = start.result()
        if status is None:
            raise httpx.ConnectError(f"in-process app failed: {headers!r}") from headers
        return httpx.Response(status, headers=headers, stream=_SyncBody(chunks, ex, fut, self.lt), request=request)

    def close(self) -> None:
        self.lt.stop()
        if self.on_close is not None:
            self.on_close()
