"""ProcessEngine: an Engine whose scheduler loop runs in a child process, behind a message boundary.

`prefixrt serve` uses it so that the HTTP server (parsing requests, encoding SSE, detokenizing) and the
scheduler loop (EngineCore.step) do not share one GIL, as vLLM V1's EngineCore process and SGLang's
scheduler process do. It has Engine's API: the caller-side half (tokenization, validation, Completion and
Chunk assembly, detokenization) is EngineFront and runs in the server process; the child owns a full Engine.

    server process                                    engine process (child, spawned)
    ProcessEngine                                     _EngineServer around an Engine
      callers: tokenize, validate, send  --- add / abort / call --->  main thread: receive, submit
      reader thread: outputs -> streams  <--- out (one per step) ---  scheduler thread: EngineCore.step
                                         <--- reply -----------------  worker threads: blocking calls

Messages are pickled tuples over a multiprocessing Pipe:
  server -> engine   ("add", call_id | None, request_id, prompt_ids, SamplingParams)
                     ("abort", request_id)
                     ("call", call_id, name, args)     a blocking Engine method (stats, cache_prefix, ...)
                     ("shutdown",)
  engine -> server   ("progress", text), then ("ready", info) or ("failed", exception)      start-up
                     ("out", [(request_id, StepOutput), ...])     all outputs of one scheduler step
                     ("reply", call_id, ok, result or exception)
                     ("bye",)                                      after shutdown
A request with a constraint waits for the reply to its "add" (its grammar compiles in the child and may be
invalid: InvalidRequest must reach the caller before anything is streamed); any other request is fully
validated in the server process and sent without waiting. The child exits when the pipe closes, so it dies
with the server process; it ignores SIGINT (Ctrl-C reaches the whole process group) and stops on "shutdown".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import pickle
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixrt.engine.front import EngineFront
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.json_schema import to_json_schema
from prefixrt.outputs import Completion, EngineStats
from prefixrt.params import SamplingParams


@dataclass
class _InFlight:
    stream: RequestStream
    unfinished: set[int] = field(default_factory=set)  # sample indexes without their final output yet


class ProcessEngine(EngineFront):
    """`ProcessEngine(model, **engine_kwargs)`: Engine's API (generate, agenerate, stream, astream,
    cache_prefix, abort, stats, flush_cache, ...) with the engine in a child process. Blocks until the
    child has built the engine; `progress(text)` receives its start-up messages. Call shutdown() when done."""

    def __init__(self, model: str = "gemma-3-270m", progress: Callable[[str], None] | None = None,
                 **engine_kwargs: Any):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child_conn, model, engine_kwargs),
                                 name="prefixrt-engine", daemon=True)
        self._proc.start()
        child_conn.close()  # the child's end lives in the child only: its exit closes the pipe
        try:
            info = self._wait_ready(progress)
        except BaseException:
            self._stop_child(timeout=5)
            raise
        self._tokenizer = info["tokenizer"]
        self._tok_lock = threading.Lock()
        self.model_name = info["model_name"]
        self.model_revision = info["model_revision"]
        self.vocab_size = info["vocab_size"]
        self.max_context = info["max_context"]
        self.kv_total_tokens = info["kv_total_tokens"]
        self.page_size = info["page_size"]
        self.device = info["device"]
        self._send_lock = threading.Lock()
        self._streams: dict[str, _InFlight] = {}  # written by callers, finished by the reader thread
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closed: str | None = None  # why the engine no longer takes requests
        self._reader = threading.Thread(target=self._read_loop, name="prefixrt-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, progress) -> dict:
        while True:
            try:
                kind, payload = self._conn.recv()
            except EOFError:
                self._proc.join(timeout=10)
                raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode}); "
                                   "its error is above") from None
            if kind == "progress":
                if progress is not None:
                    progress(payload)
            elif kind == "failed":
                raise payload
            else:
                return payload

    # ------------------------------------------------------------------ messages
    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            try:
                self._conn.send(msg)
            except OSError as e:
                raise EngineDeadError(f"the engine process is gone: {e}") from e

    def _ask(self, kind: str, *payload, timeout: float | None = None):
        """Send (kind, call_id, *payload) and wait for the engine's reply: its result, or its exception."""
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[call_id] = fut
        try:
            self._send((kind, call_id, *payload))
        except BaseException:
            self._replies.pop(call_id, None)
            raise
        if self._closed is not None:  # the reader may have failed the pending replies before ours was in
            self._replies.pop(call_id, None)
            raise EngineDeadError(self._closed)
        return fut.result(timeout=timeout)

    def _call(self, name: str, *args, timeout: float | None = None):
        """Engine.<name>(*args), run in the engine process."""
        return self._ask("call", name, args, timeout=timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "out":
                    self._deliver(msg[1])
                elif kind == "reply":
                    _, call_id, ok, value = msg
                    fut = self._replies.pop(call_id, None)
                    if fut is not None and ok:
                        fut.set_result(value)
                    elif fut is not None:
                        fut.set_exception(value)
                elif kind == "bye":
                    break
        except (EOFError, OSError):
            pass
        self._fail_all(self._closed or f"the engine process died (exit code {self._proc.exitcode})")

    def _deliver(self, items: list[tuple[str, StepOutput]]) -> None:
        pairs = []
        for rid, out in items:
            entry = self._streams.get(rid)
            if entry is None:
                continue
            pairs.append((entry.stream, out))
            if out.finished:
                entry.unfinished.discard(out.index)
                if not entry.unfinished:
                    del self._streams[rid]
        RequestStream.push_many(pairs)  # one wake-up per event loop for the whole step

    def _fail_all(self, reason: str) -> None:
        """The child is gone: every waiting caller gets an error instead of waiting forever."""
        with self._send_lock:
            self._closed = self._closed or reason
        for fut in list(self._replies.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._replies.clear()
        pairs = []
        for entry in list(self._streams.values()):
            for i in sorted(entry.unfinished):
                pairs.append((entry.stream, StepOutput(index=i, token_ids=[], text=None, finished=True,
                                                       finish_reason="abort", error=reason)))
        self._streams.clear()
        RequestStream.push_many(pairs)

    # ------------------------------------------------------------------ EngineFront hooks
    def _submit(self, prompt, params, loop: asyncio.AbstractEventLoop | None = None, **req_fields):
        if req_fields:
            raise TypeError(f"ProcessEngine does not take {sorted(req_fields)}")
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        p = SamplingParams.coerce(params)
        ids = self._tokenize(prompt)
        self._validate_ids(ids, p)
        if isinstance(p.json_schema, type):  # a pydantic class: send its schema, not the class
            p = dataclasses.replace(p, json_schema=to_json_schema(p.json_schema))
        rid = p.request_id or f"req-{uuid.uuid4().hex[:12]}"
        if rid in self._streams:
            raise InvalidRequest(f"request_id {rid!r} is already in flight", param="request_id")
        p = dataclasses.replace(p, request_id=rid)
        stream = RequestStream(loop)
        self._streams[rid] = _InFlight(stream, set(range(p.n)))  # before sending: outputs may come at once
        try:
            if p.constraint_kind not in (None, "choices"):
                self._ask("add", rid, ids, p)  # the grammar compiles in the child: wait for its verdict
            else:
                self._send(("add", None, rid, ids, p))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return rid, stream, ids, p

    def _select(self, prompt, p: SamplingParams) -> Completion:
        return self._call("generate", prompt, p)

    # ------------------------------------------------------------------ public API (the rest is EngineFront's)
    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass  # nothing runs any more

    def cache_prefix(self, prompt, cache_salt: str | None = None) -> int:
        """Prefill prompt into the radix cache without generating. Returns how many of its tokens are cached."""
        return self._call("cache_prefix", prompt, cache_salt)

    def stats(self) -> EngineStats:
        return self._call("stats", timeout=60)

    def flush_cache(self) -> None:
        self._call("flush_cache", timeout=60)

    def check_integrity(self) -> None:
        """Debug: verify KV accounting now (in the engine process)."""
        self._call("check_integrity", timeout=60)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is waiting or running."""
        self._call("wait_idle", timeout, timeout=timeout + 10)

    def render_metrics(self) -> bytes:
        """The engine's Prometheus metrics (text format), rendered in the engine process where the latency
        histograms are observed."""
        return self._call("render_metrics", timeout=60)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is running, stop the engine process and wait for it to exit."""
        with self._send_lock:
            if self._closed is not None and not self._proc.is_alive():
                return
            try:
                self._conn.send(("shutdown",))
            except OSError:
                pass
            self._closed = self._closed or "engine is shut down"
        self._reader.join(timeout=timeout)
        self._stop_child(timeout)
        self._conn.close()

    def _stop_child(self, timeout: float) -> None:
        self._proc.join(timeout=timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


# ---------------------------------------------------------------------------------------------- the child
@dataclass
class _PipeSink:
    """A request's output sink in the engine process: its outputs go to the server process."""

    request_id: str


def _child_main(conn, model: str, engine_kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when the engine stops
    from prefixrt.engine.engine import Engine

    try:
        engine = Engine(model, progress=lambda text: conn.send(("progress", text)), **engine_kwargs)
    except BaseException as e:
        conn.send(("failed", _picklable(e)))
        return
    _EngineServer(engine, conn).run()


class _EngineServer:
    """The engine process's side: receives requests on the main thread, streams outputs from the scheduler
    thread, runs blocking calls on worker threads."""

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self.send_lock = threading.Lock()  # the main, scheduler and worker threads all send
        self.workers = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="prefixrt-engine-call")
        self.metrics = _metrics_for(engine)
        engine.core.deliver = self.deliver
        self.calls: dict[str, Callable] = {
            "stats": engine.stats, "flush_cache": engine.flush_cache, "cache_prefix": engine.cache_prefix,
            "generate": engine.generate, "check_integrity": engine.check_integrity,
            "wait_idle": engine.wait_idle, "render_metrics": self.render_metrics,
        }

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def deliver(self, items: list[tuple[Any, StepOutput]]) -> None:
        """EngineCore.deliver: one message per step for the server's requests; the engine process's own
        requests (the choices scoring and cache_prefix calls) stay local."""
        local = [(sink, out) for sink, out in items if not isinstance(sink, _PipeSink)]
        remote = [(sink.request_id, out) for sink, out in items if isinstance(sink, _PipeSink)]
        if local:
            RequestStream.push_many(local)
        if remote:
            try:
                self.send(("out", remote))
            except OSError:
                pass  # the server process is gone; the main thread is shutting down

    def run(self) -> None:
        eng = self.engine
        info = {"model_name": eng.model_name, "model_revision": eng.model_revision, "vocab_size": eng.vocab_size,
                "max_context": eng.max_context, "kv_total_tokens": eng.kv_total_tokens,
                "page_size": eng.page_size, "device": str(eng.device), "tokenizer": eng.tokenizer}
        try:
            self.send(("ready", info))
            while True:
                msg = self.conn.recv()
                if msg[0] == "shutdown":
                    break
                self.handle(msg)
        except (EOFError, OSError):
            pass  # the server process is gone
        finally:
            eng.shutdown()
            self.workers.shutdown(wait=False, cancel_futures=True)
            try:
                self.send(("bye",))
            except OSError:
                pass

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, call_id, rid, ids, params = msg
            try:
                self.engine._submit(ids, params, sink=_PipeSink(rid))
            except Exception as e:
                if call_id is not None:
                    self.send(("reply", call_id, False, _picklable(e)))
                else:  # validated in the server already, so this is a bug: end the request with its error
                    self.send(("out", [(rid, StepOutput(index=i, token_ids=[], text=None, finished=True,
                                                        finish_reason="abort", error=str(e)))
                                       for i in range(params.n)]))
                return
            if call_id is not None:
                self.send(("reply", call_id, True, None))
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "call":
            self.workers.submit(self.run_call, *msg[1:])

    def run_call(self, call_id: int, name: str, args: tuple) -> None:
        try:
            result = self.calls[name](*args)
        except BaseException as e:
            reply = ("reply", call_id, False, _picklable(e))
        else:
            reply = ("reply", call_id, True, result)
        try:
            self.send(reply)
        except OSError:
            pass

    def render_metrics(self) -> bytes:
        if self.metrics is None:
            raise RuntimeError("metrics need prometheus-client (pip install 'prefixrt[server]')")
        return self.metrics.render()


def _metrics_for(engine):
    """The engine's Prometheus metrics, installed at start so the latency histograms see every request."""
    try:
        from prefixrt.engine.metrics import Metrics
    except ImportError:
        return None
    return Metrics.for_engine(engine)


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
