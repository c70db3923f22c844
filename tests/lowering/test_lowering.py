"""The translation layer (prefixrt/lowering/) without a model: schemas, tool plans and
their grammars checked against the real llguidance matcher on the tiny tokenizer, message lowering."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from typing_extensions import TypedDict

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.constraints import response_format_constraint
from prefixrt.lowering.json_schema import embed, strict_schema, to_json_schema, with_defs
from prefixrt.lowering.messages import engine_messages, with_tools_prompt
from prefixrt.lowering.options import sampling_options
from prefixrt.lowering.tools import TAGGED, plan_tools, template_call_syntax, tools_from_openai, tools_prompt
from tests.server.conftest import needs_constrained_decoding


class Address(pydantic.BaseModel):
    city: str
    zip: str


class Person(pydantic.BaseModel):
    name: str
    home: Address
    past: list[Address] = []


class Movie(TypedDict):
    title: str
    year: int


def test_strict_rule_closes_listed_objects_only():
    s = strict_schema(to_json_schema(Person))
    assert s["additionalProperties"] is False and s["$defs"]["Address"]["additionalProperties"] is False
    assert strict_schema({"type": "object"}) == {"type": "object"}  # no properties: open (dict[str, Any])
    assert strict_schema({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    loose = strict_schema(to_json_schema(Person), strict=False)  # "strict": false keeps JSON Schema's meaning
    assert loose["additionalProperties"] is True
    assert strict_schema(loose)["additionalProperties"] is True  # and nothing downstream closes it again
    assert to_json_schema(Movie)["required"] == ["title", "year"]
    with pytest.raises(InvalidRequest):
        to_json_schema(object())


def test_strict_rule_requires_every_listed_property():
    """OpenAI strict mode: every listed property is required (a default is written out, not skipped), unless
    requiring it leaves no finite instance or the property admits nothing."""
    s = strict_schema(to_json_schema(Person))
    assert s["required"] == ["name", "home", "past"]  # `past` has a default
    assert strict_schema(to_json_schema(Person), strict=False)["required"] == ["name", "home"]
    iterable = {"type": "object", "required": [], "properties": {"tasks": {"type": "array", "items": {"$ref": "#/$defs/C"}}},
                "$defs": {"C": {"type": "object", "properties": {"n": {"type": "string"}}}}}
    out = strict_schema(iterable)
    assert out["required"] == ["tasks"] and out["$defs"]["C"]["required"] == ["n"]
    jsonschema.validate({"tasks": []}, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, out)
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}, "gone": False}}
    assert strict_schema(node)["required"] == ["v"]  # `next` required would have no finite instance
    nullable = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    assert strict_schema(nullable)["required"] == ["v", "next"]  # null ends the list


def test_embedded_schema_refs_resolve():
    inner = to_json_schema(Person)
    ref, defs = embed(inner, "save.arguments")
    outer = with_defs({"type": "object", "properties": {"arguments": ref}, "required": ["arguments"]}, defs)
    doc = {"arguments": {"name": "A", "home": {"city": "P", "zip": "1"}, "past": [{"city": "Q", "zip": "2"}]}}
    jsonschema.validate(doc, outer)  # resolves #/$defs/save.arguments/$defs/Address
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"arguments": {"name": "A", "home": {"city": 1, "zip": "1"}}}, outer)
    ref, defs = embed({"type": "object", "properties": {"next": {"$ref": "#"}}}, "node")  # recursion
    assert defs["node"]["properties"]["next"] == {"$ref": "#/$defs/node"}


TOOLS = tools_from_openai([
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "save", "parameters": Person.model_json_schema()}},
])


def _matcher(tiny_tokenizer, constraint):
    from prefixrt.constrained.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tiny_tokenizer)
    (kind, spec), = constraint.items()
    return backend, backend.compile(kind, spec)


def _accepts(backend, compiled, text) -> bool:
    m = backend.matcher(compiled)
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return m.accept_tokens(ids) == len(ids) and m.can_stop()


CALL_ADD = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
CALL_SAVE = '{"name": "save", "arguments": {"name": "A", "home": {"city": "P", "zip": "1"}, "past": []}}'


@needs_constrained_decoding()
def test_auto_grammar_is_text_or_calls(tiny_tokenizer):
    plan = plan_tools(TOOLS, "auto")
    assert "grammar" in plan.constraint and plan.parallel
    backend, g = _matcher(tiny_tokenizer, plan.constraint)
    assert _accepts(backend, g, "The answer is 5.")
    assert _accepts(backend, g, "")
    assert _accepts(backend, g, CALL_ADD) and _accepts(backend, g, CALL_ADD + "\n" + CALL_SAVE)
    assert not _accepts(backend, g, '{"name": "add", "arguments": {"a": 2, "b": 3, "c": 1}}')  # closed
    assert not _accepts(backend, g, '{"name": "mul", "arguments": {}}')  # undeclared tool
    assert not _accepts(backend, g, '{"a": 2, "b": 3}')  # starts like a call, so it must be one
    assert [c.name for c in plan.parse(CALL_ADD + "\n" + CALL_SAVE)] == ["add", "save"]
    assert plan.parse("The answer is 5.") is None


@needs_constrained_decoding()
@pytest.mark.parametrize("choice,parallel,kind", [("required", False, "json_schema"), ("required", None, "grammar"),
                                                  ({"type": "function", "function": {"name": "save"}}, None,
                                                   "json_schema")])
def test_forced_plans(tiny_tokenizer, choice, parallel, kind):
    plan = plan_tools(TOOLS, choice, parallel)
    assert kind in plan.constraint
    backend, g = _matcher(tiny_tokenizer, plan.constraint)
    assert _accepts(backend, g, CALL_SAVE)  # nested $defs resolve inside the call schema
    assert not _accepts(backend, g, "plain text")
    assert _accepts(backend, g, CALL_ADD) == (choice == "required")
    assert _accepts(backend, g, CALL_SAVE + "\n" + CALL_SAVE) == (parallel is None and choice == "required")


@needs_constrained_decoding()
def test_tagged_call_syntax(tiny_tokenizer):
    plan = plan_tools(TOOLS, "auto", None, TAGGED)
    backend, g = _matcher(tiny_tokenizer, plan.constraint)
    assert _accepts(backend, g, "<tool_call>\n" + CALL_ADD + "\n</tool_call>")
    assert not _accepts(backend, g, CALL_ADD)
    assert _accepts(backend, g, "Hello")
    assert plan.parse("<tool_call>\n" + CALL_ADD + "\n</tool_call>")[0].arguments == {"a": 2, "b": 3}
    assert not plan.may_be_call("Hi") and plan.may_be_call("<tool") and plan.may_be_call("<tool_call>\n{")


def test_tool_choice_validation():
    assert plan_tools(TOOLS, "none") is None and plan_tools([], None) is None
    with pytest.raises(InvalidRequest):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequest):
        plan_tools([], "required")
    with pytest.raises(InvalidRequest):
        tools_from_openai([{"type": "function", "function": {"name": "a"}}] * 2)


def test_response_formats():
    chat = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    assert response_format_constraint(chat)["json_schema"]["additionalProperties"] is False
    # "strict": false (LangChain sends it for dict and TypedDict schemas) still decodes strictly, as vLLM does.
    flat = {"type": "json_schema", "name": "p", "schema": Person.model_json_schema(), "strict": False}
    assert response_format_constraint(flat)["json_schema"]["additionalProperties"] is False
    explicit = {"type": "json_schema", "schema": {"type": "object", "properties": {}, "additionalProperties": True}}
    assert response_format_constraint(explicit)["json_schema"]["additionalProperties"] is True
    assert response_format_constraint({"type": "json_object"}) == {"json_object": True}
    assert response_format_constraint({"type": "text"}) == {}
    with pytest.raises(InvalidRequest):
        response_format_constraint({"type": "json_schema", "json_schema": {"name": "x"}})


def test_options_and_logit_bias():
    assert sampling_options({"max_tokens": 5, "stop": "x", "logit_bias": {"7": -100}}, what="t") == {
        "max_new_tokens": 5, "stop": ["x"], "logit_bias": {7: -100.0}}
    for bad in ({"x": 1}, {"1": 101}, {"1": "a"}):
        with pytest.raises(InvalidRequest):
            sampling_options({"logit_bias": bad}, what="t")
    with pytest.raises(InvalidRequest):
        sampling_options({"frobnicate": 1}, what="t")


def test_messages_lowering():
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "1 2"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert engine_messages(msgs) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": '{"name": "add", "arguments": {"a": 1}}'},
        {"role": "user", "content": "Result of tool add: 3"},
    ]
    templ = engine_messages(msgs, template_tools=True)
    assert templ[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    assert templ[3] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}


def test_template_tool_format_detection(tiny_tokenizer):
    assert template_call_syntax(tiny_tokenizer) is None  # no tool format: fallback prompt
    class Tok:
        chat_template = "{% if tools %}<tools>{{ tools }}</tools> ... <tool_call>{% endif %}"
    assert template_call_syntax(Tok()) is TAGGED
    plan = plan_tools(TOOLS, "auto")
    prompt = tools_prompt(plan)
    assert "add(a: integer, b: integer)" in prompt and "plain text" in prompt
    assert json.dumps(TOOLS[0].parameters) not in prompt  # signatures, not raw schemas
    # under "auto" the prompt opens with a call skeleton per tool, each a call the plan parses
    skeletons = prompt.split("\n\n")[0].splitlines()
    assert [c.name for line in skeletons for c in plan.parse(line)] == [t.name for t in TOOLS]
    # ... and goes before the caller's own system text
    messages = with_tools_prompt([{"role": "system", "content": "Be brief."}], plan)
    assert messages[0]["content"].startswith(skeletons[0]) and messages[0]["content"].endswith("Be brief.")
    forced = plan_tools(TOOLS, "required")
    assert with_tools_prompt([{"role": "system", "content": "Be brief."}], forced)[0]["content"] \
        .startswith("Be brief.")


@needs_constrained_decoding()
def test_auto_with_a_structured_answer(tiny_tokenizer):
    """tools + response_format (openai-agents' output_type): a call, or the answer under its schema."""
    answer = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"],
              "additionalProperties": False}
    plan = plan_tools(TOOLS, "auto", False, text_schema=answer)
    backend, g = _matcher(tiny_tokenizer, plan.constraint)
    assert _accepts(backend, g, '{"total": 5}') and _accepts(backend, g, CALL_ADD)
    assert not _accepts(backend, g, "five") and not _accepts(backend, g, '{"total": 5, "x": 1}')
    assert plan.parse('{"total": 5}') is None and plan.parse(CALL_ADD)[0].name == "add"
