"""DSPy's three adapters against a model that writes noise: the tiny random-weights llama at temperature 1, which
samples any byte the reply format allows (control characters, `<`, `&`, `]]>`, stray brackets). Every Predict must
parse on its first LM call, with DSPy's own parser (XMLAdapter: ElementTree; ChatAdapter: its field headers and
`parse_value`; JSONAdapter: json_repair and pydantic): exactly one call per Predict, 20 Predicts per adapter, over a
signature with str, int, float, bool, list and nested pydantic outputs. Before, XMLAdapter needed a second call
(its fallback) for most of them: a value held a character XML forbids, and a nested field was free text. Later, a
reply could still overrun max_tokens, cut before its last closing tag (a list's strings and an int's digits ran
on; a text value's cap could cut an entity reference): now every part of the reply is bounded in tokens
(adapters/dspy_formats.py, "The budget"; tests/adapters/test_dspy_formats.py drives the grammar with a sampler
that never ends a value by choice)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

dspy = pytest.importorskip("dspy")
pydantic = pytest.importorskip("pydantic")



class Inner(pydantic.BaseModel):
    name: str
    score: int


class Outer(pydantic.BaseModel):
    title: str
    inner: Inner
    tags: list[str]


class Mixed(dspy.Signature):
    question: str = dspy.InputField()
    s: str = dspy.OutputField()
    i: int = dspy.OutputField()
    f: float = dspy.OutputField()
    b: bool = dspy.OutputField()
    words: list[str] = dspy.OutputField()
    m: Outer = dspy.OutputField()


# The sampling state matters (which Predict draws a long value): each run starts from a torch seed, XMLAdapter (the
# strictest parser) from two.
@pytest.mark.parametrize("adapter,seed", [(dspy.XMLAdapter, 0), (dspy.XMLAdapter, 1), (dspy.ChatAdapter, 0),
                                          (dspy.JSONAdapter, 0)], ids=["xml-0", "xml-1", "chat-0", "json-0"])
def test_one_lm_call_per_predict_at_temperature_1(tiny_engine, adapter, seed):
    import torch

    import prefixrt

    torch.manual_seed(seed)
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=400, temperature=1.0)
    program = dspy.Predict(Mixed)
    results = []
    with dspy.context(lm=lm, adapter=adapter()):
        for k in range(20):
            results.append(program(question=f"Question number {k}?"))
    assert len(lm.history) == 20, [h["outputs"][0][:200] for h in lm.history]  # no second call, no fallback
    for out in results:
        assert isinstance(out.s, str) and isinstance(out.i, int) and isinstance(out.f, float)
        assert isinstance(out.b, bool) and all(isinstance(t, str) for t in out.words)
        assert isinstance(out.m, Outer) and isinstance(out.m.inner.score, int)
    if adapter is dspy.XMLAdapter:
        for h in lm.history:
            ET.fromstring(f"<root>{h['outputs'][0]}</root>")  # well-formed, as DSPy parses it
