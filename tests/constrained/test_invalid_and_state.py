"""Bad specs raise InvalidRequest (never hang or crash); matcher state: rollback, EOS, padding, rejection."""

from __future__ import annotations

import pytest
import torch

from prefixrt.constrained import make_backend
from prefixrt.constrained.spec import check_json_schema_refs
from prefixrt.constrained.testing import allowed_ids, mask_row
from prefixrt.errors import InvalidRequest

BACKENDS = ("llguidance", "xgrammar")

INVALID = [
    ("regex", "(abc", "regex"),
    ("regex", "[z-a]", "regex"),
    ("regex", "", "regex"),
    ("json_schema", {"type": "nonsense"}, "json_schema"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", 42, "json_schema"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "does not resolve"),
    ("json_schema", {"$ref": "#"}, "no finite instance"),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no finite instance"),
    ("json_schema", {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
                     "$ref": "#/$defs/a"}, "no finite instance"),
    ("json_schema", {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "no finite instance"),
    ("json_schema", False, "no finite instance"),
    ("grammar", "start: foo\nfoo: 'a' | ", "grammar"),
    ("grammar", "start: undefined_rule", "grammar"),
    ("grammar", 'root ::= "a" ("b"', "grammar"),
    ("choices", [], "non-empty"),
    ("choices", [""], "non-empty"),
    ("choices", ["a", 3], "non-empty"),
    ("choices", "yes", "list"),
    ("bogus_kind", "x", "unknown constraint kind"),
]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", range(len(INVALID)), ids=[f"{k}{i}" for i, (k, _, _) in enumerate(INVALID)])
def test_invalid_spec_raises_invalid_request(small_backends, backend_name, case):
    kind, spec, fragment = INVALID[case]
    with pytest.raises(InvalidRequest) as info:
        small_backends[backend_name].compile(kind, spec)
    assert fragment.lower() in str(info.value).lower()


def test_recursive_schema_check_is_precise():
    check_json_schema_refs({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                            "required": []}}, "$ref": "#/$defs/n"})  # optional: fine
    check_json_schema_refs({"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"})
    check_json_schema_refs({"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#"}},
                                                         "required": ["x"]}]})  # null is the base case
    with pytest.raises(InvalidRequest):  # mutual recursion, both required
        check_json_schema_refs({"$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"})


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_rollback_restores_mask(small_backends, small_tokenizer, backend_name):
    backend = small_backends[backend_name]
    matcher = backend.matcher(backend.compile("json_schema", {
        "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"]}))
    initial = mask_row(matcher, backend.vocab_size)
    ids = small_tokenizer.encode('{"name": "Al', add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    assert not torch.equal(mask_row(matcher, backend.vocab_size), initial)
    matcher.rollback(len(ids))
    assert torch.equal(mask_row(matcher, backend.vocab_size), initial)
    with pytest.raises(ValueError):
        matcher.rollback(1)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_rejected_token_leaves_matcher_unchanged(small_backends, small_tokenizer, backend_name):
    backend = small_backends[backend_name]
    matcher = backend.matcher(backend.compile("regex", r"[0-9]{3}"))
    before = mask_row(matcher, backend.vocab_size)
    letter = small_tokenizer.encode("x", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)
    assert not matcher.accept_token(backend.eos_token_ids[0])  # EOS before the match is complete
    assert not matcher.accept_token(backend.vocab_size - 1)  # a padding id
    assert torch.equal(mask_row(matcher, backend.vocab_size), before)
    assert matcher.error() is None
    digits = small_tokenizer.encode("123", add_special_tokens=False)
    assert matcher.accept_tokens(digits) == len(digits)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_eos_finish_and_rollback(small_backends, small_tokenizer, backend_name):
    backend = small_backends[backend_name]
    eos = backend.eos_token_ids[0]
    matcher = backend.matcher(backend.compile("regex", r"(yes|no)"))
    assert not matcher.can_stop() and not matcher.is_finished()
    ids = small_tokenizer.encode("yes", add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    assert matcher.can_stop() and matcher.is_finished()  # nothing but EOS can follow
    assert allowed_ids(matcher, backend.vocab_size) == [eos]
    assert matcher.accept_token(eos) and matcher.is_finished()
    assert allowed_ids(matcher, backend.vocab_size) == [eos]  # a finished row is never all-zero
    assert not matcher.accept_token(ids[0]) and matcher.forced_tokens() == []
    matcher.rollback(1 + len(ids))
    assert not matcher.can_stop()
    assert matcher.accept_tokens(small_tokenizer.encode("no", add_special_tokens=False)) > 0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_can_stop_without_finishing(small_backends, small_tokenizer, backend_name):
    backend = small_backends[backend_name]
    matcher = backend.matcher(backend.compile("regex", r"[0-9]+"))
    matcher.accept_tokens(small_tokenizer.encode("7", add_special_tokens=False))
    assert matcher.can_stop() and not matcher.is_finished()
    allowed = allowed_ids(matcher, backend.vocab_size)
    assert backend.eos_token_ids[0] in allowed and len(allowed) > 1


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_padding_and_special_ids_never_allowed(qwen_backends, qwen_tokenizer, backend_name):
    backend = qwen_backends[backend_name]
    matcher = backend.matcher(backend.compile("regex", r"(.|\n){0,20}"))
    allowed = set(allowed_ids(matcher, backend.vocab_size))
    assert not allowed & set(range(len(qwen_tokenizer), backend.vocab_size))  # lm_head padding
    im_start = qwen_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in allowed and not matcher.accept_token(im_start)
    assert set(backend.eos_token_ids) <= allowed  # the empty string matches: EOS allowed


def test_vocab_smaller_than_tokenizer_is_refused(small_tokenizer):
    for name in BACKENDS:
        with pytest.raises(ValueError, match="vocab_size"):
            make_backend(name, small_tokenizer, len(small_tokenizer) - 1)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_compiled_grammar_shared_across_matchers(small_backends, small_tokenizer, backend_name):
    backend = small_backends[backend_name]
    compiled = backend.compile("choices", ["alpha", "beta"])
    a, b = backend.matcher(compiled), backend.matcher(compiled)
    a.accept_tokens(small_tokenizer.encode("alpha", add_special_tokens=False))
    assert a.can_stop() and not b.can_stop()  # independent state


def test_fill_bitmasks_batch_matches_single(small_backends, small_tokenizer):
    for backend in small_backends.values():
        compiled = backend.compile("regex", r"[a-c]{2}[0-9]")
        schema = backend.compile("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}})
        matchers = [backend.matcher(compiled) for _ in range(3)] + [backend.matcher(schema) for _ in range(2)]
        matchers[1].accept_tokens(small_tokenizer.encode("a", add_special_tokens=False))
        matchers[4].accept_tokens(small_tokenizer.encode('{"', add_special_tokens=False))
        from prefixrt.constrained.logits import allocate_bitmask
        batch = allocate_bitmask(6, backend.vocab_size)
        backend.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], batch)
        for i, m in enumerate(matchers):
            assert torch.equal(batch[i], mask_row(m, backend.vocab_size))
        assert torch.all(batch[5] == -1)  # an unconstrained row is left alone
