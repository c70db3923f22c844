"""EngineCore: the scheduler loop's body. Four units, and two loops over them:

    schedule()          which requests run next and how many tokens each feeds        (Scheduler)
    forward(batch)      build the ForwardBatch, run the model: logits stay on the device
    sample(step)        grammar masks, penalties, draw: tokens stay on the device; host copies start
    process(step)       wait for the step's tokens, post-process each row, stream outputs (postprocess.py)

    synchronous  (overlap_schedule=False)   schedule(N) -> forward(N) -> sample(N) -> process(N)
    overlapped   (overlap_schedule=True)    schedule(N+1) -> build(N+1) -> draw(N) -> launch(N+1) -> process(N)
                                            -> prepare_sample(N+1)

forward = build (host lists, host->device copies) + launch (the model); sample = prepare_sample (which rows
are live, grammar masks filled on a worker thread) + draw (wait for the masks, draw on the device). In the
overlapped loop the host schedules step N+1 and builds its batch while the device runs step N and while the
grammar masks of step N are filled in the background, then post-processes step N while the device runs step
N+1's forward. Contracts:
- Input ids: a token sampled at step N is unknown to the host when step N+1 is built. The request counts it
  (Req.num_unresolved) and step N+1 reads it from step N's device tensor (`future`); at most one such token
  per request, always from the step just before.
- Sampling needs the host state through the previous token (a grammar mask, penalties): prepare_sample(N+1)
  runs after process(N), so it sees exactly what the synchronous loop sees; nothing touches the matchers
  between it and draw(N+1) (schedule and build read no grammar state).
- A request finished (or rewritten by jump-forward) at process(N) was already scheduled into N+1: its row of
  N+1 is stale and discarded (taken greedily, drawing nothing, so a seeded request's generator is untouched).
  After jump-forward the forced tokens follow the sampled one in the next forward, as in the synchronous loop.
- KV lifetimes: KVManager.write_fence is the fence of the latest built forward; a release or free while it
  is pending waits for it (see cache/kv_manager.py). On CUDA a fence is an event recorded after the step's
  forward (sampling reads no K/V); on the CPU it passes when the step is processed (the same ordering, so the
  CPU tests exercise it).
Greedy outputs are identical in both loops. Per-request failures (a grammar error, a bad token) abort that
request alone; a failing forward aborts the requests of that batch and the loop goes on.
Runs on one thread (the loop thread); everything it owns (scheduler, KV, requests) is touched only there. The
tokenizer is never called here: outputs carry token ids to the detokenizer worker (engine/detokenizer.py).
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixrt.engine.detokenizer import DetokState
from prefixrt.engine.loop import postprocess
from prefixrt.engine.loop.scheduler import ScheduledBatch, Scheduler
from prefixrt.engine.stream import RequestStream
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.outputs import EngineStats
from prefixrt.request import Req
from prefixrt.sampling.sampler import DeviceSample, SampleOutput, Sampler

log = logging.getLogger("prefixrt")


class StepFence:
    """Passes when the device has finished a step (its forward and sample). CUDA: an event recorded after the
    sample; CPU: marked when the step is processed. Unrecorded: pending."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.recorded = False
        self.done = False

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        self.recorded = True

    def query(self) -> bool:
        if not self.done and self.recorded and self.event is not None and self.event.query():
            self.done = True
        return self.done

    def wait(self) -> None:
        if not self.done:
            assert self.recorded, "waiting on a step that was never launched to the end"
            if self.event is not None:
                self.event.synchronize()
            self.done = True


@dataclass
class _HostSample:
    """A step's samples already on the host (the row-by-row fallback): DeviceSample's interface."""

    token_ids: torch.Tensor  # [B] int64 on the device, for the next step's unresolved inputs
    out: SampleOutput

    def read(self) -> SampleOutput:
        return self.out


class _Done:
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


