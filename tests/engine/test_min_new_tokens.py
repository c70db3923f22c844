"""min_new_tokens against transformers' `generate(min_new_tokens=...)`: the stop token the model picks first is
masked until the minimum, then ends the output, exactly as transformers masks its EOS ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prefixrt.errors import InvalidRequest

PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]


def test_min_new_tokens_matches_transformers(make_engine, tiny_checkpoints):
    _, hf = tiny_checkpoints("llama")
    eng = make_engine("llama")
    first = eng.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0}).token_ids[0]
    params = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [first]}
    # Without a minimum the first token is a stop token: one token and done.
    assert eng.generate(PROMPT, params).token_ids == [first]
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=5, do_sample=False,
                          eos_token_id=[2, first], pad_token_id=0)
    want = out[0, len(PROMPT):].tolist()
    got = eng.generate(PROMPT, {**params, "min_new_tokens": 5})
    assert got.token_ids == want
    assert len(got.token_ids) >= 5 and first not in got.token_ids[:5]
    # concurrent requests (batched together by the loop): only the held one is masked
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda m: eng.generate(PROMPT, {**params, "min_new_tokens": m}), [5, 0, 5, 0]))
    assert [c.token_ids for c in runs] == [want, [first], want, [first]]


def test_min_new_tokens_validation():
    from prefixrt.params import SamplingParams

    with pytest.raises(InvalidRequest, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(InvalidRequest, match="min_new_tokens"):
        SamplingParams(min_new_tokens=2, regex="[0-9]+")
