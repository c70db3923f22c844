"""DSPy with nothing but `dspy.configure(lm=prefixrt.LM("gemma-3-270m"))`: the default ChatAdapter's reply
format is a constraint (adapters/dspy_formats.py), so Predict and ChainOfThought parse on the first call —
one LM call each, no JSONAdapter fallback — and ReAct, Refine and streamify run. Gemma in-process only (one
engine for the module); `LM(base_url=...)` is checked on the tiny server."""

from __future__ import annotations

import asyncio

import pytest

dspy = pytest.importorskip("dspy")

import prefixrt  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What color is the sky?", "How many legs does a dog have?",
             "What is 2 plus 3?", "Who wrote Hamlet?", "What is the largest planet?", "What language is spoken in "
             "Spain?", "What is frozen water called?", "How many days are in a week?", "What is the opposite of hot?",
             "What animal says moo?", "What is the capital of Japan?", "How many hours are in a day?",
             "What do bees make?", "What is the boiling point of water in Celsius?", "Which month comes after May?",
             "What gas do plants breathe in?", "What is 10 minus 4?", "What shape has three sides?",
             "What is the color of grass?"]


@pytest.fixture(scope="module")
def gemma_lm(gemma_engine):
    lm = prefixrt.LM("gemma-3-270m", max_tokens=160)  # the shared in-process engine gemma_engine loaded
    dspy.configure(lm=lm)
    yield lm
    dspy.configure(lm=None)


@pytest.mark.parametrize("module", ["Predict", "ChainOfThought"])
def test_default_adapter_parses_on_the_first_call(gemma_lm, module):
    program = getattr(dspy, module)("question -> answer")
    parsed = 0
    for q in QUESTIONS:
        before = len(gemma_lm.history)
        try:
            out = program(question=q)
        except dspy.utils.exceptions.AdapterParseError:
            continue
        assert len(gemma_lm.history) - before == 1, "one LM call, no adapter fallback"
        assert "[[ ## completed ## ]]" in gemma_lm.history[-1]["outputs"][0]
        parsed += isinstance(out.answer, str) and bool(out.answer.strip())
        if module == "ChainOfThought":
            assert isinstance(out.reasoning, str)
    assert parsed >= 19, parsed


def test_react_with_a_python_tool_reaches_a_final_answer(gemma_lm):
    calls = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    react = dspy.ReAct("question -> answer", tools=[add], max_iters=4)
    out = react(question="What is 2 plus 3? Use the add tool.")
    assert isinstance(out.answer, str)
    tool_names = [v for k, v in out.trajectory.items() if k.startswith("tool_name_")]
    assert tool_names and tool_names[-1] == "finish" or len(tool_names) == 4


def test_refine_runs(gemma_lm):
    def reward(args, pred) -> float:
        return 1.0 if len(pred.answer.split()) <= 5 else 0.0

    refine = dspy.Refine(module=dspy.Predict("question -> answer"), N=2, reward_fn=reward, threshold=1.0)
    out = refine(question="What is the capital of Italy?")
    assert isinstance(out.answer, str)


def test_streamify_with_a_stream_listener(gemma_lm):
    program = dspy.streamify(dspy.Predict("question -> answer"),
                             stream_listeners=[dspy.streaming.StreamListener(signature_field_name="answer")])

    async def collect():
        return [item async for item in program(question="Name a colour of the rainbow.")]

    items = asyncio.run(collect())
    chunks = [i for i in items if isinstance(i, dspy.streaming.StreamResponse)]
    final = items[-1]
    assert isinstance(final, dspy.Prediction) and final.answer
    assert chunks and all(c.signature_field_name == "answer" for c in chunks)
    assert "".join(c.chunk for c in chunks).strip() == final.answer.strip()


def test_remote_lm_model_includes_the_revision(tiny_server):
    lm = prefixrt.LM(base_url=tiny_server)
    rev = prefixrt.RemoteEngine(tiny_server).model_revision
    assert rev and lm.model.endswith(rev) and "@" in lm.model
