"""Backend-independent handling of constraint specs: validation, canonical text, JSON-schema sanity checks.

Everything here is pure and cheap; the compiler calls `canonical_spec` in the submitting thread to build
its cache key, and both backends call the validators before handing the spec to their library.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from prefixrt.constrained.base import CONSTRAINT_KINDS
from prefixrt.errors import InvalidRequest
from prefixrt.json_schema import strict_schema, to_json_schema

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
    (prefixrt/json_schema.py). The compiler's cache key and both backends use it."""
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


# ---------------------------------------------------------------------------------------------- $ref checks
def _resolve_pointer(root: Any, ref: str) -> Any:
    """The subschema a local `#/...` JSON pointer names; KeyError if it does not exist."""
    node = root
    for raw in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node[part]
        else:
            raise KeyError(part)
    return node


def _local_refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out.add(ref)
        for value in node.values():
            _local_refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _local_refs(value, out)


def _has_finite_instance(schema: Any, productive: dict[str, bool]) -> bool:
    """Whether some finite JSON value satisfies `schema`, assuming `productive` for $ref targets.

    Deliberately optimistic: anything not understood counts as satisfiable, so this can only reject
    schemas whose every instance must contain itself (a required self-reference with no base case).
    """
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref in productive and not productive[ref]:
        return False
    if not all(_has_finite_instance(s, productive) for s in schema.get("allOf", []) or []):
        return False
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options and not any(_has_finite_instance(s, productive) for s in options):
            return False
    if "const" in schema or "enum" in schema:
        return True
    types = schema.get("type")
    if types is None:
        return True  # an untyped schema also admits scalars
    types = [types] if isinstance(types, str) else list(types)
    for t in types:
        if t == "object":
            props = schema.get("properties") or {}
            required = schema.get("required") or []
            if all(_has_finite_instance(props[name], productive) for name in required if name in props):
                return True
        elif t == "array":
            min_items = schema.get("minItems", 0) or 0
            prefix = schema.get("prefixItems") or []
            needed = prefix[:min_items]
            items = schema.get("items", True)
            ok = all(_has_finite_instance(s, productive) for s in needed)
            if min_items > len(prefix) and not isinstance(items, list):
                ok = ok and _has_finite_instance(items, productive)
            if ok:
                return True
        else:
            return True
    return False


def check_json_schema_refs(schema: Any) -> None:
    """Reject local `$ref`s that point nowhere, and recursion with no base case.

    `{"$ref": "#"}`, `{"$defs": {"a": {"$ref": "#/$defs/a"}}, ...}` and an object whose required property
    is (transitively) itself describe no finite JSON value: a matcher for them could only generate until
    max_new_tokens, never a valid document. Legitimate recursion (a tree whose children list may be empty,
    a linked list whose `next` is optional) passes. Non-local refs are left to the backend.
    """
    refs: set[str] = set()
    _local_refs(schema, refs)
    if not refs and not isinstance(schema, bool):
        return
    targets: dict[str, Any] = {}
    for ref in sorted(refs):
        try:
            targets[ref] = _resolve_pointer(schema, ref)
        except (KeyError, IndexError, ValueError):
            raise InvalidRequest(f"json_schema $ref {ref!r} does not resolve to anything", param="json_schema") from None
    # Least fixpoint: a ref target is productive once it has a finite instance given the ones known so far.
    productive = dict.fromkeys(targets, False)
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not productive[ref] and _has_finite_instance(target, productive):
                productive[ref] = changed = True
    if not _has_finite_instance(schema, productive):
        stuck = sorted(r for r, ok in productive.items() if not ok)
        raise InvalidRequest(
            "json_schema has no finite instance: "
            + (f"$ref {', '.join(stuck)} refers to itself with no base case" if stuck else "it is unsatisfiable"),
            param="json_schema",
        )


def lark_string_literal(text: str) -> str:
    """`text` as a double-quoted literal in Lark/GBNF grammars (JSON escaping, which both dialects read)."""
    return json.dumps(text, ensure_ascii=False)
