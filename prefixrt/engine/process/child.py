"""The engine process's side of a ProcessEngine: builds the Engine, then serves it over the pipe.

`child_main` is the spawned process's entry point. EngineProcessServer receives messages (engine/process/messages.py)
on the main thread, compiles constrained requests on compile threads (so a slow grammar never holds up
other messages), runs blocking calls on worker threads, streams each scheduler step's outputs as one
Outputs message from the scheduler thread (PipeEnd.deliver, the loop's delivery hook), and sends a Beat every HEARTBEAT_S.
Requests reach the engine through its public Engine.prepare / Engine.enqueue, with a PipeSink as the sink.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixrt.engine.process import messages as wire
from prefixrt.engine.stream import RequestStream, StepOutput

log = logging.getLogger("prefixrt")


@dataclass
class PipeSink:
    """A request's output sink in the engine process: its outputs go to the server process."""

    request_id: str


def child_main(conn, model: str, engine_kwargs: dict) -> None:
    # The server process decides when the engine stops: Ctrl-C and a supervisor's SIGTERM reach the whole
    # process group (systemd signals the whole cgroup), and the server must drain before the engine goes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from prefixrt.engine.engine import Engine

    pipe = PipeEnd(conn)
    try:
        engine = Engine(model, progress=lambda text: pipe.send(wire.Progress(text)), _deliver=pipe.deliver, **engine_kwargs)
    except BaseException as e:
        pipe.send(wire.Failed(wire.picklable(e)))
        return
    EngineProcessServer(engine, pipe).run()


class PipeEnd:
    """The engine process's end of the pipe: every thread sends through it (one lock), and its deliver is the
    loop's delivery hook (LoopHooks.deliver), given to the Engine when it is built."""

    def __init__(self, conn):
        self.conn = conn
        self.send_lock = threading.Lock()  # the main, scheduler, worker and heartbeat threads all send

    def send(self, msg) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def deliver(self, items: list[tuple[Any, StepOutput]]) -> None:
        """One message per step for the server's requests; the engine process's own requests (the choices
        scoring and cache_prefix calls) stay local."""
        local = [(sink, out) for sink, out in items if not isinstance(sink, PipeSink)]
        remote = [(sink.request_id, out) for sink, out in items if isinstance(sink, PipeSink)]
        if local:
            RequestStream.push_many(local)
        if remote:
            try:
                self.send(wire.Outputs(remote))
            except OSError:
                pass  # the server process is gone; the main thread is shutting down


