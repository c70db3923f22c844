"""The frontend's expressions: what `s += ...` appends to a program state.

Expressions are inert values; the interpreter (interpreter.py) executes them on the state's stream.
`"text" + gen("x") + "more"` builds a flat Concat; `user(...)`, `assistant(...)` wrap content in a role block.
Every constructor validates its arguments when it is called (the program's build time): an unknown or
ill-typed argument raises InvalidRequest naming the gen and the argument, before anything reaches a model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest

ROLES = ("system", "user", "assistant")

# Regexes of the typed gens (dtype=int|float|bool|str). A number may be followed by one space or newline,
# which is also a stop string of the typed gen: the model can end the value the way it would end a word,
# and the value excludes it. Strings are JSON strings (no raw control characters, no escapes).
REGEX_INT = r"-?[0-9]+[ \n]?"
REGEX_FLOAT = r"-?[0-9]+(\.[0-9]+)?[ \n]?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"[^"\\\x00-\x1f]*"'

# Sampling parameters a gen (or a run, as defaults for its gens) may set beyond the named ones.
GEN_SAMPLING = ("top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed",
                "stop_token_ids", "ignore_eos")
# Defaults a run (or @function) may give every gen of the program.
RUN_SAMPLING = ("max_new_tokens", "temperature", "top_p", "stop", *GEN_SAMPLING)
CHOICES_METHODS = ("token_length_normalized", "sum", "unconditional_normalized")


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
class RoleBegin(Expr):
    """Opens a role block (`with s.user():`); the text appended until RoleEnd is the message's content."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """`with s.var_scope(name):` — the text appended until VarScopeEnd becomes variable `name`."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class SetVar(Expr):
    """`s[name] = value`: sets a variable at this point of the stream (nothing is appended)."""

    name: str
    value: Any


