"""DSPy with nothing but `dspy.configure(lm=prefixrt.LM("gemma-3-270m"))`: the default ChatAdapter's reply format
is a constraint (adapters/dspy_formats.py), so Predict and ChainOfThought parse on the first call — one LM call
each, no JSONAdapter fallback — for at least 19 of 20 inputs (issue 14; measured counts in docs/adapters.md), and
streamify with a StreamListener runs. The Responses API through the in-process OpenAI shim runs on the same
engine, and dspy.ReAct with a Python tool runs its loop (the tool called with arguments under its schema) to a
final answer; dspy.Refine's feedback step parses on its first call. Gemma in-process only: the one
session engine `gemma_engine` (shared with tests/adapters/test_dspy.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

dspy = pytest.importorskip("dspy")

import prefixrt  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What color is the sky?", "How many legs does a dog have?",
             "What is 2 plus 3?", "Who wrote Hamlet?", "What is the largest planet?",
             "What language is spoken in Spain?", "What is frozen water called?", "How many days are in a week?",
             "What is the opposite of hot?", "What animal says moo?", "What is the capital of Japan?",
             "How many hours are in a day?", "What do bees make?", "What is the boiling point of water in Celsius?",
             "Which month comes after May?", "What gas do plants breathe in?", "What is 10 minus 4?",
             "What shape has three sides?", "What is the color of grass?"]
assert len(QUESTIONS) == 20


@pytest.fixture(scope="module")
def lm(gemma_engine):
    """`prefixrt.LM("gemma-3-270m")` (the shared in-process engine gemma_engine loaded), configured as the only
    DSPy setting. max_tokens bounds a reply that rambles; a parsed reply ends well before it."""
    lm = prefixrt.LM("gemma-3-270m", max_tokens=96, temperature=0.0)
    dspy.configure(lm=lm)
    yield lm
    dspy.configure(lm=None)


@pytest.mark.parametrize("module", ["Predict", "ChainOfThought"])
def test_default_adapter_parses_on_the_first_call(lm, module):
    program = getattr(dspy, module)("question -> answer")
    assert dspy.settings.adapter is None  # DSPy's default: ChatAdapter, falling back to JSONAdapter on a miss

    n_calls = len(lm.history)

    def one(q: str):
        try:
            return program(question=q)
        except Exception as e:  # noqa: BLE001 - a reply that does not parse is what is counted
            return f"{q!r}: {type(e).__name__}: {str(e)[:300]}"

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(one, QUESTIONS))
    failures, parsed = [], []
    for q, out in zip(QUESTIONS, results):
        if isinstance(out, str):
            failures.append(out)
            continue
        ok = isinstance(out.answer, str) and bool(out.answer.strip())
        if module == "ChainOfThought":
            ok = ok and isinstance(out.reasoning, str) and bool(out.reasoning.strip())
        (parsed if ok else failures).append(q if ok else f"{q!r}: empty field in {out!r}")
    # One LM call per input, 20 in all (a ChatAdapter miss would add a JSONAdapter call), each reply in the
    # ChatAdapter format.
    new = lm.history[n_calls:]
    assert len(new) == 20, [h["outputs"] for h in new]
    assert all("[[ ## completed ## ]]" in h["outputs"][0] for h in new), [h["outputs"][0] for h in new]
    print(f"{module}: {len(parsed)}/20 parsed on the first call")
    assert len(parsed) >= 19, failures


def test_streamify_with_a_stream_listener(lm):
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


def test_react_runs_its_tool_loop_to_a_final_answer(lm):
    """dspy.ReAct on the default ChatAdapter: every step parses on the first call, the chosen tool's arguments
    follow its schema (ReAct's own `dict[str, Any]` field lets a small model close `{}`, and every call failed),
    so the tool runs, and the extraction step gives a typed answer. What the model computes is not asserted."""
    calls = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    n_calls = len(lm.history)
    react = dspy.ReAct("question -> answer: int", tools=[add], max_iters=2)
    out = react(question="What is 2 + 3? Use the add tool.")
    assert isinstance(out.answer, int)
    steps = [out.trajectory[k] for k in out.trajectory if k.startswith("tool_name_")]
    assert steps and set(steps) <= {"add", "finish"}, out.trajectory
    assert len(calls) == steps.count("add"), out.trajectory  # every add step ran the tool
    for i, _ in enumerate(steps):
        assert "Execution error" not in str(out.trajectory[f"observation_{i}"]), out.trajectory
    print(f"ReAct: steps {steps}, tool calls {calls}, answer {out.answer}")
    # One LM call per step and one for the answer: no parse failure, no adapter fallback.
    assert len(lm.history) - n_calls == len(steps) + 1


def test_responses_through_the_shim(gemma_engine):
    """client.responses.create, stream and not, through prefixrt.openai on the Gemma engine (no sockets); a
    follow-up by previous_response_id reads the first turn from the radix cache."""
    from prefixrt.openai import OpenAI

    client = OpenAI(engine=gemma_engine)
    try:
        r = client.responses.create(model="gemma-3-270m", input="What is the capital of France?",
                                    instructions="Answer in one word.", max_output_tokens=8, temperature=0)
        assert r.status in ("completed", "incomplete") and r.output_text.strip()
        events = list(client.responses.create(model="gemma-3-270m", input="What is the capital of France?",
                                              instructions="Answer in one word.", max_output_tokens=8,
                                              temperature=0, stream=True))
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                             "response.incomplete")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert events[-1].response.output_text == r.output_text
        # instructions do not carry over (as in OpenAI's API): the same ones again keep the prompt's start
        follow = client.responses.create(model="gemma-3-270m", input="And of Italy?", previous_response_id=r.id,
                                         instructions="Answer in one word.", max_output_tokens=8, temperature=0)
        assert follow.output_text.strip()
        assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    finally:
        client.close()


def test_refine_feedback_parses_on_the_first_call(lm, capsys):
    """dspy.Refine with a reward the first attempt misses: its feedback step (OfferFeedback: `discussion` text and
    `advice: dict[str, str]`, under a ~4,000-token prompt) parses on its first call under the default ChatAdapter,
    so no attempt fails and the feedback step is one call (the attempts run on copies of the LM, with their own
    histories; the feedback step on the configured LM). Before, the
    model wrote `discussion` until max_tokens, ChatAdapter's parse failed and JSONAdapter's retry filled the open
    `advice` with keys until max_tokens: Refine printed "Attempt failed"."""
    refine = dspy.Refine(dspy.Predict("question -> answer"), N=2, reward_fn=lambda args, pred: 0.0, threshold=1.0)
    before = len(lm.history)
    pred = refine(question="What is the capital of France?")
    assert isinstance(pred.answer, str)
    assert "Attempt failed" not in capsys.readouterr().out
    feedback = lm.history[before:]
    assert len(feedback) == 1 and "[[ ## advice ## ]]" in feedback[0]["outputs"][0], feedback
