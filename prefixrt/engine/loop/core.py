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
import time
import traceback
from typing import TYPE_CHECKING

import torch

from prefixrt.engine.loop import batch_inputs, postprocess, stats
from prefixrt.engine.loop.grammar_masks import GrammarMasks
from prefixrt.engine.loop.hooks import LoopHooks
from prefixrt.engine.loop.scheduler import ScheduledBatch, Scheduler
from prefixrt.engine.loop.step import HostSample, Step, StepFence
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.outputs import EngineStats
from prefixrt.request import Req
from prefixrt.sampling.sampler import DeviceSample, SampleOutput, Sampler

if TYPE_CHECKING:
    from prefixrt.engine.loop.cache_audit import CacheAuditor
    from prefixrt.engine.loop.prefix_groups import PrefixGrouper
    from prefixrt.engine.loop.speculate import Speculator
    from prefixrt.multimodal.inputs import EncoderCache

log = logging.getLogger("prefixrt")


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
        hooks: LoopHooks | None = None,
        *,
        debug: bool = False,
        overlap: bool = True,
        prefix_grouper: PrefixGrouper | None = None,
        auditor: CacheAuditor | None = None,
        encoder: EncoderCache | None = None,
        speculator: Speculator | None = None,
    ):
        """Everything the loop uses comes in here; nothing is attached later. hooks: LoopHooks (delivery,
        detokenizer, grammar, events; default: deliver to RequestStreams, ids only, no grammar). prefix_grouper:
        shared-prefix groups of decode batches for cascade decode, or None; auditor: the CacheAuditor when
        cache_audit_rate > 0, else None; encoder: the EncoderCache of a vision-language model (its images' encoder
        outputs), else None; speculator: the Speculator of speculative decoding (speculate.py; synchronous loop
        only), else None."""
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
        self.hooks = hooks = hooks if hooks is not None else LoopHooks()
        self.prefix_grouper = prefix_grouper
        self.auditor = auditor
        self.encoder = encoder
        self.spec = speculator
        self.detokenizer = hooks.detokenizer  # gets [(DetokState | None, sink, StepOutput)] per step
        self._text_states = self.detokenizer.states if self.detokenizer is not None else {}  # Req -> DetokState
        self.events = hooks.events
        self.masks = GrammarMasks(hooks.grammar)  # grammar masks for the sample unit (filled on their own worker)
        self.requests: dict[str, list[Req]] = {}  # request_id -> its samples
        self.stats = EngineStats()
        self._outbox: list = []  # produced this step, handed over together
        self._in_step = False
        self._inflight: Step | None = None  # overlapped loop: the step launched last, not processed yet
        self.steps_done = 0  # iterations of the loop so far: a busy loop whose count stops is stuck (progress.py)

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
                    self.detokenizer.open(r, p.stop, p.skip_special_tokens, p.detokenize)
                if (refused := self.scheduler.add(r)) is not None:  # (its LoRA adapter was unloaded meanwhile)
                    self._finish(r, "abort", error=refused)
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
                # Idle. The outputs go first: publishing the finished requests' K/V below can take a while, and
                # a request sent after an output still waits for it (the next step starts after it).
                self.flush_outputs()
                self.scheduler.went_idle()  # every fence has passed, nothing stays held; sessions' prefixes back
                if self.debug:
                    self.kv.check_integrity()
            return ran
        finally:
            self._in_step = False
            self.flush_outputs()
            if self.auditor is not None:
                self._run_audits()
            self.steps_done += 1

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
        if self.spec is not None:
            self.spec.plan(batch, self.stats)
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
            early = self.masks.early(step, prev) if step is not None else None
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
                self.hooks.deliver([(sink, o) for _, sink, o in out])

    def _take_stop_hits(self) -> None:
        """Finish the requests a stop string ended (the detokenizer worker found it, after they were scheduled)."""
        if self.detokenizer is None:
            return
        for r in self.detokenizer.take_stopped():
            if r.finish_reason is None:  # its stream already ended: finish silently (the worker drops it)
                r.matched_stop = None
                self._finish(r, "stop")

    # ------------------------------------------------------------------ unit 1: schedule
    def schedule(self) -> ScheduledBatch | None:
        self.kv.reclaim()
        batch = self.scheduler.schedule()
        for r in batch.finished_early:
            self._finish(r, "length" if batch.stuck is None else "abort", error=batch.stuck)
        self.stats.retracted_requests_total = self.scheduler.retracted_total
        self.stats.preempted_requests_total = self.scheduler.preempted_total
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
        ins = batch_inputs.collect(batch, self._inflight)
        for i, r in enumerate(batch.reqs):
            speculating = bool(batch.drafts and batch.drafts.get(i))  # (its prompt was counted at its prefill)
            if not speculating and r.num_cached_tokens is not None and not r.prompt_counted:
                r.prompt_counted = True
                self.stats.prompt_tokens_total += len(r.prompt_ids)
                self.stats.cached_tokens_total += r.num_cached_tokens
                self.kv.salts.add(r.salt, "prompt_tokens_total", len(r.prompt_ids))
                self.kv.salts.add(r.salt, "cached_tokens_total", r.num_cached_tokens)
                if self.auditor is not None:
                    self.auditor.on_hit(r)
        sampled, holes = ins.sampled, ins.holes
        step = Step(batch, [r.row for r in batch.reqs], sampled, [r.epoch for r in sampled], StepFence(self.device))
        for r, n in zip(batch.reqs, batch.num_tokens):
            if n > 1:
                r.chunk_step = step
        self.kv.write_fence = step.fence
        step.holes, step.scored, step.num_ends = holes, ins.scored, len(ins.ends) + len(ins.spec_ends)
        step.spec = ins.spec
        try:
            self.kv.table.flush()
            fb = ForwardBatch.build(
                req_pool_indices=[r.row for r in batch.reqs],
                prefix_lens=batch.prefix_lens,
                extend_tokens=ins.extend_tokens,
                out_cache_loc=[s for slots in batch.slots for s in slots],
                req_to_token=self.kv.table.table,
                logits_indices=(ins.ends + ins.spec_ends + ins.extra) or [ins.num_tokens - 1],
                device=self.device,
                prefix_groups=(self.prefix_grouper.groups(batch.reqs)
                               if self.prefix_grouper is not None and not ins.spec
                               and all(n == 1 for n in batch.num_tokens) else None),
            )
            fb.kv_ready = self.kv.tiers.load_waiter(batch.reqs)  # host-tier loads into their paths (None: nothing)
            if any(r.images is not None for r in batch.reqs):
                fb.mm = batch_inputs.images_of(self.encoder, self.runner.model, batch, self.device)
            fb.lora = self.scheduler.lora_batch(batch, fb.extend_lens_cpu)  # None: the base model alone
            if holes:
                idx = torch.tensor([holes, ins.hole_rows], dtype=torch.int64)
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
            if self.spec is not None:
                self.spec.after_forward(fb)  # a draft model's K/V at the same slots
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
        if step.spec:
            step.spec_logits = logits[len(step.sampled): step.num_ends]
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
        self.masks.submit(step, rows, background)

    def draw(self, step: Step) -> None:
        """Wait for the step's masks, then penalties, masks and the draw on the device; host copies start."""
        if step.sampled:
            step.result = self._sample(step.logits, step.sampled, step.live, step.masks)
        step.logits = step.masks = None

    def _sample(self, logits: torch.Tensor, reqs: list[Req], live: list[bool], masks=None
                ) -> DeviceSample | HostSample:
        """Sample the batch on the device. If that raises (a mask fill included), its rows are sampled one by
        one (synchronously): the failing request(s) are aborted with the error, their neighbours go on. Rows
        of an aborted request and stale rows are marked not live."""
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            apply = None
            if masks is not None:
                bitmask = masks.result()
                self.masks.finish(reqs, masks)
                apply = lambda logits: self.masks.apply(logits, bitmask)  # noqa: E731
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
                one = self.sampler.sample(logits[i: i + 1], [r], self.masks.row_fn([r], [True]), self.eos_token_ids)
                toks[i], lps[i] = one.token_ids[0], one.logprobs[0]
            except Exception as e:
                log.error("sampling failed for %s: %s", r.rid, traceback.format_exc())
                self._finish(r, "abort", error=f"internal error in sampling: {e}")
                live[i] = False
        return HostSample(torch.tensor(toks, dtype=torch.int64, device=logits.device), SampleOutput(toks, lps))

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
        if step.spec:
            self.spec.verify_step(self, step.spec, step.spec_logits, now)
            step.spec_logits = None
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
        if self.events.observers:
            self.events.emit("tokens", req=r, num=len(adv.new_tokens), now=now)
        self._outbox.append((self._text_states.get(r), r.sink, postprocess.step_output(r, adv, logprobs)))
        if adv.finish_reason is not None:
            self._release(r)

    def fail_request(self, r: Req, what: str, e: Exception) -> None:
        """A per-request failure in `what`: logged, and r alone is aborted with the error."""
        log.error("%s failed for %s: %s", what, r.rid, traceback.format_exc())
        self._finish(r, "abort", error=f"internal error in {what}: {e}")

    # ------------------------------------------------------------------ finishing
    def _finish(self, r: Req, reason: str, error: str | None = None) -> None:
        """Finish r without a new token (abort, length-out-of-memory, prefill-only, stop string)."""
        if r.finish_reason is not None and r.state.value == "finished":
            return
        r.finish_reason = reason
        r.error = error
        if reason == "abort":
            self.stats.aborted_requests_total += 1
        self._outbox.append((self._text_states.get(r), r.sink, postprocess.final_output(r, reason, error)))
        if not self._in_step:
            self.flush_outputs()
        self._release(r)

    def _release(self, r: Req) -> None:
        # The outputs already produced carry the text state; the worker's link to it goes (DetokState refers to
        # the Req), so a finished request is freed by reference counting, not by a GC pause.
        if self.detokenizer is not None:
            self.detokenizer.finished(r)
        self.scheduler.remove(r)
        if self.spec is not None:
            self.spec.finished(r)
        samples = self.requests.get(r.rid)
        if samples is not None and all(s.state.value == "finished" for s in samples):
            del self.requests[r.rid]
        if self.events.observers:
            self.events.emit("finished", req=r, now=time.monotonic())

    def close(self) -> None:
        """Stop the mask worker (after drain: nothing is in flight)."""
        self.masks.close()

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
        """A copy of the engine's counters with the gauges read now (loop thread)."""
        return stats.snapshot(self.stats, self.kv, self.scheduler, self.auditor, self.scheduler.adapters)
