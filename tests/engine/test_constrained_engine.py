"""Constrained decoding through the engine: validity under concurrency, canonical jump-forward, errors,
and select scores that equal transformers' own logprobs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from prefixrt import InvalidRequest

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,6}@[a-z]{3}\.com", r"\(\d{2}\) [A-Z][a-z]{1,8}",
           r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10},
                                      "note": {"type": "string", "maxLength": 6}},
     "required": ["color", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 6},
                                      "shipping_address": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 6},
                                                                          "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                                                           "required": ["city", "zip"],
                                                           "additionalProperties": False}},
     "required": ["customer_full_name", "shipping_address"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
     "required": ["ok"], "additionalProperties": False},
]
LARK = r"""
start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[a-z]{1,6}/
"""
CHOICES = [["alpha", "beta", "gamma"], ["yes", "no"], ["The quick brown fox", "A stitch in time"]]


def _check(kind, spec, text):
    if kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    elif kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "grammar":
        assert re.fullmatch(r"(hello|hi) [a-z]{1,6}!", text), text
    elif kind == "choices":
        assert text in spec


def _cases(k: int = 1):
    cases = [("regex", r) for r in REGEXES] + [("json_schema", s) for s in SCHEMAS] + [("grammar", LARK)]
    cases += [("choices", c) for c in CHOICES]
    return cases * k


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_constrained_valid_mixed_with_unconstrained(arch, make_engine):
    eng = make_engine(arch, kv_cache_tokens=8192)
    cases = _cases(5)  # 70 constrained requests
    prompts, params = [], []
    for i, (kind, spec) in enumerate(cases):
        prompts.append([1, 10 + i % 50, 20 + i % 7])
        params.append({"max_new_tokens": 96, "temperature": 0.0 if i % 2 else 1.0, "seed": i, kind: spec})
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(16) as pool:
        free = [pool.submit(eng.generate, [1, 5 + i], {"max_new_tokens": 12, "ignore_eos": True}) for i in range(8)]
        futs = [pool.submit(eng.generate, p, q) for p, q in zip(prompts, params)]
        outs = [f.result(timeout=300) for f in futs]
        assert all(f.result().completion_tokens == 12 for f in free)
    for (kind, spec), c in zip(cases, outs):
        assert c.finish_reason == "stop", (kind, spec, c.text, c.finish_reason)
        _check(kind, spec, c.text)


@pytest.mark.parametrize("overlap", [True, False])
def test_jump_forward_equals_plain_decoding_and_saves_forwards(make_engine, overlap):
    """Forced tokens are exactly what greedy decoding under the mask would have produced, in fewer forwards."""
    eng = make_engine("llama", overlap_schedule=overlap)
    for schema in SCHEMAS:
        params = {"max_new_tokens": 120, "temperature": 0, "json_schema": schema}
        before = eng.stats().forward_passes_total
        with_jf = eng.generate([1, 30, 31], params)
        mid = eng.stats().forward_passes_total
        without = eng.generate([1, 30, 31], {**params, "jump_forward": False})
        after = eng.stats().forward_passes_total
        jsonschema.validate(json.loads(with_jf.text), schema)
        assert with_jf.token_ids == without.token_ids
        assert (mid - before) < (after - mid), "jump-forward should need fewer forward passes"


@pytest.mark.parametrize("overlap", [True, False])
def test_streaming_constrained_includes_forced_tokens(make_engine, overlap):
    eng = make_engine("llama", overlap_schedule=overlap)
    params = {"max_new_tokens": 80, "temperature": 0, "json_schema": SCHEMAS[0]}
    whole = eng.generate([1, 40], params)
    chunks = list(eng.stream([1, 40], params))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text


@pytest.mark.parametrize("params, param", [
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema"),
    ({"json_schema": {"$ref": "#"}}, "json_schema"),
    ({"json_schema": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}, "json_schema"),
    ({"grammar": "start: ( \"a\" "}, "grammar"),
    ({"choices": []}, "choices"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "json_schema"),
])
def test_bad_constraints_rejected_at_submit(params, param, make_engine):
    eng = make_engine("llama")
    with pytest.raises(InvalidRequest) as e:
        eng.generate([1, 2, 3], {"max_new_tokens": 4, **params})
    assert e.value.param == param, (e.value.param, str(e.value))
    assert eng.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0}).completion_tokens >= 1


def test_grammar_compile_timeout_is_invalid_request(make_engine):
    eng = make_engine("llama", grammar_timeout_s=0.001)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{1,40}[0-9]{3,9}"}
                                            for i in range(300)}}
    with pytest.raises(InvalidRequest, match="timed out"):
        eng.generate([1, 2], {"max_new_tokens": 4, "json_schema": big})
    assert eng.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0}).completion_tokens >= 1


@pytest.mark.parametrize("method", ["token_length_normalized", "sum"])
def test_select_scores_equal_transformers_logprobs(method, make_engine, tiny_checkpoints, tiny_tokenizer):
    _, hf = tiny_checkpoints("qwen2")
    eng = make_engine("qwen2")
    prompt = [1, 77, 78, 79, 80]
    choices = ["The quick", "A stitch", "prefix caching"]
    c = eng.generate(prompt, {"choices": choices, "choices_method": method})
    ref = []
    for ch in choices:
        ids = tiny_tokenizer.encode(ch, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0].float(), -1)
        tok_lps = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]
        ref.append(sum(tok_lps) / (len(ids) if method == "token_length_normalized" else 1))
    got = [c.choice_scores[ch] for ch in choices]
    assert got == pytest.approx(ref, abs=1e-4)
    assert c.text == choices[max(range(3), key=lambda i: ref[i])]
    # Scored as extends of one cached prefix: a second select reuses the prompt.
    again = eng.generate(prompt, {"choices": choices})
    assert again.cached_tokens == len(prompt) - 1


def test_grammar_warm_up_builds_the_tables_on_a_thread_during_start_up(make_engine, monkeypatch):
    import threading

    from prefixrt.engine.grammar import EngineGrammar

    seen = {}
    real_tables = EngineGrammar._warm_tables

    def tables(self):
        seen["thread"] = threading.current_thread().name
        real_tables(self)

    monkeypatch.setattr(EngineGrammar, "_warm_tables", tables)
    eng = make_engine("llama", grammar_warm_up=True)
    assert seen["thread"] == "prefixrt-grammar-warm"  # not on the engine's start-up thread
    assert eng.core.hooks.grammar.backend is not None  # and finished before the engine takes requests

    def broken(self):
        raise RuntimeError("no tables")

    monkeypatch.setattr(EngineGrammar, "_warm_tables", broken)
    eng = make_engine("llama", grammar_warm_up=True)  # a failed warm-up is logged; the engine still serves
    assert eng.core.hooks.grammar.backend is None
    assert eng.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0}).finish_reason == "length"


def test_grammar_warm_up_builds_the_backend_at_start(make_engine):
    cold = make_engine("llama")  # the CPU default: built on the first constrained request
    assert cold.core.hooks.grammar.backend is None and "grammar_warm_s" not in cold._built.startup
    eng = make_engine("llama", grammar_warm_up=True)
    assert eng.core.hooks.grammar.backend is not None and eng.core.masks.backend is eng.grammar_compiler().backend
    assert eng._built.startup["grammar_warm_s"] > 0
    backend = eng.grammar_compiler().backend
    if getattr(backend, "string_lengths", False):
        assert backend._token_table is not None  # the string-length tables too
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}
    out = eng.generate([1, 2, 3], {"max_new_tokens": 24, "temperature": 0, "json_schema": schema})
    assert eng.grammar_compiler().backend is backend  # the warmed backend served the request
    assert out.finish_reason == "stop" and len(json.loads(out.text)["a"]) <= 3
