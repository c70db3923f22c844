"""Budget-aware closing of JSON output (prefixrt/constrained/budget.py).

Oracles: `json.loads` of a prefix plus its closing text (JsonState), and a random sampler that never chooses to
close (no EOS, no closing punctuation by preference): under the plain matcher it keeps the document open past
the budget; under BudgetMatcher every walk ends within the budget as a document the schema accepts.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from prefixrt.constrained.budget import (
    PROBE_WINDOW,
    BudgetMatcher,
    JsonState,
    budget_matcher,
    document_budget,
)
from prefixrt.constrained.testing import random_walk

BACKENDS = ("llguidance", "xgrammar")

DOCUMENTS = [
    {"name": "Alice", "age": 30, "city": {"name": "Paris", "country": "France"}},
    {"tasks": [{"name": "A\\\"b", "age": -1.5e3}, {"name": "", "age": 0}], "ok": True, "none": None, "no": False},
    [1, [2, [3, {}]], [], {"k": []}],
    {"a": "x y, } ] { [ : \"", "b": [True, False, None, 12345678901234]},
]

ITERABLE = {  # instructor's Iterable[Contact] wrapper: an unbounded list of closed objects, all required
    "type": "object",
    "properties": {"tasks": {"type": "array", "items": {"$ref": "#/$defs/Contact"}}},
    "required": ["tasks"], "additionalProperties": False,
    "$defs": {"Contact": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False}},
}


@pytest.mark.parametrize("doc", range(len(DOCUMENTS)))
@pytest.mark.parametrize("indent", [None, 2])
def test_every_closing_text_ends_the_document(doc, indent):
    """For every prefix of a document (compact and pretty-printed), prefix + closing_text is valid JSON
    wherever a closing text is given; the complete document needs none."""
    text = json.dumps(DOCUMENTS[doc], indent=indent)
    given = 0
    for end in range(1, len(text) + 1):
        state = JsonState()
        state.feed(text[:end])
        closing = state.closing_text()
        assert not state.broken, text[:end]
        if closing is not None:
            given += 1
            json.loads(text[:end] + closing)
    assert closing == ""
    assert given >= len(text) // 3  # outside keys, most prefixes have a cheap syntactic end


def test_broken_text_has_no_closing_text():
    for bad in ('{"a" 1', "[1 2", "{,", "tru e", '{"a": 1}}'):
        state = JsonState()
        state.feed(bad)
        assert state.broken and state.closing_text() is None, bad


def test_sibling_cost_is_the_longest_child_so_far():
    state = JsonState()
    for piece in ["[", "{", '"a"', ": ", "1", "}", ", ", "{", "}"]:
        state.feed(piece)
    # the first item took tokens 1..5, the second 7..8: one more is "," plus the longest (5 tokens)
    assert state.sibling_cost() == 6 and state.closing_text() == "]"


def _walk(backend, texts, kind, spec, seed, budget, budgeted):
    compiled = backend.compile(kind, spec)
    matcher = budget_matcher(backend, compiled, budget) if budgeted else backend.matcher(compiled)
    return random_walk(backend, compiled, texts, seed=seed, max_tokens=budget, p_eos=0.0, p_closer=0.0,
                       matcher=matcher)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind,spec", [("json_object", None), ("json_schema", ITERABLE)], ids=["object", "iterable"])
def test_a_sampler_that_never_closes_ends_within_the_budget(small_backends, small_tokenizer, token_texts,
                                                            backend_name, kind, spec):
    backend = small_backends[backend_name]
    texts = token_texts[id(small_tokenizer)]
    open_without = 0
    for seed in range(6):
        for budget in (24, 40):
            walk = _walk(backend, texts, kind, spec, seed, budget, budgeted=True)
            text = small_tokenizer.decode(walk.ids)
            assert walk.finished and len(walk.ids) <= budget, (seed, budget, text)
            value = json.loads(text)
            if spec is None:
                assert isinstance(value, dict)
            else:
                jsonschema.validate(value, spec)
            open_without += not _walk(backend, texts, kind, spec, seed, budget, budgeted=False).finished
    assert open_without >= 4  # the plain matcher leaves a third or more of these walks open at the budget


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_an_ample_budget_changes_nothing(small_backends, small_tokenizer, token_texts, backend_name):
    """Far from the budget the rule never fires: the same seed walks the same tokens with and without it."""
    backend = small_backends[backend_name]
    texts = token_texts[id(small_tokenizer)]
    compiled = backend.compile("json_object", None)
    for seed in range(4):
        plain = random_walk(backend, compiled, texts, seed=seed, max_tokens=400)
        wrapped = random_walk(backend, compiled, texts, seed=seed, max_tokens=400,
                              matcher=BudgetMatcher(backend.matcher(compiled), 10_000, backend))
        assert plain.ids == wrapped.ids


def test_parallel_tool_calls_end_within_the_budget(small_backends, small_tokenizer, token_texts):
    """The grammar of "required" with parallel calls (calls one per line, plan_tools): a sampler that
    never closes still ends with well-formed calls of the declared tool inside the budget. llguidance only:
    the grammar's compact-layout `%json` options are llguidance's (under xgrammar the layout is free, and a
    sampler that never closes spends the budget on whitespace)."""
    backend_name = "llguidance"
    from prefixrt.lowering.tools import plan_tools, tools_from_openai

    tools = tools_from_openai([{"type": "function", "function": {"name": "Contacts", "parameters": ITERABLE}}])
    plan = plan_tools(tools, "required", None)
    assert "grammar" in plan.constraint  # the one-per-line alternation, not a single JSON schema
    backend = small_backends[backend_name]
    texts = token_texts[id(small_tokenizer)]
    for seed in range(4):
        walk = _walk(backend, texts, "grammar", plan.constraint["grammar"], seed, 48, budgeted=True)
        text = small_tokenizer.decode(walk.ids)
        calls = plan.parse(text)
        assert walk.finished and calls, (seed, text)
        for call in calls:
            jsonschema.validate(call.arguments, ITERABLE)


def test_prose_is_left_alone():
    state = JsonState()
    state.feed("2 + 3 is 5")
    assert state.broken and state.closing_text() is None


def test_a_json_value_after_a_header_line_is_followed():
    """DSPy's ChatAdapter reply: text, then a JSON value on its own line after a field header."""
    state = JsonState()
    for piece in ["[[ ## discussion ## ]]\n", "It was fine.", "\n\n[[ ## advice ## ]]\n", '{"self": "', "N/A"]:
        state.feed(piece)
    assert not state.broken and state.closing_text() == '"}'
    state.feed('"}\n\n[[ ## completed ## ]]')
    assert state.broken


