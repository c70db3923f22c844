"""check_body (server/validate.py) against a plain walk that visits every value, numbers included.

The fast walk skips numbers, booleans and nulls inside arrays without a visit; it must raise exactly what the
plain walk raises (same message, same param) and pass exactly what it passes, at the nesting limit too.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.text_checks import check_text
from prefixrt.server.protocol import CompletionRequest, GenerateRequest
from prefixrt.server.validate import MAX_NESTING, _top, check_body


def reference_check_body(body: BaseModel) -> None:
    """The walk without the scalar skip: every element of every array is visited."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            check_text(value, path or "request")
            continue
        if depth > MAX_NESTING:
            raise InvalidRequest(f"{path or 'the request'} is nested more than {MAX_NESTING} levels deep",
                                 param=_top(path))
        if isinstance(value, BaseModel):
            for name, field in type(value).model_fields.items():
                stack.append((getattr(value, name), f"{path}.{field.alias or name}" if path else
                              (field.alias or name), depth))
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    check_text(k, path or "request")
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                stack.append((v, f"{path}[{i}]", depth + 1))


def nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def outcome(check, body: BaseModel):
    try:
        check(body)
    except InvalidRequest as e:
        return e.message, e.param
    return None


SAMPLING: list[dict] = [
    {},
    {"stop": ["ok", "a\x00b"]},
    {"stop_token_ids": [1, 2, 3]},
    {"json_schema": {"type": "object", "enum": [1, 2.5, None, True, "x\ud800"]}},
    # Around the limit (each body puts these one or two levels deeper: both sides of it are covered)
    {"json_schema": {"a": nested(MAX_NESTING - 3, 7)}},
    {"json_schema": {"a": nested(MAX_NESTING - 2, 7)}},
    {"json_schema": {"a": nested(MAX_NESTING - 1, 7)}},
    {"json_schema": {"a": nested(MAX_NESTING - 2, [])}},
    {"json_schema": {"a": nested(MAX_NESTING - 3, [1, "s", 2])}},
    {"json_schema": {"a": nested(MAX_NESTING - 1, [])}},
    {"json_schema": {"a": nested(MAX_NESTING, [])}},
    {"json_schema": {"a": nested(MAX_NESTING - 2, [1, "s", 2])}},
    {"json_schema": {"a": nested(MAX_NESTING - 1, [1, "s", 2])}},
    {"json_schema": {"a": nested(MAX_NESTING + 5, "deep")}},
    {"json_schema": {"a": [1, {"b": [2, 3, "\x00"]}, 4]}},
    {"json_schema": {"a": [1, 2, 3, None, False, 1.5]}},
]
COMPLETION_PROMPTS: list[Any] = [list(range(5000)), "text", ["x", "y\x00"], [[1, 2], [3, 4]], [[1, 2], [3]] * 50]
GENERATE_PROMPTS: list[Any] = [list(range(5000)), "t\x00", [{"role": "user", "content": "a", "extra": [1, "\ud800"]}]]


@pytest.mark.parametrize("values", SAMPLING, ids=range(len(SAMPLING)))
def test_check_body_matches_the_plain_walk(values):
    bodies = [GenerateRequest.model_validate({"prompt": p, "sampling_params": values}) for p in GENERATE_PROMPTS]
    bodies += [CompletionRequest.model_validate({"prompt": p, "json_schema": values or None})
               for p in COMPLETION_PROMPTS]
    for body in bodies:
        assert outcome(check_body, body) == outcome(reference_check_body, body)


def test_check_body_still_names_bad_strings_in_arrays():
    body = CompletionRequest.model_validate({"prompt": ["fine", "bad\x00"], "stop": ["a", "b\ud800"]})
    with pytest.raises(InvalidRequest) as e:
        check_body(body)
    assert e.value.param in ("prompt[1]", "stop[1]")
    assert (e.value.message, e.value.param) == outcome(reference_check_body, body)
    check_body(CompletionRequest.model_validate({"prompt": list(range(100_000))}))  # token ids: nothing to check


def test_a_number_past_the_nesting_limit_is_refused():
    ok = GenerateRequest.model_validate({"prompt": [1], "sampling_params": {"x": nested(MAX_NESTING - 1, 1)}})
    check_body(ok)
    body = GenerateRequest.model_validate({"prompt": [1], "sampling_params": {"x": nested(MAX_NESTING, 1)}})
    with pytest.raises(InvalidRequest, match=f"nested more than {MAX_NESTING} levels deep"):
        check_body(body)