@dataclass(eq=False)
class Media(Expr):
    """An image or video input of the next message (`image(path)`, `video(path, num_frames)`)."""

    kind: str  # "image" | "video"
    path: str
    num_frames: int | None = None


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: append only). Unset sampling fields take the run's defaults.

    `dtype` (int, float, bool or str) is a constraint (its REGEX_* and, for numbers, space/newline stops);
    the value is still the generated text, as it is appended to the state."""

    name: str | None
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    regex: str | None = None
    json_schema: Any = None
    choices: list[str] | None = None  # constrained choices (gen(choices=...) itself builds a Select)
    extra: dict = field(default_factory=dict)
    min_tokens: int | None = None
    dtype: type | None = None

    @property
    def constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.choices is not None


@dataclass(eq=False)
class Select(Expr):
    """Pick the most likely of `choices` given everything so far; the choice text is appended."""

    name: str | None
    choices: list[str]
    choices_method: str | None = None  # None: the backend's normalization


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(str.__str__(value))  # a plain str (a traced placeholder keeps only its marker text)
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use str, gen, select or a role")


def flatten(expr: Expr) -> list[Expr]:
    """Concat trees -> a flat list of items (adjacent texts merged, empty texts dropped)."""
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
        if isinstance(item, (Role, RoleBegin, RoleEnd)):
            raise TypeError(f"a {role}(...) block cannot contain another role block")
    return Role(role, content)


def system(content: Any = None) -> Role:
    """A system message. `content`: str or an expression (text + gen/select)."""
    return _role("system", content)


def user(content: Any = None) -> Role:
    """A user message. `content`: str or an expression (text + gen/select + image)."""
    return _role("user", content)


def assistant(content: Any = None) -> Role:
    """An assistant message; typically `assistant(gen("answer", ...))` or literal text around gens."""
    return _role("assistant", content)


def _where(name: str | None) -> str:
    return f"gen({name!r})" if name is not None else "gen()"


def _check_number(where: str, arg: str, value, integer: bool, low: float | None = None) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or (low is not None and value < low):
        kind = "an integer" if integer else "a number"
        raise InvalidRequest(f"{where}: {arg} must be {kind}{f' >= {low}' if low is not None else ''}, "
                             f"got {value!r}", param=arg)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | None = None,
    dtype: type | str | None = None,
    choices_method: str | None = None,
    **extra: Any,
) -> Gen | Select:
    """Generate into variable `name`. The value excludes the matched stop string (as the engine reports it).

    At most one of regex / json_schema / choices / dtype. `gen(name, choices=[...])` is `select(name,
    choices)`. `max_tokens` defaults to the run's max_new_tokens, the other sampling fields to the run's
    values. `min_tokens`: EOS is not sampled before that many tokens. Extra keyword arguments must be
    sampling parameters of GEN_SAMPLING (seed, top_k, ...); anything else raises InvalidRequest.
    """
    where = _where(name)
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"gen's name must be a string, got {type(name).__name__}", param="name")
    unknown = sorted(set(extra) - set(GEN_SAMPLING))
    if unknown:
        raise InvalidRequest(f"{where}: unknown argument {unknown[0]!r} (gen takes name, max_tokens, min_tokens, "
                             f"stop, temperature, top_p, regex, json_schema, choices, dtype, choices_method and "
                             f"{', '.join(GEN_SAMPLING)})", param=unknown[0])
    if dtype is not None:
        dtype = {"int": int, "float": float, "bool": bool, "str": str}.get(dtype, dtype)
        if dtype not in (int, float, bool, str):
            raise InvalidRequest(f"{where}: dtype must be int, float, bool or str, got {dtype!r}", param="dtype")
    given = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("choices", choices),
                            ("dtype", dtype)) if v is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{where}: at most one of regex, json_schema, choices, dtype; got {', '.join(given)}",
                             param=given[-1])
    if choices is not None:
        if max_tokens is not None or min_tokens is not None or stop is not None or regex is not None:
            raise InvalidRequest(f"{where}: choices= selects among the choices; max_tokens, min_tokens and stop "
                                 f"do not apply", param="choices")
        return select(name, choices, choices_method=choices_method)
    if choices_method is not None:
        raise InvalidRequest(f"{where}: choices_method applies only with choices=", param="choices_method")
    if max_tokens is not None:
        _check_number(where, "max_tokens", max_tokens, integer=True, low=0)
    if min_tokens is not None:
        _check_number(where, "min_tokens", min_tokens, integer=True, low=0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise InvalidRequest(f"{where}: min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})",
                                 param="min_tokens")
        if regex is not None or json_schema is not None or dtype is not None:
            raise InvalidRequest(f"{where}: min_tokens cannot be combined with a constraint (regex, json_schema, "
                                 f"dtype): the constraint decides where the value ends", param="min_tokens")
    if temperature is not None:
        _check_number(where, "temperature", temperature, integer=False, low=0)
    if top_p is not None:
        _check_number(where, "top_p", top_p, integer=False)
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"{where}: stop must be a string or a list of strings", param="stop")
    if regex is not None and (not isinstance(regex, str) or not regex):
        raise InvalidRequest(f"{where}: regex must be a non-empty string", param="regex")
    stop = list(stop) if stop else None
    if dtype is not None:
        regex, stop = _typed(dtype, stop)
    return Gen(name, max_tokens, stop, temperature, top_p, regex, json_schema, None, dict(extra), min_tokens, dtype)


def _typed(dtype: type, stop: list[str] | None) -> tuple[str, list[str] | None]:
    """(regex, stop) of a typed gen."""
    if dtype is int or dtype is float:
        extra = [s for s in (" ", "\n") if s not in (stop or [])]
        return (REGEX_INT if dtype is int else REGEX_FLOAT), [*(stop or []), *extra]
    return (REGEX_BOOL if dtype is bool else REGEX_STR), stop


def gen_int(name: str | None = None, **kwargs: Any) -> Gen:
    """`gen(name, dtype=int, ...)`: an integer (digits, optional sign)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen:
    """`gen(name, dtype=str, ...)`: a double-quoted JSON string."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, choices_method: str | None = None,
           **unknown: Any) -> Select:
    """Choose the most likely of `choices` (scored by the backend) into variable `name`."""
    where = f"select({name!r})" if name is not None else "select()"
    if unknown:
        arg = sorted(unknown)[0]
        raise InvalidRequest(f"{where}: unknown argument {arg!r} (select takes name, choices, choices_method)",
                             param=arg)
    if not choices or not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"{where}: choices must be a non-empty list of non-empty strings", param="choices")
    if choices_method is not None and choices_method not in CHOICES_METHODS:
        raise InvalidRequest(f"{where}: choices_method must be one of {', '.join(CHOICES_METHODS)}, got "
                             f"{choices_method!r}", param="choices_method")
    return Select(name, list(choices), choices_method)


def image(path: str) -> Media:
    """An image input (a file path) of the message it is part of, e.g. `user(image("cat.png") + "What is it?")`.

    Rendered by the backend: an OpenAI chat endpoint receives it as an image_url part; a text-only model
    refuses it with InvalidRequest when it is appended."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequest(f"image(): path must be a file path, got {type(path).__name__}", param="path")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidRequest(f"image(): no such file {path!r}", param="path")
    return Media("image", path)


def video(path: str, num_frames: int | None = None) -> Media:
    """A video input (a file path) of the message it is part of; `num_frames` frames are sampled from it."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequest(f"video(): path must be a file path, got {type(path).__name__}", param="path")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidRequest(f"video(): no such file {path!r}", param="path")
    if num_frames is not None:
        _check_number("video()", "num_frames", num_frames, integer=True, low=1)
    return Media("video", path, num_frames)
