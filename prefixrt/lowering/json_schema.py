"""JSON-schema values as users give them -> the schema itself: the one place a pydantic class becomes a schema.

`SamplingParams.json_schema` (and the frontend's `gen(json_schema=...)`) accept a dict (or a bool schema),
JSON text, or a pydantic BaseModel subclass. Whatever must hand a plain schema on calls `to_json_schema`:
the constraint compiler (its cache key and both backends), the engine-process pipe (classes are not sent
across it), RemoteEngine's JSON body and the frontend's OpenAI backend (response_format); also TypedDicts and other
types pydantic's TypeAdapter describes (`list[Model]`).

The strict-mode rule and embedding live here too:
- `strict_schema(schema)`: the rule of OpenAI's strict structured outputs and xgrammar's strict mode: an object
  schema that lists `properties` and says nothing about `additionalProperties` is closed. JSON Schema leaves
  such objects open, and a small model under constrained decoding fills an open object with invented keys
  until `max_new_tokens`. The engine applies it to every json_schema constraint (constrained/spec.py
  `load_json_schema`); the server and adapters whatever a request's `"strict"` says, as vLLM and xgrammar do.
  `strict=False` keeps JSON Schema's meaning (objects marked open explicitly) for callers that want it.
  Objects without `properties` (`{"type": "object"}`, `dict[str, Any]`) are open either way.
- `normalized_types(schema)`: `"type"` names as people write them (Python's `int`, `str`, `float`, `bool`,
  `dict`, `list`, `None`; any capitalisation) -> JSON Schema's, with a warning per rename; a name that is
  neither is an InvalidRequest naming the node's path (`/properties/age/type`).
- `embed(schema, name)`: a schema that will sit inside a larger one (a tool's parameters under
  `properties.arguments`) is moved whole to `#/$defs/<name>` with its local `$ref`s (`#`, `#/$defs/X`,
  `#/properties/...`) rewritten to point there, so they resolve wherever it is embedded.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from prefixrt.errors import InvalidRequest


def to_json_schema(spec: Any) -> dict | bool:
    """The schema `spec` stands for: a dict or bool as is, JSON text parsed, a pydantic model class's
    `model_json_schema()`. Raises InvalidRequest (param "json_schema") for anything else, for text that is
    not JSON, and for a class pydantic cannot describe. Never mutates `spec`."""
    if isinstance(spec, type) and not _is_typed_dict(spec):
        schema_fn = getattr(spec, "model_json_schema", None)
        if schema_fn is None:
            raise InvalidRequest(
                f"json_schema class {spec.__name__} is not a pydantic BaseModel subclass", param="json_schema"
            )
        try:
            return schema_fn()
        except Exception as e:  # pydantic raises several types for unschematizable fields
            raise InvalidRequest(f"cannot build a JSON schema from {spec.__name__}: {e}", param="json_schema") from e
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", param="json_schema") from e
    if isinstance(spec, (bool, dict)):
        return spec
    if getattr(spec, "__origin__", None) is not None or _is_typed_dict(spec):  # TypedDict, list[Model], ...
        try:
            from pydantic import TypeAdapter

            return TypeAdapter(spec).json_schema()
        except ImportError:
            pass
        except Exception as e:
            raise InvalidRequest(f"cannot build a JSON schema from {spec!r}: {e}", param="json_schema") from e
    raise InvalidRequest(
        f"json_schema must be a JSON object (dict), JSON text, a pydantic model class or a TypedDict, "
        f"not {type(spec).__name__}",
        param="json_schema",
    )


def _is_typed_dict(spec: Any) -> bool:
    return isinstance(spec, type) and issubclass(spec, dict) and hasattr(spec, "__annotations__") \
        and hasattr(spec, "__total__")


# ---------------------------------------------------------------------------------------------- strict rule, embedding

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def schema_of(spec: Any, param: str = "json_schema") -> dict | bool:
    """The JSON schema `spec` describes: a dict or bool (as is), JSON text, a pydantic BaseModel class, or any
    type pydantic's TypeAdapter can describe (TypedDict, dataclass, `list[Model]`). InvalidRequest otherwise."""
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"{param} is not valid JSON: {e}", param=param) from e
    if isinstance(spec, (bool, dict)):
        return spec
    model_schema = getattr(spec, "model_json_schema", None)
    if isinstance(spec, type) and model_schema is not None:
        try:
            return model_schema()
        except Exception as e:  # pydantic raises several types for unschematizable fields
            raise InvalidRequest(f"cannot build a JSON schema from {spec.__name__}: {e}", param=param) from e
    if isinstance(spec, type) or getattr(spec, "__origin__", None) is not None:
        try:
            from pydantic import TypeAdapter

            return TypeAdapter(spec).json_schema()
        except ImportError:
            pass
        except Exception as e:
            raise InvalidRequest(f"cannot build a JSON schema from {spec!r}: {e}", param=param) from e
    raise InvalidRequest(f"{param} must be a JSON schema (dict or JSON text), a pydantic model class or a type "
                         f"pydantic can describe, not {type(spec).__name__}", param=param)


