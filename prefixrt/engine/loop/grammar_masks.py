"""GrammarMasks: the grammar side of the loop's sample unit. A step's token bitmask is filled row by row from
its requests' matchers, on a one-thread mask worker so that the fill overlaps the device (the grammar
libraries fill outside the GIL); the backend's Python rules run at the draw on the loop thread; the bitmask is
applied to the logits on the device.

A row may be filled only once its matcher is current (its request's previous token is post-processed):
engine/loop/core.py submits rows as they become current (`early` during the previous step's post-processing,
`submit` at prepare_sample) and waits for them at the draw (MaskFill.result).
"""

from __future__ import annotations

import concurrent.futures

import torch

from prefixrt.engine.loop.step import Step
from prefixrt.request import Req


class Done:
    """A Future-like result computed at once (an exception is raised by result(), as a Future's would be)."""

    def __init__(self, fn, *args):
        try:
            self._value, self._error = fn(*args), None
        except Exception as e:
            self._value, self._error = None, e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class MaskFill:
    """One step's host bitmask, filled by one or more submissions to the mask worker (disjoint rows each):
    result() waits for all of them and returns the bitmask (the first error is raised, as a Future's)."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask
        self.parts: list = []  # Futures (or Done) of the submissions
        self.submitted: set[int] = set()  # rows handed to a submission

    def result(self) -> torch.Tensor:
        for part in self.parts:
            part.result()
        return self.bitmask


class GrammarMasks:
    """Owns the mask worker. grammar: the engine's EngineGrammar (engine/grammar.py), or None. Its bitmask_ops
    (constrained/logits.py: allocate_bitmask, apply_token_bitmask) may be None (no constrained decoding
    installed: nothing is masked); its backend is None until built (rows are then filled matcher by matcher)."""

    def __init__(self, grammar=None, parts: int = 4):
        self.grammar = grammar
        self.bitmask_ops = grammar.bitmask_ops if grammar is not None else None
        # The next step's masks are submitted in this many parts as the rows of the step before are post-processed
        # (each part one parallel fill on the worker); 1: one fill of every row once all are post-processed.
        self.parts = parts
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the mask worker, started on first use

    def submit(self, step: Step, rows: list[int], background: bool = True) -> None:
        """Fill these rows of the step's bitmask (allocated all-ones on first use) on the mask worker (or at once);
        rows already submitted are skipped. A row must be filled only once its matcher is current."""
        if self.bitmask_ops is None or step.logits is None:
            return
        if step.masks is None:
            if not rows:
                return
            # pinned on CUDA, so the copy to the device never waits for the forward in flight (torch's pinned
            # allocator keeps the buffer until the copy has run)
            step.masks = MaskFill(self.bitmask_ops.allocate_bitmask(len(step.sampled), step.logits.shape[1],
                                                                     pinned=step.logits.is_cuda))
        fill = step.masks
        rows = [i for i in rows if i not in fill.submitted]
        if not rows:
            return
        fill.submitted.update(rows)
        args = (step.sampled, rows, fill.bitmask)
        fill.parts.append(self._worker().submit(self.fill_rows, *args) if background
                          else Done(self.fill_rows, *args))

    def early(self, step: Step, prev: Step):
        """A hook for process(prev): after each chunk of prev's rows, start the masks of step's rows whose matcher
        is now current (their request's row of prev is post-processed, or it had none), so the fill overlaps
        the rest of post-processing. None when step has no constrained rows."""
        if self.bitmask_ops is None or not step.sampled or step.logits is None:
            return None
        where = {id(r): k for k, r in enumerate(prev.sampled)}
        pending = sorted((where.get(id(r), -1), i) for i, r in enumerate(step.sampled) if r.matcher is not None)
        if not pending:
            return None
        chunk = max(8, len(prev.sampled) // self.parts) if self.parts > 1 else len(prev.sampled) + 1

        def on_rows(done: int) -> None:  # prev rows [0, done) are post-processed
            if done % chunk and done != len(prev.sampled):
                return
            ready = []
            while pending and pending[0][0] < done:
                _, i = pending.pop(0)
                r = step.sampled[i]
                if r.finish_reason is None and r.epoch == step.epochs[i]:
                    ready.append(i)
            self.submit(step, ready)

        return on_rows

    @property
    def backend(self):
        """The GrammarBackend, or None (not built yet, or no grammar)."""
        return self.grammar.backend if self.grammar is not None else None

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixrt-masks")
        return self._pool

    def fill_rows(self, reqs: list[Req], rows: list[int], bitmask: torch.Tensor) -> None:
        """(On the mask worker.) Fill the given rows of bitmask from their requests' matchers."""
        backend = self.backend
        if backend is not None:  # the backend fills rows in parallel where it can; its Python rules run at the
            # draw, on the loop thread (finish), not here behind the loop thread's GIL
            backend.fill_bitmasks_native([(reqs[i].matcher, i) for i in rows], bitmask)
        else:
            for i in rows:
                reqs[i].matcher.fill_bitmask(bitmask, i)

    def finish(self, reqs: list[Req], masks: MaskFill) -> None:
        """The backend's Python part of the masks (`GrammarBackend.finish_bitmasks`), for every filled row."""
        backend = self.backend
        if backend is not None and masks.submitted:
            backend.finish_bitmasks([(reqs[i].matcher, i) for i in sorted(masks.submitted)], masks.bitmask)

    def row_fn(self, reqs: list[Req], live: list[bool]):
        """The row-by-row fallback's masks: filled on the loop thread when the sampler applies them."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and live[i]]
        if not rows or self.bitmask_ops is None:
            return None

        def apply(logits: torch.Tensor) -> None:
            bitmask = self.bitmask_ops.allocate_bitmask(len(reqs), logits.shape[1], pinned=logits.is_cuda)
            self.fill_rows(reqs, rows, bitmask)
            backend = self.backend
            if backend is not None:
                backend.finish_bitmasks([(reqs[i].matcher, i) for i in rows], bitmask)
            self.apply(logits, bitmask)

        return apply

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.bitmask_ops.apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))

    def close(self) -> None:
        """Stop the mask worker (after the loop's drain: nothing is in flight)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
