"""Jump-forward tokens are the tokenizer's canonical tokenization, in context (SGLang issue #2045).

Two checks on Qwen's 151k vocab with a schema whose long fixed keys make forced runs long:
  * follow-the-document: a "model" that always samples the next token of the canonical tokenization of a
    target document, and takes forced tokens whenever offered. The forced tokens must be exactly the
    canonical tokens at that position, so the final ids equal `tokenizer.encode(document)`.
  * random walks: every forced run (text decoding to whole characters) re-encodes to itself.
"""

from __future__ import annotations

import json

import pytest

from prefixrt.constrained.testing import allowed_ids, random_walk

BACKENDS = ("llguidance", "xgrammar")

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string"},
        "shipping_address_line": {"type": "string"},
        "billing_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "preferred_delivery_window": {"enum": ["morning_slot", "afternoon_slot", "evening_slot"]},
        "order_line_items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"product_identifier": {"type": "string"}, "requested_quantity": {"type": "integer"}},
                "required": ["product_identifier", "requested_quantity"],
                "additionalProperties": False,
            },
        },
        "is_gift_wrapped": {"type": "boolean"},
    },
    "required": ["customer_full_name", "shipping_address_line", "billing_postal_code",
                 "preferred_delivery_window", "order_line_items", "is_gift_wrapped"],
    "additionalProperties": False,
}

DOCUMENTS = [
    {"customer_full_name": "Ada Lovelace", "shipping_address_line": "12 St James's Square, London",
     "billing_postal_code": "10115", "preferred_delivery_window": "evening_slot",
     "order_line_items": [{"product_identifier": "SKU-4471", "requested_quantity": 2},
                          {"product_identifier": "gift card", "requested_quantity": 1}],
     "is_gift_wrapped": True},
    {"customer_full_name": "José Müller", "shipping_address_line": "Straße 5",
     "billing_postal_code": "01234", "preferred_delivery_window": "morning_slot",
     "order_line_items": [], "is_gift_wrapped": False},
]

STATS: dict[str, dict[str, int]] = {}


def _follow_document(backend, tokenizer, compiled, document: str):
    target = tokenizer.encode(document, add_special_tokens=False)
    matcher = backend.matcher(compiled)
    ids: list[int] = []
    num_forced = num_sampled = 0
    while len(ids) < len(target):
        forced = matcher.forced_tokens()
        if forced:
            assert forced == target[len(ids): len(ids) + len(forced)], (
                f"forced {[tokenizer.decode([t]) for t in forced]} but the canonical tokens are "
                f"{[tokenizer.decode([t]) for t in target[len(ids): len(ids) + len(forced)]]} after {tokenizer.decode(ids)!r}"
            )
            assert matcher.accept_tokens(forced) == len(forced)
            ids += forced
            num_forced += len(forced)
            continue
        token = target[len(ids)]
        assert token in allowed_ids(matcher, backend.vocab_size), f"canonical token {tokenizer.decode([token])!r} masked"
        assert matcher.accept_token(token)
        ids.append(token)
        num_sampled += 1
    assert matcher.can_stop() and matcher.forced_tokens() == []
    assert matcher.accept_token(backend.eos_token_ids[0]) and matcher.is_finished()
    return ids, target, num_forced, num_sampled


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_forced_tokens_follow_canonical_tokenization(qwen_backends, qwen_tokenizer, backend_name):
    backend = qwen_backends[backend_name]
    compiled = backend.compile("json_schema", ORDER_SCHEMA)
    forced_total = sampled_total = 0
    for doc in DOCUMENTS:
        document = json.dumps(doc, ensure_ascii=False)  # the layout both backends generate: ", " and ": "
        ids, target, num_forced, num_sampled = _follow_document(backend, qwen_tokenizer, compiled, document)
        assert ids == target
        assert qwen_tokenizer.encode(qwen_tokenizer.decode(ids), add_special_tokens=False) == ids
        forced_total += num_forced
        sampled_total += num_sampled
    # The keys and enum values dominate this schema: most tokens must come from jump-forward.
    assert forced_total > sampled_total, (forced_total, sampled_total)
    STATS[f"{backend_name}/follow"] = {"forced": forced_total, "sampled": sampled_total}


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_forced_runs_are_canonical_in_random_walks(qwen_backends, qwen_tokenizer, token_texts, backend_name):
    backend = qwen_backends[backend_name]
    compiled = backend.compile("json_schema", ORDER_SCHEMA)
    texts = token_texts[id(qwen_tokenizer)]
    forced = sampled = runs = 0
    for seed in range(3):
        walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=500)
        assert walk.finished
        json.loads(qwen_tokenizer.decode(walk.ids))
        for _, run in walk.forced_runs:
            text = qwen_tokenizer.decode(run)
            if "\ufffd" in text:  # completes a character a sampled token began: not text on its own
                continue
            assert qwen_tokenizer.encode(text, add_special_tokens=False) == run, [qwen_tokenizer.decode([t]) for t in run]
            runs += 1
        forced += walk.num_forced
        sampled += walk.num_sampled
    assert runs > 0
    STATS[f"{backend_name}/random"] = {"forced": forced, "sampled": sampled, "runs": runs}


def test_report_forced_statistics(capsys):
    # Runs last in this module; shows the numbers with `pytest -s` (or -rA).
    with capsys.disabled():
        for key, value in sorted(STATS.items()):
            print(f"\nforced-token stats {key}: {value}")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_choices_forced_after_disambiguation(qwen_backends, qwen_tokenizer, backend_name):
    backend = qwen_backends[backend_name]
    choices = ["Antidisestablishmentarianism", "Paris"]
    matcher = backend.matcher(backend.compile("choices", choices))
    assert matcher.forced_tokens() == []  # two choices: nothing forced yet
    first = qwen_tokenizer.encode("Ant", add_special_tokens=False)
    assert matcher.accept_tokens(first) == len(first)
    rest = matcher.forced_tokens()
    assert qwen_tokenizer.decode(first + rest) == choices[0]
    assert matcher.accept_tokens(rest) == len(rest)
    assert matcher.can_stop() and matcher.is_finished()