def _map_subschemas(schema: dict, fn) -> dict:
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])
    if isinstance(out.get("items"), list):  # draft-4 tuple form
        out["items"] = [fn(s) for s in out["items"]]
    return out


JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# Type names that are not JSON Schema's but whose meaning is plain (SGLang serves Python's names).
TYPE_ALIASES = {"int": "integer", "long": "integer", "str": "string", "text": "string", "float": "number",
                "double": "number", "decimal": "number", "bool": "boolean", "dict": "object", "map": "object",
                "list": "array", "tuple": "array", "none": "null", "nonetype": "null", "nil": "null"}


def normalized_types(schema: Any, param: str = "json_schema") -> tuple[Any, list[str]]:
    """(a copy of `schema` with every `"type"` a JSON Schema type name, the warnings for names it renamed).

    A name in TYPE_ALIASES, or a JSON Schema name in other capitalisation (`"Integer"`), becomes the JSON
    Schema name; anything else raises InvalidRequest with the JSON pointer of the bad node. `schema` is not
    mutated; without a rename the result is `schema` itself."""
    warnings: list[str] = []
    out = _normalized(schema, "", param, warnings)
    return (out if warnings else schema), warnings


def _type_name(name: Any, path: str, param: str, warnings: list[str]) -> str:
    if isinstance(name, str):
        if name in JSON_TYPES:
            return name
        key = name.strip().lower()
        json_name = key if key in JSON_TYPES else TYPE_ALIASES.get(key)
        if json_name is not None:
            warnings.append(f"{param}: type {name!r} at {path or '/'} read as {json_name!r}")
            return json_name
    raise InvalidRequest(f"{param}: unknown type {name!r} at {path or '/'} (JSON Schema types: "
                         f"{', '.join(JSON_TYPES)})", param=param)


def _normalized(schema: Any, path: str, param: str, warnings: list[str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "type" in out:
        t = out["type"]
        where = f"{path}/type"
        out["type"] = ([_type_name(x, f"{where}/{i}", param, warnings) for i, x in enumerate(t)]
                       if isinstance(t, list) else _type_name(t, where, param, warnings))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_normalized(s, f"{path}/{key}/{i}", param, warnings) for i, s in enumerate(out[key])]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _normalized(s, f"{path}/{key}/{_pointer(name)}", param, warnings)
                        for name, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _normalized(out[key], f"{path}/{key}", param, warnings)
    if isinstance(out.get("items"), list):  # draft-4 tuple form
        out["items"] = [_normalized(s, f"{path}/items/{i}", param, warnings) for i, s in enumerate(out["items"])]
    return out


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _is_object(schema: dict) -> bool:
    t = schema.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t)


# RFC 8259 section 6: integers in [-(2**53 - 1), 2**53 - 1] are the ones JSON implementations agree on.
SAFE_INTEGER = 2**53 - 1
_BOUND_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "const"})


def _is_integer(schema: dict) -> bool:
    t = schema.get("type")
    return t == "integer" or (isinstance(t, list) and "integer" in t)


def strict_schema(schema: Any, strict: bool | None = True) -> Any:
    """A copy of `schema` with the strict-mode rule applied to every object that lists `properties` and does
    not say whether others are allowed: closed (`additionalProperties: false`) unless `strict` is False, then
    marked open (`additionalProperties: true`). Objects that say, and objects without `properties`, are kept.

    Unless `strict` is False, as in OpenAI's strict structured outputs:
    - every listed property is required (a property with a default, or `Optional[...] = None`, is written out,
      as its default or null): left optional, a small model closes `{}` at once (instructor's `Iterable[...]`
      came back empty). A constrained reply is then still an instance of the schema as given. Properties that
      admit nothing (`false`, `{"not": {}}`) stay optional, and so does a property whose requirement would leave
      the schema with no finite instance (a linked list's `next: Node`): properties that contain no `$ref`
      are then required, the others kept as given;
    - an integer with no bound, enum or const gets RFC 8259's interoperable range (|n| <= 2**53 - 1): without
      it a model that keeps choosing digits never ends the number (a small model writes `"a": 1000000000...`
      until max_tokens); any integer a JSON parser keeps exactly stays allowed."""
    if strict is False:
        return _strict(schema, False, "none")
    for promote in ("all", "plain"):
        out = _strict(schema, True, promote)
        try:
            if unproductive_refs(out) is None:
                return out
        except LookupError:  # a $ref that resolves nowhere: the constraint compiler reports it
            return out
    return _strict(schema, True, "none")


