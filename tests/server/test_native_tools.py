"""Native tool-call formats through the real openai client (HTTP and the in-process shim): a template of the
Llama 3.1 or Mistral family renders the tools itself, and the model writes its calls in that family's syntax
(held to it by decoding under "required"/named and "auto"), which the server reads back as tool_calls, whole
and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import build_engine, needs_constrained_decoding

pytestmark = needs_constrained_decoding()

_TURNS = ("{%- for m in messages %}{{ m.role }}: {%- if m.tool_calls %}{%- for c in m.tool_calls %}CALL{%- endfor %}"
          "{%- else %}{{ m.content }}{%- endif %}\n{%- endfor %}{%- if add_generation_prompt %}assistant: {%- endif %}")
TEMPLATES = {
    # Llama 3.1's wording for JSON tool calling (its template puts it in the first user turn)
    "llama3": ("{%- if tools %}<|start_header_id|>Given the following functions, please respond with a JSON for a "
               "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
               '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
               "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}{%- endif %}" + _TURNS),
    "mistral": "{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}" + _TURNS,
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def long_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a 2048-token context (the tools the template writes do not fit in 128; RoPE has no
    learned positions, so only the limit changes)."""
    import shutil

    folder = tmp_path_factory.mktemp("long") / "tiny-llama"
    shutil.copytree(tiny_checkpoints("llama")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return lambda arch: (folder, None)


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def family(request, long_checkpoint, tiny_tokenizer):
    """(family, engine whose template is that family's, {door: openai client})."""
    import copy

    from prefixrt.openai import OpenAI
    from prefixrt.server.app import create_app
    from tests.helpers.live_server import LiveServer

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATES[request.param]
    eng = build_engine(long_checkpoint, tok, "llama")
    live = LiveServer(create_app(eng, any_model_name=True)).__enter__()
    clients = {"http": openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0),
               "shim": OpenAI(engine=eng)}
    yield request.param, eng, clients
    live.__exit__(None, None, None)
    eng.shutdown()


def test_the_template_renders_the_tools_and_the_model_writes_its_syntax(family):
    from prefixrt.lowering.chat import lower_chat
    from prefixrt.lowering.tool_formats import parse
    from prefixrt.lowering.tools import template_call_syntax
    from prefixrt.params import SamplingParams

    name, eng, _ = family
    syntax = template_call_syntax(eng.tokenizer)
    assert syntax.family == name
    lowered = lower_chat(MSGS, tools=TOOLS, tool_choice="required", syntax=syntax)
    assert lowered.template_tools and lowered.messages == MSGS  # no system message of prefixrt's own
    ids = eng.encode_chat(lowered.messages, lowered.template_tools)
    assert '"get_weather"' in eng.tokenizer.decode(ids)  # the template wrote the tools
    params = SamplingParams(max_new_tokens=60, temperature=0, **lowered.constraint)
    text = eng.generate(ids, params).text
    if name == "llama3":
        assert json.loads(text)["parameters"]["city"] is not None
    else:
        assert isinstance(json.loads(text), list)
    assert parse(name, text, {"get_weather"})[0][0] == "get_weather"


def _whole_and_streamed(client, **kw):
    """(the whole reply's choice, its calls as (name, arguments)); the streamed reply must carry the same calls
    and the same content."""
    msg = client.chat.completions.create(**kw).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in msg.message.tool_calls or []]
    streamed: dict[int, list] = {}
    content = []
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content.append(d.content or "")
        for t in d.tool_calls or []:
            streamed.setdefault(t.index, []).append(t)
    got = [(ts[0].function.name, json.loads("".join(t.function.arguments or "" for t in ts)))
           for _, ts in sorted(streamed.items())]
    assert got == calls
    assert "".join(content) == (msg.message.content or "")
    return msg, calls


@pytest.mark.parametrize("door", ["http", "shim"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_calls_come_back_whole_and_streamed(family, door, choice):
    _, _, clients = family
    msg, calls = _whole_and_streamed(clients[door], model="tiny-llama", messages=MSGS, tools=TOOLS,
                                     tool_choice=choice, temperature=0, max_tokens=60)
    assert msg.finish_reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"]
    assert isinstance(calls[0][1]["city"], str)


@pytest.mark.parametrize("door", ["http", "shim"])
@pytest.mark.parametrize("branch", ["call", "text"])
def test_auto_gives_the_branch_the_model_picks(family, door, branch):
    """tool_choice="auto": the grammar lets the reply be text or calls, and the reply is read back as what was
    written. The tiny model's pick is forced by logit_bias, so the answer is known exactly. call: the family's
    lead character (llama3 "{", mistral "[") at +100 opens a call, and in the call's one free field, the city
    string (maxLength 8), it is written 8 times; a lone '"' at +60 opens that string (rather than a token that
    also writes its first character); end of sequence at +50 closes the reply after the call (where the grammar
    allows it: neither of the others is allowed there). text: "A" at +100 opens plain text and fills it."""
    name, eng, clients = family
    token = eng.tokenizer.convert_tokens_to_ids
    lead = "{" if name == "llama3" else "["
    bias = ({str(token(lead)): 100, str(token('"')): 60, str(eng.tokenizer.eos_token_id): 50} if branch == "call"
            else {str(token("A")): 100})
    msg, calls = _whole_and_streamed(clients[door], model="tiny-llama", messages=MSGS, tools=TOOLS,
                                     tool_choice="auto", temperature=0, max_tokens=60, logit_bias=bias)
    if branch == "call":
        assert msg.finish_reason == "tool_calls" and not msg.message.content
        assert calls == [("get_weather", {"city": lead * 8})]
    else:
        assert msg.finish_reason == "length" and calls == []
        assert msg.message.content == "A" * 60
