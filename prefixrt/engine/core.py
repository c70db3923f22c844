"""EngineCore: the scheduler loop's body. One step = schedule -> forward -> sample -> post-process.

Runs on one thread (the loop thread); everything it owns (scheduler, KV, requests) is touched only there.
Per-request failures (a grammar error, a bad token) abort that request alone; a failing forward aborts the
requests of that batch and the loop goes on.
"""

from __future__ import annotations

import logging
import time
import traceback

import torch

from prefixrt.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from prefixrt.engine.scheduler import ScheduledBatch, Scheduler
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.outputs import EngineStats
from prefixrt.request import Req
from prefixrt.sampling.sampler import Sampler

log = logging.getLogger("prefixrt")


class EngineCore:
    def __init__(
        self,
        runner,
        scheduler: Scheduler,
        sampler: Sampler,
        tokenizer,
        tokenizer_lock,
        eos_token_ids: list[int],
        vocab_size: int,
        max_context: int,
        device: torch.device,
        debug: bool = False,
        bitmask_ops=None,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.tokenizer_lock = tokenizer_lock
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = device
        self.debug = debug
        self.bitmask_ops = bitmask_ops  # constrained/logits.py (allocate_bitmask, apply_token_bitmask), or None
        self.prefix_grouper = None  # engine/prefix_groups.PrefixGrouper: shared-prefix groups for decode batches
        self.grammar_backend = None  # set by the Engine once it builds its GrammarBackend
        self.requests: dict[str, list[Req]] = {}  # request_id -> its samples
        self.stats = EngineStats()
        self.metrics_hook = None  # optional callable(event, **values) for Prometheus
        # Hands one step's [(sink, StepOutput)] to their consumers (the engine process replaces it).
        self.deliver = RequestStream.push_many
        self._outbox: list = []  # (stream, StepOutput) produced this step, delivered together
        self._in_step = False
        self.auditor = None  # CacheAuditor when cache_audit_rate > 0 (set by the builder)

    # ------------------------------------------------------------------ requests in and out
    def add(self, reqs: list[Req]) -> None:
        self.requests.setdefault(reqs[0].rid, []).extend(reqs)
        self.stats.requests_total += 1
        for r in reqs:
            try:
                if r.params.seed is not None:
                    r.generator = self.sampler.make_generator(r.params.generator_seed(r.index))
                if r.params.stop:
                    r.detok = IncrementalDetokenizer(self.tokenizer, r.params.skip_special_tokens,
                                                     self.tokenizer_lock)
                self.scheduler.add(r)
            except Exception as e:  # registered but not runnable: finish it now, never leave it hanging
                log.error("request %s could not be added: %s", r.rid, traceback.format_exc())
                self._finish(r, "abort", error=f"internal error adding the request: {e}")

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> None:
        for r in list(self.requests.get(rid, [])):
            if r.finish_reason is None:
                self._finish(r, reason, error=error)

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False
            self.flush_outputs()
            if self.auditor is not None:
                self._run_audits()

    def _run_audits(self) -> None:
        """Cache audits run after a step's outputs are out (cache_audit.py says when); never fatal."""
        try:
            self.auditor.run(idle=not self.scheduler.has_work)
        except Exception:
            log.error("cache audit failed: %s", traceback.format_exc())

    def flush_outputs(self) -> None:
        if self._outbox:
            out, self._outbox = self._outbox, []
            self.deliver(out)

    def _step(self) -> bool:
        batch = self.scheduler.schedule()
        for r in batch.finished_early:
            self._finish(r, "length")
        self.stats.retracted_requests_total = self.scheduler.retracted_total
        if batch.is_empty:
            return False
        try:
            logits, sampled = self._forward(batch)
        except Exception as e:  # a failing forward takes down its batch, not the engine
            log.error("forward failed: %s", traceback.format_exc())
            for r in list(batch.reqs):
                self._finish(r, "abort", error=f"internal error in forward: {e}")
            return True
        self.stats.forward_passes_total += 1
        if sampled:
            for r, tok, lp in self._sample(logits, sampled):
                try:
                    self._on_token(r, tok, lp)
                except Exception as e:
                    log.error("post-processing failed: %s", traceback.format_exc())
                    self._finish(r, "abort", error=f"internal error in post-processing: {e}")
        for r, n, s in zip(batch.reqs, batch.num_tokens, batch.sample):
            if r.finish_reason is not None:
                continue
            if s and r.params.max_new_tokens == 0:  # cache_prefix / prefill-only request
                self._finish(r, "length")
            elif n > 1:
                self.kv.cache_unfinished(r)  # publish the prefill chunk: later arrivals reuse it
        if self.debug and not self.scheduler.has_work:
            self.kv.check_integrity()
        return True

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[tuple[Req, int, object]]:
        """(request, token, logprobs) for each row of logits. If sampling the batch raises, its rows are
        sampled one by one: the failing request(s) are aborted with the error, their neighbours go on (seeded
        ones from their generator's state before the failed attempt, so they draw what they would have)."""
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            out = self.sampler.sample(logits, reqs, self._mask_fn(reqs), self.eos_token_ids)
            return list(zip(reqs, out.token_ids, out.logprobs))
        except Exception:
            log.error("sampling a batch of %d failed, isolating: %s", len(reqs), traceback.format_exc())
        for g, state in seeded:
            g.set_state(state)
        results = []
        for i, r in enumerate(reqs):
            try:
                out = self.sampler.sample(logits[i : i + 1], [r], self._mask_fn([r]), self.eos_token_ids)
                results.append((r, out.token_ids[0], out.logprobs[0]))
            except Exception as e:
                log.error("sampling failed for %s: %s", r.rid, traceback.format_exc())
                self._finish(r, "abort", error=f"internal error in sampling: {e}")
        return results

    def _forward(self, batch: ScheduledBatch):
        ends, acc = [], 0
        sampled: list[Req] = []
        scored: list[tuple[Req, list[int]]] = []  # (request, positions whose next-token logprob it wants)
        extra: list[int] = []
        for r, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.num_tokens, batch.sample):
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
                if self.auditor is not None:
                    self.auditor.on_hit(r)
        self.kv.table.flush()
        fb = ForwardBatch.build(
            req_pool_indices=[r.row for r in batch.reqs],
            prefix_lens=batch.prefix_lens,
            extend_tokens=[r.all_ids[p : p + n] for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.num_tokens)],
            out_cache_loc=[s for slots in batch.slots for s in slots],
            req_to_token=self.kv.table.table,
            logits_indices=(ends + extra) or [acc - 1],
            device=self.device,
            prefix_groups=(self.prefix_grouper.groups(batch.reqs)
                           if self.prefix_grouper is not None and all(n == 1 for n in batch.num_tokens) else None),
        )
        logits = self.runner.forward(fb)
        if scored:
            rows = torch.log_softmax(logits[len(ends):].float(), dim=-1)
            k = 0
            for r, pos in scored:
                targets = torch.tensor([r.all_ids[j + 1] for j in pos], device=rows.device)
                r.input_logprobs.extend(rows[k : k + len(pos)].gather(1, targets[:, None]).squeeze(1).tolist())
                k += len(pos)
        return logits[: len(sampled)], sampled

    def _mask_fn(self, reqs: list[Req]):
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows or self.bitmask_ops is None:
            return None

        def apply(logits: torch.Tensor) -> None:
            # Runs while the GPU still computes the forward (nothing has synchronised yet).
            bitmask = self.bitmask_ops.allocate_bitmask(len(reqs), logits.shape[1])  # all-ones: rows stay free
            if self.grammar_backend is not None:  # the backend fills rows in parallel where it can
                self.grammar_backend.fill_bitmasks([(reqs[i].matcher, i) for i in rows], bitmask)
            else:
                for i in rows:
                    reqs[i].matcher.fill_bitmask(bitmask, i)
            self.bitmask_ops.apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))

        return apply

    # ------------------------------------------------------------------ per-token post-processing
    def _on_token(self, r: Req, tok: int, lp) -> None:
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
        new = r.pending_emit + [tok]
        r.pending_emit = []
        reason, matched = None, None
        p = r.params
        if tok in (p.stop_token_ids or ()) or (tok in self.eos_token_ids and not p.ignore_eos):
            reason, matched = "stop", tok
        r.append_output([tok])
        logprobs = None
        if lp is not None:
            logprobs = [self._logprob_entry(f, (0.0, [])) for f in new[:-1]] + [self._logprob_entry(tok, lp)]
        if reason is None and r.matcher is not None:
            if not r.matcher.accept_token(tok):
                raise RuntimeError(f"grammar rejected sampled token {tok}")
            if r.matcher.is_finished():
                reason = "stop"
            elif p.jump_forward:
                forced = r.matcher.forced_tokens()[: max(0, r.remaining_new_tokens)]
                forced = forced[: max(0, self.max_context - r.seq_len)]
                for f in forced:
                    if not r.matcher.accept_token(f):
                        raise RuntimeError(f"grammar rejected its own forced token {f}")
                if forced:
                    r.append_output(forced)
                    r.num_forced_tokens += len(forced)
                    new.extend(forced)
                    if logprobs is not None:
                        logprobs.extend(self._logprob_entry(f, (0.0, [])) for f in forced)
                    if r.matcher.is_finished():
                        reason = "stop"
        text = None
        if r.detok is not None:
            text_ids = r.output_ids[:-1] if isinstance(matched, int) else r.output_ids
            before = len(r.text)
            r.text += r.detok.step(text_ids)
            hit = find_stop(r.text, p.stop, before)
            if hit is not None:
                r.text = r.text[: hit[0]]
                reason, matched = "stop", hit[1]
            emitted = r.num_emitted_chars
            upto = len(r.text) if reason else len(r.text) - stop_holdback(r.text, p.stop)
            text = r.text[emitted:upto]
            r.num_emitted_chars = max(emitted, upto)
        if reason is None and len(r.output_ids) >= p.max_new_tokens:
            reason = "length"
        if reason is None and r.seq_len >= self.max_context:
            reason = "length"
        self.stats.generated_tokens_total += len(new)
        r.finish_reason = reason
        r.matched_stop = matched
        if self.metrics_hook is not None:
            self.metrics_hook("tokens", req=r, num=len(new), now=now)
        self._outbox.append((r.sink, StepOutput(
            index=r.index, token_ids=new, text=text, logprobs=logprobs,
            finished=reason is not None, finish_reason=reason, matched_stop=matched,
            prompt_tokens=len(r.prompt_ids), cached_tokens=r.num_cached_tokens or 0,
            final_text=r.text if (reason and r.detok is not None) else None,
        )))
        if reason is not None:
            self._release(r)

    def _logprob_entry(self, tok: int, lp) -> dict:
        tok_lp, top = lp
        return {
            "token_id": tok, "token": self._tok_str(tok), "logprob": tok_lp,
            "top_logprobs": [{"token_id": t, "token": self._tok_str(t), "logprob": v} for t, v in top],
        }

    def _tok_str(self, tok: int) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode([tok])

    # ------------------------------------------------------------------ finishing
    def _finish(self, r: Req, reason: str, error: str | None = None) -> None:
        """Finish r without a new token (abort, length-out-of-memory, prefill-only)."""
        if r.finish_reason is not None and r.state.value == "finished":
            return
        r.finish_reason = reason
        r.error = error
        if reason == "abort":
            self.stats.aborted_requests_total += 1
        text = None
        if r.detok is not None:
            text = r.text[r.num_emitted_chars:]
        self._outbox.append((r.sink, StepOutput(
            index=r.index, token_ids=[], text=text, finished=True, finish_reason=reason,
            prompt_tokens=len(r.prompt_ids), cached_tokens=r.num_cached_tokens or 0, error=error,
            final_text=r.text if r.detok is not None else None,
            input_logprobs=r.input_logprobs if r.input_logprobs_from is not None else None,
        )))
        if not self._in_step:
            self.flush_outputs()
        self._release(r)

    def _release(self, r: Req) -> None:
        self.scheduler.remove(r)
        samples = self.requests.get(r.rid)
        if samples is not None and all(s.state.value == "finished" for s in samples):
            del self.requests[r.rid]
        if self.metrics_hook is not None:
            self.metrics_hook("finished", req=r, now=time.monotonic())

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
        if self.auditor is not None:
            s.cache_audits_total = self.auditor.audits_total
            s.cache_audit_mismatches_total = self.auditor.mismatches_total
        return EngineStats(**s.to_dict())
