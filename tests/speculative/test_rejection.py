"""Rejection sampling keeps the target distribution exactly: the emitted token of verify_draft is distributed
as p, whatever the draft (a point mass) or the drafter's distribution q; chi-square over many seeds on a small
vocabulary, with the distribution built by the sampler's own sampling_probs from random logits and options."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.params import SamplingParams
from prefixrt.sampling.sampler import sampling_probs
from prefixrt.speculative.rejection import verify_draft, verify_draft_reference

TRIALS = 3000


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor, df: int | None = None) -> float:
    """Pearson's chi-square p-value (its survival function, as the regularized upper gamma); df default: a
    goodness of fit's len - 1."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1 if df is None else df
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2,
                                                                                                 dtype=torch.float64)))


def _emitted(probs, draft, q=None, trials=TRIALS, seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    counts = torch.zeros(len(probs))
    accepted = 0
    for _ in range(trials):
        tok, ok = verify_draft(probs, draft, g, q)
        counts[tok] += 1
        accepted += ok
    return counts, accepted


def _check(probs, counts):
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target excludes was emitted"
    expected = probs[support] * counts.sum()
    if support.sum() > 1:
        assert chi_square_pvalue(counts[support].double(), expected.double()) > 1e-4, (probs, counts)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1), st.sampled_from([0.3, 0.7, 1.0, 1.8]),
       st.sampled_from([-1, 1, 2, 4]), st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from([0.0, 0.2]),
       st.data())
def test_point_mass_draft_keeps_the_target_distribution(V, seed, temperature, top_k, top_p, min_p, data):
    gen = torch.Generator()
    gen.manual_seed(seed)
    logits = torch.randn(1, V, generator=gen) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = sampling_probs(logits, [params])[0]
    draft = data.draw(st.integers(0, V - 1))
    counts, accepted = _emitted(probs, draft, seed=seed)
    _check(probs, counts)
    # the draft is accepted at rate p(draft)
    assert abs(accepted / TRIALS - float(probs[draft])) < 5 * (0.25 / TRIALS) ** 0.5 + 1e-9


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_draft_with_a_distribution_keeps_the_target_distribution(V, seed):
    """A drafter with its own distribution q: the draft drawn from q, accepted with min(1, p/q)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(V, generator=gen) * 2, -1)
    g = torch.Generator()
    g.manual_seed(seed + 1)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        x = int(torch.multinomial(q, 1, generator=g))
        tok, _ = verify_draft(p, x, g, q)
        counts[tok] += 1
    _check(p, counts)


def test_reference_agrees():
    probs = [0.1, 0.5, 0.0, 0.4]
    assert verify_draft_reference(probs, 1, 0.3, 0.0) == 1  # accepted: u < p(1)
    assert verify_draft_reference(probs, 1, 0.6, 0.1) == 0  # rejected: residual {0: .2, 3: .8}
    assert verify_draft_reference(probs, 1, 0.6, 0.5) == 3
    assert verify_draft_reference(probs, 2, 0.0, 0.5) == 1  # p(draft) == 0 is never accepted
    assert verify_draft(torch.tensor(probs), 2, torch.Generator())[1] is False
    certain = torch.tensor([0.0, 1.0, 0.0])
    assert verify_draft(certain, 1, torch.Generator()) == (1, True)
