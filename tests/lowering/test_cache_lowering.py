"""The prompt-cache fields and the Anthropic request lowered (prefixrt/lowering/prompt_cache.py, anthropic.py):
which breakpoints a request writes and with what lifetime, where each falls in the rendered prompt's tokens (the
tiny model's chat template and tokenizer: the kept prefix is exactly the tokens up to the marked block's end), and
Anthropic's blocks as OpenAI chat messages."""

from __future__ import annotations

import pytest

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.anthropic import lower_messages_request
from prefixrt.lowering.chat import lower_chat_request
from prefixrt.lowering.messages import responses_input
from prefixrt.lowering.prompt_cache import openai_cache_plan, responses_cache_plan, shared_prefix_len
from prefixrt.prompt_cache import KeepPrefix, parse_ttl

SYSTEM = [{"type": "text", "text": "Long rules. " * 2, "prompt_cache_breakpoint": {"mode": "explicit"}}]
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "first part"},
                                         {"type": "text", "text": " second part",
                                          "prompt_cache_breakpoint": {"mode": "explicit"}}]},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "the question"}]


def test_openai_breakpoints_options_and_retention():
    plan = openai_cache_plan({"messages": MESSAGES, "prompt_cache_key": "k"})
    assert plan.session == "k" and [bp.ttl_s for bp in plan.breakpoints] == [1800.0, 1800.0]
    assert [len(bp.upto) for bp in plan.breakpoints] == [1, 2]  # the cut conversations, no implicit one
    assert plan.breakpoints[1].upto[1]["content"][-1]["text"] == " second part"
    implicit = openai_cache_plan({"messages": MESSAGES, "prompt_cache_options": {"ttl": "30m"}})
    assert [bp.upto is None for bp in implicit.breakpoints] == [False, False, True]
    explicit = openai_cache_plan({"messages": MESSAGES, "prompt_cache_options": {"mode": "explicit"}})
    assert [bp.upto is None for bp in explicit.breakpoints] == [False, False]
    kept = openai_cache_plan({"messages": [{"role": "user", "content": "x"}], "prompt_cache_retention": "24h"})
    assert [(bp.upto, bp.ttl_s) for bp in kept.breakpoints] == [(None, 86400.0)]
    assert openai_cache_plan({"messages": MESSAGES[2:], "prompt_cache_retention": "in_memory"}).empty
    many = [{"role": "user", "content": [{"type": "text", "text": str(k), "prompt_cache_breakpoint":
                                          {"mode": "explicit"}} for k in range(6)]}]
    plan = openai_cache_plan({"messages": many, "prompt_cache_options": {}})
    assert len(plan.breakpoints) == 4 and plan.breakpoints[-1].upto is None  # the latest 3 + the implicit one
    for bad in ({"prompt_cache_retention": "1w"}, {"prompt_cache_options": {"mode": "sometimes"}},
                {"prompt_cache_options": {"ttl": "forever"}}, {"prompt_cache_key": ""}):
        with pytest.raises(InvalidRequest):
            openai_cache_plan({"messages": MESSAGES, **bad})


def test_a_breakpoint_keeps_exactly_the_tokens_up_to_its_block(engine):
    tok = engine.tokenizer
    request = {"messages": MESSAGES, "prompt_cache_options": {"mode": "explicit"}}

    def lower(messages):
        return lower_chat_request({**request, "messages": messages}, tokenizer=tok, max_context=engine.max_context)

    def encode(messages):
        chat = lower(messages)
        return engine.encode_chat(chat.messages, chat.template_tools, False, chat.template_kwargs)

    ids = encode(MESSAGES)
    pc = openai_cache_plan(request).resolve(ids, encode)
    assert len(pc.keep) == 2
    system_end, block_end = (k.num_tokens for k in pc.keep)
    system_text, block_text = tok.decode(ids[:system_end]), tok.decode(ids[:block_end])
    # (the template's next turn opens with "<|user|>" in the full prompt and "<|assistant|>" in the cut one: the
    # kept prefix stops inside that marker; the block's turn is followed by the assistant's in both)
    assert system_text.startswith("<bos><|system|>" + "Long rules. " * 2) and "<|user|>" not in system_text
    assert block_text.endswith("first part second part\n<|assistant|>") and "an answer" not in block_text
    # the kept prefix is the full prompt's own head
    assert ids[:block_end] == encode(MESSAGES[:2])[:block_end]


def test_responses_input_breakpoints():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "context " * 5,
                                           "prompt_cache_breakpoint": {"mode": "explicit"}},
                                          {"type": "input_text", "text": "question"}]}]
    plan = responses_cache_plan({"prompt_cache_key": "s"}, items, lambda xs: responses_input(xs))
    (bp,) = plan.breakpoints
    assert plan.session == "s" and bp.upto == [{"role": "user", "content": "context " * 5}]


def test_anthropic_blocks_become_chat_messages_and_cache_control_breakpoints():
    req = {
        "max_tokens": 16, "stop_sequences": ["END"], "temperature": 0.5, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                              {"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42",
                                          "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]},
        ]}
    low = lower_messages_request(req)
    chat = low.chat
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert chat["messages"][2]["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                                  "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "42"}
    assert (chat["stop"], chat["temperature"], chat["tool_choice"], chat["parallel_tool_calls"]) == (
        ["END"], 0.5, "required", False)
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    plan = low.cache
    assert plan.session == "u1"
    # tools (ends with the system prompt), system (1h), the tool result, the last block (the whole prompt)
    assert [None if bp.upto is None else len(bp.upto) for bp in plan.breakpoints] == [1, 1, 4, None]
    assert [bp.ttl_s for bp in plan.breakpoints] == [300.0, 3600.0, 300.0, 300.0]


@pytest.mark.parametrize("bad, needle", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "tool_result", "tool_use_id": "t"}]}]}, "before"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
])
def test_anthropic_malformed_requests_are_named(bad, needle):
    req = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **bad}
    with pytest.raises(InvalidRequest) as e:
        lower_messages_request(req)
    assert needle in e.value.message


def test_helpers():
    assert shared_prefix_len([1, 2, 3, 4], [1, 2, 9]) == 2 and shared_prefix_len([1, 2], [1, 2, 3]) == 2
    assert shared_prefix_len(list(range(100)), list(range(57)) + [0]) == 57
    assert parse_ttl("5m", "x") == 300 and parse_ttl("1h", "x") == 3600 and parse_ttl("24h", "x") == 86400
    for bad in ("0m", "25h", "5 minutes", 5):
        with pytest.raises(InvalidRequest):
            parse_ttl(bad, "x")
    assert KeepPrefix(3, 1.0).num_tokens == 3
