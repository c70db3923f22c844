"""Poison requests: sampling parameters at and beyond their extremes, fuzzed with hypothesis (>= 500 sets,
batched through one in-process engine). Each batch runs beside a greedy request; the greedy request's
tokens never change, nothing hangs, and every poison request either raises InvalidRequest at submit or
finishes with a Completion. The pool is clean after every batch."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixrt import InvalidRequest
from tests.helpers.engines import assert_idle_and_clean

VICTIM_PROMPT = [1, 17, 33, 65, 129, 200]
VICTIM_PARAMS = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
BATCH, EXAMPLES = 50, 11  # 550 parameter sets
NAN, INF = float("nan"), float("inf")


def _deep(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"k": s}}
    return s


TEXTS_OK = ["x", "é" * 3, "\n", "the", "a" * 2000, "\U0001f600", ""]
TEXTS_BAD = ["\x00", "a\ud800b", "\udfff"]
BAD_NUMBERS = [NAN, INF, -INF, 10**400, "1", True, [1.0]]
# field -> (values the sampler must execute, values that must raise InvalidRequest at submit)
FIELDS = {
    "temperature": ([0.0, -0.0, 0, 5e-324, 1e-300, 1e-7, 1e-5, 0.5, 1.0, 2.0, 100.0, 100], [-1e-9, 100.001, 1e300]),
    "top_p": ([5e-324, 1e-300, 1e-9, 0.5, 1.0, 1], [0.0, -0.5, 1.0000001]),
    "top_k": ([-1, 1, 2, 319, 320, 321, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 10**30], [0, -2, -(2**63), 1.5]),
    "min_p": ([0.0, 0, 5e-324, 1e-300, 0.5, 1.0, 1], [-1e-300, 1.0000001]),
    "frequency_penalty": ([-2, -2.0, 0, 1e-300, 2.0], [-2.0000001, 3]),
    "presence_penalty": ([-2, 0, 5e-324, 2], [2.5, -3]),
    "repetition_penalty": ([0.01, 0.5, 1.0, 2.0, 100.0], [0, 0.009, 100.5, 1e-300, -1]),
    "seed": ([None, -(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1], [2**64, -(2**63) - 1, 10**30, 1.5, "3"]),
    "max_new_tokens": ([0, 1, 2, 5, 2**31, 10**30], [-1, 1.0, None]),
    "min_new_tokens": ([0, 0, 0, 1, 5], [-1, 1.5, 10**40]),
    "n": ([1, 1, 1, 1, 1, 1, 2, 3, 8], [0, -1, 257, 2**70, 1.5]),
    "logprobs": ([None, 0, 1, 20], [21, -1, 2**63]),
    "stop": ([None, *TEXTS_OK, ["x", "\n"], TEXTS_OK], [*TEXTS_BAD, ["ok", "\ud800"], [1, 2], 5]),
    "stop_token_ids": ([None, [], [0], [2], [1, 2, 3], [319], [320], [2**63]], [[-1], ["a"], 5]),
    "ignore_eos": ([True, False], [1, "yes", None]),
    "priority": ([0, 1, -(2**70), 2**70], [1.5, "high"]),
    "cache_salt": ([None, "t1", ""], [5, ["t"]]),
    "request_id": ([None, None, "dup"], [5]),
}
CONSTRAINTS = {
    "regex": (["[a-z]{1,4}", "\\d+"], ["(", "a\ud800", "a\x00", "", 7]),
    "json_schema": ([{"type": "integer"}, "json_object"],
                    [_deep(100), json.dumps(_deep(70)), "[" * 50_000, "{", [], 5,
                     {"type": "object", "properties": {"\x00": {"type": "string"}}}]),
    "grammar": (['start: "ab"'], ["start: (", "\ud800", "   "]),
    "choices": ([["yes", "no"]], [[], [""], ["a\ud800"], "yes"]),
    "json_object": ([True], ["yes", 1]),
}


def _valid(k):
    ok = (FIELDS | CONSTRAINTS)[k][0]
    return st.sampled_from(ok)


def _invalid(k):
    bad = (FIELDS | CONSTRAINTS)[k][1]
    return st.sampled_from(bad + (BAD_NUMBERS if k in FIELDS and k not in ("stop", "request_id") else []))


valid_sets = st.fixed_dictionaries({}, optional={k: _valid(k) for k in FIELDS})
# A request: valid extremes for any subset of fields; sometimes a constraint; sometimes one field (or an
# unknown key) made invalid.
poison_params = st.tuples(
    valid_sets,
    st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(CONSTRAINTS))),
    st.one_of(st.none(), st.none(), st.sampled_from(sorted(FIELDS | CONSTRAINTS) + ["bogus"])),
    st.data(),
).map(lambda t: t)


def _draw_params(t) -> dict:
    params, constraint, bad_field, data = t
    params = dict(params)
    if constraint is not None:
        params[constraint] = data.draw(_valid(constraint))
    if bad_field == "bogus":
        params["bogus"] = 1
    elif bad_field is not None:
        params[bad_field] = data.draw(_invalid(bad_field))
    return params


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tiny_tokenizer):
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    path, _ = tiny_checkpoints("llama")
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name="tiny-llama", revision="test", extra_eos_token_ids=(), path=str(path))
    eng = Engine("tiny-llama", _parts=(model, tiny_tokenizer, resolved), device="cpu", debug=True,
                 kv_cache_tokens=4096)
    eng.expected = eng.generate(VICTIM_PROMPT, VICTIM_PARAMS).token_ids
    eng.poisoned = 0
    eng.outcomes = []
    yield eng
    try:
        assert eng.poisoned >= BATCH * EXAMPLES, eng.poisoned
        # The mix must exercise both halves: most requests run, a good share is refused at submit.
        ran, refused = eng.outcomes.count("ok"), eng.outcomes.count("invalid")
        assert ran >= 0.4 * eng.poisoned and refused >= 0.1 * eng.poisoned, (ran, refused)
        assert_idle_and_clean(eng)
    finally:
        eng.shutdown()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])
@given(drawn=st.lists(poison_params, min_size=BATCH, max_size=BATCH))
def test_poison_batch_never_touches_a_greedy_neighbour(drawn, engine):
    eng = engine
    batch = [_draw_params(t) for t in drawn]
    prompts = ["The quick", [1, 5, 6, 7], [{"role": "user", "content": "hi"}], "a\ud800", [1] * 120]

    async def one(i, params):
        try:
            c = await eng.agenerate(prompts[i % len(prompts)], params)
        except InvalidRequest as e:
            assert e.param is not None and str(e), params
            return "invalid"
        for o in c.outputs:
            assert o.finish_reason in ("stop", "length", "abort"), (params, o)
            assert o.finish_reason != "abort" or o.error, (params, o)  # an abort here is an error: say why
        return "ok"

    async def go():
        victim = asyncio.ensure_future(eng.agenerate(VICTIM_PROMPT, VICTIM_PARAMS))
        outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        return (await victim).token_ids, outcomes

    tokens, outcomes = asyncio.run(asyncio.wait_for(go(), timeout=300))  # a hang fails here
    assert tokens == eng.expected
    assert len(outcomes) == len(batch)
    eng.poisoned += len(batch)
    eng.outcomes.extend(outcomes)
    assert_idle_and_clean(eng)
