"""Sampler on hand-built requests: penalties, grammar masks, greedy, seeded draws and logprobs, each against
values computed by hand or by plain torch. (tests/reliability/test_sampler_batch.py checks that batching
never changes a row, and the top-k/top-p/min-p filters against a float64 reference.)
"""

from __future__ import annotations

import math

import torch

from prefixrt.params import SamplingParams
from prefixrt.request import Req
from prefixrt.sampling.sampler import Sampler

V = 8


def req(prompt=(1, 2), output=(), **params) -> Req:
    r = Req(rid="r", prompt_ids=list(prompt), params=SamplingParams(**params), sink=None)
    r.append_output(list(output))
    return r


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 4.0, -3.0, 1.0, 0.5, 0.0, 3.0]])
    r = req(prompt=[0, 1], output=[2, 2], repetition_penalty=2.0)  # seen: 0, 1, 2 (prompt and output)
    got = Sampler("cpu").adjust_logits(logits, [r])
    want = torch.tensor([[1.0, -2.0, 2.0, -3.0, 1.0, 0.5, 0.0, 3.0]])
    assert torch.equal(got, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 4.0, -3.0, 1.0, 0.5, 0.0, 3.0]]))  # input untouched


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, V)
    r = req(prompt=[5, 5, 5], output=[3, 3, 3, 4], frequency_penalty=0.5, presence_penalty=1.0)
    got = Sampler("cpu").adjust_logits(logits, [r])
    want = torch.zeros(1, V)
    want[0, 3] = -(0.5 * 3 + 1.0)
    want[0, 4] = -(0.5 * 1 + 1.0)
    assert torch.equal(got, want)  # token 5 appears only in the prompt: not penalised


def test_no_knob_no_copy():
    logits = torch.randn(2, V)
    assert Sampler("cpu").adjust_logits(logits, [req(), req()]) is logits


def test_greedy_takes_the_argmax_after_penalties_and_mask():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    plain = req(temperature=0)
    penalised = req(prompt=[0], temperature=0, repetition_penalty=10.0)  # 5 -> 0.5: token 1 wins
    masked = req(temperature=0)

    def mask(lg):  # what EngineCore's grammar callback does: forbid tokens in place
        lg[2, :2] = float("-inf")

    out = Sampler("cpu").sample(logits, [plain, penalised, masked], mask)
    assert out.token_ids == [0, 1, 2]
    assert out.logprobs == [None, None, None]


def test_top_k_1_samples_the_argmax_whatever_the_temperature():
    logits = torch.tensor([[0.1, 0.3, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0]])
    s = Sampler("cpu", seed=123)
    draws = {s.sample(logits, [req(temperature=50.0, top_k=1)]).token_ids[0] for _ in range(20)}
    assert draws == {2}


def test_seeded_row_draws_what_torch_multinomial_draws_with_the_same_seed():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    s = Sampler("cpu")
    r = req(temperature=0.7, seed=42)
    r.generator = s.make_generator(42)
    got = [s.sample(logits, [r]).token_ids[0] for _ in range(10)]
    g = torch.Generator().manual_seed(42)
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    want = [torch.multinomial(probs, 1, generator=g).item() for _ in range(10)]
    assert got == want
    assert len(set(got)) > 1  # a real draw, not an argmax


def test_logprobs_come_from_the_raw_distribution_with_sorted_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 0.25, -2.0]])
    r = req(prompt=[1], temperature=0, repetition_penalty=100.0, logprobs=3)  # penalty: token 2 is chosen
    out = Sampler("cpu").sample(logits, [r])
    assert out.token_ids == [2]
    raw = torch.log_softmax(logits[0], dim=-1)
    tok_lp, top = out.logprobs[0]
    assert math.isclose(tok_lp, raw[2].item(), rel_tol=1e-6)  # before the penalty, not after
    assert [t for t, _ in top] == [1, 2, 0]
    for t, lp in top:
        assert math.isclose(lp, raw[t].item(), rel_tol=1e-6)


def test_logprobs_zero_reports_the_token_without_alternatives():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = Sampler("cpu").sample(logits, [req(temperature=0, logprobs=0)])
    tok_lp, top = out.logprobs[0]
    assert out.token_ids == [1] and top == []
    assert math.isclose(tok_lp, 1.0 - math.log(math.e + 7), rel_tol=1e-6)
