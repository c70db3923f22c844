"""prefixrt/lowering/reasoning.py: replies in Qwen3's and DeepSeek-R1's forms split into reasoning and content, whole
and streamed in every way a reply can be cut into deltas."""

from __future__ import annotations

import random

import pytest

from prefixrt.lowering.reasoning import ReasoningParser, check_parser

QWEN3 = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4."
R1 = "Okay, 2+2 is 4. Check: 4-2=2.\n</think>\n\n**4**"


@pytest.mark.parametrize("name,text,tail,want", [
    ("qwen3", QWEN3, "<|im_start|>assistant\n", ("The user asks 2+2. That is 4.", "The answer is 4.")),
    ("qwen3", "Just the answer.", "<|im_start|>assistant\n", (None, "Just the answer.")),
    # thinking switched off by the template: an empty block in the prompt, none in the reply
    ("qwen3", "4", "<|im_start|>assistant\n<think>\n\n</think>\n\n", (None, "4")),
    # a template that opens the block in the prompt (Qwen3 thinking-only models)
    ("qwen3", "hmm, 4.\n</think>\n\n4", "<|im_start|>assistant\n<think>\n", ("hmm, 4.", "4")),
    ("qwen3", "<think>\nstill thinking when max_tokens", "", ("still thinking when max_tokens", "")),
    ("qwen3", "a < b and <thin ice>", "", (None, "a < b and <thin ice>")),
    ("deepseek-r1", R1, "<｜Assistant｜><think>\n", ("Okay, 2+2 is 4. Check: 4-2=2.", "**4**")),
    ("deepseek-r1", "<think>\nx\n</think>\ny", "", ("x", "y")),
    ("deepseek-r1", "cut off mid-thought", "", ("cut off mid-thought", "")),
    ("deepseek-r1", "</think>\n\nno thinking at all", "", ("", "no thinking at all")),
])
def test_split_whole_and_streamed(name, text, tail, want):
    parser = ReasoningParser(name)
    assert parser.split(text, tail) == want
    rng = random.Random(0)
    for _ in range(200):  # any cut of the reply into deltas gives the same two texts
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = parser.splitter(tail)
        got_r, got_c = [], []
        for p in pieces:
            r, c = s.feed(p)
            assert "<think>" not in r + c and "</think>" not in r + c or "<think>" in want[1]
            got_r.append(r)
            got_c.append(c)
        r, c = s.finish()
        got_r.append(r)
        got_c.append(c)
        assert ("".join(got_r) if s.saw_reasoning else None, "".join(got_c)) == want, pieces


def test_streamed_deltas_hold_back_only_a_tag_start():
    s = ReasoningParser("qwen3").splitter()
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>\nstep one") == ("step one", "")
    assert s.feed(" and two\n</thi") == (" and two", "")  # the trailing newline may end the reasoning
    assert s.feed("nk>\n\nAns") == ("", "Ans")
    assert s.feed("wer") == ("", "wer")
    assert s.finish() == ("", "")


def test_unknown_parser_is_refused():
    assert check_parser(None) is None and check_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="qwen3, deepseek-r1"):
        ReasoningParser("granite")
