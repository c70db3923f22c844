"""llguidance matchers are copies of a per-grammar template whose lexer DFA is warmed by finished requests
(llguidance_backend._Template), and fill_bitmasks computes the mask of rows in the same state once. A copy must
behave exactly as a matcher made fresh from the grammar text, and a shared mask must equal the row's own: the
same mask, forced tokens, can_stop and finished state at every step, over many walks in mixed states (rows
that follow another row's tokens for a while, then diverge), after the template has adopted finished requests'
lexers."""

from __future__ import annotations

import random

import llguidance
import pytest
import torch

from prefixrt.constrained.llguidance_backend import LLGuidanceMatcher
from prefixrt.constrained.logits import allocate_bitmask, unpack_bitmask

SPECS = [
    ("json_schema", {"type": "object", "properties": {
        "customer_full_name": {"type": "string", "maxLength": 6},
        "note": {"type": "string"},
        "window": {"enum": ["morning", "evening"]},
        "total": {"type": "integer", "minimum": 0, "maximum": 999},
        "gift": {"type": "boolean"}},
        "required": ["customer_full_name", "note", "window", "total", "gift"], "additionalProperties": False}),
    ("json_object", None),
    ("regex", r"[a-z]{1,5}-\d{2,4}( [A-Z]+)?"),
    ("choices", ["yes", "no", "maybe"]),
    ("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]+/ | "x"'),
]


def _fresh(backend, compiled) -> LLGuidanceMatcher:
    """The oracle: a matcher built from the grammar text, with no template behind it (and the grammar's string
    lengths, checked beside it)."""
    return LLGuidanceMatcher(llguidance.LLMatcher(backend.ll_tokenizer, compiled.handle.text, log_level=0), backend,
                             None, compiled.handle)


@pytest.mark.parametrize("case", range(len(SPECS)), ids=[k for k, _ in SPECS])
def test_template_copies_match_fresh_matchers(small_backends, case, monkeypatch):
    backend = small_backends["llguidance"]
    monkeypatch.setattr(backend, "warm_lexer", True)
    kind, spec = SPECS[case]
    compiled = backend.compile(kind, spec)
    template = compiled.handle.template
    rng = random.Random(case)
    eos = set(backend.eos_token_ids)
    rows, steps = 6, 0
    bm_copy, bm_fresh = allocate_bitmask(rows, backend.vocab_size), allocate_bitmask(rows, backend.vocab_size)
    # Rows start at different times, so the batch mixes states (and later rows start from donated lexers).
    live: list[tuple[LLGuidanceMatcher, LLGuidanceMatcher] | None] = [None] * rows
    started = finished = 0
    follow: dict[int, int] = {}  # row -> the row whose sampled tokens it copies (same state, until it diverges)
    shared0 = backend.shared_mask_rows_total
    while finished < 24 and steps < 2000:
        steps += 1
        for i in range(rows):
            if live[i] is None and rng.random() < 0.5:
                live[i] = (backend.matcher(compiled), _fresh(backend, compiled))
                started += 1
                if i > 0 and rng.random() < 0.5:
                    follow[i] = i - 1
        pairs = [(i, p) for i, p in enumerate(live) if p is not None]
        if not pairs:
            continue
        taken_forced: dict[int, bool] = {}
        for i, (a, b) in pairs:
            forced = a.forced_tokens()
            assert forced == b.forced_tokens()
            lead = follow.get(i)
            take = taken_forced.get(lead) if lead in taken_forced else rng.random() < 0.5
            taken_forced[i] = take
            if forced and take:
                assert a.accept_tokens(forced) == b.accept_tokens(forced) == len(forced)
        bm_copy.fill_(0)
        bm_fresh.fill_(0)
        backend.fill_bitmasks([(a, i) for i, (a, _) in pairs], bm_copy)
        for i, (_, b) in pairs:
            b.fill_bitmask(bm_fresh, i)
        assert torch.equal(bm_copy, bm_fresh)
        sampled: dict[int, int] = {}
        for i, (a, b) in pairs:
            assert a.can_stop() == b.can_stop() and a.is_finished() == b.is_finished()
            ids = unpack_bitmask(bm_copy[i: i + 1], backend.vocab_size)[0].nonzero().flatten().tolist()
            assert ids
            non_eos = [t for t in ids if t not in eos]
            tok = rng.choice(non_eos) if non_eos and rng.random() < 0.9 else rng.choice(ids)
            lead = follow.get(i)
            if lead in sampled and sampled[lead] in ids and rng.random() < 0.9:
                tok = sampled[lead]  # stay in the leader's state
            else:
                follow.pop(i, None)
            sampled[i] = tok
            assert a.accept_token(tok) and b.accept_token(tok)
            if a.is_finished():
                assert b.is_finished()
                live[i] = None
                follow.pop(i, None)
                finished += 1
    assert finished >= 24, f"only {finished} walks finished in {steps} steps"
    assert template.generation == template.max_generations  # the later walks started from donated lexers
    assert backend.shared_mask_rows_total > shared0  # some rows' masks were copies of another row's


def test_rollback_after_donation(small_backends, monkeypatch):
    """A matcher that donated its lexer still rolls back and goes on like a fresh one."""
    backend = small_backends["llguidance"]
    monkeypatch.setattr(backend, "warm_lexer", True)
    compiled = backend.compile("choices", ["yes", "no"])
    tok = backend.tokenizer
    a, b = backend.matcher(compiled), _fresh(backend, compiled)
    ids = tok.encode("yes", add_special_tokens=False)
    assert a.accept_tokens(ids) == b.accept_tokens(ids) == len(ids)
    assert a.is_finished() and compiled.handle.template.generation >= 1
    a.rollback(len(ids))
    b.rollback(len(ids))
    bm_a, bm_b = allocate_bitmask(1, backend.vocab_size), allocate_bitmask(1, backend.vocab_size)
    a.fill_bitmask(bm_a, 0)
    b.fill_bitmask(bm_b, 0)
    assert torch.equal(bm_a, bm_b)
    no = tok.encode("no", add_special_tokens=False)
    assert a.accept_tokens(no) == b.accept_tokens(no) == len(no)
    assert a.is_finished() and b.is_finished()


def test_matchers_start_fresh_unless_warm_lexer(small_backends, monkeypatch):
    """The default (the parallel mask fill measured faster with them): every matcher is built from the grammar
    text, and finishing one hands nothing back to the template."""
    backend = small_backends["llguidance"]
    compiled = backend.compile("choices", ["yes", "no"])
    m = backend.matcher(compiled)
    assert m._template is None
    generation = compiled.handle.template.generation
    assert m.accept_tokens(backend.tokenizer.encode("yes", add_special_tokens=False)) > 0
    m.accept_token(backend.eos_token_ids[0])
    assert compiled.handle.template.generation == generation
    monkeypatch.setattr(backend, "warm_lexer", True)
    assert backend.matcher(compiled)._template is compiled.handle.template
