"""DSPy's XMLAdapter on Gemma-3-270M, in-process and through `prefixrt serve`: the reply format is a grammar
(adapters/dspy_formats.py) in which a field's value never contains the field's own tags, so every Predict parses
on its first call: exactly one LM call per Predict, counted with DSPy's history (before, the model wrote
`<answer>\\n<answer>...`, the parse failed and DSPy called the LM again)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

dspy = pytest.importorskip("dspy")

from tests.adapters.test_dspy_first_call import QUESTIONS  # noqa: E402


@pytest.mark.parametrize("signature", ["question -> answer", "question -> reasoning, answer"])
def test_xml_adapter_one_lm_call_per_predict(gemma_target, signature):
    lm = gemma_target.lm(max_tokens=96, temperature=0.0)
    program = dspy.Predict(signature)
    fields = [f.strip() for f in signature.split("->")[1].split(",")]

    def one(q: str):
        with dspy.context(lm=lm, adapter=dspy.XMLAdapter()):
            try:
                return program(question=q)
            except Exception as e:  # noqa: BLE001 - a reply that does not parse is what is counted
                return f"{q!r}: {type(e).__name__}: {str(e)[:300]}"

    questions = QUESTIONS[:10]
    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(one, questions))
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, failures
    assert len(lm.history) == len(questions), [h["outputs"] for h in lm.history]  # one call each, no fallback
    for h, out in zip(lm.history, results):
        reply = h["outputs"][0]
        for f in fields:
            assert reply.count(f"<{f}>") == 1 and reply.count(f"</{f}>") == 1, reply
            assert isinstance(getattr(out, f), str) and getattr(out, f).strip(), reply
        assert not re.search(r"<(\w+)>\s*<\1>", reply), reply
