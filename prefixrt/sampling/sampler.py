"""Sampler: logits of the sampled rows -> next tokens, with every SamplingParams knob, batched.

Order per row: penalties (repetition on prompt+output, frequency/presence on output) -> logit_bias -> grammar mask ->
greedy argmax, or temperature -> top-k / top-p / min-p -> draw. `adjust_logits` (penalties, masks) and
`sampling_probs` (the filtered distribution) are row-wise: a row's distribution never depends on its batch
neighbours. Rows with a seed draw from their own torch.Generator (reproducible whatever the batch); others
share the engine's generator.
Logprobs are reported from the raw model distribution (before penalties, masks and temperature), as
OpenAI and vLLM do, so they are comparable across requests and usable for select scoring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrt.request import Req


@dataclass
class SampleOutput:
    token_ids: list[int]
    # per row: None, or (token logprob, [(token_id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


@dataclass
class DeviceSample:
    """One step's samples, still on the device; the host copies start at once (into pinned memory on CUDA) and
    read() returns them once the device is done. Nothing here synchronises until read()."""

    token_ids: torch.Tensor  # [B] int64 on the device
    want: list[int]  # rows that asked for logprobs
    ks: list[int]  # their top-k
    _host: list[torch.Tensor]  # [tokens, (token logprobs, top values, top ids)] being copied to the host
    _event: object = None

    def read(self) -> SampleOutput:
        if self._event is not None:
            self._event.synchronize()
        toks = self._host[0].tolist()
        lps: list = [None] * len(toks)
        if self.want:
            tok_lp, top_v, top_i = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self.want):
                k = self.ks[j]
                lps[i] = (tok_lp[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return SampleOutput(toks, lps)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list as a device tensor without synchronising: on CUDA through pinned memory with a
    non-blocking copy (a copy from pageable memory waits for the stream, i.e. for the forward in flight;
    torch's pinned allocator keeps the buffer until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors], None
    host = []
    for t in tensors:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event()
    event.record()
    return host, event


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
    def adjust_logits(self, logits: torch.Tensor, reqs: list[Req], bitmask_fn=None,
                      eos_token_ids: tuple[int, ...] | set[int] = ()) -> torch.Tensor:
        """Penalties, logit_bias, min_new_tokens holds, then grammar masks, row by row: the logits greedy rows
        argmax and sampled rows scale. A row below its min_new_tokens gets eos_token_ids and its stop_token_ids
        masked. Returns a new tensor when anything applies, else logits itself (never modified)."""
        held = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens]
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if not (any(r.params.has_penalties for r in reqs) or bitmask_fn or held or biased):
            return logits
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if r.params.has_penalties:
                self._apply_penalties(logits[i], r)
        for i in biased:
            self._apply_logit_bias(logits[i], reqs[i].params.logit_bias)
        for i in held:
            V = logits.shape[1]  # stop ids past the vocabulary can never be sampled: nothing to hold
            ids = sorted(t for t in set(eos_token_ids) | set(reqs[i].params.stop_token_ids or ()) if t < V)
            if ids:
                logits[i, to_device(ids, logits.device)] = float("-inf")
        if bitmask_fn is not None:
            bitmask_fn(logits)
        return logits

    def sample(self, logits: torch.Tensor, reqs: list[Req], bitmask_fn=None,
               eos_token_ids: tuple[int, ...] | set[int] = ()) -> SampleOutput:
        """logits: [B, V] float32, row i for reqs[i]. bitmask_fn(logits) applies grammar masks in place;
        eos_token_ids are held back in rows below their min_new_tokens. Returns one token per row (waits for
        the device)."""
        return self.sample_on_device(logits, reqs, bitmask_fn, eos_token_ids).read()

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, reqs: list[Req], bitmask_fn=None,
                         eos_token_ids: tuple[int, ...] | set[int] = (), live: list[bool] | None = None
                         ) -> DeviceSample:
        """As sample(), without waiting for the device: tokens stay on it (the next step's input ids are
        gathered from them) and their host copies start. Rows with live[i] False (stale or finished: their
        token is discarded) are taken greedily, without logprobs or random draws, so a request's own generator
        advances exactly once per token it keeps."""
        live = live if live is not None else [True] * len(reqs)
        raw = logits
        logits = self.adjust_logits(logits, reqs, bitmask_fn, eos_token_ids)

        greedy = [r.params.greedy or not ok for r, ok in zip(reqs, live)]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(reqs), dtype=torch.int64, device=logits.device)
            g_rows = [i for i, g in enumerate(greedy) if g]
            s_rows = [i for i, g in enumerate(greedy) if not g]
            if g_rows:
                gi = to_device(g_rows, logits.device)
                tokens[gi] = logits[gi].argmax(dim=-1)
            si = to_device(s_rows, logits.device)
            tokens[si] = self._sample_rows(logits[si], [reqs[i] for i in s_rows])

        want = [i for i, r in enumerate(reqs) if live[i] and r.params.logprobs is not None]
        parts = [tokens]
        ks: list[int] = []
        if want:
            wi = to_device(want, logits.device)
            rows = torch.log_softmax(raw[wi].float(), dim=-1)  # [W, V]
            ks = [reqs[i].params.logprobs for i in want]
            tok_lp = rows.gather(1, tokens[wi].unsqueeze(1)).squeeze(1)  # [W]
            top_v, top_i = rows.topk(max(max(ks), 1), dim=-1)  # [W, K]
            parts += [tok_lp, top_v, top_i]
        host, event = _to_host(parts)
        return DeviceSample(tokens, want, ks, host, event)

    # ------------------------------------------------------------------ pieces
    def _apply_penalties(self, row: torch.Tensor, r: Req) -> None:
        p = r.params
        dev = row.device
        if p.repetition_penalty != 1.0 and r.all_ids:
            seen = set(r.all_ids)
            if r.images is not None:  # image positions hold (key, offset) pairs: the model saw its image token
                seen = {t if t.__class__ is int else r.images.image_token_id for t in seen}
            ids = to_device(sorted(seen), dev)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            out = to_device(r.output_ids, dev)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
        """row[V] += bias at its token ids (ids were checked against the vocabulary at submission)."""
        ids = to_device(list(bias), row.device)
        row[ids] += to_device(list(bias.values()), row.device, row.dtype)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        return self._draw(sampling_probs(logits, [r.params for r in reqs]), reqs)

    def _draw(self, probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """One token per row of probs [B, V]. Rows with their own generator draw from it alone, so their
        tokens depend only on their own distribution and seed, whatever the batch."""
        out = torch.empty(len(reqs), dtype=torch.int64, device=probs.device)
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if shared:
            si = to_device(shared, probs.device)
            out[si] = torch.multinomial(probs[si], 1, generator=self.generator).squeeze(1)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=r.generator).squeeze(0)
        return out


def sampling_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The distribution each sampled row draws from: probs [B, V] (vocabulary order) of
    softmax(logits / temperature) after top-k, top-p and min-p filtering. Pure and batched, no host sync.

    Row i depends only on logits[i] and params[i] (the property tests check this bit for bit): every op is
    row-wise, and a row whose filters are off goes through the same ops as when its neighbours' are on, with
    nothing dropped. top_k is clamped to the vocabulary; the most likely token always survives.
    logits: [B, V] float (penalties and grammar masks already applied); params: B SamplingParams (not greedy).
    """
    dev = logits.device
    B, V = logits.shape
    temps = to_device([p.temperature for p in params], dev, logits.dtype)
    scaled = logits / temps.unsqueeze(1)  # [B, V]
    probs = torch.softmax(scaled, dim=-1)
    topk = [p.top_k if 0 < p.top_k < V else V for p in params]
    use_sort = any(k < V for k in topk) or any(p.top_p < 1 for p in params)
    use_min_p = any(p.min_p > 0 for p in params)
    if not (use_sort or use_min_p):
        return probs
    drop = torch.zeros(B, V, dtype=torch.bool, device=dev)
    if use_sort:
        sorted_probs, idx = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
        ks = to_device(topk, dev)
        ps = to_device([p.top_p for p in params], dev, probs.dtype)
        rank = torch.arange(V, device=dev).unsqueeze(0)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the higher-ranked tokens
        drop_sorted = (rank >= ks.unsqueeze(1)) | ((mass_before > ps.unsqueeze(1)) & (ps < 1).unsqueeze(1))
        drop_sorted[:, 0] = False  # the most likely token always survives
        drop.scatter_(1, idx, drop_sorted)
    if use_min_p:
        mps = to_device([p.min_p for p in params], dev, probs.dtype)
        drop |= probs < mps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, V] < [B, 1]
    return torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
