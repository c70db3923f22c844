"""Batched sampling: a row's distribution and draw never depend on its batch neighbours.

Property test (CPU): random batches of 1-16 rows with mixed temperature / top-k / top-p / min-p / penalties /
seeds. For every row, the batched sampler's adjusted logits and final filtered distribution equal those of
the row sampled alone (bit for bit), the distribution equals an independent float64 reference of the
filters, seeded rows draw the same token batched and alone, and greedy rows take their own argmax.
Plus the item-0 regressions: several filtered sampled rows in one engine step (n=2 with top_p; concurrent
requests with top_p/top_k/min_p) finish normally.
"""

from __future__ import annotations

import asyncio
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.params import SamplingParams
from prefixrt.request import Req
from prefixrt.sampling.sampler import Sampler, sampling_probs

V = 48

row_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-7, 1e-5, 0.05, 0.3, 0.7, 1.0, 1.5, 2.0, 30.0, 100.0]),
    "top_k": st.sampled_from([-1, 1, 2, 3, 7, V - 1, V, V + 5, 2**63, 10**30]),
    "top_p": st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-9]),
    "min_p": st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    "frequency_penalty": st.sampled_from([0.0, -2.0, 0.5, 2.0]),
    "presence_penalty": st.sampled_from([0.0, -1.0, 1.5]),
    "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3, 5.0]),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "min_new_tokens": st.sampled_from([0, 0, 3, 20]),  # holds EOS (id 2) and stop ids while below it
    "stop_token_ids": st.sampled_from([None, [5], [7, V + 3]]),
})
EOS = (2,)


def _req(params: dict, prompt: list[int], output: list[int], index: int, sampler: Sampler) -> Req:
    p = SamplingParams(**params, ignore_eos=True)
    r = Req(rid=f"r{index}", prompt_ids=prompt, params=p, sink=None, index=0)
    r.append_output(output)
    if p.seed is not None:
        r.generator = sampler.make_generator(p.generator_seed(0))
    return r


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, bool]:
    """float64, one row, written from the definitions: keep the k most likely tokens, the smallest
    most-likely set whose mass reaches top_p, and tokens with prob >= min_p * max prob; renormalise.
    Also says whether a top-p or min-p decision sits within float32 rounding of its threshold (exact ties
    make masses like 0.5 exactly; float32 may then decide the other way, legitimately)."""
    x = logits.double() / p.temperature
    probs = torch.softmax(x, dim=-1)
    order = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    top = probs[order[0]].item()
    keep = set()
    k = p.top_k if p.top_k > 0 else len(probs)
    mass, borderline = 0.0, False
    for rank, t in enumerate(order):
        pt = probs[t].item()
        if rank < k:
            borderline |= p.top_p < 1 and abs(mass - p.top_p) < 1e-5
            borderline |= p.min_p > 0 and abs(pt - p.min_p * top) < 1e-5 * top
        if rank < k and (p.top_p >= 1 or mass <= p.top_p) and pt >= p.min_p * top:
            keep.add(t)
        mass += pt
    keep.add(order[0])
    mask = torch.tensor([t not in keep for t in range(len(probs))])
    return torch.softmax(x.masked_fill(mask, -math.inf), dim=-1), borderline


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(row_params, min_size=1, max_size=16),
    data_seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.5, 3.0, 20.0]),
    ties=st.booleans(),
)
def test_batched_rows_equal_rows_alone(rows, data_seed, scale, ties):
    gen = torch.Generator().manual_seed(data_seed)
    B = len(rows)
    logits = torch.randn(B, V, generator=gen) * scale
    if ties:  # coarse values: many equal logits, so top-k ranks among ties must not depend on the batch
        logits = logits.round()
    hist = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(2 * B)]
    batched_sampler, alone_sampler = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    batch = [_req(p, hist[2 * i], hist[2 * i + 1], i, batched_sampler) for i, p in enumerate(rows)]
    alone = [_req(p, hist[2 * i], hist[2 * i + 1], i, alone_sampler) for i, p in enumerate(rows)]

    adjusted = batched_sampler.adjust_logits(logits, batch, eos_token_ids=EOS)
    sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
    probs = sampling_probs(adjusted[sampled], [batch[i].params for i in sampled]) if sampled else None
    out = batched_sampler.sample(logits, batch, eos_token_ids=EOS)

    for i, r in enumerate(alone):
        own = alone_sampler.adjust_logits(logits[i : i + 1], [r], eos_token_ids=EOS)
        assert torch.equal(own[0], adjusted[i]), f"row {i}: penalties depend on the batch"
        tok = alone_sampler.sample(logits[i : i + 1], [r], eos_token_ids=EOS).token_ids[0]
        if len(r.output_ids) < r.params.min_new_tokens:
            held = [2, *(t for t in r.params.stop_token_ids or () if t < V)]
            assert torch.all(own[0, held] == float("-inf")) and tok not in held
        if r.params.greedy:
            assert tok == out.token_ids[i] == int(own[0].argmax())
            continue
        row_probs = probs[sampled.index(i)]
        own_probs = sampling_probs(own, [r.params])[0]
        assert torch.equal(row_probs, own_probs), f"row {i}: distribution depends on the batch"
        ref, borderline = _reference_probs(own[0], r.params)
        if not borderline:
            assert torch.allclose(own_probs.double(), ref, atol=1e-5, rtol=0), (i, r.params)
            # Filtered tokens have probability exactly 0 (float32 may also underflow where float64 does not).
            assert torch.all(own_probs[ref == 0] == 0), f"row {i}: a filtered token kept probability"
            assert torch.all(own_probs[ref > 1e-6] > 0), f"row {i}: a kept token lost its probability"
        assert own_probs[out.token_ids[i]] > 0, "drew a filtered-out token"
        if r.params.seed is not None:
            assert tok == out.token_ids[i], f"seeded row {i} drew differently batched and alone"


