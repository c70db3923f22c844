"""Speculative decoding in the step loop: drafts before the forward, verification after it.

plan(batch)      for each decode row that may speculate: ask the drafter for k tokens (the adaptive length
                 says k; a grammar keeps the prefix it accepts), give them pool slots (KVManager.extend) and
                 record them in batch.drafts. The forward then feeds the row's last token + its drafts as one
                 short extend (a chain) and returns logits at every one of those positions.
verify(step)     per speculating row, position by position: the token the plain sampler would take there (the
                 request's state -- penalties, grammar matcher, min_new_tokens -- advanced by the tokens
                 already emitted), greedy argmax or rejection sampling (speculative/rejection.py); each token
                 is post-processed like any sampled token (stop tokens, stop strings, grammar, max_tokens,
                 jump-forward) and the row stops at the first rejected draft, the bonus token after the last,
                 or when the request finishes. kv_len covers exactly the accepted tokens; the slots of the
                 rejected drafts are freed at once (KVManager.truncate). Accepted tokens' K/V is a request's
                 own K/V like any output and enters the tree when it is published.
Greedy rows therefore emit exactly what plain decoding emits; sampled rows keep the target distribution (the
row's seeded generator draws the uniforms, so a seed reproduces a run, though not plain decoding's stream).
Speculation runs in the synchronous loop only (the engine turns the overlap scheduler off when it is on);
rows with images, prompt logprobs or `speculative=False` never speculate.
"""

from __future__ import annotations

import time

import torch

from prefixrt.engine.loop.scheduler import ScheduledBatch
from prefixrt.request import Req
from prefixrt.sampling.sampler import sampling_probs
from prefixrt.speculative.draft_length import AdaptiveDraftLength
from prefixrt.speculative.drafter import Drafter
from prefixrt.speculative.rejection import verify_draft


