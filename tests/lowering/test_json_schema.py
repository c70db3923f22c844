"""to_json_schema (the one pydantic-class -> schema conversion) and json_object as a constraint kind of its own."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.json_schema import to_json_schema
from prefixrt.params import SamplingParams


class Point(BaseModel):
    x: int
    y: float = 0.5


def test_pydantic_class_becomes_its_model_json_schema():
    assert to_json_schema(Point) == Point.model_json_schema()
    assert to_json_schema(Point)["required"] == ["x"]


def test_dict_bool_and_json_text():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert to_json_schema(schema) is schema
    assert to_json_schema(json.dumps(schema)) == schema
    assert to_json_schema(json.dumps(schema).encode()) == schema
    assert to_json_schema(True) is True


@pytest.mark.parametrize("bad", [int, "not json {", 3, ["a"], Point(x=1)])
def test_anything_else_is_an_invalid_request_naming_json_schema(bad):
    with pytest.raises(InvalidRequest) as e:
        to_json_schema(bad)
    assert e.value.param == "json_schema"


def test_json_object_is_its_own_constraint_kind():
    p = SamplingParams(json_object=True)
    assert p.constraint_kind == "json_object" and p.json_schema is None
    assert SamplingParams().constraint_kind is None
    assert SamplingParams(json_object=False, regex="a+").constraint_kind == "regex"


def test_json_object_excludes_other_constraints_and_must_be_a_bool():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(json_object=True, json_schema={"type": "object"})
    assert "json_object" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(json_object="yes")
    assert e.value.param == "json_object"


def test_the_earlier_json_schema_spelling_becomes_json_object():
    p = SamplingParams(json_schema="json_object")
    assert (p.json_schema, p.json_object, p.constraint_kind) == (None, True, "json_object")


def test_engine_decodes_a_json_object(make_engine):
    pytest.importorskip("llguidance")
    eng = make_engine()
    c = eng.generate("Answer: ", {"json_object": True, "max_new_tokens": 48, "temperature": 0})
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.text), dict)
