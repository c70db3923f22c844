"""Submit-time validation (every sampling parameter to the range the sampler executes; text and schemas) and
the loop's second line of defence (a request failing after registration finishes alone, with its error)."""

from __future__ import annotations

import json
import threading

import pytest

from prefixrt import InvalidRequest
from prefixrt.params import SamplingParams

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
NAN, INF = float("nan"), float("inf")


def _deep_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("params, param", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 10**40}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": 10**400}, "temperature"),  # an int too large for a float
    ({"temperature": 101.0}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 3.0}, "top_k"),
    ({"min_p": NAN}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": INF}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 257}, "n"),
    ({"n": True}, "n"),
    ({"max_new_tokens": 1.0}, "max_new_tokens"),
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"stop": ["ok", "a\ud800"]}, "stop"),
    ({"stop": "x\x00"}, "stop"),
    ({"regex": "a\udfff+"}, "regex"),
    ({"regex": "a\x00b"}, "regex"),
    ({"grammar": 'start: "\ud800"'}, "grammar"),
    ({"choices": ["yes", "n\ud800o"]}, "choices"),
    ({"json_schema": _deep_schema(300)}, "json_schema"),
    ({"json_schema": json.dumps(_deep_schema(300))}, "json_schema"),
    ({"json_schema": "[" * 100_000 + "]" * 100_000}, "json_schema"),  # json.loads itself would recurse out
    ({"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60_000)}}},
     "json_schema"),
    ({"json_schema": {"type": "object", "properties": {"a\ud800": {"type": "string"}}}}, "json_schema"),
    ({"json_schema": '{"type": "string", "pattern": "\\ud800"}'}, "json_schema"),  # escaped surrogate
])
def test_out_of_range_params_raise_invalid_request(params, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.coerce(params)
    assert e.value.param == param and str(e.value)


def test_accepted_extremes():
    assert SamplingParams(seed=2**64 - 1).generator_seed(1) == 0
    assert SamplingParams(seed=-(2**63)).generator_seed(0) == 2**63
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(top_k=2**63).top_k == 2**63  # clamped to the vocabulary by the sampler
    SamplingParams(json_schema=_deep_schema(20))
    SamplingParams(json_schema="json_object")


@pytest.mark.parametrize("prompt", [
    "a\ud800b",
    "nul\x00inside",
    [{"role": "user", "content": "hi\udc00"}],
    [{"role": "user", "content": [{"type": "text", "text": "x\x00"}]}],
    [{"role": "user\ud800", "content": "hi"}],
])
def test_bad_text_prompts_raise_invalid_request(prompt, make_engine):
    eng = make_engine("llama")
    for call in (eng.generate, eng.stream):
        with pytest.raises(InvalidRequest) as e:
            call(prompt, {"max_new_tokens": 2})
        assert e.value.param in ("prompt", "messages")
    assert eng.generate("fine", {"max_new_tokens": 2, **{k: v for k, v in GREEDY.items() if k != "max_new_tokens"}}
                        ).finish_reason == "length"


def test_issue_extremes_run_without_harming_a_greedy_neighbour(make_engine):
    """Issue items 1-2: seeds at the 64-bit edge, temperature 1e-300, top_k 2**63, beside a greedy stream."""
    eng = make_engine("llama")
    want = eng.generate([1, 9, 10, 11], GREEDY).token_ids
    with pytest.raises(InvalidRequest):
        eng.generate("hi", {"seed": 2**64})
    results = {}

    def run(key, prompt, params):
        results[key] = eng.generate(prompt, params)

    jobs = [
        ("greedy", [1, 9, 10, 11], GREEDY),
        ("seed", [1, 5], {"seed": 2**64 - 1, "n": 2, "temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}),
        ("tiny_t", [1, 9, 10, 11], {"temperature": 1e-300, "max_new_tokens": 12, "ignore_eos": True}),
        ("huge_k", [1, 7], {"top_k": 9223372036854775808, "temperature": 0.9, "max_new_tokens": 8,
                            "ignore_eos": True}),
    ]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results["greedy"].token_ids == want
    assert results["tiny_t"].token_ids == want  # below MIN_TEMPERATURE: greedy
    for key in ("seed", "huge_k"):
        for o in results[key].outputs:
            assert o.finish_reason == "length" and o.error is None, (key, o)
    again = eng.generate([1, 5], {"seed": 2**64 - 1, "n": 2, "temperature": 1.0, "max_new_tokens": 8,
                                  "ignore_eos": True})
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in results["seed"].outputs]
    assert eng.stats().aborted_requests_total == 0


# ---------------------------------------------------------------------------------------------- second line
def _concurrent(eng, jobs):
    out = {}

    def run(key, prompt, params):
        try:
            out[key] = eng.generate(prompt, params)
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            out[key] = e

    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung"
    return out


def test_sampling_failure_aborts_only_the_failing_request(make_engine, monkeypatch):
    eng = make_engine("llama")
    want = eng.generate([1, 9, 10, 11], GREEDY).token_ids
    want_sampled = eng.generate([1, 20], {"temperature": 0.7, "seed": 3, "max_new_tokens": 12,
                                          "ignore_eos": True}).token_ids
    sampler = eng.core.sampler
    real = sampler._apply_penalties

    def poisoned(row, r):
        if r.params.repetition_penalty == 1.25:
            raise RuntimeError("poisoned row")
        return real(row, r)

    monkeypatch.setattr(sampler, "_apply_penalties", poisoned)
    out = _concurrent(eng, [
        ("greedy", [1, 9, 10, 11], GREEDY),
        ("sampled", [1, 20], {"temperature": 0.7, "seed": 3, "max_new_tokens": 12, "ignore_eos": True}),
        ("bad", [1, 30, 31], {**GREEDY, "repetition_penalty": 1.25}),
    ])
    assert out["greedy"].token_ids == want and out["greedy"].finish_reason == "length"
    assert out["sampled"].token_ids == want_sampled
    assert out["bad"].finish_reason == "abort" and "poisoned row" in out["bad"].error
    chunks = list(eng.stream([1, 30, 31], {**GREEDY, "repetition_penalty": 1.25}))
    assert chunks[-1].finish_reason == "abort" and "poisoned row" in chunks[-1].error


def test_post_processing_failure_aborts_only_that_request(make_engine, monkeypatch):
    eng = make_engine("llama")
    want = eng.generate([1, 9, 10, 11], GREEDY).token_ids
    core = eng.core
    real = core._post_process

    def poisoned(r, tok, lp, now):
        if r.params.request_id == "bad" and len(r.output_ids) >= 3:
            raise ValueError("post-processing poison")
        return real(r, tok, lp, now)

    monkeypatch.setattr(core, "_post_process", poisoned)
    out = _concurrent(eng, [("greedy", [1, 9, 10, 11], GREEDY), ("bad", [1, 30], {**GREEDY, "request_id": "bad"})])
    assert out["greedy"].token_ids == want
    assert out["bad"].finish_reason == "abort" and "post-processing poison" in out["bad"].error


def test_failure_while_adding_finishes_the_request(make_engine, monkeypatch):
    """Issue item 1: torch.Generator raising on the loop thread after registration used to hang forever."""
    eng = make_engine("llama")
    sampler = eng.core.sampler
    real = sampler.make_generator

    def failing(seed):
        if seed == 4242:
            raise OverflowError("generator refused the seed")
        return real(seed)

    monkeypatch.setattr(sampler, "make_generator", failing)
    out = _concurrent(eng, [("greedy", [1, 9], GREEDY),
                            ("bad", [1, 30], {"seed": 4242, "n": 2, "temperature": 1.0, "max_new_tokens": 5})])
    assert out["greedy"].finish_reason == "length"
    bad = out["bad"]
    assert bad.outputs[0].finish_reason == "abort" and "generator refused" in bad.outputs[0].error
    assert bad.outputs[1].finish_reason == "length"  # seed 4243: its sibling runs


def test_failure_after_the_draw_leaves_seeded_neighbours_reproducible(make_engine, monkeypatch):
    """A batch that fails after its rows drew (here: in the logprobs step) is retried row by row; seeded
    neighbours redraw from their generator's state before the failed attempt, so their tokens are those of
    a run without the failing request."""
    eng = make_engine("llama")
    seeded = {"temperature": 1.0, "seed": 11, "max_new_tokens": 12, "ignore_eos": True}
    want = eng.generate([1, 20, 21], seeded).token_ids
    sampler = eng.core.sampler
    real = sampler._draw

    def draw_then_fail(probs, reqs):
        out = real(probs, reqs)
        if any(r.params.request_id == "bad" for r in reqs):
            raise RuntimeError("failed after drawing")
        return out

    monkeypatch.setattr(sampler, "_draw", draw_then_fail)
    out = eng.generate([[1, 20, 21], [1, 40]], seeded)  # control: both run, no failure
    assert out[0].token_ids == want
    jobs = [("seeded", [1, 20, 21], seeded),
            ("bad", [1, 40], {"temperature": 0.5, "max_new_tokens": 12, "ignore_eos": True, "request_id": "bad"})]
    got = _concurrent(eng, jobs)
    assert got["bad"].finish_reason == "abort" and "failed after drawing" in got["bad"].error
    assert got["seeded"].token_ids == want and got["seeded"].finish_reason == "length"
