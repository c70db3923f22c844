"""Stop-string search, hold-back and incremental detokenization, against brute-force references.

The streaming contract EngineCore relies on: text is searched only where a new chunk could complete a stop
(find_stop from the old length), the earliest-starting stop completed by that chunk wins, and the text a
stream has already emitted never contains anything that a later stop cuts off (stop_holdback).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback


def find_stop_reference(text: str, stops: list[str], search_from: int):
    """Every occurrence of every stop whose last character is at or after search_from; the earliest start
    wins, then the stop listed first."""
    hits = [(i, k, s) for k, s in enumerate(stops) for i in range(len(text))
            if text.startswith(s, i) and i + len(s) - 1 >= search_from]
    if not hits:
        return None
    i, _, s = min(hits)
    return i, s


def holdback_reference(text: str, stops: list[str]) -> int:
    return max([k for s in stops for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])],
               default=0)


def test_find_stop_examples():
    assert find_stop("hello world", ["world"], 0) == (6, "world")
    assert find_stop("hello world", ["world"], 10) == (6, "world")  # completed by the last character
    assert find_stop("hello world", ["world"], 11) is None  # nothing new to search
    assert find_stop("a STOP b STOP", ["STOP"], 6) == (9, "STOP")  # the first one was in old text
    assert find_stop("a STOP b STOP", ["STOP"], 5) == (2, "STOP")  # ... unless its last character is new
    assert find_stop("xxabcd", ["cd", "abcd"], 4) == (2, "abcd")  # earliest start wins
    assert find_stop("abc", [], 0) is None


def test_holdback_examples():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello world", ["world"]) == 0  # complete stops are find_stop's business
    assert stop_holdback("ab", ["abcd", "bx"]) == 2
    assert stop_holdback("xyz", ["q"]) == 0  # a one-character stop is never held back
    assert stop_holdback("", ["abc"]) == 0


ALPHABET = "ab c"
texts = st.text(alphabet=ALPHABET, max_size=24)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3)


@settings(max_examples=300, deadline=None)
@given(texts, stop_lists, st.integers(0, 26))
def test_find_stop_equals_reference(text, stops, search_from):
    assert find_stop(text, stops, search_from) == find_stop_reference(text, stops, search_from)


@settings(max_examples=300, deadline=None)
@given(texts, stop_lists)
def test_holdback_equals_reference(text, stops):
    assert stop_holdback(text, stops) == holdback_reference(text, stops)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=ALPHABET, max_size=5), max_size=8), stop_lists)
def test_streamed_text_never_emits_what_a_later_stop_cuts(chunks, stops):
    """EngineCore's use of the two functions, chunk by chunk: what was emitted is always a prefix of the
    final text, the emitted pieces add up to it, and no stop string survives inside it."""
    text, emitted, final = "", "", None
    for chunk in chunks:
        before = len(text)
        text += chunk
        hit = find_stop(text, stops, before)
        if hit is not None:
            final = text[: hit[0]]
            emitted += final[len(emitted):]
            break
        upto = len(text) - stop_holdback(text, stops)
        emitted += text[len(emitted): upto]
        assert text.startswith(emitted)
    if final is None:  # finished for another reason: the held-back text goes out last
        final = text
        emitted += text[len(emitted):]
    assert emitted == final
    assert not any(s in final for s in stops)  # every completed stop was caught where it completed


def test_incremental_detokenizer_equals_decode_on_multibyte_text(tiny_tokenizer):
    text = "héllo wörld — naïve café 🙂 Paris? {\"ünï\": [1, 2]}"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tiny_tokenizer)
    pieces = [det.step(ids[: i + 1]) for i in range(len(ids))]
    pieces.append(det.flush(ids))
    assert "".join(pieces) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # never half a character
    assert sum(1 for p in pieces if p) > 5  # and it really streams


def test_incremental_detokenizer_skips_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    det = IncrementalDetokenizer(tiny_tokenizer)
    out = "".join(det.step(ids[: i + 1]) for i in range(len(ids))) + det.flush(ids)
    assert out == "abc"
