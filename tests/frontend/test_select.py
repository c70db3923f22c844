"""select on an Engine is the engine's own choice scoring: the best choice by the model's token logprobs
(transformers as the oracle, and Engine.score_continuations), exact for any choice, not only for tokens that
happen to be in a top-k list."""

from __future__ import annotations

import math

import pytest
import torch

from prefixrt.frontend import ProviderBackend, function, select

PROMPT = "Question: what is the capital of France? Answer:"
CHOICES = [" Paris", " London", " the lazy dog", " radix trees index token sequences", " nine"]


def _oracle_logprobs(hf_model, prompt_ids: list[int], choice_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [logp[n + j - 1, t].item() for j, t in enumerate(choice_ids)]


def _select_record(st):
    return next(r for r in st.requests if r.kind == "select")


@pytest.mark.parametrize("normalization", ["token_length_normalized", "sum"])
def test_select_equals_best_choice_by_engine_logprobs(make_frontend_engine, long_checkpoint, normalization):
    eng = make_frontend_engine()
    _, hf_model = long_checkpoint
    be = ProviderBackend(eng, normalization=normalization)

    @function
    def pick(s):
        s += PROMPT + select("x", choices=CHOICES)

    st = pick.run(backend=be, timeout=60)
    assert _select_record(st).method == "engine"  # the engine's `choices` scoring, not a top-k approximation

    prompt_ids = be.encode(PROMPT)
    choice_ids = [eng.tokenizer.encode(c, add_special_tokens=False) for c in CHOICES]
    assert max(map(len, choice_ids)) >= 4
    oracle = [_oracle_logprobs(hf_model, prompt_ids, ids) for ids in choice_ids]
    _, _, engine_lps = eng.score_continuations(prompt_ids, choice_ids)
    norm = (lambda lps: math.fsum(lps) / len(lps)) if normalization == "token_length_normalized" else math.fsum
    expected = [norm(lps) for lps in oracle]
    scores = st.select_scores("x")
    for c, o, lps in zip(CHOICES, expected, engine_lps):
        assert abs(scores[c] - o) < 1e-3, (c, scores[c], o)
        assert abs(scores[c] - norm(lps)) < 1e-5
    best = CHOICES[max(range(len(CHOICES)), key=expected.__getitem__)]
    assert st["x"] == best and st.text() == PROMPT + best


def test_select_logprobs_fallback_matches_engine_when_tokens_in_top_k(make_frontend_engine):
    """The top-k logprob scoring (for providers without choice scoring) agrees with the engine's scoring
    when every forced token is in the reported top-k."""
    eng = make_frontend_engine()
    pb = ProviderBackend(eng)
    ids = pb.encode(PROMPT)
    top = eng.generate(ids, {"max_new_tokens": 1, "temperature": 0, "logprobs": 6}).logprobs[0]["top_logprobs"]
    choices = []
    for t in top:
        tail = eng.generate(ids + [t["token_id"]], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        text = eng.tokenizer.decode([t["token_id"], *tail.token_ids])
        if eng.tokenizer.encode(text, add_special_tokens=False) == [t["token_id"], *tail.token_ids] \
                and pb.encode(PROMPT + text) == ids + [t["token_id"], *tail.token_ids] and text not in choices:
            choices.append(text)
    assert len(choices) >= 3, choices
    choices = choices[::-1]

    @function
    def pick(s):
        s += PROMPT + select("x", choices=choices)

    by_engine = pick.run(backend=pb, timeout=60)
    by_logprobs = pick.run(backend=ProviderBackend(eng, select_method="logprobs"), timeout=60)
    assert _select_record(by_logprobs).method == "logprobs"  # exact: no "~" (no token outside the top-k)
    assert by_logprobs["x"] == by_engine["x"]
    e, lp = by_engine.select_scores("x"), by_logprobs.select_scores("x")
    assert all(abs(e[c] - lp[c]) < 1e-4 for c in choices), (e, lp)
