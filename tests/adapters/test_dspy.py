"""prefixrt.LM under DSPy, each test in-process and through `prefixrt serve` (the `*_target` parameter).

Tiny random model: the engine interface, usage with cache reads, prefix sharing across module.batch, async,
streaming, options, state. Gemma-3-270M: the acceptance checks — `prefixrt.LM("gemma-3-270m")` running Predict and
ChainOfThought with demos, JSONAdapter typed outputs parsing on 20 of 20 calls (constrained decoding),
module.batch of 16 reporting cached tokens, acall, and dspy.streamify.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import dspy
import pydantic
import pytest
from prefixrt.adapters.dspy import AsyncPrefixRTEngine, PrefixRTEngine, lower_request

import prefixrt

SYSTEM = "You are a terse assistant for a library catalogue. " * 8  # a long shared prefix


class Ask(dspy.Module):
    """Calls the LM directly with a prompt that opens with a long shared text (no output parsing: works on a random
    model)."""

    def forward(self, question: str):
        lm = dspy.settings.lm
        out = lm(f"{SYSTEM}\n{question}")
        return dspy.Prediction(answer=out[0], usage=lm.history[-1]["usage"])


# ---------------------------------------------------------------------------------------------- tiny model


def test_constructs_an_lm_on_the_engine_interface(tiny_target):
    lm = tiny_target.lm(max_tokens=8)
    assert isinstance(lm, dspy.LM)
    assert isinstance(lm.engine, PrefixRTEngine) and isinstance(lm._async_engine_spec, AsyncPrefixRTEngine)
    if tiny_target.kind == "engine":
        assert lm.model == "prefixrt/tiny-llama@test"  # revision in the model string: DSPy's cache key
    else:
        assert lm.model.startswith("prefixrt/tiny-llama")  # the name the server reports
    assert lm.supports_response_schema and "response_format" in lm.supported_params
    out = lm("hello")
    assert isinstance(out, list) and isinstance(out[0], str)


def test_usage_reports_cache_reads(tiny_target):
    from dspy.lm15 import Config, Message, Request

    lm = tiny_target.lm()
    request = Request(model=lm.model, system=SYSTEM, messages=(Message.user("Which shelf?"),),
                      config=Config(max_tokens=4))
    with dspy.context(lm=lm, track_usage=True):
        lm(request)
        response = lm(request)
        usage = lm.history[-1]["usage"]
    assert response.usage.output_tokens == 4 and response.usage.cache_read_tokens == usage["prompt_tokens"] - 1
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_module_batch_shares_the_prefix(tiny_target):
    tiny_target.provider.flush_cache()
    lm = tiny_target.lm(max_tokens=4)
    examples = [dspy.Example(question=f"Where is book number {i}?").with_inputs("question") for i in range(16)]
    with dspy.context(lm=lm):
        results = Ask().batch(examples, num_threads=16)
    cached = [r.usage["prompt_tokens_details"]["cached_tokens"] for r in results]
    assert sum(c > 0 for c in cached) >= 15, cached


def test_acall(tiny_target):
    lm = tiny_target.lm(max_tokens=4)

    async def main():
        return await asyncio.gather(*(lm.acall(f"question {i}") for i in range(4)))

    outs = asyncio.run(main())
    assert len(outs) == 4 and all(isinstance(o[0], str) for o in outs)


def test_streamify_streams_chunks(tiny_target):
    lm = tiny_target.lm(max_tokens=12)
    program = dspy.streamify(Ask())

    async def collect():
        return [item async for item in program(question="Stream please")]

    with dspy.context(lm=lm):
        items = asyncio.run(collect())
    chunks = [i for i in items if not isinstance(i, dspy.Prediction)]
    final = items[-1]
    assert isinstance(final, dspy.Prediction)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(chunks) > 1 and streamed == final.answer


def test_engine_stream_events_close_with_usage(tiny_target):
    from dspy.lm15 import Message, Request

    engine = PrefixRTEngine(tiny_target.lm().handle)
    events = list(engine.stream(Request(model="m", messages=(Message.user("hi"),))))
    assert events[0].type == "start" and events[-1].type == "end"
    assert events[-1].usage.input_tokens > 0 and events[-1].usage.cache_read_tokens is not None


def test_response_format_and_tools_are_constrained(tiny_target):
    """Explicit lm15 requests: a JSON schema and a forced tool call come back valid even from random weights."""
    import json

    import jsonschema
    from dspy.lm15 import Config, FunctionTool, Message, Request, ToolChoice

    lm = tiny_target.lm()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    request = Request(model=lm.model, messages=(Message.user("A number?"),),
                      config=Config(max_tokens=32, response_format={"type": "json_schema", "schema": schema}))
    jsonschema.validate(json.loads(lm(request).text), schema)
    request = Request(model=lm.model, messages=(Message.user("A number?"),),
                      config=Config(response_format={"type": "json_object"}))
    lowered = lower_request(request)[1]
    assert lowered.get("json_object") is True and "json_schema" not in lowered  # any JSON object
    tool = FunctionTool(name="shelf", description="Find a shelf.",
                parameters={"type": "object", "properties": {"row": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["row"]})
    request = Request(model=lm.model, messages=(Message.user("Where?"),), tools=(tool,),
                      config=Config(max_tokens=48, tool_choice=ToolChoice(mode="required")))
    response = lm(request)
    calls = [p for p in response.message.parts if p.type == "tool_call"]
    assert response.finish_reason == "tool_call" and calls[0].name == "shelf"
    assert set(calls[0].input) == {"row"} and 1 <= calls[0].input["row"] <= 9


def test_unknown_option_is_refused(tiny_target):
    lm = tiny_target.lm(max_tokens=4)
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


def test_dump_and_load_state(tiny_target):
    lm = tiny_target.lm(max_tokens=7, temperature=0.0)
    state = lm.dump_state()
    assert state["model"] == "tiny-llama" and state["max_tokens"] == 7 and "api_key" not in state
    if tiny_target.kind == "engine":
        assert state["revision"] == "test"
        again = prefixrt.LM.load_state(state, engine=tiny_target.provider)
    else:
        assert state["base_url"] == tiny_target.base_url
        again = prefixrt.LM.load_state(state)  # reconnects to the server
        assert isinstance(again("hi")[0], str)
    assert again.model == lm.model and again.kwargs["max_tokens"] == 7
    copy = lm.copy(temperature=0.5)
    assert copy.handle is lm.handle and copy.kwargs["temperature"] == 0.5


# ---------------------------------------------------------------------------------------------- Gemma
# Bounds on strings, numbers and lists keep every reply short (CPU time), and are what a schema for a small model
# should carry anyway; constrained decoding is what makes every reply parse.


class Author(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    born: int = pydantic.Field(ge=1000, le=2025)


class Typed(dspy.Signature):
    """Describe the book."""

    book: str = dspy.InputField()
    pages: Annotated[int, pydantic.Field(ge=1, le=5000)] = dspy.OutputField()
    rating: Annotated[float, pydantic.Field(ge=0, le=5)] = dspy.OutputField()
    in_print: bool = dspy.OutputField()
    tags: Annotated[list[Annotated[str, pydantic.Field(max_length=12)]], pydantic.Field(max_length=2)] = \
        dspy.OutputField()
    genre: Literal["fiction", "science", "history"] = dspy.OutputField()
    author: Author = dspy.OutputField()


class Colour(dspy.Signature):
    """Name the colour the question is about."""

    question: str = dspy.InputField()
    colour: Literal["red", "green", "blue", "yellow"] = dspy.OutputField()


BOOKS = ["Dune", "A Brief History of Time", "The Guns of August", "Emma", "Cosmos", "Ulysses", "SPQR",
         "The Hobbit", "The Selfish Gene", "Middlemarch", "Sapiens", "Beloved", "The Gene", "Dracula",
         "Silent Spring", "Jane Eyre", "The Histories", "Neuromancer", "Origin of Species", "Persuasion"]


def test_predict_and_chain_of_thought_with_demos(gemma_target):
    """`dspy.configure(lm=prefixrt.LM("gemma-3-270m"))` (or base_url=), then Predict and ChainOfThought with demos,
    run concurrently through acall (both DSPy adapters' default output parsing falls back to JSON)."""
    predict = dspy.Predict("question -> answer")
    predict.demos = [dspy.Example(question="What is the capital of Italy?", answer="Rome")]
    cot = dspy.ChainOfThought("question -> answer")
    cot.predict.demos = [dspy.Example(question="What is 2 + 2?", reasoning="Two plus two is four.", answer="4")]
    lm = gemma_target.lm(max_tokens=96)

    async def main():
        return await asyncio.gather(predict.acall(question="What is the capital of France?"),
                                    cot.acall(question="What is 3 + 4?"))

    dspy.configure(lm=lm, adapter=dspy.JSONAdapter())
    try:
        p, c = asyncio.run(main())
    finally:
        dspy.configure(lm=None, adapter=None)
    assert isinstance(p.answer, str) and p.answer
    assert isinstance(c.answer, str) and isinstance(c.reasoning, str) and c.reasoning
    assert "Rome" in str(lm.history[0]["messages"]) or "Rome" in str(lm.history[1]["messages"])  # demos sent


def test_json_adapter_typed_outputs_parse_every_time(gemma_target):
    lm = gemma_target.lm(max_tokens=96)
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        results = dspy.Predict(Typed).batch([dspy.Example(book=b).with_inputs("book") for b in BOOKS],
                                            num_threads=20, max_errors=0)
    assert len(results) == 20
    for r in results:
        assert isinstance(r.pages, int) and isinstance(r.rating, float) and isinstance(r.in_print, bool)
        assert isinstance(r.tags, list) and all(isinstance(t, str) for t in r.tags)
        assert r.genre in ("fiction", "science", "history") and isinstance(r.author, Author)


def test_module_batch_reports_cached_tokens(gemma_target):
    gemma_target.provider.flush_cache()
    lm = gemma_target.lm(max_tokens=16)
    examples = [dspy.Example(question=f"Which colour is a ripe fruit number {i}?").with_inputs("question")
                for i in range(16)]
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter(), track_usage=True):
        results = dspy.Predict(Colour).batch(examples, num_threads=16, max_errors=0)
    assert all(r.colour in ("red", "green", "blue", "yellow") for r in results)
    cached = [r.get_lm_usage()[lm.model]["prompt_tokens_details"]["cached_tokens"] for r in results]
    assert sum(c > 0 for c in cached) >= 15, cached


def test_streamify_streams_a_field(gemma_target):
    lm = gemma_target.lm(max_tokens=48)
    program = dspy.streamify(dspy.Predict("question -> answer"),
                             stream_listeners=[dspy.streaming.StreamListener(signature_field_name="answer")])

    async def collect():
        return [item async for item in program(question="Name three colours of the rainbow.")]

    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        items = asyncio.run(collect())
    chunks = [i for i in items if isinstance(i, dspy.streaming.StreamResponse)]
    final = items[-1]
    assert isinstance(final, dspy.Prediction) and final.answer
    assert len(chunks) > 1 and all(c.signature_field_name == "answer" for c in chunks)
    assert "".join(c.chunk for c in chunks).strip().strip('"') == final.answer.strip()  # chunks are JSON text