class _MaskFill:
    """One step's host bitmask, filled by one or more submissions to the mask worker (disjoint rows each):
    result() waits for all of them and returns the bitmask (the first error is raised, as a Future's)."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask
        self.parts: list = []  # Futures (or _Done) of the submissions
        self.submitted: set[int] = set()  # rows handed to a submission

    def result(self) -> torch.Tensor:
        for part in self.parts:
            part.result()
        return self.bitmask


@dataclass
class Step:
    """One launched forward and what the host needs to finish it."""

    batch: ScheduledBatch
    rows: list[int | None]  # each batch request's table row at launch (a retracted one has another later)
    sampled: list[Req]  # requests with a sampled row, in row order
    epochs: list[int]  # their Req.epoch at launch: a later change marks the row stale
    fence: StepFence
    logits: torch.Tensor | None = None  # [len(sampled), V] until drawn
    result: DeviceSample | _HostSample | None = None
    live: list[bool] = field(default_factory=list)  # rows sampled for real (not stale, not finished)
    fb: ForwardBatch | None = None  # built, until launched
    holes: list[int] = field(default_factory=list)  # flat positions of fb whose token is prev's device token
    hole_idx: torch.Tensor | None = None  # [2, len(holes)]: those positions, and the rows of prev's tokens
    scored: list = field(default_factory=list)  # (request, positions) wanting prompt logprobs
    num_ends: int = 0  # logits rows of sampled requests (the scored rows follow)
    masks: Any = None  # the step's _MaskFill (prepare_sample; rows may start during the previous process), or None


class EngineCore:
    def __init__(
        self,
        runner,
        scheduler: Scheduler,
        sampler: Sampler,
        eos_token_ids: list[int],
        vocab_size: int,
        max_context: int,
        device: torch.device,
        debug: bool = False,
        bitmask_ops=None,
        overlap: bool = True,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.sampler = sampler
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = device
        self.debug = debug
        self.overlap = overlap
        self.bitmask_ops = bitmask_ops  # constrained/logits.py (allocate_bitmask, apply_token_bitmask), or None
        self.prefix_grouper = None  # engine/prefix_groups.PrefixGrouper: shared-prefix groups for decode batches
        self.grammar_backend = None  # set by the Engine once it builds its GrammarBackend
        self.requests: dict[str, list[Req]] = {}  # request_id -> its samples
        self.stats = EngineStats()
        self.metrics_hook = None  # optional callable(event, **values) for Prometheus
        # Hands one step's [(sink, StepOutput)] to their consumers (the engine process replaces it). Called by
        # the detokenizer worker when there is one (the Engine starts it), else by the loop.
        self.deliver = RequestStream.push_many
        self.detokenizer = None  # DetokenizerWorker: gets [(DetokState | None, sink, StepOutput)] per step
        self._outbox: list = []  # produced this step, handed over together
        self._in_step = False
        self._inflight: Step | None = None  # overlapped loop: the step launched last, not processed yet
        self._stop_hits: queue.SimpleQueue = queue.SimpleQueue()  # requests a stop string ended (worker thread)
        self.auditor = None  # CacheAuditor when cache_audit_rate > 0 (set by the builder)
        self._masks_pool = None  # the mask worker (a one-thread executor), started on first use
        # The next step's masks are submitted in this many parts as the rows of the step before are post-processed
        # (each part one parallel fill on the worker); 1: one fill of every row once all are post-processed.
        self.mask_parts = 4

    # ------------------------------------------------------------------ requests in and out
    def add(self, reqs: list[Req]) -> None:
        self.requests.setdefault(reqs[0].rid, []).extend(reqs)
        self.stats.requests_total += 1
        for r in reqs:
            p = r.params
            try:
                if p.seed is not None:
                    r.generator = self.sampler.make_generator(p.generator_seed(r.index))
                if self.detokenizer is not None and (p.detokenize or p.stop or p.logprobs is not None):
                    r.detok = DetokState(r, p.stop, p.skip_special_tokens, p.detokenize)
                self.scheduler.add(r)
            except Exception as e:  # registered but not runnable: finish it now, never leave it hanging
                log.error("request %s could not be added: %s", r.rid, traceback.format_exc())
                self._finish(r, "abort", error=f"internal error adding the request: {e}")

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> None:
        for r in list(self.requests.get(rid, [])):
            if r.finish_reason is None:
                self._finish(r, reason, error=error)

    def finish_unscheduled(self, reqs: list[Req], reason: str = "abort") -> None:
        """Finish requests that never reached the scheduler (disaggregation: aborted while their K/V was on its
        way): their streams end with `reason`."""
        for r in reqs:
            if r.finish_reason is None:
                self._finish(r, reason)

    def stop_hit(self, req: Req) -> None:
        """A stop string ended req's stream (called on the detokenizer thread); the loop finishes it next."""
        self._stop_hits.put(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    # ------------------------------------------------------------------ the loops
    def step(self) -> bool:
        """One iteration of the loop. Returns False when there was nothing to run."""
        self._in_step = True
        try:
            self._take_stop_hits()
            ran = self._step_overlapped() if self.overlap else self._step_sync()
            if not self.has_work:
                self.kv.reclaim(wait=True)  # idle: every fence has passed, nothing stays held
                if self.debug:
                    self.kv.check_integrity()
            return ran
        finally:
            self._in_step = False
            self.flush_outputs()
            if self.auditor is not None:
                self._run_audits()

    def _run_audits(self) -> None:
        """Cache audits run after a step's outputs are out (cache_audit.py says when); never fatal."""
        try:
            self.auditor.run(idle=not self.has_work)
        except Exception:
            log.error("cache audit failed: %s", traceback.format_exc())

    def set_overlap(self, overlap: bool) -> None:
        """Switch loops (on the loop thread): the step in flight is finished first."""
        self.drain()
        self.overlap = overlap

    def _step_sync(self) -> bool:
        batch = self.schedule()
        if batch is None:
            return False
        step = self.forward(batch, None)
        if step is not None:
            self.sample(step)
            self.process(step)
        return True

    def _step_overlapped(self) -> bool:
        prev = self._inflight  # launched, its masks being filled, not drawn yet
        batch = self.schedule()
        step = self.build(batch) if batch is not None else None
        self._inflight = None
        if prev is not None:
            self.draw(prev)
        if step is not None:
            step = self.launch(step, prev)
        if prev is not None:
            early = self._early_masks(step, prev) if step is not None else None
            self.process(prev, on_rows=early)
        if step is not None:
            self.prepare_sample(step)
            self._inflight = step
        return batch is not None or prev is not None

    def flush_outputs(self) -> None:
        if self._outbox:
            out, self._outbox = self._outbox, []
            if self.detokenizer is not None:
                self.detokenizer.submit(out)
            else:
                self.deliver([(sink, o) for _, sink, o in out])

    def _take_stop_hits(self) -> None:
        while True:
            try:
                r = self._stop_hits.get_nowait()
            except queue.Empty:
                return
            if r.finish_reason is None:  # its stream already ended: finish silently (the worker drops it)
                r.matched_stop = None
                self._finish(r, "stop")

    # ------------------------------------------------------------------ unit 1: schedule
    def schedule(self) -> ScheduledBatch | None:
        self.kv.reclaim()
        batch = self.scheduler.schedule()
        for r in batch.finished_early:
            self._finish(r, "length")
        self.stats.retracted_requests_total = self.scheduler.retracted_total
        return None if batch.is_empty else batch

    # ------------------------------------------------------------------ unit 2: forward
    def forward(self, batch: ScheduledBatch, prev: Step | None) -> Step | None:
        """Build the batch's ForwardBatch and launch the model (build + launch). None if it failed."""
        step = self.build(batch)
        return self.launch(step, prev) if step is not None else None

    def build(self, batch: ScheduledBatch) -> Step | None:
        """The batch's ForwardBatch on the device (host lists, one copy), not launched; marks the sampled
        requests' new tokens unresolved. Tokens still on the device are holes, filled from the previous step's
        tokens at launch. None if building failed (its requests are aborted)."""
        ends, acc = [], 0
        sampled: list[Req] = []
        scored: list[tuple[Req, list[int]]] = []  # (request, positions whose next-token logprob it wants)
        extra: list[int] = []
        extend_tokens: list[list[int]] = []
        holes: list[int] = []  # flat positions whose token is still on the device
        hole_rows: list[int] = []  # ... at these rows of prev's sampled tokens
        for r, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.num_tokens, batch.sample):
            known = len(r.all_ids)
            toks = r.all_ids[p: min(p + n, known)]
            if p + n > known:
                step, row = r.future
                assert step is self._inflight and p + n == known + 1, "an unresolved token must come from the last step"
                holes.append(acc + n - 1)
                hole_rows.append(row)
                toks = toks + [0]
            extend_tokens.append(toks)
            if r.input_logprobs_from is not None:
                pos = [j for j in range(p, p + n) if r.input_logprobs_from - 1 <= j <= r.seq_len - 2]
                if pos:
                    scored.append((r, pos))
                    extra.extend(acc + j - p for j in pos)
            acc += n
            if s and r.params.max_new_tokens > 0:
                ends.append(acc - 1)
                sampled.append(r)
            if r.num_cached_tokens is not None and not r.prompt_counted:
                r.prompt_counted = True
                self.stats.prompt_tokens_total += len(r.prompt_ids)
                self.stats.cached_tokens_total += r.num_cached_tokens
                self.kv.salts.add(r.namespace, "prompt_tokens_total", len(r.prompt_ids))
                self.kv.salts.add(r.namespace, "cached_tokens_total", r.num_cached_tokens)
                if self.auditor is not None:
                    self.auditor.on_hit(r)
        step = Step(batch, [r.row for r in batch.reqs], sampled, [r.epoch for r in sampled], StepFence(self.device))
        for r, n in zip(batch.reqs, batch.num_tokens):
            if n > 1:
                r.chunk_step = step
        self.kv.write_fence = step.fence
        step.holes, step.scored, step.num_ends = holes, scored, len(ends)
        try:
            self.kv.table.flush()
            fb = ForwardBatch.build(
                req_pool_indices=[r.row for r in batch.reqs],
                prefix_lens=batch.prefix_lens,
                extend_tokens=extend_tokens,
                out_cache_loc=[s for slots in batch.slots for s in slots],
                req_to_token=self.kv.table.table,
                logits_indices=(ends + extra) or [acc - 1],
                device=self.device,
                prefix_groups=(self.prefix_grouper.groups(batch.reqs)
                               if self.prefix_grouper is not None and all(n == 1 for n in batch.num_tokens) else None),
            )
            fb.kv_ready = self.kv.load_waiter()  # host-tier loads in flight (None without a host tier)
            if holes:
                idx = torch.tensor([holes, hole_rows], dtype=torch.int64)
                step.hole_idx = idx.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
                    else idx
            step.fb = fb
        except Exception as e:  # a failing batch takes down its requests, not the engine
            self._fail_step(step, e)
            return None
        for i, r in enumerate(sampled):
            r.num_unresolved += 1
            r.future = (step, i)
        return step

    def launch(self, step: Step, prev: Step | None) -> Step | None:
        """Fill the holes from prev's device tokens (prev is drawn already) and run the model; the step's fence
        is recorded after the forward. None if the forward failed (its requests are aborted)."""
        fb, step.fb = step.fb, None
        try:
            if step.holes:
                fb.input_ids[step.hole_idx[0]] = prev.result.token_ids[step.hole_idx[1]]
            logits = self.runner.forward(fb)
            step.fence.record()
            if self.debug and fb.kv_ready is not None:
                fb.kv_ready.check()  # race mode: every layer waited for the loads in flight before reading
            if step.scored:
                rows = torch.log_softmax(logits[step.num_ends:].float(), dim=-1)
                k = 0
                for r, pos in step.scored:
                    targets = torch.tensor([r.all_ids[j + 1] for j in pos], device=rows.device)
                    r.input_logprobs.extend(rows[k: k + len(pos)].gather(1, targets[:, None]).squeeze(1).tolist())
                    k += len(pos)
        except Exception as e:  # a failing forward takes down its batch, not the engine
            self._fail_step(step, e)
            return None
        self.stats.forward_passes_total += 1
        step.logits = logits[: len(step.sampled)]
        return step

    def _fail_step(self, step: Step, e: Exception) -> None:
        """A batch that could not be built or run: its requests are aborted; their tokens never come."""
        log.error("forward failed: %s", traceback.format_exc())
        if not step.fence.recorded:
            step.fence.record()
        step.fence.wait()
        for r in step.sampled:
            if r.future is not None and r.future[0] is step:
                r.num_unresolved -= 1
                r.future = None
        for r in list(step.batch.reqs):
            self._finish(r, "abort", error=f"internal error in forward: {e}")

    # ------------------------------------------------------------------ unit 3: sample
    def sample(self, step: Step) -> None:
        """prepare_sample + draw (the masks filled on the loop thread: nothing to overlap them with)."""
        self.prepare_sample(step, background=False)
        self.draw(step)

    def prepare_sample(self, step: Step, background: bool = True) -> None:
        """Which rows are live, from the host state (current through the previous step); their grammar masks
        are filled, in the background on the mask worker thread (the grammar libraries fill outside the GIL)."""
        if not step.sampled:
            return
        step.live = [r.finish_reason is None and r.epoch == e for r, e in zip(step.sampled, step.epochs)]
        rows = [i for i, r in enumerate(step.sampled) if r.matcher is not None and step.live[i]]
        self._submit_masks(step, rows, background)

    def _submit_masks(self, step: Step, rows: list[int], background: bool = True) -> None:
        """Fill these rows of the step's bitmask (allocated all-ones on first use) on the mask worker (or at once);
        rows already submitted are skipped. A row must be filled only once its matcher is current."""
        if self.bitmask_ops is None or step.logits is None:
            return
        if step.masks is None:
            if not rows:
                return
            # pinned on CUDA, so the copy to the device never waits for the forward in flight (torch's pinned
            # allocator keeps the buffer until the copy has run)
            step.masks = _MaskFill(self.bitmask_ops.allocate_bitmask(len(step.sampled), step.logits.shape[1],
                                                                      pinned=step.logits.is_cuda))
        fill = step.masks
        rows = [i for i in rows if i not in fill.submitted]
        if not rows:
            return
        fill.submitted.update(rows)
        args = (step.sampled, rows, fill.bitmask)
        fill.parts.append(self._mask_worker().submit(self._fill_rows, *args) if background
                          else _Done(self._fill_rows, *args))

    def _early_masks(self, step: Step, prev: Step):
        """A hook for process(prev): after each chunk of prev's rows, start the masks of step's rows whose matcher
        is now current (their request's row of prev is post-processed, or it had none), so the fill overlaps
        the rest of post-processing. None when step has no constrained rows."""
        if self.bitmask_ops is None or not step.sampled or step.logits is None:
            return None
        where = {id(r): k for k, r in enumerate(prev.sampled)}
        pending = sorted((where.get(id(r), -1), i) for i, r in enumerate(step.sampled) if r.matcher is not None)
        if not pending:
            return None
        chunk = max(8, len(prev.sampled) // self.mask_parts) if self.mask_parts > 1 else len(prev.sampled) + 1

        def on_rows(done: int) -> None:  # prev rows [0, done) are post-processed
            if done % chunk and done != len(prev.sampled):
                return
            ready = []
            while pending and pending[0][0] < done:
                _, i = pending.pop(0)
                r = step.sampled[i]
                if r.finish_reason is None and r.epoch == step.epochs[i]:
                    ready.append(i)
            self._submit_masks(step, ready)

        return on_rows

    def _mask_worker(self):
        if self._masks_pool is None:
            import concurrent.futures

            self._masks_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixrt-masks")
        return self._masks_pool

    def _fill_rows(self, reqs: list[Req], rows: list[int], bitmask: torch.Tensor) -> None:
        """(On the mask worker.) Fill the given rows of bitmask from their requests' matchers."""
        if self.grammar_backend is not None:  # the backend fills rows in parallel where it can; its Python
            # rules run at the draw, on the loop thread (finish_masks), not here behind the loop thread's GIL
            self.grammar_backend.fill_bitmasks_native([(reqs[i].matcher, i) for i in rows], bitmask)
        else:
            for i in rows:
                reqs[i].matcher.fill_bitmask(bitmask, i)

    def draw(self, step: Step) -> None:
        """Wait for the step's masks, then penalties, masks and the draw on the device; host copies start."""
        if step.sampled:
            step.result = self._sample(step.logits, step.sampled, step.live, step.masks)
        step.logits = step.masks = None

    def _sample(self, logits: torch.Tensor, reqs: list[Req], live: list[bool], masks=None
                ) -> DeviceSample | _HostSample:
        """Sample the batch on the device. If that raises (a mask fill included), its rows are sampled one by
        one (synchronously): the failing request(s) are aborted with the error, their neighbours go on. Rows
        of an aborted request and stale rows are marked not live."""
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            apply = None
            if masks is not None:
                bitmask = masks.result()
                self._finish_masks(reqs, masks)
                apply = lambda logits: self._apply_masks(logits, bitmask)  # noqa: E731
            return self.sampler.sample_on_device(logits, reqs, apply, self.eos_token_ids, live)
        except Exception:
            log.error("sampling a batch of %d failed, isolating: %s", len(reqs), traceback.format_exc())
        for g, state in seeded:  # seeded rows draw what they would have, from before the failed attempt
            g.set_state(state)
        toks, lps = [0] * len(reqs), [None] * len(reqs)
        for i, r in enumerate(reqs):
            if not live[i]:
                continue
            try:
                one = self.sampler.sample(logits[i: i + 1], [r], self._mask_fn([r], [True]), self.eos_token_ids)
                toks[i], lps[i] = one.token_ids[0], one.logprobs[0]
            except Exception as e:
                log.error("sampling failed for %s: %s", r.rid, traceback.format_exc())
                self._finish(r, "abort", error=f"internal error in sampling: {e}")
                live[i] = False
        return _HostSample(torch.tensor(toks, dtype=torch.int64, device=logits.device), SampleOutput(toks, lps))

    def _finish_masks(self, reqs: list[Req], masks: _MaskFill) -> None:
        """The backend's Python part of the masks (`GrammarBackend.finish_bitmasks`), for every filled row."""
        if self.grammar_backend is not None and masks.submitted:
            self.grammar_backend.finish_bitmasks([(reqs[i].matcher, i) for i in sorted(masks.submitted)],
                                                 masks.bitmask)

    def _mask_fn(self, reqs: list[Req], live: list[bool]):
        """The row-by-row fallback's masks: filled on the loop thread when the sampler applies them."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and live[i]]
        if not rows or self.bitmask_ops is None:
            return None

        def apply(logits: torch.Tensor) -> None:
            bitmask = self.bitmask_ops.allocate_bitmask(len(reqs), logits.shape[1], pinned=logits.is_cuda)
            self._fill_rows(reqs, rows, bitmask)
            if self.grammar_backend is not None:
                self.grammar_backend.finish_bitmasks([(reqs[i].matcher, i) for i in rows], bitmask)
            self._apply_masks(logits, bitmask)

        return apply

    def _apply_masks(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.bitmask_ops.apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))

    # ------------------------------------------------------------------ unit 4: post-process
    def process(self, step: Step, on_rows=None) -> None:
        """Wait for the step, then per row: resolve the token, post-process, stream; publish prefill chunks.
        on_rows(n), when given, is called after each of the first n rows is post-processed (and once with n =
        all rows, also when there are no tokens)."""
        step.fence.wait()
        out = step.result.read() if step.result is not None else None
        now = time.monotonic()
        if out is not None:
            for j, (r, live, epoch, tok, lp) in enumerate(
                    zip(step.sampled, step.live, step.epochs, out.token_ids, out.logprobs)):
                if live and r.finish_reason is None and r.epoch == epoch:  # else stale or finished: discarded
                    r.num_unresolved -= 1
                    if r.future is not None and r.future[0] is step:
                        r.future = None
                    try:
                        self._post_process(r, tok, lp, now)
                    except Exception as e:
                        log.error("post-processing failed: %s", traceback.format_exc())
                        self._finish(r, "abort", error=f"internal error in post-processing: {e}")
                if on_rows is not None:
                    on_rows(j + 1)
        elif on_rows is not None:
            on_rows(len(step.sampled))
        b = step.batch
        for r, row, p, n, s in zip(b.reqs, step.rows, b.prefix_lens, b.num_tokens, b.sample):
            if r.chunk_step is step:
                r.chunk_step = None
            if r.finish_reason is not None:
                continue
            if s and r.params.max_new_tokens == 0:  # cache_prefix / prefill-only request
                self._finish(r, "length")
            elif n > 1 and r.row is not None and r.row == row:  # (not retracted since)
                self.kv.cache_unfinished(r, p + n)  # publish the prefill chunk: later arrivals reuse it
        self.kv.reclaim()

    def _post_process(self, r: Req, tok: int, lp, now: float) -> None:
        if r.first_token_time is None:
            r.first_token_time = now
        adv = postprocess.advance(r, tok, self.eos_token_ids, self.max_context)
        if adv.num_forced and r.num_unresolved:
            # A sample launched after tok is stale: the forced tokens come first (the next forward feeds them).
            r.num_unresolved -= 1
            r.epoch += 1
            r.future = None
        logprobs = None
        if lp is not None:
            logprobs = postprocess.logprob_entries(adv.new_tokens, len(adv.new_tokens) - 1 - adv.num_forced, lp)
        self.stats.generated_tokens_total += len(adv.new_tokens)
        r.finish_reason = adv.finish_reason
        r.matched_stop = adv.matched_stop
        if self.metrics_hook is not None:
            self.metrics_hook("tokens", req=r, num=len(adv.new_tokens), now=now)
        self._outbox.append((r.detok, r.sink, postprocess.step_output(r, adv, logprobs)))
        if adv.finish_reason is not None:
            self._release(r)

    # ------------------------------------------------------------------ finishing
    def _finish(self, r: Req, reason: str, error: str | None = None) -> None:
        """Finish r without a new token (abort, length-out-of-memory, prefill-only, stop string)."""
        if r.finish_reason is not None and r.state.value == "finished":
            return
        r.finish_reason = reason
        r.error = error
        if reason == "abort":
            self.stats.aborted_requests_total += 1
        self._outbox.append((r.detok, r.sink, postprocess.final_output(r, reason, error)))
        if not self._in_step:
            self.flush_outputs()
        self._release(r)

    def _release(self, r: Req) -> None:
        # The outputs already produced carry the text state; dropping the request's own link to it breaks the
        # Req <-> DetokState cycle, so a finished request is freed by reference counting, not by a GC pause.
        r.detok = None
        self.scheduler.remove(r)
        samples = self.requests.get(r.rid)
        if samples is not None and all(s.state.value == "finished" for s in samples):
            del self.requests[r.rid]
        if self.metrics_hook is not None:
            self.metrics_hook("finished", req=r, now=time.monotonic())

    def close(self) -> None:
        """Stop the mask worker (after drain: nothing is in flight)."""
        if self._masks_pool is not None:
            self._masks_pool.shutdown(wait=True)
            self._masks_pool = None

    def drain(self) -> None:
        """Finish the step in flight and every held release (shutdown, or before inspecting KV state)."""
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            self.draw(prev)
            self.process(prev)
            self.flush_outputs()
        self.kv.reclaim(wait=True)

    # ------------------------------------------------------------------ stats
    def snapshot_stats(self) -> EngineStats:
        s = self.stats
        s.cache_hit_rate = s.cached_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
        s.evicted_tokens_total = self.kv.evicted_tokens_total
        s.requests_running = len(self.scheduler.running)
        s.requests_waiting = len(self.scheduler.waiting)
        s.kv_total = self.kv.total_tokens
        s.kv_free = self.kv.free_tokens
        s.kv_evictable = self.kv.evictable_tokens
        s.kv_locked = s.kv_total - s.kv_free - s.kv_evictable
        tiered = self.kv.tiered
        if tiered is not None:
            s.kv_host_total = tiered.host_alloc.total_tokens
            s.kv_host_free = tiered.host_alloc.free_tokens
            s.kv_host_cached = tiered.host_cached_tokens
            s.host_hit_tokens_total = tiered.host_hit_tokens_total
            s.host_evicted_tokens_total = tiered.host_evicted_tokens_total
            s.host_load_failures_total = self.kv.load_failures_total
            t = tiered.transfer.stats()
            bpt = tiered.host.bytes_per_token
            s.host_load_bytes_total, s.host_load_seconds_total = t["load"][1] * bpt, t["load"][2]
            s.host_backup_bytes_total, s.host_backup_seconds_total = t["backup"][1] * bpt, t["backup"][2]
        disk = self.kv.disk
        if disk is not None:
            s.kv_disk_total_bytes, s.kv_disk_used_bytes = disk.max_bytes, disk.used_bytes
            s.kv_disk_cached_tokens, s.kv_disk_files = disk.cached_tokens, disk.num_files
            s.disk_hit_tokens_total = disk.hit_tokens_total
            s.disk_load_bytes_total, s.disk_load_seconds_total = disk.load_bytes_total, disk.load_seconds_total
            s.disk_write_bytes_total, s.disk_write_seconds_total = disk.write_bytes_total, disk.write_seconds_total
            s.disk_write_skipped_total, s.disk_evicted_bytes_total = disk.write_skipped_total, disk.evicted_bytes_total
            s.disk_rejected_files_total = disk.rejected_files_total
        s.salts = self.kv.salt_stats()
        if self.auditor is not None:
            s.cache_audits_total = self.auditor.audits_total
            s.cache_audit_mismatches_total = self.auditor.mismatches_total
        return EngineStats(**s.to_dict())