def test_greedy_row_ignores_poisoned_neighbour_distribution():
    """A greedy row beside sampled rows whose filters keep a single token still takes its own argmax."""
    s = Sampler(torch.device("cpu"))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    reqs = [
        _req({"temperature": 0.0}, [1], [], 0, s),
        _req({"temperature": 1e-5, "top_p": 1e-9, "min_p": 1.0, "top_k": 10**30}, [1], [], 1, s),
        _req({"temperature": 100.0, "top_k": 2**63}, [1], [], 2, s),
    ]
    out = s.sample(logits, reqs)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == int(logits[1].argmax())  # the only surviving token


# ---------------------------------------------------------------------------------------------- engine level
FILTERED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "ignore_eos": True, "max_new_tokens": 8}


def _no_engine_errors(caplog):
    """The loop isolates a failing batch by sampling its rows one by one; item 0 must not even get there."""
    errors = [r.getMessage() for r in caplog.records if r.name == "prefixrt" and r.levelname == "ERROR"]
    assert not errors, errors[0]


def test_n2_with_top_p_finishes_normally(make_engine, caplog):
    eng = make_engine("llama")
    c = eng.generate([1, 40, 41, 42], {"n": 2, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True,
                                       "max_new_tokens": 8})
    assert len(c.outputs) == 2
    for o in c.outputs:
        assert o.finish_reason == "length" and o.error is None and len(o.token_ids) == 8
    _no_engine_errors(caplog)


def test_concurrent_filtered_sampled_requests_share_steps(make_engine, caplog):
    eng = make_engine("qwen2")

    async def go():
        return await asyncio.gather(
            eng.agenerate([1, 50, 51], {**FILTERED, "top_k": -1}),  # top_p + min_p
            eng.agenerate([1, 60, 61, 62], {**FILTERED, "top_p": 1.0, "seed": 7}),  # top_k + min_p, seeded
            eng.agenerate([1, 70], {**FILTERED, "min_p": 0.0, "n": 3}),  # top_k + top_p, three samples
        )

    results = asyncio.run(go())
    assert eng.stats().aborted_requests_total == 0
    for c in results:
        for o in c.outputs:
            assert o.finish_reason == "length" and o.error is None and len(o.token_ids) == 8
    # One batch through the stream path as well: every chunk well-formed, no error on the last.
    chunks = list(eng.stream([1, 80, 81], {**FILTERED, "n": 2}))
    last = [ch for ch in chunks if ch.finish_reason is not None]
    assert len(last) == 2 and all(ch.finish_reason == "length" and ch.error is None for ch in last)
    _no_engine_errors(caplog)
