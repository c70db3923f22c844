"""Choice scoring for `select(choices=...)` / SamplingParams.choices: the one home of the normalizations.

Whoever gathers the logprobs of each choice's tokens after the prompt (the engine, by prefilling
`prompt + choice` for every choice with the prompt shared through the radix cache; the frontend, by
teacher forcing over a provider's top logprobs) calls `score_choices`, then `best_choice`. Pure functions,
no engine state, no dependencies.

Normalizations (as in SGLang's `choices_method`):
  "token_length_normalized"  mean token logprob (default; does not favour short choices)
  "sum"                      total logprob, i.e. the choice's likelihood (favours short choices)
  "unconditional_normalized" mean over tokens of (logprob after the real prompt - logprob of the same
                             token after an unconditional prompt, e.g. empty context). Removes the prior
                             of choices that are likely anywhere. The unconditional logprob of a first
                             token may be None (nothing precedes it); it counts as 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NORMALIZATIONS = ("token_length_normalized", "sum", "unconditional_normalized")


def _check(choice_logprobs: Sequence[Sequence[float]]) -> None:
    if len(choice_logprobs) == 0:
        raise ValueError("no choices to score")
    for i, lps in enumerate(choice_logprobs):
        if len(lps) == 0:
            raise ValueError(f"choice {i} has no tokens")


def score_choices(
    choice_logprobs: Sequence[Sequence[float]],
    normalization: str = "token_length_normalized",
    unconditional_logprobs: Sequence[Sequence[float | None]] | None = None,
) -> list[float]:
    """One score per choice (higher is better).

    choice_logprobs[i][j]: logprob of token j of choice i after the prompt and choice i's tokens before j.
    unconditional_logprobs: same shape, under the unconditional prompt; required for
    "unconditional_normalized", ignored otherwise.
    """
    _check(choice_logprobs)
    if normalization == "token_length_normalized":
        return [math.fsum(lps) / len(lps) for lps in choice_logprobs]
    if normalization == "sum":
        return [math.fsum(lps) for lps in choice_logprobs]
    if normalization == "unconditional_normalized":
        if unconditional_logprobs is None:
            raise ValueError("unconditional_normalized needs unconditional_logprobs")
        if len(unconditional_logprobs) != len(choice_logprobs):
            raise ValueError("unconditional_logprobs must have one list per choice")
        scores = []
        for i, (cond, uncond) in enumerate(zip(choice_logprobs, unconditional_logprobs)):
            if len(cond) != len(uncond):
                raise ValueError(f"choice {i}: {len(cond)} conditional but {len(uncond)} unconditional logprobs")
            scores.append(math.fsum(c - (u or 0.0) for c, u in zip(cond, uncond)) / len(cond))
        return scores
    raise ValueError(f"unknown normalization {normalization!r}; expected one of {', '.join(NORMALIZATIONS)}")


def best_choice(scores: Sequence[float]) -> int:
    """Index of the best score; ties go to the earliest choice."""
    if len(scores) == 0:
        raise ValueError("no choices to score")
    return max(range(len(scores)), key=scores.__getitem__)
