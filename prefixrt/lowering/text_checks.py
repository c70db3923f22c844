"""Checks on user text and JSON before it reaches a tokenizer, a grammar compiler or a process boundary.

Every str a request carries (prompt, chat message contents, stop strings, regex, grammar, schema) must be
encodable as UTF-8 (no lone surrogates: tokenizers and the Rust grammar libraries raise on them) and free of
NUL characters. JSON schemas are walked iteratively (never recursively: a deep schema must not raise
RecursionError here or later) and bounded in depth and size, so pickling, canonicalising and compiling them
cannot blow the stack. Failures raise InvalidRequest naming the parameter.
"""

from __future__ import annotations

from typing import Any

from prefixrt.errors import InvalidRequest

# Container nesting allowed in a JSON schema (each nested object costs two levels: schema + properties).
MAX_JSON_DEPTH = 64
# Values (containers, keys and scalars) allowed in a JSON schema.
MAX_JSON_NODES = 100_000


def check_text(text: str, param: str) -> None:
    """Raise InvalidRequest unless text is valid Unicode for UTF-8 (no lone surrogates) without NUL."""
    if "\x00" in text:
        raise InvalidRequest(f"{param} contains a NUL character (at index {text.index(chr(0))})", param=param)
    if text.isascii():  # O(1) (a flag of the str): no surrogates; spares a 5 MB prompt a 5 MB encode
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{param} contains a lone surrogate {text[e.start]!r} at index {e.start}; "
                             "text must be valid Unicode", param=param) from None


def check_json_value(value: Any, param: str, max_depth: int = MAX_JSON_DEPTH,
                     max_nodes: int = MAX_JSON_NODES) -> None:
    """Walk a JSON-like value (dicts, lists, scalars) without recursion: bounded depth and size, every
    str (keys too) checked with check_text. Raises InvalidRequest naming param."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise InvalidRequest(f"{param} is too large (more than {max_nodes} values)", param=param)
        if isinstance(v, str):
            check_text(v, param)
        elif isinstance(v, dict):
            if depth > max_depth:
                raise InvalidRequest(f"{param} is nested too deeply (more than {max_depth} levels)", param=param)
            for k, item in v.items():
                if isinstance(k, str):
                    check_text(k, param)
                stack.append((item, depth + 1))
        elif isinstance(v, (list, tuple)):
            if depth > max_depth:
                raise InvalidRequest(f"{param} is nested too deeply (more than {max_depth} levels)", param=param)
            stack.extend((item, depth + 1) for item in v)