class EngineProcessServer:
    """The engine process's side: receives requests on the main thread, streams outputs from the scheduler
    thread, runs blocking calls on worker threads."""

    def __init__(self, engine, pipe: PipeEnd):
        self.engine, self.pipe = engine, pipe
        self.workers = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="prefixrt-engine-call")
        # Constrained adds compile their grammar here, so a slow compile never holds up other messages.
        self.compilers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="prefixrt-engine-compile")
        self.compiling: dict[str, bool] = {}  # request id -> aborted while compiling
        self.compiling_lock = threading.Lock()
        self.stopped = threading.Event()
        self.metrics = _metrics_for(engine)
        self.calls: dict[str, Callable] = {
            "stats": engine.stats, "flush_cache": engine.flush_cache, "cache_prefix": engine.cache_prefix,
            "generate": engine.generate, "check_integrity": engine.check_integrity,
            "wait_idle": engine.wait_idle, "render_metrics": self.render_metrics,
            "score_continuations": engine.score_continuations,
            "largest_prefixes": engine.largest_prefixes, "image_prompt_ids": engine.image_prompt_ids,
            "load_lora_adapter": engine.load_lora_adapter, "unload_lora_adapter": engine.unload_lora_adapter,
            "lora_adapters": engine.lora_adapters,
        }

    def send(self, msg) -> None:
        self.pipe.send(msg)

    def run(self) -> None:
        eng = self.engine
        info = wire.EngineInfo.of(eng)
        try:
            self.send(wire.Ready(info))
            threading.Thread(target=self.heartbeat, name="prefixrt-engine-heartbeat", daemon=True).start()
            while True:
                msg = self.pipe.conn.recv()
                if isinstance(msg, wire.Shutdown):
                    break
                self.handle(msg)
        except _ShutdownRequested:
            pass
        except (EOFError, OSError):
            pass  # the server process is gone
        finally:
            self.stopped.set()
            eng.shutdown()
            self.workers.shutdown(wait=False, cancel_futures=True)
            self.compilers.shutdown(wait=False, cancel_futures=True)
            try:
                self.send(wire.Bye())
            except OSError:
                pass

    def heartbeat(self) -> None:
        core = self.engine.core
        while not self.stopped.wait(wire.HEARTBEAT_S):
            try:
                self.send(wire.Beat(core.steps_done, core.has_work))
            except OSError:
                return

    def handle(self, msg) -> None:
        if isinstance(msg, wire.Batch):
            for part in msg.parts:
                try:
                    inner = pickle.loads(part)
                except Exception:
                    log.exception("engine process: a message of a batch cannot be unpickled")
                    continue
                if isinstance(inner, wire.Shutdown):
                    raise _ShutdownRequested()
                self.handle(inner)
        elif isinstance(msg, wire.Add):
            if msg.call_id is None:
                self.add(msg)
            else:  # a constraint to compile: off the receiving thread
                with self.compiling_lock:
                    self.compiling[msg.request_id] = False
                self.compilers.submit(self.add, msg)
        elif isinstance(msg, wire.Abort):
            with self.compiling_lock:
                if msg.request_id in self.compiling:
                    self.compiling[msg.request_id] = True
                    return
            self.engine.abort(msg.request_id)
        elif isinstance(msg, wire.Call):
            self.workers.submit(self.run_call, msg)
        else:
            log.error("engine process: unknown message %r", type(msg).__name__)

    def add(self, msg: wire.Add) -> None:
        rid, call_id = msg.request_id, msg.call_id
        try:
            prepared = (self.engine.prepare(msg.messages, msg.params) if msg.messages is not None
                        else self.engine.prepare_packed(msg.packed_prompt_ids, msg.params))
            self.engine.enqueue(prepared, PipeSink(rid))
        except Exception as e:
            with self.compiling_lock:
                self.compiling.pop(rid, None)
            if call_id is not None:
                self.send(wire.Reply(call_id, False, wire.picklable(e)))
            else:  # validated in the server already, so this is a bug: end the request with its error
                self.send(wire.Outputs([(rid, StepOutput(index=i, token_ids=[], text=None, finished=True,
                                                         finish_reason="abort", error=f"internal error: {e}"))
                                        for i in range(msg.params.n)]))
            return
        with self.compiling_lock:
            aborted = self.compiling.pop(rid, False)
        if aborted:
            self.engine.abort(rid)
        if call_id is not None:
            self.send(wire.Reply(call_id, True, None))

    def run_call(self, msg: wire.Call) -> None:
        try:
            reply = wire.Reply(msg.call_id, True, self.calls[msg.name](*msg.args))
        except BaseException as e:
            reply = wire.Reply(msg.call_id, False, wire.picklable(e))
        try:
            self.send(reply)
        except OSError:
            pass

    def render_metrics(self) -> bytes:
        if self.metrics is None:
            raise RuntimeError("metrics need prometheus-client (pip install 'prefixrt[server]')")
        return self.metrics.render()


class _ShutdownRequested(Exception):
    """A Shutdown inside a Batch: ends the receiving loop as a Shutdown on its own does."""


def _metrics_for(engine):
    """The engine's Prometheus metrics, installed at start so the latency histograms see every request."""
    try:
        from prefixrt.engine.metrics import Metrics
    except ImportError:
        return None
    return Metrics.for_engine(engine)
