"""The frontend's expressions: what `s += ...` appends to a program state.

Expressions are inert values; the interpreter (interpreter.py) executes them on the state's stream.
`"text" + gen("x") + "more"` builds a flat Concat; `user(...)`, `assistant(...)` wrap content in a role block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every expression. `+` concatenates (strings are promoted to Text)."""

    def __add__(self, other: Any) -> Concat:
        return Concat([*flatten(self), *flatten(to_expr(other))])

    def __radd__(self, other: Any) -> Concat:
        return Concat([*flatten(to_expr(other)), *flatten(self)])


@dataclass(eq=False)
class Text(Expr):
    text: str


@dataclass(eq=False)
class Concat(Expr):
    items: list[Expr]


@dataclass(eq=False)
class Role(Expr):
    """A whole chat message: role block `role` whose content is `content` (may contain gen/select)."""

    role: str
    content: Expr


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: append only). Unset sampling fields take the run's defaults."""

    name: str | None
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    regex: str | None = None
    json_schema: Any = None
    choices: list[str] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.choices is not None


@dataclass(eq=False)
class Select(Expr):
    """Pick the most likely of `choices` given everything so far; the choice text is appended."""

    name: str | None
    choices: list[str]


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use str, gen, select or a role")


def flatten(expr: Expr) -> list[Expr]:
    """Concat trees -> a flat list of Text/Gen/Select/Role items (adjacent texts merged)."""
    out: list[Expr] = []
    stack = [expr]
    while stack:
        e = stack.pop(0)
        if isinstance(e, Concat):
            stack[:0] = e.items
        elif isinstance(e, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        elif isinstance(e, Text) and e.text == "":
            continue
        else:
            out.append(e)
    return out


# ---------------------------------------------------------------------- public constructors
def _role(role: str, content: Any) -> Role:
    content = to_expr(content if content is not None else "")
    for item in flatten(content):
        if isinstance(item, Role):
            raise TypeError(f"a {role}(...) block cannot contain another role block")
    return Role(role, content)


def system(content: Any = None) -> Role:
    """A system message. `content`: str or an expression (text + gen/select)."""
    return _role("system", content)


def user(content: Any = None) -> Role:
    """A user message. `content`: str or an expression (text + gen/select)."""
    return _role("user", content)


def assistant(content: Any = None) -> Role:
    """An assistant message; typically `assistant(gen("answer", ...))` or literal text around gens."""
    return _role("assistant", content)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | None = None,
    **extra: Any,
) -> Gen:
    """Generate into variable `name`. The value excludes the matched stop string (as the engine reports it).

    At most one of regex / json_schema / choices. `max_tokens` defaults to the run's max_new_tokens;
    `temperature` to the run's temperature. Extra keyword arguments are passed to the backend as sampling
    parameters (e.g. `seed`, `top_k`).
    """
    if name is not None and not isinstance(name, str):
        raise TypeError("gen's name must be a string")
    if isinstance(stop, str):
        stop = [stop]
    given = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("choices", choices)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"gen takes at most one of regex, json_schema, choices; got {', '.join(given)}")
    return Gen(name, max_tokens, list(stop) if stop else None, temperature, top_p, regex, json_schema,
               list(choices) if choices is not None else None, extra)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Choose the most likely of `choices` (scored by the backend) into variable `name`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return Select(name, list(choices))
