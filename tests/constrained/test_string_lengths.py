"""String lengths checked beside the grammar (prefixrt/constrained/string_lengths.py) give the masks of the grammar
with the bounds compiled in: both backends walk the same random documents and every mask is compared bit for bit,
as are the answers to tokens that break a bound."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from benchmarks.common import LONG_KEYS_SCHEMA
from prefixrt.constrained.llguidance_backend import LLGuidanceBackend
from prefixrt.constrained.logits import allocate_bitmask
from prefixrt.constrained.string_lengths import ITEM, LengthRule, TokenTable, split_lengths

QWEN_MODEL_VOCAB = 151936  # as in conftest.py
QWEN_EOS = (151643, 151645)

LONG_KEYS = LONG_KEYS_SCHEMA  # the benchmarks' schema: bounded strings among long forced keys
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "minLength": 2, "maxLength": 3},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 5,
                                                            "title": "Name"},
                                                   "note": {"type": "string"}},
                  "required": ["name", "note"]},
        "code": {"type": "string", "maxLength": 2, "pattern": "^[a-z]+$"},  # pattern: stays in the grammar
        "empty": {"type": "string", "maxLength": 0},
    },
    "required": ["id", "tags", "owner", "code", "empty"],
}
ROOT_STRING = {"type": "string", "minLength": 3, "maxLength": 6}


def test_split_lengths_places_only_what_keys_decide():
    stripped, bounds = split_lengths(NESTED)
    assert bounds == {("id",): (2, 3), ("tags", ITEM): (0, 4), ("owner", "name"): (1, 5)}
    assert stripped["properties"]["empty"]["maxLength"] == 0  # forced `""`: stays in the grammar
    assert "maxLength" in stripped["properties"]["code"]  # with a pattern
    assert "maxLength" not in stripped["properties"]["id"] and "minLength" not in stripped["properties"]["id"]
    assert NESTED["properties"]["id"]["maxLength"] == 3  # the input is not modified
    anyof = {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]}
    assert split_lengths(anyof) == (anyof, {})
    assert split_lengths({"type": "string", "maxLength": 2, "minLength": 5})[1] == {}  # empty: the grammar says so


def _mask(matcher, vocab):
    bm = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bm, 0)
    return np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _pick(rng, allowed: np.ndarray, raw: list[bytes]) -> int:
    ids = np.flatnonzero(allowed[: len(raw)])
    roll = rng.random()
    if roll < 0.3:  # the longest allowed token: reaches the bounds
        return int(max(ids, key=lambda t: len(raw[t])))
    if roll < 0.55:
        special = [int(t) for t in ids if b'"' in raw[t] or b"\\" in raw[t] or any(b >= 0x80 for b in raw[t])]
        if special:
            return rng.choice(special)
    return int(rng.choice(list(ids)))


def _walk(reference, checked, schema, vocab, raw, rng, steps=60):
    ref = reference.matcher(reference.compile("json_schema", schema))
    new = checked.matcher(checked.compile("json_schema", schema))
    assert new._lengths is not None
    for _ in range(steps):
        want, got = _mask(ref, vocab), _mask(new, vocab)
        diff = np.flatnonzero(want != got)
        assert not len(diff), [(int(t), raw[t] if t < len(raw) else None, bool(want[t])) for t in diff[:8]]
        if ref.is_finished() or not want.any():
            break
        for t in rng.sample(range(len(raw)), 20):  # any token: both accept or both refuse
            assert ref.fork().accept_token(t) == new.fork().accept_token(t), (t, raw[t])
        t = _pick(rng, want, raw)
        assert ref.accept_token(t) and new.accept_token(t)
        # Forced runs: the same, except that at a string's maximum (`_closing_run`) ours may stop earlier where the
        # bounded lexemes after it let llguidance see further.
        want_forced, got_forced = ref.forced_tokens(), new.forced_tokens()
        assert got_forced == want_forced or (new._lengths.at_maximum() and got_forced
                                             and got_forced == want_forced[: len(got_forced)])
    return ref


@pytest.fixture(scope="module")
def qwen_pair(qwen_tokenizer):
    make = lambda on: LLGuidanceBackend(qwen_tokenizer, QWEN_MODEL_VOCAB, list(QWEN_EOS), mask_threads=0,  # noqa: E731
                                        string_lengths=on)
    return make(False), make(True)


@pytest.mark.parametrize("schema", [LONG_KEYS, NESTED, ROOT_STRING], ids=["long_keys", "nested", "root"])
def test_masks_equal_the_bounded_grammar(qwen_pair, qwen_tokenizer, schema):
    reference, checked = qwen_pair
    raw = checked.token_table()._bytes
    rng = random.Random(7)
    for _ in range(4):
        _walk(reference, checked, schema, QWEN_MODEL_VOCAB, raw, rng)


def test_rollback_and_fill_bitmasks_rows(qwen_pair):
    reference, checked = qwen_pair
    rng = random.Random(3)
    raw = checked.token_table()._bytes
    compiled = checked.compile("json_schema", LONG_KEYS)
    rows = [checked.matcher(compiled) for _ in range(4)]
    refs = [reference.matcher(reference.compile("json_schema", LONG_KEYS)) for _ in range(4)]
    for _ in range(25):
        bm = allocate_bitmask(4, QWEN_MODEL_VOCAB)
        checked.fill_bitmasks(list(zip(rows, range(4))), bm)  # the batched path (shared rows, narrowing)
        for i, (m, r) in enumerate(zip(rows, refs)):
            want = _mask(r, QWEN_MODEL_VOCAB)
            got = np.unpackbits(bm[i].numpy().view(np.uint8), bitorder="little")[:QWEN_MODEL_VOCAB].astype(bool)
            assert (want == got).all()
            if r.is_finished():
                continue
            t = _pick(rng, want, raw) if i else int(np.flatnonzero(want)[0])
            assert m.accept_token(t) and r.accept_token(t)
    for m, r in zip(rows, refs):  # roll back and compare again
        k = min(5, m._num_accepted)
        m.rollback(k)
        r.rollback(k)
        assert (_mask(m, QWEN_MODEL_VOCAB) == _mask(r, QWEN_MODEL_VOCAB)).all()


def test_tracker_counts_characters_like_the_grammar():
    raw = [bytes([b]) for b in range(256)] + ['é'.encode(), '😀'.encode(), b'\\n', b'\\u00', b'e9', b'"}', b'", "']
    rule = LengthRule({("a",): (1, 3)}, TokenTable(raw, len(raw)))
    tr = rule.tracker()
    assert tr.feed(b'{"a": "')
    assert tr.in_string and tr.bound == (1, 3)
    assert tr.violates(b'"')  # below minLength
    assert not tr.violates('é😀'.encode() + b'\\n"}')  # three characters
    assert tr.violates('é😀'.encode() + b'\\nx')
    assert not tr.violates(b'\\u00e9ab')
    assert tr.violates(b'\\u00e9abc')
    assert tr.feed('é'.encode()[:1]) and tr.count == 1 and tr.feed('é'.encode()[1:]) and tr.count == 1


def test_forked_matcher_does_not_share_accepted_tokens(qwen_pair):
    _, checked = qwen_pair
    m = checked.matcher(checked.compile("json_schema", LONG_KEYS))
    twin = m.fork()
    ids = twin.forced_tokens()
    assert ids and twin.accept_tokens(ids) == len(ids)
    assert m._ids == [] and len(m._hashes) == 1


def test_off_keeps_bounds_in_the_grammar(qwen_pair):
    reference, _ = qwen_pair
    assert reference.compile("json_schema", LONG_KEYS).handle.lengths is None
    assert torch.is_tensor(allocate_bitmask(1, 8))
