"""DSPy adapters' reply formats as constraints (adapters/dspy_formats.py), no model: the grammar built from the
messages DSPy's own ChatAdapter / XMLAdapter produce accepts a reply in that format, which the adapter then
parses, and refuses replies outside it (checked with the real llguidance matcher on the tiny tokenizer)."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest

dspy = pytest.importorskip("dspy")
pytest.importorskip("llguidance")

from prefixrt.adapters.dspy_formats import json_adapter_schema, output_format_constraint  # noqa: E402


class QA(dspy.Signature):
    question: str = dspy.InputField()
    reasoning: str = dspy.OutputField()
    answer: int = dspy.OutputField()
    kind: Literal["easy", "hard"] = dspy.OutputField()
    extra: dict[str, Any] = dspy.OutputField()
    ok: bool = dspy.OutputField()


CHAT_REPLY = ("[[ ## reasoning ## ]]\nTwo plus two.\nSo four.\n\n[[ ## answer ## ]]\n4\n\n[[ ## kind ## ]]\neasy\n\n"
              "[[ ## extra ## ]]\n{\"a\": 1}\n\n[[ ## ok ## ]]\nTrue\n\n[[ ## completed ## ]]")
XML_REPLY = "<reasoning>\nTwo plus two.\nSo four.\n</reasoning>\n<answer>\n4\n</answer>\n<kind>\neasy\n</kind>\n" \
            "<extra>\n{\"a\": 1}\n</extra>\n<ok>\nTrue\n</ok>"
EXPECTED = {"reasoning": "Two plus two.\nSo four.", "answer": 4, "kind": "easy", "extra": {"a": 1}, "ok": True}


@pytest.fixture(scope="module")
def backend():
    from prefixrt.constrained.llguidance_backend import LLGuidanceBackend
    from tests.helpers.engines import make_tiny_tokenizer

    return LLGuidanceBackend(make_tiny_tokenizer())


def _accepts(backend, grammar: str, text: str) -> bool:
    m = backend.matcher(backend.compile("grammar", grammar))
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return m.accept_tokens(ids) == len(ids) and m.can_stop()


@pytest.mark.parametrize("adapter,reply", [(dspy.ChatAdapter(), CHAT_REPLY), (dspy.XMLAdapter(), XML_REPLY)])
def test_adapter_format_becomes_a_grammar(backend, adapter, reply):
    messages = adapter.format(QA, demos=[], inputs={"question": "2+2?"})
    constraint = output_format_constraint(messages)
    grammar = constraint["grammar"]
    assert _accepts(backend, grammar, reply)
    assert adapter.parse(QA, reply) == EXPECTED
    assert not _accepts(backend, grammar, reply.replace("\n4\n", "\nfour\n"))  # an int field takes digits only
    assert not _accepts(backend, grammar, reply.replace("easy", "medium"))  # Literal choices only


@pytest.mark.parametrize("max_tokens", [None, 96])
def test_xml_values_are_character_data(backend, max_tokens):
    """XMLAdapter parses the reply as XML: a text value may not contain a tag (`<answer>\\n<answer-value>` does not
    parse, and DSPy calls the LM again), nor a bare `&`; entity references are fine and parse to their text."""
    adapter = dspy.XMLAdapter()
    sig = dspy.Signature("question -> reasoning, answer")
    grammar = output_format_constraint(adapter.format(sig, demos=[], inputs={"question": "q"}), max_tokens)["grammar"]
    good = "<reasoning>\nThink about it.\n</reasoning>\n<answer>\nParis\n</answer>"
    assert _accepts(backend, grammar, good)
    assert adapter.parse(sig, good) == {"reasoning": "Think about it.", "answer": "Paris"}
    escaped = good.replace("Paris", "&lt;b&gt; A &amp; B")
    assert _accepts(backend, grammar, escaped)
    assert adapter.parse(sig, escaped)["answer"] == "<b> A & B"
    for bad in ("<answer>\nParis", "<answer-value>", "Paris </answer> more", "Paris\n<answer>\nParis", "<b>Paris</b>",
                "A & B"):
        assert not _accepts(backend, grammar, good.replace("\nParis\n", f"\n{bad}\n")), bad
    assert not _accepts(backend, grammar, good.replace("Think about it.", "<reasoning>\nThink"))


@pytest.mark.parametrize("max_tokens", [None, 96])
def test_chat_text_fields_end_at_a_blank_line(backend, max_tokens):
    """A text value ends at a blank line, also when it is capped by the request's max_tokens (before, a capped
    value could only end at its cap)."""
    messages = dspy.ChatAdapter().format(dspy.Signature("question -> answer"), demos=[], inputs={"question": "q"})
    grammar = output_format_constraint(messages, max_tokens)["grammar"]
    assert _accepts(backend, grammar, "[[ ## answer ## ]]\nParis\n\n[[ ## completed ## ]]")
    assert not _accepts(backend, grammar, "[[ ## answer ## ]]\nParis\n\nMore text\n\n[[ ## completed ## ]]")
    assert not _accepts(backend, grammar, "Paris")


def test_plain_prompts_are_left_alone():
    assert output_format_constraint([{"role": "user", "content": "hello"}]) == {}
    json_messages = dspy.JSONAdapter().format(dspy.Signature("question -> answer"), demos=[], inputs={"question": "q"})
    assert output_format_constraint(json_messages) == {}  # JSONAdapter sends response_format itself


def _react_signature():
    def add(a: int, b: int = 1) -> int:
        """Add two integers.
        A second line."""
        return a + b

    return dspy.ReAct("question -> answer: int", tools=[add], max_iters=2).react.signature


@pytest.mark.parametrize("adapter", [dspy.ChatAdapter(), dspy.XMLAdapter()])
def test_react_tool_arguments_follow_the_chosen_tool(backend, adapter):
    """dspy.ReAct's next_tool_args is `dict[str, Any]` (any object, so a small model closed `{}` and the tool call
    failed): the grammar ties the arguments to the tool named in next_tool_name, from the tools ReAct lists."""
    sig = _react_signature()
    grammar = output_format_constraint(adapter.format(sig, demos=[], inputs={"question": "2+3?", "trajectory": ""}))[
        "grammar"]

    def reply(name, args):
        if isinstance(adapter, dspy.XMLAdapter):
            return (f"<next_thought>\nAdd them.\n</next_thought>\n<next_tool_name>\n{name}\n</next_tool_name>\n"
                    f"<next_tool_args>\n{args}\n</next_tool_args>")
        return (f"[[ ## next_thought ## ]]\nAdd them.\n\n[[ ## next_tool_name ## ]]\n{name}\n\n"
                f"[[ ## next_tool_args ## ]]\n{args}\n\n[[ ## completed ## ]]")

    assert _accepts(backend, grammar, reply("add", '{"a": 2, "b": 3}'))
    assert _accepts(backend, grammar, reply("finish", "{}"))
    assert not _accepts(backend, grammar, reply("add", "{}"))  # a tool's arguments are required (strict rule)
    assert not _accepts(backend, grammar, reply("add", '{"a": 2}'))  # a default is written out too
    assert not _accepts(backend, grammar, reply("add", '{"a": 2, "b": 3, "c": 4}'))  # closed
    assert not _accepts(backend, grammar, reply("finish", '{"a": 2, "b": 3}'))  # finish takes nothing
    assert not _accepts(backend, grammar, reply("add", '{"a": "two", "b": 3}'))
    assert adapter.parse(sig, reply("add", '{"a": 2, "b": 3}'))["next_tool_args"] == {"a": 2, "b": 3}


def test_json_adapter_react_step_has_one_branch_per_tool(backend):
    """dspy.ReAct under JSONAdapter: `next_tool_args` is `dict[str, Any]`, so JSONAdapter sends json_object; the
    reply's schema has one branch per tool ReAct lists: `next_tool_name` that tool and `next_tool_args` under its
    argument schema (closed, every argument written), `finish` with `{}`."""
    import jsonschema

    sig = _react_signature()
    messages = dspy.JSONAdapter().format(sig, demos=[], inputs={"question": "2+3?", "trajectory": ""})
    schema = json_adapter_schema(messages)
    grammar = backend.compile("json_schema", json.dumps(schema))

    def accepts(name, args) -> bool:
        text = json.dumps({"next_thought": "Add them.", "next_tool_name": name, "next_tool_args": args})
        m = backend.matcher(grammar)
        ids = backend.tokenizer.encode(text, add_special_tokens=False)
        ok = m.accept_tokens(ids) == len(ids) and m.can_stop()
        try:
            jsonschema.validate(json.loads(text), schema)
        except jsonschema.ValidationError:
            assert not ok, text  # the grammar and the schema agree
            return False
        assert ok, text
        return True

    assert accepts("add", {"a": 2, "b": 3}) and accepts("finish", {})
    for name, args in (("add", {}), ("add", {"a": 2}), ("add", {"a": 2, "b": 3, "c": 4}), ("finish", {"a": 2}),
                       ("add", {"a": "two", "b": 3}), ("sub", {"a": 2, "b": 3})):
        assert not accepts(name, args), (name, args)
    parsed = dspy.JSONAdapter().parse(sig, json.dumps({"next_thought": "t", "next_tool_name": "add",
                                                       "next_tool_args": {"a": 2, "b": 3}}))
    assert parsed["next_tool_args"] == {"a": 2, "b": 3}


def test_json_adapter_strings_fit_the_budget():
    """With max_tokens, every plain string of a JSONAdapter reply (text fields, a ReAct tool's string arguments) has
    a maxLength of text_cap characters, so the object closes within the budget; without it, none."""
    import jsonschema
    from prefixrt.adapters.dspy_formats import text_cap

    def weather(city: str, celsius: bool) -> str:
        """The weather in a city."""
        return city

    sig = dspy.ReAct("question -> answer", tools=[weather], max_iters=2).react.signature
    messages = dspy.JSONAdapter().format(sig, demos=[], inputs={"question": "weather?", "trajectory": ""})
    assert "maxLength" not in json.dumps(json_adapter_schema(messages))
    schema = json_adapter_schema(messages, max_tokens=160)
    cap = text_cap(["next_thought", "next_tool_name", "next_tool_args"], 160)
    branch = next(b for b in schema["anyOf"] if b["properties"]["next_tool_name"] == {"const": "weather"})
    assert branch["properties"]["next_thought"]["maxLength"] == cap
    assert branch["properties"]["next_tool_args"]["properties"]["city"]["maxLength"] == cap
    ok = {"next_thought": "t" * cap, "next_tool_name": "weather", "next_tool_args": {"city": "Rome", "celsius": True}}
    jsonschema.validate(ok, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**ok, "next_thought": "t" * (cap + 1)}, schema)


def test_json_adapter_json_object_becomes_the_fields_schema():
    """JSONAdapter sends `json_object` (any object) when an output field is an open mapping; the fields its
    prompt names become the reply's schema: those keys, typed from their notes, all required, no others."""
    import jsonschema

    messages = dspy.JSONAdapter().format(QA, demos=[], inputs={"question": "2+2?"})
    schema = json_adapter_schema(messages)
    reply = {"reasoning": "Two plus two.", "answer": 4, "kind": "easy", "extra": {"a": 1}, "ok": True}
    jsonschema.validate(reply, schema)
    assert list(schema["properties"]) == list(reply) and schema["required"] == list(reply)
    assert dspy.JSONAdapter().parse(QA, json.dumps(reply)) == EXPECTED | {"reasoning": "Two plus two."}
    for bad in ({**reply, "answer": "four"}, {**reply, "kind": "medium"}, {**reply, "more": 1},
                {k: v for k, v in reply.items() if k != "extra"}, {**reply, "ok": "yes"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert json_adapter_schema(dspy.ChatAdapter().format(QA, demos=[], inputs={"question": "q"})) is None


@pytest.mark.parametrize("max_tokens", [None, 96])
def test_xml_values_stay_inside_xml_1_0(backend, max_tokens):
    """No character outside XML 1.0's Char production, no numeric character reference (it may name one), no
    `]]>`: each makes expat refuse the reply. A model's `&amp;` parses back to `&`."""
    import xml.etree.ElementTree as ET

    adapter = dspy.XMLAdapter()
    sig = dspy.Signature("question -> answer")
    grammar = output_format_constraint(adapter.format(sig, demos=[], inputs={"question": "q"}), max_tokens)["grammar"]
    good = "<answer>\nAT&amp;T &lt;3 a]]b a]>b\ttab\n</answer>"
    assert _accepts(backend, grammar, good) and adapter.parse(sig, good) == {"answer": "AT&T <3 a]]b a]>b\ttab"}
    for bad in ("a\x0bb", "a\x01b", "a\ufffeb", "a]]>b", "&#0;", "&#65;", "a & b"):
        reply = good.replace("AT&amp;T", bad)
        with pytest.raises(ET.ParseError) if bad != "&#65;" else _no_error():
            ET.fromstring(f"<r>{reply}</r>")
        assert not _accepts(backend, grammar, reply), repr(bad)


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_xml_nested_fields_are_json_the_adapter_reads(backend):
    """XMLAdapter asks for lists, dicts and models as nested XML; the grammar writes them as JSON text (which its
    parser takes as the field's value when the element has no child elements), typed from the caller's signature
    when given (the prompt's skeleton has no leaf types), XML-safe (no `<` or `&` in a string)."""
    import pydantic

    class Point(pydantic.BaseModel):
        label: str
        x: int

    sig = dspy.Signature({"question": (str, dspy.InputField()), "points": (list[Point], dspy.OutputField()),
                          "tags": (list[str], dspy.OutputField())})
    adapter = dspy.XMLAdapter()
    messages = adapter.format(sig, demos=[], inputs={"question": "q"})
    typed = output_format_constraint(messages, nested_schemas={
        "points": pydantic.TypeAdapter(list[Point]).json_schema()})["grammar"]
    untyped = output_format_constraint(messages)["grammar"]
    reply = '<points>\n[{"label": "a", "x": 3}]\n</points>\n<tags>\n["x", "y"]\n</tags>'
    assert _accepts(backend, typed, reply) and _accepts(backend, untyped, reply.replace('"x": 3', '"x": "3"'))
    parsed = adapter.parse(sig, reply)
    assert parsed["points"] == [Point(label="a", x=3)] and parsed["tags"] == ["x", "y"]
    assert not _accepts(backend, typed, reply.replace('"x": 3', '"x": "three"'))  # an int leaf
    assert not _accepts(backend, typed, reply.replace('"a"', '"a<b"'))
    assert not _accepts(backend, typed, reply.replace('"a"', '"a&b"'))


# ------------------------------------------------------------------------------------------------ the budget

def _mixed_format(adapter, max_tokens, count_tokens=None):
    """The reply grammar of the noise test's signature (str, int, float, bool, list[str] and a nested model), with
    the caller's leaf types for XMLAdapter's nested fields as prefixrt.LM gives them."""
    import pydantic

    from tests.adapters.test_dspy_noise import Mixed

    nested = {name: pydantic.TypeAdapter(f.annotation).json_schema() for name, f in Mixed.output_fields.items()
              if name in ("words", "m")} if isinstance(adapter, dspy.XMLAdapter) else None
    messages = adapter.format(Mixed, demos=[], inputs={"question": "q?"})
    return Mixed, output_format_constraint(messages, max_tokens, nested_schemas=nested,
                                           count_tokens=count_tokens)["grammar"]


@pytest.mark.parametrize("counted", [False, True], ids=["bytes", "tokenizer"])
@pytest.mark.parametrize("max_tokens", [400, 1000])
@pytest.mark.parametrize("adapter", [dspy.ChatAdapter(), dspy.XMLAdapter()], ids=["chat", "xml"])
def test_a_reply_that_never_ends_a_value_fits_max_tokens(backend, adapter, max_tokens, counted):
    """The longest reply the grammar allows fits max_tokens: a sampler that never ends a value by choice (never a
    newline, quote, bracket, brace, comma, `<` or `;` while anything else is allowed) still writes a complete reply
    within it, as the engine runs it (the BudgetMatcher closes each JSON value within its `x-max-tokens`), and
    DSPy's own parser takes it. Before, an int's digits ran on until max_tokens, a list's strings too, and the
    reply was cut before its last field."""
    import xml.etree.ElementTree as ET

    from prefixrt.constrained.budget import budget_matcher
    from prefixrt.constrained.testing import random_walk

    tok = backend.tokenizer
    count = (lambda text: len(tok.encode(text, add_special_tokens=False))) if counted else None
    sig, grammar = _mixed_format(adapter, max_tokens, count)
    compiled = backend.compile("grammar", grammar)
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    for seed in range(4):
        walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=max_tokens, p_eos=0.0, p_closer=0.0,
                           matcher=budget_matcher(backend, compiled, max_tokens), prefer_open='\n"]},<;')
        reply = tok.decode(walk.ids)
        assert walk.finished and len(walk.ids) <= max_tokens, (seed, len(walk.ids), reply[-300:])
        out = adapter.parse(sig, reply)
        assert isinstance(out["i"], int) and isinstance(out["m"].inner.score, int), reply
        if isinstance(adapter, dspy.XMLAdapter):
            ET.fromstring(f"<root>{reply}</root>")


@pytest.fixture(scope="module")
def qwen_backend():
    """llguidance on Qwen's 151k vocabulary (tests/constrained/conftest.py builds it offline): a real model's
    tokens, several bytes each."""
    from prefixrt.constrained.llguidance_backend import LLGuidanceBackend
    from tests.constrained.conftest import QWEN_EOS, QWEN_MODEL_VOCAB, _build_qwen

    return LLGuidanceBackend(_build_qwen(), vocab_size=QWEN_MODEL_VOCAB, eos_token_ids=list(QWEN_EOS))


@pytest.mark.parametrize("adapter", [dspy.ChatAdapter(), dspy.XMLAdapter()], ids=["chat", "xml"])
def test_a_real_reply_has_room(qwen_backend, adapter):
    """At max_tokens=400, counted with the model's tokenizer as the in-process LM does, a model's plain answer (a
    sentence, a 3-item list of short strings, a nested object with a 3-item list) is written whole: every token is
    one the engine's mask allows (no value reaches its cap), and DSPy parses it."""
    import json as _json

    from prefixrt.constrained.budget import budget_matcher
    from prefixrt.constrained.logits import allocate_bitmask, unpack_bitmask

    tok = qwen_backend.tokenizer
    sig, grammar = _mixed_format(adapter, 400, lambda text: len(tok.encode(text, add_special_tokens=False)))
    m = {"title": "Dune", "inner": {"name": "Frank Herbert", "score": 9}, "tags": ["sci-fi", "classic", "desert"]}
    xml = isinstance(adapter, dspy.XMLAdapter)
    values = {"s": "Paris is the capital of France, on the Seine.", "i": "42", "f": "3.14", "b": "True",
              "words": _json.dumps(["apple", "banana", "cherry"]),
              # (members in the schema's order: ChatAdapter's field note gives it with sorted keys)
              "m": _json.dumps(m, sort_keys=not xml)}
    if xml:
        reply = "\n".join(f"<{k}>\n{v}\n</{k}>" for k, v in values.items())
    else:
        reply = "\n\n".join(f"[[ ## {k} ## ]]\n{v}" for k, v in values.items()) + "\n\n[[ ## completed ## ]]"
    compiled = qwen_backend.compile("grammar", grammar)
    matcher = budget_matcher(qwen_backend, compiled, 400)
    bitmask = allocate_bitmask(1, qwen_backend.vocab_size)
    for t in tok.encode(reply, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        assert unpack_bitmask(bitmask, qwen_backend.vocab_size)[0, t], tok.decode([t])
        assert matcher.accept_token(t)
    assert matcher.is_finished()
    out = adapter.parse(sig, reply)
    assert out["words"] == ["apple", "banana", "cherry"] and out["m"].model_dump() == m


@pytest.mark.parametrize("adapter", [dspy.ChatAdapter(), dspy.XMLAdapter()], ids=["chat", "xml"])
def test_a_max_tokens_too_small_for_the_fields_is_an_error(backend, adapter):
    """A max_tokens that cannot hold the shortest reply is an InvalidRequest naming the budget it takes; at that
    budget the values have no room beyond their shortest spelling, and a reply still fits and parses."""
    import re as _re

    from prefixrt.constrained.budget import budget_matcher
    from prefixrt.constrained.testing import random_walk
    from prefixrt.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="too small") as error:
        _mixed_format(adapter, 100)
    least = int(_re.search(r"its shortest reply takes (\d+) tokens", str(error.value)).group(1))
    assert least > 100
    with pytest.raises(InvalidRequest):
        _mixed_format(adapter, least - 1)
    sig, grammar = _mixed_format(adapter, least)
    compiled = backend.compile("grammar", grammar)
    texts = backend.tokenizer.batch_decode([[i] for i in range(len(backend.tokenizer))])
    for seed in range(2):
        walk = random_walk(backend, compiled, texts, seed=seed, max_tokens=least, p_eos=0.0, p_closer=0.0,
                           matcher=budget_matcher(backend, compiled, least), prefer_open='\n"]},<;')
        assert walk.finished and len(walk.ids) <= least
        adapter.parse(sig, backend.tokenizer.decode(walk.ids))


def test_a_capped_xml_value_keeps_its_references_where_a_cut_cannot_split_them(backend):
    """llguidance ends a capped text value after its cap-th token wherever it is, `&am` included, which XML
    refuses: an entity reference stands only within the value's first cap - 1 bytes, while they are ASCII (a
    token holds at least one byte, so it is complete before the cut)."""
    import re as _re

    sig = dspy.Signature("question -> answer")
    grammar = output_format_constraint(dspy.XMLAdapter().format(sig, demos=[], inputs={"question": "q"}), 64)[
        "grammar"]
    cap = int(_re.search(r"v_answer_text\[max_tokens=(\d+)\]", grammar).group(1))

    def reply(text):
        return f"<answer>\n{text}\n</answer>"

    assert _accepts(backend, grammar, reply("AT&amp;T and more"))
    assert _accepts(backend, grammar, reply("x" * (cap - 6) + "&amp;"))  # ends at byte cap - 1
    assert not _accepts(backend, grammar, reply("x" * (cap - 5) + "&amp;"))
    assert not _accepts(backend, grammar, reply("é &amp;"))  # a byte count no longer bounds the tokens
    assert _accepts(backend, grammar, reply("é, AT and T"))