def _with_cap(schema: dict, cap: int | None) -> dict:
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, **({"x-max-tokens": cap} if cap is not None else {}), "x-guidance": compact}


def _value_grammar(cap: int | None) -> str:
    """A JSON value between two tags, as DSPy's XMLAdapter reply holds a nested field."""
    return f'start: "<tasks>\\n" v "\\n</tasks>"\nv: %json {json.dumps(_with_cap(ITERABLE, cap))}'


def test_document_budget_is_the_smallest_x_max_tokens(small_backends):
    backend = small_backends["llguidance"]
    assert document_budget(backend.compile("grammar", _value_grammar(None))) is None
    two = _value_grammar(40) + f'\nw: %json {json.dumps(_with_cap({"type": "array"}, 24))}'
    assert document_budget(backend.compile("grammar", two)) == 24
    assert document_budget(backend.compile("json_schema", _with_cap(ITERABLE, 24))) is None  # grammars only


def test_a_grammar_json_value_closes_within_its_x_max_tokens(small_backends, small_tokenizer, token_texts):
    """A sampler that never ends a value by choice: a `%json` value with `x-max-tokens` still ends within that many
    tokens, as a document its schema accepts, and the grammar's text after it follows; without the cap it runs on
    (the reply's budget alone lets it take everything)."""
    backend = small_backends["llguidance"]
    texts = token_texts[id(small_tokenizer)]
    longer = 0
    for cap in (24, 48):
        compiled = backend.compile("grammar", _value_grammar(cap))
        plain = backend.compile("grammar", _value_grammar(None))
        for seed in range(4):
            walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=400, p_eos=0.0, p_closer=0.0,
                               matcher=budget_matcher(backend, compiled, 400), prefer_open='"]},')
            text = small_tokenizer.decode(walk.ids)
            assert walk.finished and text.startswith("<tasks>\n") and text.endswith("\n</tasks>"), (seed, text)
            value = text[len("<tasks>\n"):-len("\n</tasks>")]
            jsonschema.validate(json.loads(value), ITERABLE)
            assert len(small_tokenizer.encode(value, add_special_tokens=False)) <= cap + 1, (cap, seed, value)
            walk = random_walk(backend, plain, texts, seed=seed, max_tokens=400, p_eos=0.0, p_closer=0.0,
                               matcher=budget_matcher(backend, plain, 400), prefer_open='"]},')
            longer += len(walk.ids) > cap + 16
    assert longer == 8


def test_the_end_is_measured_before_it_is_near(small_backends, small_tokenizer, token_texts):
    """A document whose end needs more than PROBE_WINDOW tokens (a list, then an object of many required members):
    the rule measures it before the last PROBE_WINDOW tokens, so a sampler that never closes still ends within
    the budget."""
    backend = small_backends["llguidance"]
    texts = token_texts[id(small_tokenizer)]
    tail = {f"member_number_{k}": {"type": "string"} for k in range(8)}
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string"}},
        "tail": {"type": "object", "properties": tail, "required": list(tail), "additionalProperties": False}},
        "required": ["items", "tail"], "additionalProperties": False}
    compiled = backend.compile("json_schema", schema)
    assert BudgetMatcher(backend.matcher(compiled), 10_000, backend).need(10_000) > PROBE_WINDOW
    assert_open_walks_close(backend, compiled, texts, small_tokenizer, schema, budget=300)


def assert_open_walks_close(backend, compiled, texts, tokenizer, schema, budget: int, seeds: int = 4) -> None:
    """Walks by a sampler that never ends a value by choice (prefer_open), under the budget rule: each finishes
    within the budget with a document the schema accepts."""
    for seed in range(seeds):
        walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=budget, p_eos=0.0, p_closer=0.0,
                           matcher=budget_matcher(backend, compiled, budget), prefer_open='"]},')
        text = tokenizer.decode(walk.ids)
        assert walk.finished and len(walk.ids) <= budget, (seed, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_number_that_would_run_on_is_ended(small_backends, small_tokenizer, token_texts, backend_name):
    """A sampler that never ends a number by choice, with more members required after it: the rule ends the number
    (the next member's comma, not one more digit) and the object within the budget."""
    backend = small_backends[backend_name]
    texts = token_texts[id(small_tokenizer)]
    schema = {"type": "object", "properties": {"rating": {"type": "number"}, "count": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["rating", "count", "tags"], "additionalProperties": False}
    compiled = backend.compile("json_schema", schema)
    assert_open_walks_close(backend, compiled, texts, small_tokenizer, schema, budget=48)
