"""What decoding is held to: response formats -> a constraint, and the one-constraint rule.

- `response_format_constraint`: chat's `response_format`, the Responses API's `text.format` and lm15's form ->
  `{"json_schema": ...}` (or `{"json_object": True}`) under the strict-mode rule of lowering/json_schema.py,
  whatever the request's `strict` says;
- `schema_types`: a schema's type names as people write them (`int`, `str`) -> JSON Schema's, with warnings;
- `merge_constraint`: a constraint added to a request's SamplingParams fields, two constraints refused.
"""

from __future__ import annotations

from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.json_schema import normalized_types, strict_schema, to_json_schema
from prefixrt.params import CONSTRAINT_FIELDS


def schema_types(schema: Any, param: str, warnings: list[str] | None) -> Any:
    """`schema` with its type names normalised (Python's `int`, `str`, ... -> JSON Schema's), the renames
    appended to `warnings`; InvalidRequest naming the path of a type name that is neither."""
    out, renamed = normalized_types(schema, param)
    if warnings is not None:
        warnings.extend(renamed)
    return out


def merge_constraint(params: dict, constraint: dict, param: str) -> None:
    """Add `constraint` ({kind: spec}) to params in place; two constraints on one request are refused."""
    if not constraint:
        return
    if any(params.get(k) not in (None, False) for k in CONSTRAINT_FIELDS):
        raise InvalidRequest(f"{param} cannot be combined with another constraint (regex, json_schema, grammar, "
                             "choices, response_format, tool_choice)", param=param)
    params.update(constraint)


def response_format_constraint(response_format: dict | None, param: str = "response_format",
                               warnings: list[str] | None = None) -> dict[str, Any]:
    """A response format -> {"json_schema": ...} for constrained decoding ({} for plain text).

    Accepts chat's {"type": "json_schema", "json_schema": {"schema", "strict"}}, the Responses API's
    {"type": "json_schema", "schema", "strict"} (also lm15's form), and {"type": "json_object"} (any JSON
    object). The strict-mode rule applies whatever `"strict"` says; explicit `additionalProperties` is kept."""
    if not response_format:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        holder = inner if isinstance(inner, dict) else response_format
        schema = holder.get("schema")
        if schema is None:
            raise InvalidRequest(f"{param} json_schema needs a schema", param=param)
        # Decoding is strict whatever "strict" says (as vLLM and xgrammar do): clients send "strict": false for
        # schemas they cannot make strict-valid (LangChain's TypedDicts), and an open object lets a small model
        # invent keys until max_tokens.
        return {"json_schema": strict_schema(schema_types(to_json_schema(schema), param, warnings))}
    raise InvalidRequest(f"unsupported {param} type {kind!r}", param=param)
