"""Chat rendering has one home: EngineAPI.chat_prompt_ids / render_chat over hub.chat_templates'
render_chat_template, checked against transformers' own apply_chat_template, and used by the server
(continue_final_message) and the frontend (same tokenizer lock as the engine)."""

from __future__ import annotations

import pytest

from prefixrt.errors import InvalidRequest
from prefixrt.hub.chat_templates import render_chat_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def test_chat_prompt_ids_equal_transformers_rendering(make_engine, tiny_tokenizer):
    eng = make_engine()
    text = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert eng.chat_prompt_ids(MESSAGES) == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert render_chat_template(tiny_tokenizer, MESSAGES) == text
    assert eng.generate(MESSAGES, {"max_new_tokens": 1}).prompt_tokens == len(eng.chat_prompt_ids(MESSAGES))


def test_continue_final_message_leaves_the_assistant_turn_open(make_engine, tiny_tokenizer):
    eng = make_engine()
    msgs = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    head = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = tiny_tokenizer.encode(head + "It is", add_special_tokens=False)
    assert eng.chat_prompt_ids(msgs, continue_final_message=True) == want
    with pytest.raises(InvalidRequest) as e:
        eng.chat_prompt_ids(MESSAGES, continue_final_message=True)
    assert e.value.param == "messages"


def test_server_continue_final_message_renders_through_the_engine(make_engine):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from prefixrt.openai import OpenAI

    eng = make_engine()
    msgs = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    r = OpenAI(engine=eng).chat.completions.create(
        model=eng.model_name, messages=msgs, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "ignore_eos": True})
    want = eng.generate(eng.chat_prompt_ids(msgs, continue_final_message=True),
                        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == want.prompt_tokens


def test_frontend_renders_with_the_engine_tokenizer_lock(make_engine):
    from prefixrt.frontend import ProviderBackend

    eng = make_engine()
    backend = ProviderBackend(eng)
    assert backend._tok_lock is eng.tokenizer_lock
    assert backend.chat_format._lock is eng.tokenizer_lock
