"""Choice scoring: the normalizations of prefixrt/lowering/choice_scoring.py and best_choice."""

from __future__ import annotations

import math

import pytest

from prefixrt.lowering.choice_scoring import best_choice, score_choices


def select_choice(*args):
    return best_choice(score_choices(*args))

# "Paris" is one confident token; the long word has a poor first token and then near-certain ones.
PARIS = [-0.5]
LONG = [-2.0, -0.01, -0.01, -0.01, -0.01]


def test_token_length_normalized_is_mean():
    scores = score_choices([PARIS, LONG])
    assert scores == pytest.approx([-0.5, -2.04 / 5])
    assert select_choice([PARIS, LONG]) == 1  # the documented weakness of mean normalization


def test_sum_is_total_logprob():
    assert score_choices([PARIS, LONG], "sum") == pytest.approx([-0.5, -2.04])
    assert select_choice([PARIS, LONG], "sum") == 0


def test_unconditional_normalized_removes_prior():
    # Under the real prompt both choices look alike; unconditionally "the" is far likelier (a prior).
    cond = [[-1.0, -0.5], [-1.2, -0.6]]
    uncond = [[None, -0.1], [None, -2.0]]  # first token: no unconditional context -> counts as 0
    scores = score_choices(cond, "unconditional_normalized", uncond)
    assert scores == pytest.approx([(-1.0 + (-0.5 + 0.1)) / 2, (-1.2 + (-0.6 + 2.0)) / 2])
    assert select_choice(cond) == 0 and select_choice(cond, "unconditional_normalized", uncond) == 1


def test_ties_pick_first_and_errors():
    assert select_choice([[-1.0], [-0.5, -1.5]]) == 0
    with pytest.raises(ValueError):
        score_choices([])
    with pytest.raises(ValueError):
        score_choices([[]])
    with pytest.raises(ValueError):
        score_choices([PARIS], "unconditional_normalized")
    with pytest.raises(ValueError):
        score_choices([PARIS], "unconditional_normalized", [[None, -1.0]])
    with pytest.raises(ValueError):
        score_choices([PARIS], "mean")
    assert math.isinf(score_choices([[float("-inf")]], "sum")[0])
