"""ProcessEngine: an Engine whose scheduler loop runs in a child process, behind a message boundary.

`prefixrt serve` uses it so that the HTTP server (parsing requests, encoding SSE, detokenizing) and the
scheduler loop (EngineCore.step) do not share one GIL, as vLLM V1's EngineCore process and SGLang's
scheduler process do. It has Engine's API: the caller-side half (tokenization, validation, Completion and
Chunk assembly, detokenization) is EngineAPI and runs in the server process; the child owns a full Engine.

    server process                                    engine process (child, spawned: process_child.py)
    ProcessEngine                                     EngineProcessServer around an Engine
      callers: tokenize, validate, send  --- Add / Abort / Call --->  main thread: receive, prepare, enqueue
      reader thread: outputs -> streams  <--- Outputs (one per step) --  scheduler thread: EngineCore.step
                                         <--- Reply -----------------  worker threads: blocking calls

The messages are the typed dataclasses of engine/process/messages.py (the whole wire protocol), pickled over a
multiprocessing Pipe.
A request with a constraint waits for the Reply to its Add (its grammar compiles in the child, on a compile
thread so the child keeps receiving, and may be invalid: InvalidRequest must reach the caller before anything
is streamed); any other request is fully validated in the server process and sent without waiting. An
Abort that arrives while its request's grammar still compiles aborts it as soon as it is in.

The child exits when the pipe closes, so it dies with the server process; it ignores SIGINT (Ctrl-C reaches
the whole process group) and SIGTERM, and stops on Shutdown. When the child dies on its own, the reader thread reaps it
(no zombie), finishes every in-flight request with finish_reason "abort" and an error naming the cause, fails
every pending call with EngineDeadError, and calls `on_death(reason)` (the server uses it to exit).

The heartbeat (every HEARTBEAT_S, with the loop's step count and whether it has work) lets `health()` tell a
stopped or hung engine from a busy one: unhealthy after `heartbeat_timeout_s` without a word (a stopped
process), or after `progress.stall_timeout_s` without a step while it has work (a hung kernel, a deadlock;
engine/progress.py). While it is unhealthy a watchdog finishes every in-flight request with finish_reason
"abort" and an error starting with ENGINE_UNRESPONSIVE, so no caller hangs; the engine process is left alone,
and the requests it still holds are aborted there once it answers again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixrt.default_models import BASE_MODEL
from prefixrt.engine.api import EngineAPI
from prefixrt.engine.process.child import child_main
from prefixrt.engine.process.messages import (
    Abort,
    Add,
    Beat,
    Bye,
    Call,
    EngineInfo,
    Failed,
    Outputs,
    PackedIds,
    Progress,
    Reply,
    Shutdown,
    pack_token_ids,
    packed_id_range,
    pickled,
)
from prefixrt.engine.process.pipe_writer import PipeWriter
from prefixrt.engine.progress import ProgressWatch
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.errors import ENGINE_UNRESPONSIVE, EngineDeadError, InvalidRequest
from prefixrt.lowering.json_schema import to_json_schema
from prefixrt.multimodal.messages import has_images
from prefixrt.outputs import Completion, EngineStats
from prefixrt.params import SamplingParams

log = logging.getLogger("prefixrt")

@dataclass
class _InFlight:
    stream: RequestStream
    unfinished: set[int] = field(default_factory=set)  # sample indexes without their final output yet


def import_tokenizer_classes() -> None:
    """Import transformers' tokenizer base classes, which unpickling the engine's tokenizer (ProcessEngine._ready)
    would import otherwise: seconds on some installs (transformers' package import), better spent while the engine
    process builds. A failure is left for the unpickling to report."""
    try:
        import transformers.tokenization_utils_tokenizers  # noqa: F401
    except Exception:
        pass


class ProcessEngine(EngineAPI):
    """`ProcessEngine(model, **engine_kwargs)`: Engine's API (generate, agenerate, stream, astream,
    cache_prefix, abort, stats, flush_cache, ...) with the engine in a child process. Blocks until the
    child has built the engine; `progress(text)` receives its start-up messages. Call shutdown() when done.

    `on_death`: called once (on the reader thread) with the reason if the engine process dies on its own.
    `heartbeat_timeout_s`: health() reports the engine process as unresponsive after this long without a word;
    `progress.stall_timeout_s`: ... and after this long without a loop step while it has work."""

    on_death: Callable[[str], None] | None = None
    heartbeat_timeout_s: float = 30.0
    watch_interval_s: float = 1.0  # how often the watchdog looks

    def __init__(self, model: str = BASE_MODEL, progress: Callable[[str], None] | None = None,
                 **engine_kwargs: Any):
        self._spawn(model, engine_kwargs)
        try:
            info = self._wait_ready(progress)
        except BaseException:
            self._stop_child(timeout=5)
            raise
        self._ready(info)

    @classmethod
    def start(cls, model: str = BASE_MODEL, progress: Callable[[str], None] | None = None,
              **engine_kwargs: Any) -> Callable[[], ProcessEngine]:
        """Start the engine process and return `ready()`, which waits for it and returns the ProcessEngine (or
        raises its start-up error). Meanwhile the caller does its own start-up (`prefixrt serve` imports its HTTP
        stack); `progress` receives the start-up messages as they come, on a thread that only reads the pipe.
        If the caller fails before ready(), `ready.cancel()` kills the engine process."""
        eng = cls.__new__(cls)
        eng._spawn(model, engine_kwargs)
        reading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixrt-engine-start")
        info = reading.submit(eng._wait_ready, progress)
        reading.shutdown(wait=False)

        def ready() -> ProcessEngine:
            try:
                import_tokenizer_classes()  # while the engine may still be building
                eng._ready(info.result())
            except BaseException:
                eng._stop_child(timeout=5)
                raise
            return eng

        def cancel() -> None:
            eng._proc.kill()
            eng._proc.join()
            eng._conn.close()

        ready.cancel = cancel
        return ready

    def _spawn(self, model: str, engine_kwargs: dict) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child_conn = ctx.Pipe()
        # Daemonic unless it starts tensor-parallel ranks of its own (a daemonic process may not have children).
        self._proc = ctx.Process(target=child_main, args=(child_conn, model, engine_kwargs),
                                 name="prefixrt-engine", daemon=engine_kwargs.get("tp_size", 1) == 1)
        self._proc.start()
        child_conn.close()  # the child's end lives in the child only: its exit closes the pipe

    def _ready(self, info: EngineInfo) -> None:
        """The rest of the constructor, once the engine process has said it is ready."""
        # Two copies of the tokenizer: one decodes outputs (on the event loop), one encodes prompts (on worker
        # threads), so a long encode never blocks a stream. Unpickling holds the GIL: done now, not while serving.
        self._tokenizer = pickle.loads(info.tokenizer)
        self._tok_lock = threading.Lock()
        self._encoder = pickle.loads(info.tokenizer)
        self._encode_lock = threading.Lock()
        for name, value in info.api_attributes().items():  # model_name, vocab_size, max_context, ...
            setattr(self, name, value)
        self._pipe = PipeWriter(self._conn)  # group commit; never blocks an event loop
        self._streams: dict[str, _InFlight] = {}  # written by callers, finished by the reader thread
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.death: str | None = None  # why the engine process died, if it died on its own
        self._stopping = False  # shutdown() was called: the child's exit is expected
        self._last_heard = time.monotonic()
        self.progress = ProgressWatch()  # fed by the heartbeats; its stall_timeout_s is the stall bound
        self._abandoned: set[str] = set()  # failed by the watchdog: aborted in the engine once it answers
        self._reader = threading.Thread(target=self._read_loop, name="prefixrt-engine-reader", daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, name="prefixrt-engine-watchdog", daemon=True)
        self._watchdog.start()

    def _wait_ready(self, progress) -> EngineInfo:
        while True:
            try:
                msg = self._conn.recv()
            except EOFError:
                self._proc.join(timeout=10)
                raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode}); "
                                   "its error is above") from None
            if isinstance(msg, Progress):
                if progress is not None:
                    progress(msg.text)
            elif isinstance(msg, Failed):
                raise msg.error
            else:
                return msg.info

    # ------------------------------------------------------------------ messages
    def _send(self, msg) -> None:
        try:
            data = pickled(msg)
        except (pickle.PicklingError, RecursionError, TypeError, AttributeError) as e:
            raise InvalidRequest(f"the request cannot be passed to the engine process: {type(e).__name__}: {e}"
                                 ) from None
        self._post(data)

    def _post(self, data: bytes, closing: bool = False) -> None:
        """Send a pickled message (engine/process/pipe_writer.py). closing: the Shutdown, which may follow a close."""
        self._pipe.post(data, closing)

    @property
    def _closed(self) -> str | None:
        """Why the engine no longer takes requests (None while it does)."""
        return self._pipe.closed

    def _ask(self, make_msg: Callable[[int], Any], timeout: float | None = None):
        """Send make_msg(call_id) and wait for the engine's Reply: its result, or its exception."""
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[call_id] = fut
        try:
            self._send(make_msg(call_id))
        except BaseException:
            self._replies.pop(call_id, None)
            raise
        if self._closed is not None:  # the reader may have failed the pending replies before ours was in
            self._replies.pop(call_id, None)
            raise EngineDeadError(self._closed)
        return fut.result(timeout=timeout)

    def _call_in_engine(self, name: str, *args, timeout: float | None = None):
        """Engine.<name>(*args), run in the engine process."""
        return self._ask(lambda call_id: Call(call_id, name, args), timeout=timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                self._last_heard = time.monotonic()
                if isinstance(msg, Beat):
                    self.progress.observe(msg.steps, msg.busy, self._last_heard)
                    continue
                if isinstance(msg, Outputs):
                    self._deliver(msg.items)
                elif isinstance(msg, Reply):
                    fut = self._replies.pop(msg.call_id, None)
                    if fut is not None and msg.ok:
                        fut.set_result(msg.value)
                    elif fut is not None:
                        fut.set_exception(msg.value)
                elif isinstance(msg, Bye):
                    break
        except (EOFError, OSError):
            pass
        if self._stopping:
            self._fail_all(self._closed or "engine is shut down")
            return
        self._proc.join(timeout=5)  # reap it: its exit code names the cause, and no zombie is left behind
        code = self._proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        reason = f"the engine process died ({how})"
        self.death = reason
        log.error("%s; failing every in-flight request", reason)
        if self.on_death is not None:  # first, so that whoever reads the failures below knows the cause
            try:
                self.on_death(reason)
            except Exception:
                log.exception("on_death callback failed")
        self._fail_all(reason)

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
                    self._streams.pop(rid, None)  # the watchdog may have failed it meanwhile
        RequestStream.push_many(pairs)  # one wake-up per event loop for the whole step

    def _fail_all(self, reason: str) -> None:
        """The child is gone: every waiting caller gets an error instead of waiting forever."""
        self._pipe.close(reason)
        self._fail_in_flight(reason)

    def _fail_in_flight(self, reason: str) -> list[str]:
        """Every pending call fails with EngineDeadError(reason) and every in-flight request finishes with
        finish_reason "abort" and `reason`; returns the request ids."""
        for fut in list(self._replies.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._replies.clear()
        pairs, rids = [], []
        for rid, entry in list(self._streams.items()):
            rids.append(rid)
            for i in sorted(entry.unfinished):
                pairs.append((entry.stream, StepOutput(index=i, token_ids=[], text=None, finished=True,
                                                       finish_reason="abort", error=reason)))
            self._streams.pop(rid, None)
        RequestStream.push_many(pairs)
        return rids

    def _watch(self) -> None:
        """While the engine is unresponsive (health()), fail what is in flight; once it answers again, abort
        there what was failed here."""
        while self._closed is None:
            time.sleep(self.watch_interval_s)
            reason = self.health()
            if self._closed is not None:
                return
            if reason is not None:
                if self._streams or self._replies:
                    log.error("%s; failing every in-flight request", reason)
                    self._abandoned.update(self._fail_in_flight(f"{ENGINE_UNRESPONSIVE}: {reason}"))
            elif self._abandoned:
                for rid in list(self._abandoned):
                    self._abandoned.discard(rid)
                    self.abort(rid)

    # ------------------------------------------------------------------ EngineAPI hooks
    def _submit(self, prompt, params, loop: asyncio.AbstractEventLoop | None = None, **req_fields):
        if req_fields:
            raise TypeError(f"ProcessEngine does not take {sorted(req_fields)}")
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        p = SamplingParams.coerce(params)
        images = list(prompt) if has_images(prompt) else None  # chat messages the engine process prepares
        if images is not None:
            if p.choices is not None:
                raise InvalidRequest("choices with images are not supported", param="choices")
            ids, packed = self.image_prompt_ids(images), b""
            self._validate_ids(ids, p)
        else:
            ids = self._tokenize(prompt)
            packed = _pack_if_int32(ids)  # what the Add carries; its id range is read off it, not scanned twice
            self._validate_ids(ids, p, packed_id_range(packed) if packed else None)
        if isinstance(p.json_schema, type):  # a pydantic class: send its schema, not the class
            p = dataclasses.replace(p, json_schema=to_json_schema(p.json_schema))
        rid = p.request_id or f"req-{uuid.uuid4().hex[:12]}"
        if rid in self._streams:
            raise InvalidRequest(f"request_id {rid!r} is already in flight", param="request_id")
        p = dataclasses.replace(p, request_id=rid)
        stream = RequestStream(loop)
        self._streams[rid] = _InFlight(stream, set(range(p.n)))  # before sending: outputs may come at once
        try:
            if images is not None or p.constraint_kind not in (None, "choices"):
                # compiles a constraint or decodes images in the child: wait for its verdict
                self._ask(lambda call_id: Add(call_id, rid, packed, p, images))
            else:
                self._send(Add(None, rid, packed, p))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return rid, stream, ids, p

    def image_prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._call_in_engine("image_prompt_ids", list(messages))

    def _select(self, prompt, p: SamplingParams) -> Completion:
        return self._call_in_engine("generate", prompt, p)

    # ------------------------------------------------------------------ public API (the rest is EngineAPI's)
    def health(self) -> str | None:
        """None while the engine process is alive and talking; else why not (cheap: no round trip)."""
        if self._closed is not None:
            return self._closed
        if not self._proc.is_alive():
            return f"the engine process died (exit code {self._proc.exitcode})"
        silent = time.monotonic() - self._last_heard
        if silent > self.heartbeat_timeout_s:
            return f"the engine process has not answered for {silent:.0f} s (stopped or hung)"
        return self.progress.stall()

    def abort(self, request_id: str) -> None:
        try:
            self._send(Abort(request_id))
        except EngineDeadError:
            pass  # nothing runs any more

    def cache_prefix(self, prompt, cache_salt: str | None = None, lora: str | None = None) -> int:
        """Prefill prompt into the radix cache without generating. Returns how many of its tokens are cached."""
        return self._call_in_engine("cache_prefix", prompt, cache_salt, lora)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Engine.load_lora_adapter, in the engine process (reads the folder there)."""
        self._call_in_engine("load_lora_adapter", name, str(path), timeout=600)

    def unload_lora_adapter(self, name: str) -> None:
        self._call_in_engine("unload_lora_adapter", name, timeout=60)

    def lora_adapters(self) -> list[str]:
        return self._call_in_engine("lora_adapters", timeout=60)

    def stats(self) -> EngineStats:
        return self._call_in_engine("stats", timeout=60)

    def score_continuations(self, prompt, continuations: list[list[int]], cache_salt: str | None = None,
                            lora: str | None = None):
        """Engine.score_continuations, in the engine process."""
        return self._call_in_engine("score_continuations", prompt, continuations, cache_salt, lora)

    def largest_prefixes(self, max_nodes: int = 40) -> list[dict]:
        """Engine.largest_prefixes, computed in the engine process."""
        return self._call_in_engine("largest_prefixes", max_nodes, timeout=60)

    def flush_cache(self) -> None:
        self._call_in_engine("flush_cache", timeout=60)

    def check_integrity(self) -> None:
        """Debug: verify KV accounting now (in the engine process)."""
        self._call_in_engine("check_integrity", timeout=60)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is waiting or running."""
        self._call_in_engine("wait_idle", timeout, timeout=timeout + 10)

    def render_metrics(self) -> bytes:
        """The engine's Prometheus metrics (text format), rendered in the engine process where the latency
        histograms are observed."""
        return self._call_in_engine("render_metrics", timeout=60)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is running, stop the engine process and wait for it to exit."""
        self._stop_workers()
        if self._closed is not None and not self._proc.is_alive():
            self._proc.join(timeout=1)
            return
        self._stopping = True
        try:
            self._post(pickled(Shutdown()), closing=True)
        except EngineDeadError:
            pass
        self._reader.join(timeout=timeout)
        self._stop_child(timeout)
        self._pipe.stop()
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


def _pack_if_int32(ids: list[int]) -> bytes | None:
    """pack_token_ids(ids) (a PackedIds' own bytes), or None for an id beyond int32 (outside any vocabulary:
    _validate_ids names it)."""
    if type(ids) is PackedIds:
        return ids.packed
    try:
        return pack_token_ids(ids)
    except OverflowError:
        return None


