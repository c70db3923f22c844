"""prefixrt/lowering/tool_stream.py: calls read while they stream. Whatever pieces a reply arrives in, each call's
events are its start (with its name), its arguments' exact JSON text in order, then its end; a call cut short has
no end."""

from __future__ import annotations

import json
import random

import pytest

from prefixrt.lowering.tool_stream import ArgumentsDelta, CallEnded, CallStarted, CallStreamer
from prefixrt.lowering.tools import BARE, LLAMA3, MISTRAL, TAGGED

TRICKY = {"q": 'a } " { ] [ \\ , :', "n": -1.5e3, "ok": True, "none": None, "list": [1, {"x": [2, "]"]}],
          "é": "\u00e9\n"}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", TRICKY), ("noop", {})]


def _reply(syntax, calls) -> tuple[str, list[str]]:
    """A reply writing `calls` in `syntax`, and each call's arguments text as written."""
    args = [json.dumps(a, ensure_ascii=False, separators=(", ", ": ")) for _, a in calls]
    bodies = [f'{{"name": {json.dumps(n)}, "{syntax.key}": {t}}}' for (n, _), t in zip(calls, args)]
    return syntax.sep.join(f"{syntax.open}{b}{syntax.close}" for b in bodies), args


def _run(text: str, pieces: list[int], key: str) -> list:
    streamer, events, at = CallStreamer(key), [], 0
    for n in pieces:
        events += streamer.feed(text[at:at + n])
        at += n
    return events + streamer.feed(text[at:])


def _calls(events) -> list[tuple[str, str, bool]]:
    """(name, arguments text, ended) per call, checking the events' order."""
    out: list[list] = []
    for e in events:
        if isinstance(e, CallStarted):
            assert e.index == len(out)
            out.append([e.name, "", False])
        else:
            assert e.index == len(out) - 1 and not out[-1][2]  # only the open call grows or ends
            if isinstance(e, ArgumentsDelta):
                out[-1][1] += e.text
            else:
                assert isinstance(e, CallEnded)
                out[-1][2] = True
    return [tuple(c) for c in out]


@pytest.mark.parametrize("syntax", [BARE, TAGGED, LLAMA3, MISTRAL], ids=["bare", "tagged", "llama3", "mistral"])
@pytest.mark.parametrize("seed", range(5))
def test_calls_read_back_in_any_pieces(syntax, seed):
    text, args = _reply(syntax, CALLS)
    rng = random.Random(seed)
    pieces = [rng.randint(1, 7) for _ in range(len(text))] if seed else [1] * len(text)
    events = _run(text, pieces, syntax.key)
    assert _calls(events) == [(n, a, True) for (n, _), a in zip(CALLS, args)]
    assert [json.loads(a) for _, a, _ in _calls(events)] == [a for _, a in CALLS]
    if seed == 0:  # one character at a time: the arguments arrive in as many pieces as characters
        deltas = [e for e in events if isinstance(e, ArgumentsDelta) and e.index == 1]
        assert len(deltas) == len(args[1])


def test_one_feed_coalesces_each_calls_arguments():
    text, args = _reply(BARE, CALLS[:2])
    events = CallStreamer().feed(text)
    assert events == [CallStarted(0, "get_weather"), ArgumentsDelta(0, args[0]), CallEnded(0),
                      CallStarted(1, "search"), ArgumentsDelta(1, args[1]), CallEnded(1)]


def test_arguments_before_the_name_wait_for_it():
    text = '{"arguments": {"a": 1}, "name": "add"}'
    streamer = CallStreamer()
    assert streamer.feed(text[:20]) == []
    assert streamer.feed(text[20:]) == [CallStarted(0, "add"), ArgumentsDelta(0, '{"a": 1}'), CallEnded(0)]


def test_escaped_name_and_scalar_members():
    # the scalar arguments end in one piece, their delimiter comes in the next
    events = _run('{"name": "a\\"b", "id": 7, "arguments": 5, "x": null}', [40], "arguments")
    assert _calls(events) == [('a"b', "5", True)]


def test_a_call_cut_short_does_not_end():
    text, args = _reply(TAGGED, CALLS[:1])
    cut = text[:text.index("celsius")]
    events = _run(cut, [3] * len(cut), "arguments")
    assert _calls(events) == [("get_weather", args[0][:args[0].index("celsius")], False)]
    assert CallStreamer().feed('{"na') == []  # no name yet: nothing to say
