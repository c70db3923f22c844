"""prefixrt.LM under DSPy: the engine interface, usage with cache reads, prefix sharing across module.batch,
async, streaming, state; typed outputs through JSONAdapter + constrained decoding on Gemma-3-270M."""

from __future__ import annotations

import asyncio
from typing import Literal

import dspy
import pydantic
import pytest
from prefixrt.adapters.dspy import AsyncPrefixRTEngine, PrefixRTEngine

import prefixrt
from tests.adapters.conftest import needs_constraints

pytestmark = pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning")

SYSTEM = "You are a terse assistant for a library catalogue. " * 8  # a long shared prefix


class Ask(dspy.Module):
    """Calls the LM directly with a shared system prompt (no output parsing: works on a random model)."""

    def forward(self, question: str):
        lm = dspy.settings.lm
        out = lm(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        return dspy.Prediction(answer=out[0], usage=lm.history[-1]["usage"])


def test_constructs_an_lm_on_the_engine_interface(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=8)
    assert isinstance(lm, dspy.LM)
    assert isinstance(lm.engine, PrefixRTEngine) and isinstance(lm._async_engine_spec, AsyncPrefixRTEngine)
    assert lm.model == "prefixrt/tiny-llama@test"  # revision in the model string: DSPy's cache key
    assert lm.supports_response_schema and "response_format" in lm.supported_params
    out = lm("hello")
    assert isinstance(out, list) and isinstance(out[0], str)


def test_usage_reports_cache_reads(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=4)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which shelf?"}]
    with dspy.context(lm=lm, track_usage=True):
        lm(messages=messages)
        lm(messages=messages)
        usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_module_batch_shares_the_prefix(tiny_engine):
    tiny_engine.flush_cache()
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=4)
    examples = [dspy.Example(question=f"Where is book number {i}?").with_inputs("question") for i in range(16)]
    with dspy.context(lm=lm):
        results = Ask().batch(examples, num_threads=16)
    cached = [r.usage["prompt_tokens_details"]["cached_tokens"] for r in results]
    assert sum(c > 0 for c in cached) >= 15, cached


def test_acall(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=4)

    async def main():
        return await asyncio.gather(*(lm.acall(f"question {i}") for i in range(4)))

    outs = asyncio.run(main())
    assert len(outs) == 4 and all(isinstance(o[0], str) for o in outs)


def test_streamify_streams_chunks(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=12)
    program = dspy.streamify(Ask())

    async def collect():
        items = []
        async for item in program(question="Stream please"):
            items.append(item)
        return items

    with dspy.context(lm=lm):
        items = asyncio.run(collect())
    chunks = [i for i in items if not isinstance(i, dspy.Prediction)]
    final = items[-1]
    assert isinstance(final, dspy.Prediction)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks and streamed == final.answer


def test_engine_stream_events_close_with_usage(tiny_engine):
    from dspy.lm15 import Message, Request

    engine = PrefixRTEngine(prefixrt.LM(engine=tiny_engine).handle)
    events = list(engine.stream(Request(model="m", messages=(Message.user("hi"),))))
    assert events[0].type == "start" and events[-1].type == "end"
    assert events[-1].usage.input_tokens > 0 and events[-1].usage.cache_read_tokens is not None


def test_unknown_option_is_refused(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=4)
    with pytest.raises(Exception, match="'bogus'"):
        lm("hi", bogus=1)
    from dspy.lm15 import Config, Message, Request  # prefixrt knobs travel in Config.extensions

    request = Request(model=lm.model, messages=(Message.user("hi"),),
                      config=Config(max_tokens=2, extensions={"cache_salt": "tenant-a", "bogus": 1}))
    with pytest.raises(Exception, match="no sampling option 'bogus'"):
        lm(request)
    request = Request(model=lm.model, messages=(Message.user("hi"),),
                      config=Config(max_tokens=2, extensions={"cache_salt": "tenant-a"}))
    assert lm(request).usage.cache_read_tokens == 0


