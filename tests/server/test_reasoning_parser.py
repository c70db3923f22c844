"""--reasoning-parser through the real openai client, over HTTP and through the in-process shim: a tiny model
forced (by a regex constraint) to write a reasoning model's reply, whose thinking must come back apart from
its answer (chat's reasoning_content, whole and streamed; the Responses API's reasoning item), with the
request's `chat_template_kwargs` reaching the template and max_tokens counting both parts."""

from __future__ import annotations

import re

import openai
import pytest

from tests.server.conftest import build_engine, needs_constrained_decoding

pytestmark = needs_constrained_decoding()

# Qwen3's template in brief: thinking off closes an empty block in the prompt.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
QWEN3_REPLY = "<think>\nTwo and two make four.\n</think>\n\nIt is 4."
R1_REPLY = "Two plus two: four.\n</think>\n\n**4**"
MSGS = [{"role": "user", "content": "2+2?"}]
FREE = {"qwen3": r"<think>\n[a-z]{24}\n</think>\n\n[a-z]{6}", "deepseek-r1": r"[a-z]{24}\n</think>\n\n[a-z]{6}"}


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN3_TEMPLATE
    eng = build_engine(tiny_checkpoints, tok, "llama")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def clients(engine):
    """parser name -> door -> a real openai.OpenAI serving `engine` with that reasoning parser."""
    from prefixrt.openai import OpenAI
    from prefixrt.server.app import create_app
    from tests.helpers.live_server import LiveServer

    out, servers = {}, []
    for name in ("qwen3", "deepseek-r1"):
        live = LiveServer(create_app(engine, reasoning_parser=name)).__enter__()
        servers.append(live)
        out[name] = {"http": openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0),
                     "shim": OpenAI(engine=engine, reasoning_parser=name)}
    yield out
    for live in servers:
        live.__exit__(None, None, None)


class Forcing:
    """The engine, with every request held to `regex` (the Responses API takes no regex of its own)."""

    def __init__(self, engine):
        self.engine, self.regex = engine, None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _forced(self, params):
        import dataclasses

        return dataclasses.replace(params, regex=self.regex) if self.regex is not None else params

    async def agenerate(self, prompt, params=None):
        return await self.engine.agenerate(prompt, self._forced(params))

    async def astream_open(self, prompt, params=None, **kw):
        return await self.engine.astream_open(prompt, self._forced(params), **kw)


@pytest.fixture(scope="module")
def responses_clients(engine):
    """parser name -> door -> (a real openai.OpenAI, its Forcing engine)."""
    from prefixrt.openai import OpenAI
    from prefixrt.server.app import create_app
    from tests.helpers.live_server import LiveServer

    out, servers = {}, []
    for name in ("qwen3", "deepseek-r1"):
        eng = Forcing(engine)
        live = LiveServer(create_app(eng, reasoning_parser=name)).__enter__()
        servers.append(live)
        out[name] = {"http": (openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0), eng),
                     "shim": (OpenAI(engine=eng, reasoning_parser=name), eng)}
    yield out
    for live in servers:
        live.__exit__(None, None, None)


def forced(reply: str, **extra) -> dict:
    return {"extra_body": {"regex": re.escape(reply), **extra}}


CASES = [("qwen3", QWEN3_REPLY, "Two and two make four.", "It is 4."),
         ("deepseek-r1", R1_REPLY, "Two plus two: four.", "**4**")]


@pytest.mark.parametrize("door", ["http", "shim"])
@pytest.mark.parametrize("parser,reply,thought,answer", CASES)
def test_chat_reasoning_content(clients, door, parser, reply, thought, answer):
    c = clients[parser][door]
    out = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, **forced(reply))
    msg = out.choices[0].message
    assert (msg.reasoning_content, msg.content) == (thought, answer)
    assert out.choices[0].finish_reason == "stop"

    # Forced text arrives in one piece (jump-forward); letters the model picks come token by token.
    free = {"extra_body": {"regex": FREE[parser]}}
    whole = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, **free).choices[0].message
    thought, answer = whole.reasoning_content, whole.content
    assert re.fullmatch("[a-z]{24}", thought) and re.fullmatch("[a-z]{6}", answer)
    stream = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, **free)
    kinds, thoughts, answers = [], [], []
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        r = getattr(d, "reasoning_content", None)
        if r:
            thoughts.append(r)
            kinds.append("r")
        if d.content:
            answers.append(d.content)
            kinds.append("c")
    assert "".join(thoughts) == thought and "".join(answers) == answer
    assert thoughts  # (how many deltas depends on the load: the server joins events a client falls behind on)
    assert kinds == sorted(kinds, reverse=True)  # all the thinking before the answer
    assert not any("think>" in t for t in thoughts + answers)


@pytest.mark.parametrize("door", ["http", "shim"])
def test_enable_thinking_false_reaches_the_template(clients, door):
    c = clients["qwen3"][door]
    on = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, **forced("4"))
    off = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0,
                                    **forced("4", chat_template_kwargs={"enable_thinking": False}))
    assert off.choices[0].message.content == "4"
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    # the template closed an empty thinking block in the prompt
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    # thinking off: the parser is off too, so a <think> the model writes anyway stays in the content
    raw = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0,
                                    **forced(QWEN3_REPLY, chat_template_kwargs={"enable_thinking": False}))
    assert raw.choices[0].message.content == QWEN3_REPLY
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", messages=MSGS, extra_body={"chat_template_kwargs": {"tools": []}})
    assert "chat_template_kwargs" in e.value.message


@pytest.mark.parametrize("door", ["http", "shim"])
def test_max_tokens_covers_reasoning_and_answer(clients, door):
    c = clients["qwen3"][door]
    out = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, max_tokens=12, **forced(QWEN3_REPLY))
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12
    assert msg.reasoning_content and "Two and two make four.".startswith(msg.reasoning_content)
    assert not msg.content


@pytest.mark.parametrize("door", ["http", "shim"])
@pytest.mark.parametrize("parser,reply,thought,answer", CASES)
def test_responses_reasoning_item(responses_clients, door, parser, reply, thought, answer):
    c, eng = responses_clients[parser][door]
    eng.regex = re.escape(reply)
    r = c.responses.create(model="tiny-llama", input="2+2?", temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thought and r.output_text == answer

    eng.regex = FREE[parser]
    whole = c.responses.create(model="tiny-llama", input="2+2?", temperature=0)
    thought, answer = whole.output[0].content[0].text, whole.output_text
    events = list(c.responses.create(model="tiny-llama", input="2+2?", temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought and deltas
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    final = events[-1].response
    assert final.output[0].id == events[[e.type for e in events].index("response.output_item.added")].item.id
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == answer
    # a follow-up through previous_response_id does not replay the reasoning item as input
    eng.regex = re.escape(reply)
    again = c.responses.create(model="tiny-llama", input="and 3+3?", previous_response_id=r.id, temperature=0)
    assert [o.type for o in again.output] == ["reasoning", "message"]
    eng.regex = None


def test_without_a_parser_the_reply_is_untouched(engine):
    from prefixrt.openai import OpenAI

    c = OpenAI(engine=engine)
    msg = c.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=0, **forced(QWEN3_REPLY)).choices[0].message
    assert msg.content == QWEN3_REPLY and getattr(msg, "reasoning_content", None) is None


def test_serve_flag():
    import argparse

    from prefixrt.server.launch import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--reasoning-parser", "deepseek-r1"]).reasoning_parser == "deepseek-r1"
    assert p.parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])
