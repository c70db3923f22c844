"""How a setting is declared: once, as a dataclass field whose metadata carries its help, its choices, its range
and whether it is a command-line flag. Everything else is read from that declaration: the checks of a value
(`check_fields`), the flags and their defaults (config/flags.py), the section a component receives
(`section_of`).

    page_size: int = setting(1, "radix cache / allocator granularity, in tokens", minimum=1, flag=True)

A flag's name is the field's with dashes (`--page-size`); its type, default and choices are the field's. A bool
field that defaults to False is a switch (`--debug`); `flag="--no-radix-cache"` names a switch that sets a
default-True field to False; a `bool | None` field is a `--x / --no-x` pair whose absence means None.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, field
from typing import Any


def setting(default: Any, help: str, *, choices: tuple | None = None, minimum: float | None = None,
            flag: bool | str | tuple[str, ...] = False, metavar: str | None = None, flag_default: Any = MISSING,
            flag_help: str | None = None, env: str | None = None, nargs: str | None = None) -> Any:
    """A dataclass field declaring one setting.

    default / help: the setting's default and what it means. choices: the values it may take (checked).
    minimum: the smallest value it may take, None always allowed (checked). flag: True for a command-line flag
    named after the field, or the flag's name(s). metavar, flag_help: argparse's metavar and a help text for the
    flag where the flag reads differently from the setting. flag_default: the flag's default where it differs
    from the setting's (config/flags.py engine_kwargs reads a value below the minimum back as the default).
    env: an environment variable whose value, when set, is the flag's default. nargs: argparse's, for a list."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "flag": flag, "metavar": metavar,
            "flag_default": flag_default, "flag_help": flag_help, "env": env, "nargs": nargs}
    return field(default=default, metadata=meta)


def check_fields(obj: Any, bad) -> None:
    """Check every field of a settings dataclass against its declared choices and minimum; `bad(msg)` raises."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            bad(f"{f.name} must be one of {choices}, got {value!r}")
        minimum = f.metadata.get("minimum")
        if minimum is not None and value is not None and not value >= minimum:
            bad(f"{f.name} must be >= {minimum}, got {value!r}")


def section_of(config: Any, section: type) -> Any:
    """The `section` dataclass (a base class of config's) holding config's values of its fields."""
    return section(**{f.name: getattr(config, f.name) for f in dataclasses.fields(section)})


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its resolved type annotation."""
    return typing.get_type_hints(cls)