def test_dump_and_load_state(tiny_engine):
    lm = prefixrt.LM(engine=tiny_engine, max_tokens=7, temperature=0.0)
    state = lm.dump_state()
    assert state["model"] == "tiny-llama" and state["revision"] == "test" and state["max_tokens"] == 7
    assert "api_key" not in state
    again = prefixrt.LM.load_state(state, engine=tiny_engine)
    assert again.model == lm.model and again.kwargs["max_tokens"] == 7
    copy = lm.copy(temperature=0.5)
    assert copy.handle is lm.handle and copy.kwargs["temperature"] == 0.5


# ---------------------------------------------------------------------------------------------- Gemma


class Author(pydantic.BaseModel):
    name: str
    born: int


class Typed(dspy.Signature):
    """Describe the book."""

    book: str = dspy.InputField()
    pages: int = dspy.OutputField()
    rating: float = dspy.OutputField()
    in_print: bool = dspy.OutputField()
    tags: list[str] = dspy.OutputField()
    genre: Literal["fiction", "science", "history"] = dspy.OutputField()
    author: Author = dspy.OutputField()


BOOKS = ["Dune", "A Brief History of Time", "The Guns of August", "Emma", "Cosmos", "Ulysses", "SPQR",
         "The Hobbit", "The Selfish Gene", "Middlemarch", "Sapiens", "Beloved", "The Gene", "Dracula",
         "Silent Spring", "Jane Eyre", "The Histories", "Neuromancer", "Origin of Species", "Persuasion"]


@pytest.fixture
def gemma_lm(gemma_provider):
    return prefixrt.LM(engine=gemma_provider, max_tokens=160)


@needs_constraints
def test_predict_and_chain_of_thought_with_demos(gemma_lm):
    demos = [dspy.Example(question="What is 2 + 2?", reasoning="Two plus two is four.", answer="4")]
    cot = dspy.ChainOfThought("question -> answer")
    cot.predict.demos = demos
    with dspy.context(lm=gemma_lm, adapter=dspy.JSONAdapter()):
        p = dspy.Predict("question -> answer")(question="What is the capital of France?")
        c = cot(question="What is 3 + 4?")
    assert isinstance(p.answer, str) and isinstance(c.answer, str) and isinstance(c.reasoning, str)


@needs_constraints
def test_json_adapter_typed_outputs_parse_every_time(gemma_lm):
    predict = dspy.Predict(Typed)
    with dspy.context(lm=gemma_lm, adapter=dspy.JSONAdapter()):
        results = predict.batch([dspy.Example(book=b).with_inputs("book") for b in BOOKS], num_threads=20,
                                max_errors=0)
    assert len(results) == 20
    for r in results:
        assert isinstance(r.pages, int) and isinstance(r.rating, float) and isinstance(r.in_print, bool)
        assert isinstance(r.tags, list) and all(isinstance(t, str) for t in r.tags)
        assert r.genre in ("fiction", "science", "history") and isinstance(r.author, Author)


@needs_constraints
def test_gemma_batch_reports_cached_tokens(gemma_lm, gemma_provider):
    examples = [dspy.Example(question=f"Name a colour, number {i}.").with_inputs("question") for i in range(16)]
    with dspy.context(lm=gemma_lm, adapter=dspy.JSONAdapter(), track_usage=True):
        results = dspy.Predict("question -> answer").batch(examples, num_threads=16, max_errors=0)
    cached = [r.get_lm_usage()[gemma_lm.model]["prompt_tokens_details"]["cached_tokens"] for r in results]
    assert sum(c > 0 for c in cached) >= 15, cached


@needs_constraints
def test_gemma_acall(gemma_lm):
    async def main():
        with dspy.context(lm=gemma_lm, adapter=dspy.JSONAdapter()):
            return await dspy.Predict("question -> answer").acall(question="What colour is the sky?")

    assert isinstance(asyncio.run(main()).answer, str)
