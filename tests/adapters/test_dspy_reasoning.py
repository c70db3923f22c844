"""prefixrt.LM(reasoning_parser=...): a reasoning model's thinking comes back apart from its reply, as DSPy's
reasoning_content, and fills a `dspy.Reasoning` output field (the tiny model held by a regex to a Qwen3-style
reply in ChatAdapter's format)."""

from __future__ import annotations

import re

import pytest

from tests.server.conftest import needs_constrained_decoding

pytestmark = needs_constrained_decoding()
dspy = pytest.importorskip("dspy")

REPLY = "<think>\nTwo and two make four.\n</think>\n\n[[ ## answer ## ]]\n4\n\n[[ ## completed ## ]]"


class Ask(dspy.Signature):
    question: str = dspy.InputField()
    reasoning: dspy.Reasoning = dspy.OutputField()
    answer: str = dspy.OutputField()


class Forcing:
    """The engine, with every request held to REPLY (DSPy carries no regex option of its own)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, params=None):
        return self.engine.generate(prompt, {**params, "regex": re.escape(REPLY)})


def test_reasoning_field_from_the_models_thinking(tiny_engine):
    import prefixrt

    lm = prefixrt.LM(engine=Forcing(tiny_engine), reasoning_parser="qwen3", max_tokens=200)
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        pred = dspy.Predict(Ask)(question="2+2?")
    assert pred.answer == "4" and str(pred.reasoning) == "Two and two make four."
    assert len(lm.history) == 1  # one call: the reply parsed first time
    out = lm.history[-1]["outputs"][0]
    assert out["reasoning_content"] == "Two and two make four." and "<think>" not in out["text"]
    # the parser goes with the LM when DSPy saves and copies it
    assert prefixrt.LM.load_state(lm.dump_state(), engine=tiny_engine).reasoning_parser == "qwen3"
    assert lm.copy(temperature=0.5).reasoning_parser == "qwen3"


def test_without_a_parser_reasoning_is_refused_as_before(tiny_engine):
    import prefixrt

    lm = prefixrt.LM(engine=tiny_engine, max_tokens=8)
    assert not lm.supports_reasoning
    with pytest.raises(Exception, match="reasoning"):
        lm("hi", reasoning_effort="low")