class Speculator:
    def __init__(self, drafter: Drafter, kv, lengths: AdaptiveDraftLength, max_context: int):
        self.drafter = drafter
        self.kv = kv
        self.lengths = lengths
        self.max_context = max_context

    def finished(self, r: Req) -> None:
        """r finished: the drafter may learn from it; what the drafter and the draft length kept about it goes."""
        self.drafter.on_finished(r)
        self.lengths.forget(r)

    # ------------------------------------------------------------------ before the forward
    def _eligible(self, r: Req, n: int, sample: bool) -> bool:
        p = r.params
        return (n == 1 and sample and p.speculative and p.max_new_tokens > 0 and r.images is None
                and r.input_logprobs_from is None and r.num_unresolved == 0 and r.kv_len == len(r.all_ids))

    def plan(self, batch: ScheduledBatch, stats) -> None:
        decode = [i for i, (r, n, s) in enumerate(zip(batch.reqs, batch.num_tokens, batch.sample))
                  if self._eligible(r, n, s)]
        if not decode:
            return
        t0 = time.perf_counter()
        rows = []  # (batch index, request, k)
        for i in decode:
            r = batch.reqs[i]
            # never draft past max_tokens (the bonus token is the last) nor the context
            room = min(r.remaining_new_tokens - 1, self.max_context - len(r.all_ids) - 1)
            k = min(self.lengths.length(r, len(decode)), room)
            if k > 0:
                rows.append((i, r, k))
        if hasattr(self.drafter, "propose_in_slots"):
            self._plan_in_slots(batch, rows)
        else:
            for i, r, k in rows:
                drafts = [t for t in self.drafter.propose(r, k, self.kv.cache)[:k] if isinstance(t, int)]
                if r.matcher is not None:
                    drafts = self._grammar_filter(r, drafts, k)
                if not drafts or not self.kv.ensure_pages(self.kv.pages_for(r, len(drafts))):
                    continue
                batch.slots[i] = batch.slots[i] + self.kv.extend(r, len(drafts))
                r.kv_len += len(drafts)
                batch.drafts[i] = drafts
        stats.spec_drafter_seconds_total += time.perf_counter() - t0

    def _plan_in_slots(self, batch: ScheduledBatch, rows: list) -> None:
        """A drafter that runs a model in the rows' own slots (engine/loop/draft_model.py): k slots per row
        first, then the drafts; slots past what the grammar keeps are freed at once."""
        held = []
        for i, r, k in rows:
            if not self.kv.ensure_pages(self.kv.pages_for(r, k)):
                continue
            new = self.kv.extend(r, k)
            r.kv_len += k
            held.append((i, r, k, new))
        if not held:
            return
        proposals = self.drafter.propose_in_slots([(r, k, batch.slots[i][-1:] + new) for i, r, k, new in held])
        for (i, r, k, new), drafts in zip(held, proposals):
            drafts = drafts[:k]
            if r.matcher is not None:
                drafts = self._grammar_filter(r, drafts, k)
            if len(drafts) < k:
                r.kv_len -= k - len(drafts)
                self.kv.truncate(r)
            if drafts:
                batch.slots[i] = batch.slots[i] + new[: len(drafts)]
                batch.drafts[i] = drafts

    def after_forward(self, fb) -> None:
        """A target forward ran: a drafter with a model of its own mirrors it (draft_model.py)."""
        mirror = getattr(self.drafter, "mirror", None)
        if mirror is not None:
            mirror(fb)

    @staticmethod
    def _grammar_filter(r: Req, drafts: list[int], k: int) -> list[int]:
        """The prefix of drafts the grammar accepts (the matcher is rolled back after); with jump-forward off
        and no drafts, the grammar's forced tokens are the drafts."""
        m = r.matcher
        if not drafts and not r.params.jump_forward:
            drafts = m.forced_tokens()[:k]
        if not drafts or m.is_finished():
            return []
        n = m.accept_tokens(drafts)
        m.rollback(n)
        return drafts[:n]

    # ------------------------------------------------------------------ after the forward
    @staticmethod
    def plain_greedy(r: Req) -> bool:
        """A greedy row whose adjusted logits are its raw logits at every position it may verify (no penalties,
        bias, grammar, min_new_tokens hold or logprobs): its tokens are the raw argmaxes, taken for all such rows
        of a step in one device op (the fast path; _token is the reference)."""
        p = r.params
        return (p.greedy and r.matcher is None and not p.has_penalties and not p.logit_bias
                and p.logprobs is None and len(r.output_ids) >= p.min_new_tokens)

    def verify_step(self, core, spec: list, logits: torch.Tensor, now: float) -> None:
        """Every speculating row of a step (Step.spec), in order; logits: their rows (Step.spec_logits)."""
        fast = None
        if any(self.plain_greedy(r) for r, *_ in spec):
            fast = logits.argmax(dim=-1).tolist()  # one host copy for the step
        for r, drafts, off, epoch in spec:
            argmax = fast[off: off + len(drafts) + 1] if fast is not None and self.plain_greedy(r) else None
            try:
                self.verify(core, r, logits[off: off + len(drafts) + 1], drafts, epoch, now, argmax)
            except Exception as e:
                core.fail_request(r, "speculative verification", e)

    def verify(self, core, r: Req, raw: torch.Tensor, drafts: list[int], epoch: int, now: float,
               argmax: list[int] | None = None) -> None:
        """r's logits raw [k+1, V] at its last token and its k drafts: emit the verified tokens (see the module
        docstring). core: the EngineCore (its sampler, masks and post-processing); argmax: raw's argmaxes when r
        is plain_greedy (the fast path), else None."""
        k = len(drafts)
        base = r.kv_len - k  # K/V valid before the drafts: the tokens up to and including the last one
        stats = core.stats
        if r.finish_reason is not None or r.epoch != epoch or r.row is None:
            return  # finished meanwhile: its K/V (drafts included) went back with it
        stats.spec_verify_rows_total += 1
        stats.spec_draft_tokens_total += k
        accepted = 0
        for i in range(k + 1):
            r.kv_len = base + i  # positions [0, base + i) hold the accepted tokens' K/V
            draft = drafts[i] if i < k else None
            if argmax is not None:
                tok, lp = argmax[i], None
            else:
                tok, lp = self._token(core, r, raw[i: i + 1], draft)
            length = len(r.all_ids)
            core._post_process(r, tok, lp, now)
            stats.spec_emitted_tokens_total += 1
            if draft is None or tok != draft:
                break
            accepted += 1
            if r.finish_reason is not None or len(r.all_ids) != length + 1:  # finished, or forced tokens follow
                break
        stats.spec_accepted_tokens_total += accepted
        self.lengths.update(r, k, accepted)
        if r.finish_reason is None and r.row is not None:
            self.kv.truncate(r)  # the rejected drafts' slots

    @staticmethod
    def _token(core, r: Req, raw: torch.Tensor, draft: int | None):
        """The token at one position, as the plain sampler would take it given r's state now, with the draft
        verified against it; and its logprob entry (from the raw distribution, as the sampler reports it)."""
        sampler = core.sampler
        logits = sampler.adjust_logits(raw, [r], core.masks.row_fn([r], [True]), core.eos_token_ids)
        p = r.params
        if p.greedy:
            tok = int(logits[0].argmax().item())
        else:
            probs = sampling_probs(logits, [p])[0]
            gen = r.generator if r.generator is not None else sampler.generator
            if draft is None:
                tok = int(torch.multinomial(probs, 1, generator=gen).item())
            else:
                tok, _ = verify_draft(probs, draft, gen)
        lp = None
        if p.logprobs is not None:
            row = torch.log_softmax(raw[0].float(), dim=-1)
            top_v, top_i = row.topk(max(p.logprobs, 1))
            lp = (float(row[tok]), list(zip(top_i.tolist()[: p.logprobs], top_v.tolist()[: p.logprobs])))
        return tok, lp
