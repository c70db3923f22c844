"""dspy.ReAct's step names a tool and its arguments; the arguments always validate against the named tool's
schema, whichever adapter writes the step (adapters/dspy_formats.py: one grammar branch per tool, `finish` with
no arguments). 100 seeded, sampled runs of one ReAct step on Gemma-3-270M under JSONAdapter, in-process and
through `prefixrt serve`: 0 invalid, one LM call each."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

dspy = pytest.importorskip("dspy")
jsonschema = pytest.importorskip("jsonschema")


RUNS = int(os.environ.get("PREFIXRT_TEST_REACT_RUNS", "100"))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def weather(city: str, celsius: bool) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


SCHEMAS = {
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "boolean"}},
                "required": ["city", "celsius"], "additionalProperties": False},
    "finish": {"type": "object", "properties": {}, "additionalProperties": False},
}
QUESTIONS = ["What is 2 + 3?", "What is the weather in Paris?", "Add 40 and 2.", "Is it warm in Rome?"]


@pytest.mark.parametrize("adapter", [dspy.JSONAdapter, dspy.ChatAdapter])
def test_react_step_arguments_always_validate(gemma_target, adapter):
    if adapter is dspy.ChatAdapter and gemma_target.kind == "remote":
        pytest.skip("the ChatAdapter grammar is the same in both doors; the in-process run covers it")
    step = dspy.ReAct("question -> answer", tools=[add, weather], max_iters=3).react  # one Predict: one step

    def one(seed: int):
        lm = gemma_target.lm(max_tokens=160, temperature=1.0, seed=seed)
        with dspy.context(lm=lm, adapter=adapter()):
            try:
                pred = step(question=QUESTIONS[seed % len(QUESTIONS)], trajectory="")
            except Exception as e:  # noqa: BLE001 - a step that does not parse counts as invalid
                return lm, f"seed {seed}: {type(e).__name__}: {str(e)[:300]}"
        try:
            jsonschema.validate(pred.next_tool_args, SCHEMAS[pred.next_tool_name])
        except (KeyError, jsonschema.ValidationError) as e:
            return lm, f"seed {seed}: {pred.next_tool_name} {pred.next_tool_args!r}: {str(e)[:200]}"
        return lm, pred.next_tool_name

    with ThreadPoolExecutor(max_workers=25) as pool:
        results = list(pool.map(one, range(RUNS)))
    invalid = [r for _, r in results if r not in SCHEMAS]
    assert not invalid, invalid
    assert all(len(lm.history) == 1 for lm, _ in results)  # one LM call per step: no parse failure, no fallback
    names = [r for _, r in results]
    print(f"{adapter.__name__} {gemma_target.kind}: " + ", ".join(f"{n} {names.count(n)}" for n in SCHEMAS))


def test_langchain_auto_tool_calls_always_validate(gemma_target):
    """LangChain `bind_tools` with tool_choice "auto": when the model starts a call, the arguments follow that
    tool's schema (prefixrt/lowering.py plan_tools: one grammar branch per tool). 100 seeded, sampled runs: every
    call made validates; a reply may be text instead (the default model is not tool-trained)."""
    pytest.importorskip("langchain_core")
    from langchain_core.tools import tool

    tools = [tool(add), tool(weather)]

    def one(seed: int):
        model = gemma_target.chat(max_tokens=64, temperature=1.0, seed=seed).bind_tools(tools, tool_choice="auto")
        msg = model.invoke(QUESTIONS[seed % len(QUESTIONS)] + " Use a tool.")
        bad = []
        for call in msg.tool_calls:
            try:
                jsonschema.validate(call["args"], SCHEMAS[call["name"]])
            except (KeyError, jsonschema.ValidationError) as e:
                bad.append(f"seed {seed}: {call}: {str(e)[:200]}")
        return len(msg.tool_calls), bad, getattr(msg, "invalid_tool_calls", [])

    with ThreadPoolExecutor(max_workers=25) as pool:
        results = list(pool.map(one, range(RUNS)))
    invalid = [b for _, bad, inv in results for b in [*bad, *inv]]
    assert not invalid, invalid
    calls = sum(n for n, _, _ in results)
    print(f"langchain {gemma_target.kind}: {calls} tool calls in {RUNS} replies, 0 invalid")
    assert calls > 0  # the check saw calls to check
