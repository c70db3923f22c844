"""Sampler: logits of the sampled rows -> next tokens, with every SamplingParams knob, batched.

Order per row: penalties (repetition on prompt+output, frequency/presence on output) -> grammar mask ->
greedy argmax, or temperature -> top-k / top-p / min-p -> draw. Rows with a seed draw from their own
torch.Generator (reproducible whatever the batch); others share the engine's generator.
Logprobs are reported from the raw model distribution (before penalties, masks and temperature), as
OpenAI and vLLM do, so they are comparable across requests and usable for select scoring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrt.engine.request import Req


@dataclass
class SampleOutput:
    token_ids: list[int]
    # per row: None, or (token logprob, [(token_id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req], bitmask_fn=None,
               eos_token_ids: tuple[int, ...] | set[int] = ()) -> SampleOutput:
        """logits: [B, V] float32, row i for reqs[i]. bitmask_fn(logits) applies grammar masks in place.
        eos_token_ids: masked (with the request's stop_token_ids) in rows below their min_new_tokens.
        Returns one token per row."""
        raw = logits
        held = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens]
        if any(r.params.has_penalties for r in reqs) or bitmask_fn or held:
            logits = logits.clone()
        for i, r in enumerate(reqs):
            if r.params.has_penalties:
                self._apply_penalties(logits[i], r)
        for i in held:
            ids = sorted(set(eos_token_ids) | set(reqs[i].params.stop_token_ids or ()))
            logits[i, ids] = float("-inf")
        if bitmask_fn is not None:
            bitmask_fn(logits)

        greedy = [r.params.greedy for r in reqs]
        tokens = torch.empty(len(reqs), dtype=torch.int64, device=logits.device)
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            g_rows = [i for i, g in enumerate(greedy) if g]
            s_rows = [i for i, g in enumerate(greedy) if not g]
            if g_rows:
                gi = torch.tensor(g_rows, device=logits.device)
                tokens[gi] = logits[gi].argmax(dim=-1)
            si = torch.tensor(s_rows, device=logits.device)
            tokens[si] = self._sample_rows(logits[si], [reqs[i] for i in s_rows])
        token_list = tokens.tolist()

        lps: list = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            rows = torch.log_softmax(raw[want].float(), dim=-1)
            for j, i in enumerate(want):
                k = reqs[i].params.logprobs
                tok_lp = rows[j, token_list[i]].item()
                top = []
                if k:
                    v, ix = rows[j].topk(k)
                    top = list(zip(ix.tolist(), v.tolist()))
                lps[i] = (tok_lp, top)
        return SampleOutput(token_list, lps)

    # ------------------------------------------------------------------ pieces
    def _apply_penalties(self, row: torch.Tensor, r: Req) -> None:
        p = r.params
        dev = row.device
        if p.repetition_penalty != 1.0 and r.all_ids:
            ids = torch.tensor(sorted(set(r.all_ids)), device=dev)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, device=dev)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in reqs], device=dev, dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        need_filter = any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs)
        if need_filter:
            vals, idx = logits.sort(dim=-1, descending=True)
            probs = torch.softmax(vals, dim=-1)
            V = vals.shape[1]
            ks = torch.tensor([r.params.top_k if r.params.top_k > 0 else V for r in reqs], device=dev)
            ps = torch.tensor([r.params.top_p for r in reqs], device=dev, dtype=probs.dtype)
            mps = torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=probs.dtype)
            rank = torch.arange(V, device=dev).unsqueeze(0)
            cum = probs.cumsum(dim=-1)
            drop = (rank >= ks.unsqueeze(1)) | ((cum - probs) > ps.unsqueeze(1))
            drop |= probs < (mps.unsqueeze(1) * probs[:, :1])
            drop[:, 0] = False  # the most likely token always survives
            vals = vals.masked_fill(drop, float("-inf"))
            probs = torch.softmax(vals, dim=-1)
            choice = self._draw(probs, reqs)
            return idx.gather(1, choice.unsqueeze(1)).squeeze(1)
        return self._draw(torch.softmax(logits, dim=-1), reqs)

    def _draw(self, probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        out = torch.empty(len(reqs), dtype=torch.int64, device=probs.device)
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if shared:
            si = torch.tensor(shared, device=probs.device)
            out[si] = torch.multinomial(probs[si], 1, generator=self.generator).squeeze(1)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=r.generator).squeeze(0)
        return out
