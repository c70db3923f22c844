"""Post-processing units on hand-built requests: stop tokens, grammar accept, the one jump-forward path (step 0
and step N, capped by the output budget and the context), length limits, logprob records."""

from __future__ import annotations

import pytest

from prefixrt.engine.loop import postprocess
from prefixrt.params import SamplingParams
from prefixrt.request import Req

EOS = {2}


class ScriptMatcher:
    """A grammar that accepts exactly one token sequence: tokens it has a single choice for are forced."""

    def __init__(self, script: list[int], choice_at: set[int]):
        self.script, self.choice_at, self.pos = script, choice_at, 0

    def accept_token(self, t: int) -> bool:
        if self.pos >= len(self.script) or self.script[self.pos] != t:
            return False
        self.pos += 1
        return True

    def accept_tokens(self, ts: list[int]) -> int:  # Matcher.accept_tokens: in order, until one is rejected
        for n, t in enumerate(ts):
            if not self.accept_token(t):
                return n
        return len(ts)

    def is_finished(self) -> bool:
        return self.pos == len(self.script)

    def forced_tokens(self) -> list[int]:
        out = []
        for i in range(self.pos, len(self.script)):
            if i in self.choice_at:
                break
            out.append(self.script[i])
        return out


def _req(prompt=(1, 5, 6), **params) -> Req:
    return Req(rid="r", prompt_ids=list(prompt), params=SamplingParams(**params), sink=None)


def test_stop_token_eos_and_ignore_eos():
    r = _req(max_new_tokens=10, stop_token_ids=[9])
    a = postprocess.advance(r, 9, EOS, 128)
    assert (a.finish_reason, a.matched_stop, a.new_tokens, r.output_ids) == ("stop", 9, [9], [9])
    r = _req(max_new_tokens=10)
    assert postprocess.advance(r, 2, EOS, 128).finish_reason == "stop"
    r = _req(max_new_tokens=10, ignore_eos=True)
    assert postprocess.advance(r, 2, EOS, 128).finish_reason is None


def test_length_limits():
    r = _req(max_new_tokens=2)
    assert postprocess.advance(r, 7, EOS, 128).finish_reason is None
    assert postprocess.advance(r, 7, EOS, 128).finish_reason == "length"
    r = _req(prompt=[1] * 9, max_new_tokens=50)
    assert postprocess.advance(r, 7, EOS, 10).finish_reason == "length"  # the context is full


def test_jump_forward_step0_and_stepN_one_path():
    # Script: 10 11 12 | choice | 13 14 15 | choice | 16 (finished after 16)
    script = [10, 11, 12, 20, 13, 14, 15, 21, 16]
    r = _req(max_new_tokens=50)
    r.matcher = ScriptMatcher(script, choice_at={3, 7})
    forced0 = postprocess.jump_forward(r, 128, reserve=1)  # step 0: before the prefill
    assert forced0 == [10, 11, 12] and r.output_ids == [10, 11, 12]
    r.pending_emit = forced0
    a = postprocess.advance(r, 20, EOS, 128)  # the first sampled token
    assert a.new_tokens == [10, 11, 12, 20, 13, 14, 15] and a.num_forced == 3 and a.finish_reason is None
    assert r.pending_emit == [] and r.num_forced_tokens == 6
    a = postprocess.advance(r, 21, EOS, 128)
    assert a.new_tokens == [21, 16] and a.finish_reason == "stop"  # forced to the end: the grammar is done
    with pytest.raises(RuntimeError):
        postprocess.advance(_req_with(script), 99, EOS, 128)


def _req_with(script):
    r = _req(max_new_tokens=50)
    r.matcher = ScriptMatcher(script, choice_at={0})
    return r


@pytest.mark.parametrize("max_new, ctx, want", [(3, 128, [10, 11]), (50, 6, [10, 11]), (50, 5, [10]), (1, 128, [])])
def test_jump_forward_caps_at_step0(max_new, ctx, want):
    """Step 0 keeps one token of the budget and of the context for the prefill's own sample."""
    r = _req(max_new_tokens=max_new)
    r.matcher = ScriptMatcher([10, 11, 12, 20, 13, 14, 15], choice_at={3})
    assert postprocess.jump_forward(r, ctx, reserve=1) == want
    assert r.output_ids == want and r.matcher.pos == len(want)


@pytest.mark.parametrize("max_new, ctx, want, reason", [(5, 128, [20, 13], "length"), (50, 8, [20, 13], "length"),
                                                        (50, 128, [20, 13, 14, 15], "stop")])
def test_jump_forward_caps_at_step_n(max_new, ctx, want, reason):
    """After a sampled token the forced run may use the whole remaining budget and context."""
    r = _req(max_new_tokens=max_new)
    r.matcher = ScriptMatcher([10, 11, 12, 20, 13, 14, 15], choice_at={3})
    r.matcher.pos = 3
    r.append_output([10, 11, 12])
    a = postprocess.advance(r, 20, EOS, ctx)
    assert a.new_tokens == want and a.finish_reason == reason
    assert r.output_ids == [10, 11, 12] + want


def test_jump_forward_off_and_logprob_records():
    r = _req(max_new_tokens=10, jump_forward=False)
    r.matcher = ScriptMatcher([10, 11, 12], choice_at=set())
    assert postprocess.jump_forward(r, 128, reserve=1) == []
    a = postprocess.advance(r, 10, EOS, 128)
    assert a.new_tokens == [10] and a.num_forced == 0
    recs = postprocess.logprob_entries([4, 10, 11], 1, (-0.25, [(10, -0.25), (3, -2.0)]))
    assert [e["logprob"] for e in recs] == [0.0, -0.25, 0.0]
    assert recs[1]["top_logprobs"] == [{"token_id": 10, "token": None, "logprob": -0.25},
                                       {"token_id": 3, "token": None, "logprob": -2.0}]
    assert recs[0]["top_logprobs"] == [] and all(e["token"] is None for e in recs)
