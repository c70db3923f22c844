"""The host side of one forward's inputs: per row, the tokens it feeds (image placeholders mapped to the model's
ids, speculative drafts appended), where logits are read (sampled rows, every draft position, scored prompt
positions), and which input tokens are still on the device (holes: a token sampled by the step in flight, filled
at launch). EngineCore.build (core.py) turns them into the ForwardBatch; images_of gives its encoder outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from prefixrt.engine.loop.scheduler import ScheduledBatch
from prefixrt.model.vision import SequenceImages, multimodal_batch
from prefixrt.multimodal.inputs import model_ids
from prefixrt.request import Req


@dataclass
class BatchInputs:
    extend_tokens: list[list[int]] = field(default_factory=list)  # per row, the tokens it feeds
    ends: list[int] = field(default_factory=list)  # flat positions whose logits are sampled ...
    sampled: list[Req] = field(default_factory=list)  # ... for these requests
    scored: list[tuple[Req, list[int]]] = field(default_factory=list)  # (request, positions whose logprob it wants)
    extra: list[int] = field(default_factory=list)  # flat positions of those
    holes: list[int] = field(default_factory=list)  # flat positions whose token is still on the device
    hole_rows: list[int] = field(default_factory=list)  # ... at these rows of the step in flight's samples
    spec: list[tuple[Req, list[int], int, Any]] = field(default_factory=list)  # speculating rows (speculate.py)
    spec_ends: list[int] = field(default_factory=list)  # logits at their last token and every draft
    num_tokens: int = 0  # flat positions in all


def collect(batch: ScheduledBatch, inflight) -> BatchInputs:
    """The batch's host lists; `inflight` is the step in flight, the only one an unresolved token may come from."""
    out = BatchInputs()
    acc = 0
    for i, (r, p, n, s) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.num_tokens, batch.sample)):
        drafts = batch.drafts.get(i) if batch.drafts else None
        known = len(r.all_ids)
        toks = r.all_ids[p: min(p + n, known)]
        if p + n > known:
            step, row = r.future
            assert step is inflight and p + n == known + 1, "an unresolved token must come from the last step"
            out.holes.append(acc + n - 1)
            out.hole_rows.append(row)
            toks = toks + [0]
        if r.images is not None:
            toks = model_ids(toks, r.images.image_token_id)
        if drafts:
            toks = toks + drafts
        out.extend_tokens.append(toks)
        if r.input_logprobs_from is not None:
            pos = [j for j in range(p, p + n) if r.input_logprobs_from - 1 <= j <= r.seq_len - 2]
            if pos:
                out.scored.append((r, pos))
                out.extra.extend(acc + j - p for j in pos)
        if drafts:
            out.spec.append((r, drafts, len(out.spec_ends), r.epoch))
            out.spec_ends.extend(range(acc + n - 1, acc + n + len(drafts)))
            acc += n + len(drafts)
            continue
        acc += n
        if s and r.params.max_new_tokens > 0:
            out.ends.append(acc - 1)
            out.sampled.append(r)
    out.num_tokens = acc
    return out


def images_of(encoder, model, batch: ScheduledBatch, device: torch.device):
    """The forward's MultimodalBatch: encoder outputs (from the encoder cache) for the image tokens it computes."""
    if encoder is None:
        raise RuntimeError("a request with images reached a model without a vision encoder")
    seqs = []
    for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.num_tokens):
        im = r.images
        if im is None:
            seqs.append(SequenceImages([], p, n, []))
            continue
        needed = [i for i, (a, b) in enumerate(im.blocks) if a < p + n and b > p]
        embeds: list = [None] * len(im.blocks)
        for i, emb in zip(needed, encoder.get([im.images[i] for i in needed])):
            embeds[i] = emb
        seqs.append(SequenceImages(im.blocks, p, n, embeds))
    return multimodal_batch(model.vision, seqs, device)
