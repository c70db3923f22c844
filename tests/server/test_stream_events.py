"""The streaming fast paths of the OpenAI routes leave what a client reads unchanged.

- openai_format.TextEvents builds the text-only chunk events from a per-response template: the same bytes as
  sse(completion_chunk(...)) / sse(chat_chunk(...)), the general path, for any text and model name.
- Coalescing (astream_open(coalesce=True), outputs.coalesce_chunks): a stream that fell behind sends the waiting
  tokens of a sample as one multi-token event. Against the same request streamed one event per step, on a real
  engine: the concatenated text, logprobs (tokens, values, text offsets), finish reasons and usage are equal, and
  every event still has OpenAI's chunk schema (published spec and the openai SDK's own types).
"""

from __future__ import annotations

import asyncio
import json

import openai.types as oai_types
import openai.types.chat as oai_chat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.outputs import Chunk, coalesce_chunks
from prefixrt.server import openai_api
from prefixrt.server import openai_format as convert
from prefixrt.server.sse import sse
from tests.server.conftest import build_engine
from tests.server.test_conformance import conforms

OBJS = ("text_completion", "chat.completion.chunk")


def _reference(obj: str, rid: str, model: str, created: int, index: int, text: str, reason) -> str:
    if obj == "text_completion":
        return sse(convert.completion_chunk(rid, model, created, index, text, reason))
    return sse(convert.chat_chunk(rid, model, created, index, {"content": text}, reason))


@settings(max_examples=300, deadline=None)
@given(obj=st.sampled_from(OBJS), model=st.text(max_size=12), text=st.text(max_size=40),
       index=st.integers(0, 300), reason=st.sampled_from([None, "stop", "length", "tool_calls"]),
       created=st.integers(0, 2**40))
def test_text_events_match_the_general_path_byte_for_byte(obj, model, text, index, reason, created):
    # st.text draws lone surrogates too: the general path's ASCII fallback must be matched as well.
    got = convert.TextEvents("cmpl-x", model, created, obj).event(index, text, reason)
    assert got == _reference(obj, "cmpl-x", model, created, index, text, reason)


def test_text_events_fixed_cases():
    for obj in OBJS:
        for model in ("tiny-llama", "mod\u00e8le \U0001f389", "bad\ud800"):
            ev = convert.TextEvents("chatcmpl-1", model, 7, obj)
            for text in ("", " the", 'q"uote\\ \n\t\x00', "\u00e9\u4e2d", "\udc80lone", "\ufffd"):
                assert ev.event(2, text, None) == _reference(obj, "chatcmpl-1", model, 7, 2, text, None)
    with pytest.raises(ValueError):
        convert.TextEvents("r", "m", 0, "chat.completion")


# ---------------------------------------------------------------------------------------------- coalesce_chunks
def _ch(index, text, ids, reason=None, n=0, lps=None, error=None):
    return Chunk(request_id="r", text=text, token_ids=ids, finish_reason=reason, index=index, logprobs=lps,
                 prompt_tokens=5, cached_tokens=1, completion_tokens=n, error=error)


def test_coalesce_chunks_joins_per_sample_and_keeps_order():
    lp = [{"token": "a", "logprob": -1.0}]
    chunks = [_ch(0, "a", [1], n=1, lps=lp), _ch(1, "x", [7], n=1, lps=lp), _ch(0, "b", [2], n=2, lps=lp),
              _ch(1, "y", [8], "length", n=2, lps=lp), _ch(0, "c", [3], "stop", n=3, lps=lp)]
    before = [c.to_dict() for c in chunks]
    out = coalesce_chunks(chunks)
    assert [c.to_dict() for c in chunks] == before  # the input is not modified
    assert [(c.index, c.text, c.token_ids, c.finish_reason, c.completion_tokens, len(c.logprobs)) for c in out] \
        == [(0, "abc", [1, 2, 3], "stop", 3, 3), (1, "xy", [7, 8], "length", 2, 2)]
    assert coalesce_chunks([_ch(0, "a", [1])]) == [_ch(0, "a", [1])]
    assert coalesce_chunks([]) == []


def test_coalesce_chunks_never_joins_across_an_abort():
    chunks = [_ch(0, "a", [1], n=1), _ch(1, "x", [7], n=1), _ch(1, "", [], "abort", error="boom"),
              _ch(0, "b", [2], n=2), _ch(0, "c", [3], n=3)]
    out = coalesce_chunks(chunks)
    assert [(c.index, c.text, c.finish_reason) for c in out] == \
        [(0, "a", None), (1, "x", None), (1, "", "abort"), (0, "bc", None)]


def test_chunk_to_dict_is_asdict():
    import dataclasses

    c = _ch(1, "t", [1, 2], "stop", n=2, lps=[{"token": "t", "logprob": -0.5, "top_logprobs": []}])
    assert c.to_dict() == dataclasses.asdict(c)
    assert json.dumps(c.to_dict()) == json.dumps(dataclasses.asdict(c))


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def eng(tiny_checkpoints, tiny_tokenizer):
    e = build_engine(tiny_checkpoints, tiny_tokenizer, "llama")
    yield e
    e.shutdown()


def _reset(eng) -> None:
    """Let the last request finish (a stop string ends it one step after its stream) and empty the cache."""
    eng.wait_idle()
    eng.flush_cache()


