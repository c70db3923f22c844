"""EngineProbes: what a benchmark may observe of a running Engine, and the few switches it may flip, as one small
public surface (`Engine.probes`; docs/api.md "Probes"). Benchmarks use this and nothing below it.

Observe (contexts: instruments installed on entry, removed on exit; their results complete once exited)
    time_units(...)         seconds spent in each loop unit (wall or thread CPU), in fence waits; optionally one
                            record per call: host start/end, device times, the batch's composition
    log_forwards()          one row per forward: how it ran, tokens, sequences, host and device times
    time_masks(...)         seconds spent filling grammar masks, and rows filled
    profile_loop()          cProfile of the loop thread
    hold_loop()             the loop held between steps, so requests submitted meanwhile start together
Read
    forward_counts()        forwards so far by how they ran: decode / cascade / extend / verify graph, or eager
    facts()                 device, dtype, KV dtype, CUDA graphs and cascade on or not, the start-up report
    model, drafter          the loaded model; the speculative drafter (or None)
    graph_replay_ms(...)    a captured CUDA graph replayed alone: the device time of one step of its shape
    time_forward_ms(...)    the model's forward alone on a synthetic batch (decode, or verify-shaped rows)
Switch (between steps; none changes what a greedy request produces, except replace_forward)
    set_overlap(on), set_cascade(on), set_cuda_graphs(on), set_mask_threads(n), set_mask_parts(n),
    set_draft_tokens(k), replace_forward(fn) / restore_forward()

Everything that touches the loop's objects runs on the loop thread, between steps, so an engine with no probe open
runs exactly its normal code. An instrument shadows a loop unit with a timed wrapper (the loop looks its units up
on every call): cheap, not free, so figures taken inside one include a few microseconds per wrapped call.
Device times: CUDA events around the call, read as milliseconds since the context opened (`device_start_ms`,
`device_end_ms`) and as durations (`device_ms`); None on the CPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from prefixrt.engine.probe_results import DeviceClock, ForwardLog, HeldLoop, MaskTimes, UnitTimes, batch_rows

# The units of engine/loop/core.py: the synchronous loop runs schedule, forward (= build + launch), sample
# (= prepare_sample + draw) and process; the overlapped loop runs the parts.
LOOP_UNITS = ("schedule", "build", "draw", "launch", "process", "prepare_sample")
# What time_units() can time: the loop units, a whole loop iteration (`step`), the hand-over of a step's outputs
# (`flush_outputs`), and the detokenizer worker's delivery to the streams (`deliver`; on its own thread).
TIMEABLE = LOOP_UNITS + ("step", "flush_outputs", "deliver")


class EngineProbes:
    """See the module docstring. Built once per engine by Engine.probes."""

    def __init__(self, engine):  # an Engine (engine/engine.py, which imports this module)
        self._engine = engine
        self._saved_grouper = None  # set_cascade(False) keeps the grouper here until set_cascade(True)
        self._saved_graphs = None  # set_cuda_graphs(False) keeps the runner's graph banks here

    def _on_loop(self, fn, timeout: float | None = 60.0):
        return self._engine._run_on_loop(fn, timeout)

    @property
    def _core(self):
        return self._engine.core

    def _cuda(self) -> bool:
        return self._core.device.type == "cuda"

    # ------------------------------------------------------------------ reading
    def forward_counts(self) -> dict[str, int]:
        """Forwards since start-up by how they ran ({"decode", "cascade", "extend", "verify", "eager"}: a copy)."""
        return self._on_loop(lambda: dict(self._core.runner.replays))

    def facts(self) -> dict:
        """What the engine was built as: `device`, `dtype` (the model's), `kv_dtype` (the pool's), `cuda_graphs`
        (decode graphs in use now), `cascade` (cascade decode groups in use now), `cascade_built` (the engine has
        them, on or switched off), `startup` (the start-up report:
        seconds per phase, graph capture lines, whatever the build recorded; a copy)."""
        core, built = self._core, self._engine._built
        return {"device": str(core.device), "dtype": str(built.dtype), "kv_dtype": str(core.kv.pool.dtype),
                "cuda_graphs": core.runner.graphs is not None, "cascade": core.prefix_grouper is not None,
                "cascade_built": core.prefix_grouper is not None or self._saved_grouper is not None,
                "startup": dict(built.startup)}

    @property
    def model(self):
        """The loaded model (nn.Module): read its shape and weights; changing it changes the engine's outputs."""
        return self._engine._built.model

    @property
    def drafter(self):
        """The speculative decoding drafter (speculative/: NgramDrafter, a draft model, ...) of an engine built with
        `speculative`, else None. Read its counters (e.g. a draft model's `draft_forwards`)."""
        spec = self._core.spec
        return spec.drafter if spec is not None else None

    def graph_replay_ms(self, kind: str, key, iters: int = 20) -> float:
        """A captured CUDA graph replayed alone, back to back (3 warm replays first): device milliseconds per
        replay. kind "decode" (key: the batch size bucket) or "extend" (key: (tokens, batch size)). Its K/V writes
        go to the padding slot first, so the stale static inputs touch no live slot. Raises ValueError when the
        engine has no such graph."""
        import torch

        runner = self._core.runner
        bank = {"decode": runner.graphs, "extend": runner.extend_graphs}.get(kind)
        entry = bank.graphs.get(key) if bank is not None else None
        if entry is None or entry[0] is None:
            raise ValueError(f"no captured {kind} graph for {key!r}")
        graph = entry[0]

        def replay() -> float:
            with torch.inference_mode():  # the static buffers are inference tensors
                bank.out_cache_loc.zero_()
                for _ in range(3):
                    graph.replay()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(iters):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b) / iters

        return self._on_loop(replay)

    def time_forward_ms(self, batch: int, context: int, tokens_per_row: int = 1, iters: int = 20) -> float:
        """Milliseconds per model forward (the runner's: a graph where one fits, else eager) of `batch` rows, each
        `context` tokens cached and feeding `tokens_per_row` new ones (1: a decode step; k + 1: a speculative verify
        of k drafts), logits at every fed position; 3 warm forwards first, then `iters` timed back to back. Runs
        on the loop thread on rows and slots of its own (K/V left as garbage: only time is measured): call it on an
        idle engine whose pool is free (after flush_cache). Raises ValueError when the pool is too small."""
        import torch

        from prefixrt.model.forward_batch import ForwardBatch

        core = self._core
        kv, runner = core.kv, core.runner
        span = context + tokens_per_row
        if batch * span >= kv.total_tokens:
            raise ValueError(f"{batch} rows of {span} tokens do not fit the pool ({kv.total_tokens} tokens)")

        def sync():
            if core.device.type == "cuda":
                torch.cuda.synchronize()

        def run() -> float:
            rows = [kv.table.alloc_row() for _ in range(batch)]
            try:
                for i, row in enumerate(rows):  # each row its own slots (slot 0 is the padding slot)
                    kv.table.write(row, 0, list(range(1 + i * span, 1 + (i + 1) * span)))
                kv.table.flush()
                slots = [1 + i * span + context for i in range(batch)]
                fb = ForwardBatch.build(
                    req_pool_indices=rows, prefix_lens=[context] * batch, extend_tokens=[[7] * tokens_per_row] * batch,
                    out_cache_loc=[s + j for s in slots for j in range(tokens_per_row)], req_to_token=kv.table.table,
                    logits_indices=list(range(batch * tokens_per_row)), device=core.device)
                for _ in range(3):
                    runner.forward(fb)
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    runner.forward(fb)
                sync()
                return (time.perf_counter() - t0) / iters * 1000
            finally:
                for row in rows:
                    kv.table.free_row(row)

        return self._on_loop(run, timeout=600)

    # ------------------------------------------------------------------ observing
    @contextlib.contextmanager
    def time_units(self, units: tuple[str, ...] = LOOP_UNITS, clock: Callable[[], float] = time.perf_counter,
                   fence_wait: bool = True, record_calls: bool = False,
                   device_events: bool = False) -> Iterator[UnitTimes]:
        """Time the units named in `units` (TIMEABLE) with `clock` (time.perf_counter: wall seconds;
        time.thread_time: the calling thread's CPU seconds) while the context is open. fence_wait: also the host's
        waits at step fences (time.perf_counter); record_calls: one record per call (UnitTimes.records);
        device_events: CUDA events around each recorded call (on a CUDA engine). Yields the UnitTimes."""
        unknown = set(units) - set(TIMEABLE)
        if unknown:
            raise ValueError(f"unknown units {sorted(unknown)}: choose from {TIMEABLE}")
        from prefixrt.engine.loop.step import StepFence

        times, core = UnitTimes(tuple(units), fence_wait, record_calls), self._core
        dev = DeviceClock(device_events and record_calls and self._cuda())
        original_wait = StepFence.wait
        owners = {name: (core.detokenizer if name == "deliver" else core) for name in units}
        if owners.get("deliver", core) is None:
            raise ValueError("this engine has no detokenizer worker: nothing to time as 'deliver'")
        saved = {name: owners[name].__dict__.get(name) for name in units}  # instance attributes (deliver) or None

        def timed_wait(fence):
            t = time.perf_counter()
            try:
                return original_wait(fence)
            finally:
                times.seconds["wait"] += time.perf_counter() - t

        def wrap(name):
            f = getattr(owners[name], name)

            def timed(*a, **k):
                rec = times.records is not None
                if rec:
                    start, cpu, ev = time.perf_counter(), time.thread_time(), dev.mark()
                t = clock()
                out = None
                try:
                    out = f(*a, **k)
                    return out
                finally:
                    times.seconds[name] += clock() - t
                    times.calls[name] += 1
                    if rec:
                        end = time.perf_counter()
                        times.records.append({"unit": name, "start": start, "end": end, "wall_s": end - start,
                                              "cpu_s": time.thread_time() - cpu, "_events": (ev, dev.mark()),
                                              **batch_rows(out, a)})
            return timed

        def install():
            for name in units:
                owners[name].__dict__[name] = wrap(name)  # shadows the method (or replaces the callable)
            if fence_wait:
                StepFence.wait = timed_wait

        def remove():
            for name in units:
                if saved[name] is None:
                    owners[name].__dict__.pop(name, None)
                else:
                    owners[name].__dict__[name] = saved[name]
            if fence_wait:
                StepFence.wait = original_wait

        self._on_loop(install)
        try:
            yield times
        finally:
            self._on_loop(remove)
            if times.records is not None:
                dev.sync()
                for r in times.records:
                    dev.fill(r)

    @contextlib.contextmanager
    def log_forwards(self) -> Iterator[ForwardLog]:
        """Log every forward while the context is open (ForwardLog)."""
        runner, log = self._core.runner, ForwardLog()
        original = runner.forward
        dev = DeviceClock(self._cuda())

        def logged(fb):
            before = dict(runner.replays)
            a = dev.mark()
            t = time.perf_counter()
            out = original(fb)
            b = dev.mark()
            kind = next((k for k, v in runner.replays.items() if v != before.get(k)), "?")
            log.rows.append({"kind": kind, "tokens": int(fb.input_ids.shape[0]), "seqs": int(fb.batch_size),
                             "start": t, "_events": (a, b)})
            return out

        self._on_loop(lambda: runner.__dict__.__setitem__("forward", logged))
        try:
            yield log
        finally:
            self._on_loop(lambda: runner.__dict__.pop("forward", None))
            dev.sync()
            rows = log.rows
            for i, r in enumerate(rows):
                dev.fill(r)
                r["wall_ms"] = (rows[i + 1]["start"] - r["start"]) * 1000 if i + 1 < len(rows) else None

    @contextlib.contextmanager
    def time_masks(self, clock: Callable[[], float] = time.perf_counter) -> Iterator[MaskTimes]:
        """Time the grammar masks with `clock` while the context is open (time.thread_time: CPU seconds of the
        thread that fills, which with set_mask_threads(0) is all of it). Yields the MaskTimes."""
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
    def profile_loop(self):
        """cProfile of the loop thread while the context is open; yields the cProfile.Profile (read it after)."""
        import cProfile

        prof = cProfile.Profile()
        self._on_loop(prof.enable)
        try:
            yield prof
        finally:
            self._on_loop(prof.disable)

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
        if self._saved_grouper is None and core.prefix_grouper is None:
            raise ValueError("this engine has no cascade decode groups (built with cascade_decode off)")

        def flip():
            if on:
                if core.prefix_grouper is None:
                    core.prefix_grouper, self._saved_grouper = self._saved_grouper, None
            elif core.prefix_grouper is not None:
                self._saved_grouper, core.prefix_grouper = core.prefix_grouper, None

        self._on_loop(flip)

    def set_cuda_graphs(self, on: bool) -> None:
        """The captured CUDA graphs (decode, extend, verify) off: every forward eager; or back on. A no-op on an
        engine that captured none."""
        runner = self._core.runner

        def flip():
            if on:
                if self._saved_graphs is not None:
                    (runner.graphs, runner.extend_graphs, runner.verify_graphs), self._saved_graphs = \
                        self._saved_graphs, None
            elif self._saved_graphs is None:
                self._saved_graphs = (runner.graphs, runner.extend_graphs, runner.verify_graphs)
                runner.graphs = runner.extend_graphs = runner.verify_graphs = None

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

    def set_draft_tokens(self, k: int) -> None:
        """Speculative decoding drafts at most k tokens a step from now on (1 <= k <= the engine's
        speculative_num_tokens, which sized its verify graphs). Raises ValueError on an engine without speculation
        or for k out of that range."""
        spec, built_k = self._core.spec, self._engine.config.speculative_num_tokens
        if spec is None:
            raise ValueError("this engine has no speculative decoding (built with speculative=None)")
        if not 1 <= k <= built_k:
            raise ValueError(f"draft tokens must be in [1, {built_k}] (speculative_num_tokens), got {k}")
        self._on_loop(lambda: setattr(spec.lengths, "max_tokens", k))
