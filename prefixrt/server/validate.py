"""Checks on a parsed request body before anything of it is tokenized, compiled or sent to the engine process.

- Text: a string with a lone surrogate (JSON allows `"\\ud800"`; it is not Unicode text and cannot be encoded)
  or a NUL character is a 400 naming the field (`prompt[1]`, `messages[0].content`, `stop[0]`, `regex`, ...),
  by text_checks.check_text (the engine front checks the same again for in-process callers).
- Nesting: a value nested deeper than MAX_NESTING objects/arrays (a 300-level JSON schema) is a 400 — it would
  otherwise overflow the recursion limit while compiled or pickled to the engine process.

Numbers, booleans and nulls inside arrays are skipped without a visit: a token-id prompt of 100k ids costs one
C-speed scan of its element types, not a Python step (and a path string) per id.
"""

from __future__ import annotations

from pydantic import BaseModel

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.text_checks import check_text

MAX_NESTING = 100  # objects/arrays; real JSON schemas and tool definitions stay far below
_SCALARS = frozenset({int, float, bool, type(None)})  # exact types: nothing in them to check


def check_body(body: BaseModel) -> None:
    """Raise InvalidRequest for the first bad string or over-deep value in body (a request model)."""
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
                key = field.alias or name
                stack.append((getattr(value, name), f"{path}.{key}" if path else key, depth))
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    check_text(k, path or "request")
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(value, (list, tuple)):
            if depth + 1 <= MAX_NESTING:  # (deeper, even a number is over the limit: visit each)
                if _SCALARS.issuperset(map(type, value)):  # all scalars (a token-id list): nothing to check
                    continue
                items = ((i, v) for i, v in enumerate(value) if type(v) not in _SCALARS)
            else:
                items = enumerate(value)
            for i, v in items:
                stack.append((v, f"{path}[{i}]", depth + 1))


def _top(path: str) -> str | None:
    """The request field a deep path starts at (`json_schema.properties.a...` -> `json_schema`)."""
    if not path:
        return None
    return path.split(".")[0].split("[")[0]
