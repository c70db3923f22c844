"""EngineProbes: what a benchmark may observe of a running Engine, and the few switches it may flip, as one small
public surface (`Engine.probes`; docs/api.md "Probes"). Benchmarks use this and nothing below it.

    forward_counts()        forwards so far by how they ran: decode / cascade / extend / verify graph, or eager
    time_units(...)         a context: wall (or thread CPU) seconds spent in each loop unit, and in fence waits
    log_forwards()          a context: one row per forward (how it ran, tokens, sequences, device and wall ms)
    time_masks(...)         a context: seconds spent filling grammar masks (on the mask worker, and finishing them
                            at the draw), and rows filled
    hold_loop()             a context: the loop held between steps, so requests submitted meanwhile start together
    profile_loop()          a context: cProfile of the loop thread
    replace_forward(fn)     the model's forward replaced by fn(ForwardBatch) -> logits (host-work benchmarks);
                            restore_forward() undoes it
    set_overlap(on)         the overlapped or the synchronous loop, switched between steps
    set_cascade(on)         shared-prefix (cascade) decode groups off or back on (an engine built with them)
    set_mask_threads(n)     the grammar backend's threads for filling masks
    set_mask_parts(n)       the parts a step's masks are submitted in while the step before is post-processed
    facts()                 device, dtype, KV dtype, CUDA graphs and cascade on or not, the start-up report
    model                   the loaded model (read its shape; do not change it)
    decode_graph(bs)        the captured CUDA decode graph of batch bucket bs (replay it alone to time the device)

Everything that touches the loop's objects runs on the loop thread, between steps; the contexts install their
instruments on entry and remove them on exit, so an engine with no probe open runs exactly its normal code. The
instruments shadow a loop unit with a timed wrapper (the loop looks its units up on every call): cheap, but not
free, so figures taken inside time_units() or log_forwards() include a few microseconds per unit. Nothing here
changes what the engine computes: greedy outputs are the same with any probe open and either switch position.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixrt.engine.engine import Engine

# The loop units of engine/loop/core.py that time_units() can time: the synchronous loop runs schedule, forward
# (= build + launch), sample (= prepare_sample + draw) and process; the overlapped loop runs the parts.
LOOP_UNITS = ("schedule", "build", "draw", "launch", "process", "prepare_sample")


class UnitTimes:
    """Seconds spent in each loop unit while its time_units() context was open (`seconds[unit]`, `calls[unit]`),
    plus `wait`: the time the host waited for the device at step fences (inside process), when asked for. With
    record_calls, `records` holds one dict per call: `unit`, `wall_s`, `cpu_s` (the loop thread's CPU time),
    `extend_rows` and `decode_rows` (the batch's rows feeding more than one token / one token; 0 and 0 when the
    call had no batch)."""

    def __init__(self, units: tuple[str, ...], fence_wait: bool, record_calls: bool):
        self.units = units
        self.seconds = dict.fromkeys(units + (("wait",) if fence_wait else ()), 0.0)
        self.calls = dict.fromkeys(units, 0)
        self.records: list[dict] | None = [] if record_calls else None

    def per_step_ms(self, steps: int) -> dict:
        """Milliseconds per step of each unit and of the fence wait, and `host_ms`: the units' sum less the wait."""
        out = {k: round(v / steps * 1000, 3) for k, v in self.seconds.items()}
        out["host_ms"] = round(sum(self.seconds[u] for u in self.units) / steps * 1000 - out.get("wait", 0.0), 3)
        return out


class MaskTimes:
    """Grammar mask work while its time_masks() context was open: `fill_s` (the backend's native fill, on the mask
    worker), `finish_s` (its Python part, at the draw on the loop thread), `fills` (calls) and `rows` (rows filled)."""

    def __init__(self):
        self.fill_s = self.finish_s = 0.0
        self.fills = self.rows = 0


class ForwardLog:
    """One row per forward while its log_forwards() context was open: `kind` (how it ran: decode / cascade / extend
    / verify graph, or eager), `tokens`, `seqs`, `device_ms` (CUDA events around the forward; 0 on the CPU) and
    `wall_ms` (launch to the next launch; None for the last). Rows are complete once the context has exited."""

    def __init__(self):
        self.rows: list[dict] = []

    def summary(self) -> list[dict]:
        """The rows grouped by kind and by token count (rounded up to a power of two): count and means."""
        groups: dict = {}
        for r in self.rows:
            b = 1 << max(0, (r["tokens"] - 1)).bit_length()
            groups.setdefault((r["kind"], b), []).append(r)
        out = []
        for (kind, b), rs in sorted(groups.items()):
            walls = [r["wall_ms"] for r in rs if r["wall_ms"] is not None]
            out.append({"kind": kind, "tokens_le": b, "count": len(rs),
                        "mean_tokens": round(sum(r["tokens"] for r in rs) / len(rs), 1),
                        "mean_seqs": round(sum(r["seqs"] for r in rs) / len(rs), 1),
                        "device_ms": round(sum(r["device_ms"] for r in rs) / len(rs), 3),
                        "wall_ms": round(sum(walls) / len(walls), 3) if walls else None})
        return out


def _rows(out, args) -> dict:
    """The composition of the batch a unit call returned or was given (a ScheduledBatch, or a Step holding one)."""
    for x in (out, *args):
        batch = getattr(x, "batch", x)
        num_tokens = getattr(batch, "num_tokens", None)
        if num_tokens is not None:
            extend = sum(1 for n in num_tokens if n > 1)
            return {"extend_rows": extend, "decode_rows": len(num_tokens) - extend}
    return {"extend_rows": 0, "decode_rows": 0}


class HeldLoop:
    """The loop held between two steps by EngineProbes.hold_loop(): requests submitted meanwhile wait in the inbox
    and reach the loop together when the hold ends."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def wait_queued(self, count: int, timeout: float = 60.0) -> bool:
        """Wait until `count` messages (one per submitted request) wait for the loop; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._engine._inbox.qsize() < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


class EngineProbes:
    """See the module docstring. Built by Engine.probes; holds the engine, nothing else."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._saved_grouper = None  # set_cascade(False) keeps the grouper here until set_cascade(True)

    def _on_loop(self, fn, timeout: float | None = 60.0):
        return self._engine._run_on_loop(fn, timeout)

    @property
    def _core(self):
        return self._engine.core

    # ------------------------------------------------------------------ reading
    def forward_counts(self) -> dict[str, int]:
        """Forwards since start-up by how they ran ({"decode", "cascade", "extend", "verify", "eager"}: a copy)."""
        return self._on_loop(lambda: dict(self._core.runner.replays))

    def facts(self) -> dict:
        """What the engine was built as: `device`, `dtype` (the model's), `kv_dtype` (the pool's), `cuda_graphs`
        (decode graphs captured), `cascade` (cascade decode groups on now), `startup` (the start-up report:
        seconds per phase, graph capture lines; a copy)."""
        core, built = self._core, self._engine._built
        return {"device": str(core.device), "dtype": str(built.dtype), "kv_dtype": str(core.kv.pool.dtype),
                "cuda_graphs": core.runner.graphs is not None, "cascade": core.prefix_grouper is not None,
                "startup": dict(built.startup)}

    @property
    def model(self):
        """The loaded model (nn.Module): read its shape and weights; changing it changes the engine's outputs."""
        return self._engine._built.model

    def decode_graph(self, batch_size: int):
        """The captured CUDA graph (torch.cuda.CUDAGraph) of the decode bucket `batch_size`, its static inputs as
        the last replay left them: replaying it alone times the device work of one decode step of that size.
        Raises ValueError when the engine captured no graph for that bucket."""
        graphs = self._core.runner.graphs
        entry = graphs.graphs.get(batch_size) if graphs is not None else None
        if entry is None or entry[0] is None:
            raise ValueError(f"no captured decode graph for batch size {batch_size}")
        return entry[0]

    # ------------------------------------------------------------------ timing
    @contextlib.contextmanager
    def time_units(self, units: tuple[str, ...] = LOOP_UNITS, clock: Callable[[], float] = time.perf_counter,
                   fence_wait: bool = True, record_calls: bool = False) -> Iterator[UnitTimes]:
        """Time the loop units named in `units` (LOOP_UNITS) with `clock` (time.perf_counter: wall seconds;
        time.thread_time: the loop thread's CPU seconds) while the context is open; fence_wait: also the host's
        waits at step fences (time.perf_counter always); record_calls: also one record per call, with its batch's
        composition (UnitTimes.records). Yields the UnitTimes, filled as steps run."""
        unknown = set(units) - set(LOOP_UNITS)
        if unknown:
            raise ValueError(f"unknown loop units {sorted(unknown)}: choose from {LOOP_UNITS}")
        from prefixrt.engine.loop.step import StepFence

        times, core = UnitTimes(tuple(units), fence_wait, record_calls), self._core
        original_wait = StepFence.wait

        def timed_wait(fence):
            t = time.perf_counter()
            try:
                return original_wait(fence)
            finally:
                times.seconds["wait"] += time.perf_counter() - t

        def wrap(name):
            f = getattr(core, name)

            def timed(*a, **k):
                if times.records is not None:
                    w, c = time.perf_counter(), time.thread_time()
                t = clock()
                out = None
                try:
                    out = f(*a, **k)
                    return out
                finally:
                    times.seconds[name] += clock() - t
                    times.calls[name] += 1
                    if times.records is not None:
                        times.records.append({"unit": name, "wall_s": time.perf_counter() - w,
                                              "cpu_s": time.thread_time() - c, **_rows(out, a)})
            return timed

        def install():
            for name in units:
                core.__dict__[name] = wrap(name)  # shadows the method until removed
            if fence_wait:
                StepFence.wait = timed_wait

        def remove():
            for name in units:
                core.__dict__.pop(name, None)
            if fence_wait:
                StepFence.wait = original_wait

        self._on_loop(install)
        try:
            yield times
        finally:
            self._on_loop(remove)

    @contextlib.contextmanager
    def log_forwards(self) -> Iterator[ForwardLog]:
        """Log every forward while the context is open (ForwardLog); device times are read on exit."""
        import torch

        runner, log = self._core.runner, ForwardLog()
        original = runner.forward
        cuda = self._core.device.type == "cuda"

        def logged(fb):
            before = dict(runner.replays)
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            t = time.perf_counter()
            out = original(fb)
            if ev:
                ev[1].record()
            kind = next((k for k, v in runner.replays.items() if v != before.get(k)), "?")
            log.rows.append({"kind": kind, "tokens": int(fb.input_ids.shape[0]), "seqs": int(fb.batch_size),
                             "t": t, "ev": ev})
            return out

        self._on_loop(lambda: runner.__dict__.__setitem__("forward", logged))
        try:
            yield log
        finally:
            self._on_loop(lambda: runner.__dict__.pop("forward", None))
            if cuda:
                torch.cuda.synchronize()
            rows = log.rows
            for i, r in enumerate(rows):
                ev = r.pop("ev")
                r["device_ms"] = ev[0].elapsed_time(ev[1]) if ev else 0.0
                r["wall_ms"] = (rows[i + 1]["t"] - r["t"]) * 1000 if i + 1 < len(rows) else None

    @contextlib.contextmanager
    def time_masks(self, clock: Callable[[], float] = time.perf_counter) -> Iterator[MaskTimes]:
        """Time the grammar masks with `clock` while the context is open (time.thread_time: CPU seconds of the
        thread that fills, which with set_mask_threads(0) is all of it). Yields the MaskTimes, filled as steps run."""
        masks, times = self._core.masks, MaskTimes()
        fill_rows, finish = masks.fill_rows, masks.finish

        def timed_fill(reqs, rows, bitmask):
            t = clock()
            try:
                return fill_rows(reqs, rows, bitmask)
            finally:
                times.fill_s += clock() - t
                times.fills += 1
                times.rows += len(rows)

        def timed_finish(reqs, fill):
            t = clock()
            try:
                return finish(reqs, fill)
            finally:
                times.finish_s += clock() - t

        def install():
            masks.__dict__.update(fill_rows=timed_fill, finish=timed_finish)

        def remove():
            masks.__dict__.pop("fill_rows", None)
            masks.__dict__.pop("finish", None)

        self._on_loop(install)
        try:
            yield times
        finally:
            self._on_loop(remove)

    @contextlib.contextmanager
    def hold_loop(self, timeout: float = 60.0) -> Iterator[HeldLoop]:
        """Hold the loop between steps while the context is open (at most `timeout` seconds), so that requests
        submitted from other threads meanwhile are all taken in before its next step (as when they arrive during a
        long forward on a GPU). Yields a HeldLoop, whose wait_queued(n) waits for n submissions."""
        gate, started = threading.Event(), threading.Event()

        def hold():
            started.set()
            gate.wait(timeout)

        self._engine._inbox.put(("call", hold, concurrent.futures.Future()))
        started.wait(timeout)  # the loop is in the hold: every later message waits behind it
        try:
            yield HeldLoop(self._engine)
        finally:
            gate.set()

    @contextlib.contextmanager
    def profile_loop(self):
        """cProfile of the loop thread while the context is open; yields the cProfile.Profile (read it after)."""
        import cProfile

        prof = cProfile.Profile()
        self._on_loop(prof.enable)
        try:
            yield prof
        finally:
            self._on_loop(prof.disable)

    # ------------------------------------------------------------------ switches
    def replace_forward(self, fn: Callable) -> None:
        """The model's forward replaced by fn(ForwardBatch) -> logits [rows of fb.logits_indices, vocab], until
        restore_forward(): what is left to time is the loop's host work. The outputs are fn's, not the model's."""
        runner = self._core.runner
        self._on_loop(lambda: runner.__dict__.__setitem__("forward", fn))

    def restore_forward(self) -> None:
        runner = self._core.runner
        self._on_loop(lambda: runner.__dict__.pop("forward", None))

    def set_overlap(self, on: bool) -> None:
        """The overlapped loop (True) or the synchronous one (False) from the next step (the step in flight is
        finished first). Greedy outputs are the same in both."""
        self._on_loop(lambda: self._core.set_overlap(on))

    def set_cascade(self, on: bool) -> None:
        """Shared-prefix (cascade) decode groups off, or back on. Raises ValueError on an engine built without them
        (cascade_decode)."""
        core = self._core

        def flip():
            if on:
                if core.prefix_grouper is None:
                    core.prefix_grouper = self._saved_grouper
            elif core.prefix_grouper is not None:
                self._saved_grouper, core.prefix_grouper = core.prefix_grouper, None

        if self._saved_grouper is None and core.prefix_grouper is None:
            raise ValueError("this engine has no cascade decode groups (built with cascade_decode off)")
        self._on_loop(flip)

    def set_mask_threads(self, threads: int) -> None:
        """Threads the grammar backend fills a step's masks with (llguidance: 0 = the mask worker alone; xgrammar:
        at least 1). The backend is built first if it was not yet. Raises ValueError on an engine without a grammar
        backend, or for a count the backend refuses."""
        backend = self._engine.grammar_compiler().backend
        self._on_loop(lambda: backend.set_mask_threads(threads))

    def set_mask_parts(self, parts: int) -> None:
        """The parts a step's masks are submitted in while the rows of the step before are post-processed (each a
        fill on the mask worker); 1: one fill once every row is post-processed (the overlapped loop)."""
        if parts < 1:
            raise ValueError(f"mask parts must be >= 1, got {parts}")
        masks = self._core.masks
        self._on_loop(lambda: setattr(masks, "parts", parts))
