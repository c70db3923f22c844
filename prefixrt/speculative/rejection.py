"""Verification of one drafted position against the target distribution (speculative sampling).

The target's distribution p at a position is the one the plain sampler draws from there: penalties, logit
bias, min_new_tokens holds and the grammar mask applied, then temperature, top-k, top-p, min-p
(sampling/sampler.py `sampling_probs`). A draft x from a distribution q is accepted with probability
min(1, p(x) / q(x)); on rejection the token is drawn from the residual max(p - q, 0), normalized. The emitted
token is then distributed exactly as p. Drafters here give no distribution: q is the point mass on x, so x is
accepted with probability p(x) and the residual is p without x. Greedy rows need none of this: the draft is
accepted iff it is the argmax, which is what plain greedy decoding would emit.
"""

from __future__ import annotations

import torch


def verify_draft(probs: torch.Tensor, draft: int, generator: torch.Generator,
                 draft_probs: torch.Tensor | None = None) -> tuple[int, bool]:
    """One position: probs [V] the target distribution, draft the drafted token, draft_probs [V] its drafter's
    distribution (None: a point mass on draft). Returns (token, accepted): the draft itself when accepted, else
    a token from the residual. Draws one uniform from generator, plus one categorical draw on rejection."""
    p_x = probs[draft]
    q_x = draft_probs[draft] if draft_probs is not None else torch.ones((), dtype=probs.dtype, device=probs.device)
    u = torch.rand((), generator=generator, device=probs.device, dtype=probs.dtype)
    if float(u) * float(q_x) < float(p_x):  # u < p/q, without dividing by a zero q
        return draft, True
    if draft_probs is None:
        residual = probs.clone()
        residual[draft] = 0
    else:
        residual = (probs - draft_probs).clamp_min(0)
    total = float(residual.sum())
    if total <= 0:  # p == q (point mass: p(x) == 1, rejected only by rounding): p itself
        residual = probs
    tok = int(torch.multinomial(residual, 1, generator=generator).item())
    return tok, False


def verify_draft_reference(probs: list[float], draft: int, u: float, residual_u: float) -> int:
    """The reference for a point-mass draft, on plain floats: accept when u < p(draft), else the inverse-CDF
    draw (with residual_u in [0, 1)) over p without draft, normalized."""
    if u < probs[draft]:
        return draft
    rest = [0.0 if i == draft else v for i, v in enumerate(probs)]
    total = sum(rest)
    acc = 0.0
    for i, v in enumerate(rest):
        acc += v / total
        if residual_u < acc and v > 0:
            return i
    return max(i for i, v in enumerate(rest) if v > 0)
