"""OpenAIBackend against scripted endpoints (the real openai client over an httpx.MockTransport), for what a
live `prefixrt serve` cannot show (tests/frontend/test_gemma.py and test_server.py run the rest against the
real server): chat-endpoint speculation whose guess holds (the small real models do not begin their reply
with the template's text), guesses forced to fail at a chosen field, a cut speculative budget, endpoints that
refuse `choices`, HTTP 503s."""

from __future__ import annotations

import time

import pytest

from prefixrt.frontend import OpenAIBackend, ProgramError, assistant, function, gen, select, user
from prefixrt.frontend.ir import Gen, Text
from prefixrt.frontend.speculative import match_template
from tests.helpers.fake_openai import FailingModel, ScriptedModel, client_for

TIMEOUT = 30
RECORD = [("Name", "Alice Smith"), ("Job", "engineer"), ("City", "Paris")]
DOC = "Alice Smith is an engineer who lives in Paris. She has worked on compilers for a decade. " * 3


@function
def extract(s, doc):
    s += "Extract the fields from the text.\nText: " + doc + "\n"
    s += "Name:" + gen("name", max_tokens=16, stop="\n") + "\nJob:" + gen("job", max_tokens=16, stop="\n") \
        + "\nCity:" + gen("city", max_tokens=16, stop="\n")


@function
def extract_chat(s, doc):
    s += user("Extract name, job and city from: " + doc)
    s += assistant("Name:" + gen("name", max_tokens=16, stop="\n") + "\nJob:" + gen("job", max_tokens=16, stop="\n")
                   + "\nCity:" + gen("city", max_tokens=16, stop="\n"))


def _fields(st):
    return {k: st[k] for k in ("name", "job", "city")}


def _backend(model, spec, chat):
    return OpenAIBackend("fake", client=client_for(model), speculative_tokens=spec, chat=chat)


@pytest.mark.parametrize("chat", [True], ids=["chat"])  # completions: test_gemma.py, on prefixrt serve
def test_speculation_one_call_when_guess_holds(chat):
    prog = extract_chat if chat else extract
    plain_model = ScriptedModel(RECORD)
    plain = _backend(plain_model, 0, chat)
    spec = _backend(ScriptedModel(RECORD), 64, chat)
    st_plain = prog.run(doc=DOC, backend=plain, temperature=0, timeout=TIMEOUT)
    st_spec = prog.run(doc=DOC, backend=spec, temperature=0, timeout=TIMEOUT)
    assert _fields(st_spec) == _fields(st_plain) == {"name": " Alice Smith", "job": " engineer", "city": " Paris"}
    assert st_spec.text() == st_plain.text()
    assert plain.num_api_calls == 3 and spec.num_api_calls == 1
    assert plain.prompt_tokens >= 2 * spec.prompt_tokens, (plain.prompt_tokens, spec.prompt_tokens)
    if chat:  # without speculation, gens after literal text continue the partial assistant message
        assert [bool(r.get("continue_final_message")) for r in plain_model.requests] == [True, True, True]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_speculation_fallback_when_guess_fails(chat):
    swapped = [RECORD[0], RECORD[2], RECORD[1]]  # the model writes City before Job: the template breaks
    prog = extract_chat if chat else extract
    plain = _backend(ScriptedModel(swapped), 0, chat)
    spec = _backend(ScriptedModel(swapped), 64, chat)
    st_plain = prog.run(doc=DOC, backend=plain, temperature=0, timeout=TIMEOUT)
    st_spec = prog.run(doc=DOC, backend=spec, temperature=0, timeout=TIMEOUT)
    assert _fields(st_spec) == _fields(st_plain)
    assert st_spec.text() == st_plain.text()
    assert spec.num_api_calls == 3  # one speculative call (name matched) + separate calls for job and city


def test_speculation_budget_too_small_falls_back():
    spec = _backend(ScriptedModel(RECORD), 3, False)  # 3 "tokens": " Alice", "Smith\nJob:", "engineer\nCity:"
    plain = _backend(ScriptedModel(RECORD), 0, False)
    st_spec = extract.run(doc=DOC, backend=spec, temperature=0, timeout=TIMEOUT)
    assert _fields(st_spec) == _fields(extract.run(doc=DOC, backend=plain, temperature=0, timeout=TIMEOUT))
    assert spec.num_api_calls == 2  # name and job resolved by the cut continuation; city had no stop in it


def test_match_template_rules():
    items = [Gen("a", stop=["\n"]), Text("\nB:"), Gen("b", stop=["\n"]), Text("\nC:"), Gen("c")]
    assert match_template(" x\nB: y\nC: z", items, ended=True) == [" x", " y", " z"]
    assert match_template(" x\nB: y\nC: z", items, ended=False) == [" x", " y"]  # c may go on
    assert match_template(" x\nD: y\n", items, ended=True) == [" x"]  # literal mismatch after a
    assert match_template(" x", items, ended=False) == []  # a's stop never came
    assert match_template(" x", items, ended=True) == [" x"]  # ended inside a: same as a separate call
    long = [Gen("a", max_tokens=2, stop=["\n"])]
    assert match_template("one two three\n", long, ended=True, count_tokens=lambda t: len(t.split())) == []


def test_select_without_logprobs_uses_choices_then_nearest():
    """Constrained choices when the endpoint accepts them (on prefixrt serve: test_server.py), else plain
    generation matched to the nearest choice."""
    @function
    def pick(s):
        s += "Extract.\nName:" + select("x", choices=["Bob", "Alice Smith", "Carol"])

    accepting = ScriptedModel(RECORD, accept_choices=True)
    st = pick.run(backend=_backend(accepting, 0, False), timeout=TIMEOUT)
    assert st["x"] == "Bob" and accepting.requests[-1]["choices"] == ["Bob", "Alice Smith", "Carol"]
    refusing = ScriptedModel(RECORD)  # 400 on `choices`: plain generation matched to the nearest choice
    st = pick.run(backend=_backend(refusing, 0, False), timeout=TIMEOUT)
    assert st["x"] == "Alice Smith"


def test_failing_endpoint_raises_with_state():
    model = FailingModel()
    be = _backend(model, 64, False)
    t0 = time.monotonic()
    with pytest.raises(ProgramError) as ei:
        extract.run(doc=DOC, backend=be, temperature=0, timeout=TIMEOUT)
    assert time.monotonic() - t0 < TIMEOUT
    assert ei.value.state is not None and "Text: " in ei.value.state.text()
    assert "503" in str(ei.value) or "unavailable" in str(ei.value)


def test_chat_gen_outside_assistant_is_an_error():
    @function
    def bad(s):
        s += user("Say:" + gen("x", max_tokens=4))

    with pytest.raises(ProgramError, match="inside assistant"):
        bad.run(backend=_backend(ScriptedModel(RECORD), 0, True), timeout=TIMEOUT)