def _promoted(name: str, sub: Any, promote: str) -> bool:
    if sub is False or (isinstance(sub, dict) and sub.get("not") in ({}, True)):
        return False
    if promote == "plain":
        refs: set[str] = set()
        _local_refs(sub, refs)
        return not refs
    return promote == "all"


def _strict(schema: Any, strict: bool, promote: str) -> Any:
    if isinstance(schema, list):
        return [_strict(s, strict, promote) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda s: _strict(s, strict, promote))
    if strict and _is_integer(out) and not _BOUND_KEYS.intersection(out):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    props = out.get("properties")
    if _is_object(out) and isinstance(props, dict):
        if ("additionalProperties" not in out and "patternProperties" not in out
                and "unevaluatedProperties" not in out):
            out["additionalProperties"] = not strict
        required = list(out.get("required") or [])
        extra = [k for k, sub in props.items() if k not in required and _promoted(k, sub, promote)]
        if extra:
            out["required"] = [k for k in props if k in required or k in extra] + \
                [k for k in required if k not in props]
    return out


# ---------------------------------------------------------------------------------------------- finite instances
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


def unproductive_refs(schema: Any) -> list[str] | None:
    """None when some finite JSON value satisfies `schema`; else the local `$ref`s that refer to themselves with
    no base case (sorted; [] when the schema is unsatisfiable without recursion). Raises LookupError(ref) for a
    local `$ref` that resolves to nothing. Deliberately optimistic (anything not understood counts as
    satisfiable), so it only flags schemas whose every instance must contain itself."""
    refs: set[str] = set()
    _local_refs(schema, refs)
    targets: dict[str, Any] = {}
    for ref in sorted(refs):
        try:
            targets[ref] = _resolve_pointer(schema, ref)
        except (KeyError, IndexError, ValueError):
            raise LookupError(ref) from None
    # Least fixpoint: a ref target is productive once it has a finite instance given the ones known so far.
    productive = dict.fromkeys(targets, False)
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not productive[ref] and _has_finite_instance(target, productive):
                productive[ref] = changed = True
    if _has_finite_instance(schema, productive):
        return None
    return sorted(r for r, ok in productive.items() if not ok)


def _rewrite_refs(node: Any, base: str) -> Any:
    if isinstance(node, list):
        return [_rewrite_refs(s, base) for s in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_rewrite_refs(v, base) if k not in ("const", "enum", "default", "examples") else v)
           for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        if ref == "#" or ref.startswith("#/"):
            out["$ref"] = base + ref[1:]
        elif not ref.startswith("#"):
            raise InvalidRequest(f"only local $refs are supported, not {ref!r}", param="json_schema")
    return out


def embed(schema: Any, name: str) -> tuple[dict, dict]:
    """(the reference to put where `schema` is embedded, the `$defs` entries the outer schema must carry).

    The schema is moved whole to `#/$defs/<name>` and every local `$ref` in it is rewritten relative to that
    place, so `#/$defs/X` (pydantic's nested models), `#/definitions/X` and `#` (recursion) keep resolving.
    `name` must be unique among the schemas embedded in one outer schema."""
    if not isinstance(schema, dict):
        return {} if schema is True else {"not": {}}, {}
    key = name.replace("~", "~0").replace("/", "~1")
    return {"$ref": f"#/$defs/{key}"}, {name: _rewrite_refs(schema, f"#/$defs/{key}")}


def with_defs(schema: dict, defs: dict) -> dict:
    """`schema` carrying `defs` at its root (beside any it has)."""
    if not defs:
        return schema
    merged = dict(schema.get("$defs") or {})
    for k, v in defs.items():
        if k in merged and merged[k] != v:
            raise InvalidRequest(f"two embedded schemas are both named {k!r}", param="json_schema")
        merged[k] = v
    return {**schema, "$defs": merged}