async def _open(eng, ids, params, behind: bool):
    """The route's chunk iterator. behind: coalescing on, and nothing is read until the engine has queued
    every output of the request (the most a slow stream can fall behind)."""
    if not behind:
        return await eng.astream_open(ids, params)
    rid, stream, ids, p = await eng._asubmit(ids, params, asyncio.get_running_loop())
    while sum(ev.finished for ev in list(stream._q._queue)) < p.n:
        await asyncio.sleep(0.01)
    return eng._aiter_chunks(rid, stream, ids, p, coalesce=True)


def _events(raw: list[str]) -> list[dict]:
    out = []
    for e in raw:
        assert e.startswith("data: ") and e.endswith("\n\n"), e
        if e != "data: [DONE]\n\n":
            out.append(json.loads(e[6:]))
    assert raw[-1] == "data: [DONE]\n\n"
    return out


PARAMS = [
    dict(max_new_tokens=24, temperature=0, ignore_eos=True),
    dict(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    dict(max_new_tokens=30, temperature=0.8, seed=5, n=2, logprobs=0),
    dict(max_new_tokens=40, temperature=0, stop=["dg", "nin"]),  # each hits some tokens into its prompt's output
]


async def _completion_stream(eng, prompt: str, params: dict, behind: bool) -> list[dict]:
    from prefixrt.params import SamplingParams

    ids = eng.encode(prompt)
    p = SamplingParams(**{**params, "request_id": f"cmpl-{behind}-{len(prompt)}"})
    chunks = await _open(eng, ids, p, behind)
    raw = [e async for e in openai_api._completion_events([chunks], p.n, "cmpl-1", "tiny", 3, True, None)]
    return _events(raw)


async def _chat_stream(eng, prompt: str, params: dict, behind: bool) -> list[dict]:
    from prefixrt.params import SamplingParams

    ids = eng.encode(prompt)
    p = SamplingParams(**{**params, "request_id": f"chat-{behind}-{len(prompt)}"})
    chunks = await _open(eng, ids, p, behind)
    raw = [e async for e in openai_api._chat_events(chunks, "chatcmpl-1", "tiny", 3, None, True, None)]
    return _events(raw)


def _completion_view(events: list[dict]) -> dict:
    """Per choice index: the concatenated text and logprobs, the finish reason; and the usage."""
    view: dict = {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        v = view.setdefault(c["index"], {"text": "", "tokens": [], "lps": [], "offsets": [], "reason": None})
        v["text"] += c["text"]
        if c["logprobs"] is not None:
            v["tokens"] += c["logprobs"]["tokens"]
            v["lps"] += c["logprobs"]["token_logprobs"]
            v["offsets"] += c["logprobs"]["text_offset"]
        v["reason"] = c["finish_reason"] or v["reason"]
    return {"choices": view, "usage": events[-1]["usage"]}


def _chat_view(events: list[dict]) -> dict:
    view: dict = {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        v = view.setdefault(c["index"], {"content": "", "role": None, "lps": [], "reason": None})
        v["content"] += c["delta"].get("content") or ""
        v["role"] = c["delta"].get("role") or v["role"]
        if c["logprobs"] is not None:
            v["lps"] += [(e["token"], e["logprob"]) for e in c["logprobs"]["content"]]
        v["reason"] = c["finish_reason"] or v["reason"]
    return {"choices": view, "usage": events[-1]["usage"]}


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "logprobs", "n2-sampled", "stop-strings"])
async def test_completions_coalesced_stream_reads_the_same(eng, params):
    prompt = "Once upon a time the radix tree"
    step = await _completion_stream(eng, prompt, params, behind=False)
    _reset(eng)  # the second run must not differ by cached tokens
    joined = await _completion_stream(eng, prompt, params, behind=True)
    _reset(eng)
    assert _completion_view(joined) == _completion_view(step)
    # ... and both read as the whole (non-streamed) response does: text, tokens, offsets, finish reasons.
    from prefixrt.params import SamplingParams

    whole = convert.completion_response([await eng.agenerate(eng.encode(prompt), SamplingParams(**params))],
                                        "cmpl-1", "tiny", 3)
    _reset(eng)
    for c in whole["choices"]:
        v = _completion_view(step)["choices"][c["index"]]
        assert (v["text"], v["reason"]) == (c["text"], c["finish_reason"])
        if c["logprobs"] is not None:
            assert (v["tokens"], v["offsets"]) == (c["logprobs"]["tokens"], c["logprobs"]["text_offset"])
            assert v["lps"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5)
    n = params.get("n", 1)
    assert len(joined) == n + 1 < len(step)  # one event per sample (its whole text and finish reason) + usage
    for ev in joined:
        oai_types.Completion.model_validate(ev)
        if ev["choices"] and ev["choices"][0]["finish_reason"]:
            conforms("CreateCompletionResponse", ev)
    assert joined[-1]["choices"] == [] and joined[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "logprobs", "n2-sampled", "stop-strings"])
async def test_chat_coalesced_stream_reads_the_same(eng, params):
    prompt = "Radix trees index token sequences"
    step = await _chat_stream(eng, prompt, params, behind=False)
    _reset(eng)
    joined = await _chat_stream(eng, prompt, params, behind=True)
    _reset(eng)
    assert _chat_view(joined) == _chat_view(step)
    n = params.get("n", 1)
    assert len(joined) <= 3 * n + 1 < len(step)  # per sample: role, its whole text, finish; + usage
    for ev in joined:
        oai_chat.ChatCompletionChunk.model_validate(ev)
        conforms("CreateChatCompletionStreamResponse", ev)
