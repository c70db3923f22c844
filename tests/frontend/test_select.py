"""select on an Engine equals the best choice by the model's own token logprobs (transformers as oracle)."""

from __future__ import annotations

import torch

from prefixrt.frontend import ProviderBackend, function, select

PROMPT = "Question: what is the capital of France? Answer:"


def _oracle_mean_logprob(hf_model, prompt_ids: list[int], choice_ids: list[int]) -> float:
    ids = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return sum(logp[n + j - 1, t].item() for j, t in enumerate(choice_ids)) / len(choice_ids)


def test_select_equals_best_choice_by_engine_logprobs(make_frontend_engine, long_checkpoint):
    eng = make_frontend_engine()
    _, hf_model = long_checkpoint
    pb = ProviderBackend(eng)
    ids = pb.encode(PROMPT)
    # Multi-token choices built from the engine's own top tokens (rank 1..4, then greedy): every forced token
    # lies in the reported top logprobs, so the scores are exact rather than bounded.
    top = eng.generate(ids, {"max_new_tokens": 1, "temperature": 0, "logprobs": 6}).logprobs[0]["top_logprobs"]
    choices, choice_ids = [], []
    for t in top:
        tail = eng.generate(ids + [t["token_id"]], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        cids = [t["token_id"], *tail.token_ids]
        text = eng.tokenizer.decode(cids)
        if pb.encode(PROMPT + text) == ids + cids and text not in choices:
            choices.append(text)
            choice_ids.append(cids)
    assert len(choices) >= 3, choices
    choices, choice_ids = choices[::-1], choice_ids[::-1]

    @function
    def pick(s):
        s += PROMPT + select("x", choices=choices)

    st = pick.run(backend=eng, timeout=60)
    oracle = [_oracle_mean_logprob(hf_model, ids, c) for c in choice_ids]
    best = choices[max(range(len(choices)), key=oracle.__getitem__)]
    assert st["x"] == best
    scores = st.select_scores("x")
    for c, o in zip(choices, oracle):
        assert abs(scores[c] - o) < 1e-3, (c, scores[c], o)
    assert st.text() == PROMPT + best
