"""Backend-independent handling of constraint specs: validation, canonical text, JSON-schema sanity checks.

Everything here is pure and cheap; the compiler calls `canonical_spec` in the submitting thread to build
its cache key, and both backends call the validators before handing the spec to their library.
"""

from __future__ import annotations

import json
from typing import Any

from prefixrt.constrained.base import CONSTRAINT_KINDS
from prefixrt.errors import InvalidRequest
from prefixrt.lowering.json_schema import strict_schema, to_json_schema, unproductive_refs

# The OpenAI `json_object` response format: any JSON object.
JSON_OBJECT_SCHEMA: dict = {"type": "object"}

# Properties and items of generated JSON are separated like `json.dumps` does by default: one line,
# no optional whitespace. Compact output makes forced runs long and keeps a model from padding the
# output with endless whitespace (a known failure of any-whitespace JSON grammars).
JSON_ITEM_SEPARATOR = ", "
JSON_KEY_SEPARATOR = ": "


def _param_for(kind: str) -> str:
    return "json_schema" if kind == "json_object" else kind


def check_kind(kind: str) -> None:
    if kind not in CONSTRAINT_KINDS:
        raise InvalidRequest(f"unknown constraint kind {kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")


def load_json_schema(spec: Any) -> dict | bool:
    """The JSON schema the engine enforces for `spec` (what `to_json_schema` accepts), with the strict-mode
    rule applied: objects listing `properties` and silent on `additionalProperties` are closed
    (prefixrt/lowering/json_schema.py). The compiler's cache key and both backends use it."""
    return strict_schema(to_json_schema(spec))


def check_choices(spec: Any) -> list[str]:
    if not isinstance(spec, (list, tuple)) or len(spec) == 0:
        raise InvalidRequest("choices must be a non-empty list of strings", param="choices")
    if not all(isinstance(c, str) and c for c in spec):
        raise InvalidRequest("every choice must be a non-empty string", param="choices")
    return list(spec)


def check_text(kind: str, spec: Any) -> str:
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequest(f"{kind} must be a non-empty string", param=kind)
    return spec


def canonical_spec(kind: str, spec: Any) -> str:
    """The text two equal constraints share (the compiler's cache key). Raises InvalidRequest early on
    malformed input (not JSON, wrong type, empty choices); deeper errors come from the backend.

    JSON schemas are re-serialized without reordering keys: property order decides output order.
    """
    check_kind(kind)
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        return json.dumps(load_json_schema(spec), ensure_ascii=False, separators=(",", ":"))
    if kind == "choices":
        return json.dumps(check_choices(spec), ensure_ascii=False)
    return check_text(kind, spec)


def check_json_schema_refs(schema: Any) -> None:
    """Reject local `$ref`s that point nowhere, and recursion with no base case.

    `{"$ref": "#"}`, `{"$defs": {"a": {"$ref": "#/$defs/a"}}, ...}` and an object whose required property
    is (transitively) itself describe no finite JSON value: a matcher for them could only generate until
    max_new_tokens, never a valid document. Legitimate recursion (a tree whose children list may be empty,
    a linked list whose `next` is optional) passes. Non-local refs are left to the backend.
    """
    try:
        stuck = unproductive_refs(schema)
    except LookupError as e:
        raise InvalidRequest(f"json_schema $ref {e.args[0]!r} does not resolve to anything", param="json_schema") from None
    if stuck is not None:
        raise InvalidRequest(
            "json_schema has no finite instance: "
            + (f"$ref {', '.join(stuck)} refers to itself with no base case" if stuck else "it is unsatisfiable"),
            param="json_schema",
        )


def lark_string_literal(text: str) -> str:
    """`text` as a double-quoted literal in Lark/GBNF grammars (JSON escaping, which both dialects read)."""
    return json.dumps(text, ensure_ascii=False)
