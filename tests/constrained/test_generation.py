"""Random constrained generation under each backend: every output must parse/validate.

A random "model" picks any allowed token each step (biased towards EOS and closing punctuation so walks
end) and follows forced tokens whenever there are any. The bulk runs on a small BPE tokenizer with a
padded vocab (fast); a realistic subset runs on Qwen's 151k vocab.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

from prefixrt.constrained.testing import random_walk

BACKENDS = ("llguidance", "xgrammar")

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",  # phone number
    r"\(\d{3}\) \d{3}-\d{4}",  # US phone number with area code
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",  # ISO date
    r"(yes|no)",
    r"(true|false|maybe)",
    r"[a-z]+@[a-z]+\.(com|org|net)",  # email-ish
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",  # decimal number
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",  # capitalized name
    r"#[0-9a-f]{6}",  # hex colour
    r"(ab|cd)*e",
]


class Address(BaseModel):
    street: str
    city: str
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    email: str | None = None
    addresses: list[Address] = Field(max_length=2)


class TreeNode(BaseModel):  # legitimately recursive: children may be empty
    label: str = Field(max_length=8)
    children: list[TreeNode] = Field(default_factory=list, max_length=2)


SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "profile": {
                        "type": "object",
                        "properties": {"nick": {"type": "string", "maxLength": 6}, "score": {"type": "number"}},
                        "required": ["nick", "score"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "profile"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                       "minItems": 1, "maxItems": 2},
        },
        "required": ["tags", "matrix"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "count": {"enum": [1, 2, 3, None]},
            "kind": {"const": "shirt"},
        },
        "required": ["color", "size", "count", "kind"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
        },
        "required": ["price", "qty", "ratio", "flag"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "note": {"type": "string", "maxLength": 10},
            "extra": {"type": ["string", "null"], "maxLength": 4},
            "score": {"type": "number"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "anyof_array": {
        "type": "array",
        "items": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
        "maxItems": 4,
    },
    "linked_list": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                           "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
}

CHOICES = [
    ["yes", "no"],
    ["red", "green", "blue", "green-blue"],  # one choice is a prefix of another
    ['say "hi"', "back\\slash", "tab\there", "new\nline"],  # characters that need escaping
    ["Paris", "Antidisestablishmentarianism", "ü-umlaut", "東京"],
]

LARK_GRAMMARS = {
    "arith": (
        'start: expr\nexpr: term (("+" | "-") term){0,3}\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/',
        re.compile(r"^[0-9()+\-]+$"),
    ),
    "greeting": (
        'start: greeting " " name "!"\ngreeting: "hello" | "hi" | "hey"\nname: /[A-Z][a-z]{1,6}/',
        re.compile(r"^(hello|hi|hey) [A-Z][a-z]{1,6}!$"),
    ),
    "kv_list": (
        'start: pair ("," pair){0,3}\npair: KEY "=" VALUE\nKEY: /[a-z]{1,4}/\nVALUE: /[0-9]{1,3}/',
        re.compile(r"^[a-z]{1,4}=[0-9]{1,3}(,[a-z]{1,4}=[0-9]{1,3}){0,3}$"),
    ),
}
GBNF_GRAMMARS = {
    "gbnf_list": ('root ::= "[" item ("," item)? "]"\nitem ::= [a-c] [0-9]', re.compile(r"^\[[a-c][0-9](,[a-c][0-9])?\]$")),
}


def _run(backend, texts, kind, spec, seed, max_tokens=300):
    compiled = backend.compile(kind, spec)
    walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=max_tokens)
    assert walk.finished, f"walk did not finish within {max_tokens} tokens"
    return walk


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex(small_backends, small_tokenizer, token_texts, backend_name, pattern):
    walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "regex", pattern, seed=1)
    text = small_tokenizer.decode(walk.ids)
    assert re.fullmatch(pattern, text, flags=re.ASCII), text


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_json_schema(small_backends, small_tokenizer, token_texts, backend_name, schema_name):
    schema = SCHEMAS[schema_name]
    for seed in (1, 2):
        walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "json_schema", schema, seed)
        text = small_tokenizer.decode(walk.ids)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("model", [Person, TreeNode], ids=["person", "tree"])
def test_pydantic_model(small_backends, small_tokenizer, token_texts, backend_name, model):
    for seed in (3, 4):
        walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "json_schema", model, seed, 400)
        model.model_validate_json(small_tokenizer.decode(walk.ids))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_json_object(small_backends, small_tokenizer, token_texts, backend_name):
    for seed in (5, 6):
        walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "json_object", None, seed, 400)
        assert isinstance(json.loads(small_tokenizer.decode(walk.ids)), dict)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("choices", CHOICES, ids=["yes_no", "prefix", "escapes", "unicode"])
def test_choices(small_backends, small_tokenizer, token_texts, backend_name, choices):
    seen = set()
    for seed in range(4):
        walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "choices", choices, seed)
        text = small_tokenizer.decode(walk.ids)
        assert text in choices, text
        seen.add(text)
    assert seen  # at least one; with several seeds usually more


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("name", sorted(LARK_GRAMMARS) + sorted(GBNF_GRAMMARS))
def test_grammar(small_backends, small_tokenizer, token_texts, backend_name, name):
    grammar, check = {**LARK_GRAMMARS, **GBNF_GRAMMARS}[name]
    for seed in (7, 8):
        walk = _run(small_backends[backend_name], token_texts[id(small_tokenizer)], "grammar", grammar, seed)
        text = small_tokenizer.decode(walk.ids)
        assert check.fullmatch(text), text


# ------------------------------------------------------------------------------------ realistic vocabulary
QWEN_CASES = [
    ("regex", r"\(\d{3}\) \d{3}-\d{4}", lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t, re.ASCII)),
    ("regex", r"\d{4}-\d{2}-\d{2}", lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t, re.ASCII)),
    ("choices", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
    ("json_schema", SCHEMAS["enums"], lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enums"]) is None),
    ("json_schema", SCHEMAS["nested"], lambda t: jsonschema.validate(json.loads(t), SCHEMAS["nested"]) is None),
    ("json_schema", Person, lambda t: Person.model_validate_json(t) is not None),
]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", range(len(QWEN_CASES)), ids=[f"{k}{i}" for i, (k, _, _) in enumerate(QWEN_CASES)])
def test_qwen_vocab(qwen_backends, qwen_tokenizer, token_texts, backend_name, case):
    kind, spec, check = QWEN_CASES[case]
    walk = _run(qwen_backends[backend_name], token_texts[id(qwen_tokenizer)], kind, spec, seed=case, max_tokens=400)
    text = qwen_tokenizer.decode(walk.ids)
    assert check(text), text
