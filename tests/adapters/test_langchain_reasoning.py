"""ChatPrefixRT(reasoning_parser=...): a reasoning model's thinking in the AIMessage's
additional_kwargs["reasoning_content"], apart from its content, on invoke and on every stream path (the tiny
model held by a regex to a reasoning model's reply)."""

from __future__ import annotations

import re

import pytest

from tests.server.conftest import needs_constrained_decoding

pytestmark = needs_constrained_decoding()
pytest.importorskip("langchain_core")

REPLIES = {"qwen3": "<think>\nTwo and two make four.\n</think>\n\nIt is 4.",
           "deepseek-r1": "Two and two make four.\n</think>\n\nIt is 4."}
# letters the model picks arrive token by token (forced text comes in one piece)
FREE = {"qwen3": r"<think>\n[a-z]{16}\n</think>\n\n[a-z]{4}", "deepseek-r1": r"[a-z]{16}\n</think>\n\n[a-z]{4}"}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
async def test_reasoning_content_on_invoke_and_streams(tiny_target, parser):
    from prefixrt.adapters.langchain import ChatPrefixRT

    llm = ChatPrefixRT(engine=tiny_target.provider, reasoning_parser=parser, max_tokens=64)
    msg = llm.invoke("2+2?", regex=re.escape(REPLIES[parser]))
    assert msg.content == "It is 4."
    assert msg.additional_kwargs["reasoning_content"] == "Two and two make four."

    whole = llm.invoke("2+2?", regex=FREE[parser])
    thought = whole.additional_kwargs["reasoning_content"]
    assert re.fullmatch("[a-z]{16}", thought) and re.fullmatch("[a-z]{4}", whole.content)
    for chunks in (list(llm.stream("2+2?", regex=FREE[parser])),
                   [c async for c in llm.astream("2+2?", regex=FREE[parser])]):
        parts = [c.additional_kwargs.get("reasoning_content") for c in chunks]
        # streamed as it comes (a server joins the events of a client that falls behind, so only in-process
        # is the count certain)
        assert len([p for p in parts if p]) > (1 if tiny_target.kind == "engine" else 0)
        merged = chunks[0]
        for c in chunks[1:]:
            merged = merged + c
        assert merged.additional_kwargs["reasoning_content"] == thought and merged.content == whole.content

    plain = ChatPrefixRT(engine=tiny_target.provider, max_tokens=64).invoke("2+2?", regex=re.escape(REPLIES[parser]))
    assert plain.content == REPLIES[parser] and "reasoning_content" not in plain.additional_kwargs


def test_unknown_parser_is_refused(tiny_engine):
    from prefixrt.adapters.langchain import ChatPrefixRT

    with pytest.raises(ValueError, match="qwen3"):
        ChatPrefixRT(engine=tiny_engine, reasoning_parser="o1")
