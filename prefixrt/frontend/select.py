"""select() by teacher forcing: choice-token logprobs gathered from a provider's top logprobs (the source used
when the provider does not score `choices` requests itself). The normalization is prefixrt/lowering/choice_scoring.py's.

Each choice is scored by teacher forcing: for choice tokens c_1..c_m after the prompt, request one greedy
token with top-k logprobs after `prompt + c_1..c_{j-1}` and read c_j's logprob. All requests share the
prompt (one prefix hint, then one batch). The engine reports raw-model logprobs of the sampled token and
its top-k; a c_j outside the top-k is bounded by the k-th logprob and the score is marked approximate.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixrt.lowering.choice_scoring import score_choices

TOP_K = 20  # the most top logprobs SamplingParams accepts


@dataclass
class ChoiceScores:
    scores: list[float]
    approximate: bool = False
    token_logprobs: list[list[float]] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


def teacher_forced_scores(provider, prompt_ids: list[int], choice_ids: list[list[int]],
                  normalization: str = "token_length_normalized", prefix_hint: bool = True) -> ChoiceScores:
    """Score each tokenized choice after prompt_ids from the provider's next-token logprobs."""
    from prefixrt.params import SamplingParams

    if any(not ids for ids in choice_ids):
        raise ValueError("every choice must tokenize to at least one token")
    # One request per distinct forced prefix (choices sharing leading tokens share requests).
    keys: dict[tuple[int, ...], int] = {}
    for ids in choice_ids:
        for j in range(len(ids)):
            keys.setdefault(tuple(ids[:j]), len(keys))
    prompts = [prompt_ids + list(k) for k in keys]
    if prefix_hint and len(prompts) > 1:
        provider.cache_prefix(prompt_ids)
    outs = provider.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=TOP_K))
    approximate = False
    table: list[dict[int, float]] = []
    floors: list[float] = []
    for c in outs:
        if c.finish_reason == "abort" or not c.logprobs:
            raise RuntimeError(f"scoring request {c.request_id} returned no logprobs ({c.error or c.finish_reason})")
        entry = c.logprobs[0]
        lps = {t["token_id"]: t["logprob"] for t in entry["top_logprobs"]}
        lps[entry["token_id"]] = entry["logprob"]
        table.append(lps)
        floors.append(min(lps.values()))
    token_logprobs = []
    for ids in choice_ids:
        row = []
        for j, tok in enumerate(ids):
            k = keys[tuple(ids[:j])]
            if tok in table[k]:
                row.append(table[k][tok])
            else:
                row.append(floors[k])
                approximate = True
        token_logprobs.append(row)
    return ChoiceScores(score_choices(token_logprobs, normalization), approximate, token_logprobs,
                        prompt_tokens=outs[0].prompt_tokens, cached_tokens=outs[0].cached_tokens)
