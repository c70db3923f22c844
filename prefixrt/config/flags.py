"""The engine's command-line flags, generated from EngineConfig's declarations (config/engine_config.py), shared
by `prefixrt serve`, `generate`, `chat` and `bench`: the argparse flags, the mistakes that can be named before a
model loads, the parsed flags as Engine keyword arguments, and starting an engine with progress lines on stderr.

A setting declared with `flag=...` is a flag here, with the setting's type, default, choices and help; nothing
about it is written twice. Nothing here imports the engine, the server or torch at import time: `start_engine`
starts the class its caller passes (Engine, ProcessEngine, ...), so `prefixrt generate` and `prefixrt chat` never
load the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from typing import Any

from prefixrt.config.engine_config import EngineConfig
from prefixrt.config.settings import field_types
from prefixrt.default_models import CHAT_MODEL


def flag_fields(config_cls: type = EngineConfig) -> list[dataclasses.Field]:  # (any settings dataclass)
    """The settings of config_cls that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("flag")]


def engine_flags(config_cls: type = EngineConfig) -> tuple[str, ...]:
    """The settings that are flags: each becomes the Engine keyword argument of its name."""
    return tuple(f.name for f in flag_fields(config_cls))


ENGINE_FLAGS = engine_flags()


def add_engine_args(p: argparse.ArgumentParser, default_model: str | None = CHAT_MODEL,
                    config_cls: type = EngineConfig, only: Iterable[str] | None = None) -> None:
    """Engine construction flags (docs/api.md's Engine arguments), one per flag setting of config_cls (or of
    those named in `only`), shared by `serve`, `generate`, `chat` and `bench`. default_model None: the command
    picks the model (generate: CHAT_MODEL with --chat, else BASE_MODEL)."""
    p.add_argument("--model", default=default_model,
                   help=f"registry name or local HF folder (default: {default_model or 'see the command'})")
    add_flags(p, config_cls, only)


def add_flags(p, settings_cls: type, only: Iterable[str] | None = None) -> None:
    """One argparse flag (on a parser or an argument group) per flag setting of settings_cls (or of those named
    in `only`), with the setting's name, type, default, choices and help."""
    types_ = field_types(settings_cls)
    wanted = None if only is None else set(only)
    for f in flag_fields(settings_cls):
        if wanted is None or f.name in wanted:
            _add_flag(p, f, types_[f.name])


def _add_flag(p, f: dataclasses.Field, annotation: Any) -> None:
    meta = f.metadata
    flag = meta["flag"]
    names = [flag] if isinstance(flag, str) else list(flag) if isinstance(flag, tuple) else \
        ["--" + f.name.replace("_", "-")]
    help_ = (meta.get("flag_help") or meta["help"]).replace("%", "%%")  # (argparse formats help with %)
    kinds = set(typing.get_args(annotation)) - {type(None)} if _is_union(annotation) else {annotation}
    optional = _is_union(annotation) and type(None) in typing.get_args(annotation)
    if kinds == {bool}:
        if optional or (flag is True and f.default is True):  # --x / --no-x (absent: the default, None or True)
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:  # a switch away from the default
            p.add_argument(*names, dest=f.name, action="store_false" if f.default else "store_true", help=help_)
        return
    if typing.get_origin(annotation) is list or any(typing.get_origin(k) is list for k in kinds):
        kind = str  # a list of strings, given with nargs
    else:
        kind = next(iter(kinds)) if len(kinds) == 1 else str
    default = f.default if meta.get("flag_default", MISSING) is MISSING else meta["flag_default"]
    if meta.get("env") and os.environ.get(meta["env"]):
        default = os.environ[meta["env"]]
    choices = meta.get("choices")
    kw: dict[str, Any] = dict(dest=f.name, default=default, help=help_)
    if choices is not None:
        kw["choices"] = [c for c in choices if c is not None]
    if kind in (int, float):
        kw["type"] = kind
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if meta.get("nargs"):
        kw["nargs"] = meta["nargs"]
    p.add_argument(*names, **kw)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def engine_kwargs(args: argparse.Namespace, config_cls: type = EngineConfig) -> dict[str, Any]:
    """The parsed flags as Engine keyword arguments (those the parser has); a flag whose default differs from its
    setting's (`flag_default`) reads a value below the setting's minimum as the setting's default."""
    kw = {}
    for f in flag_fields(config_cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        minimum = f.metadata.get("minimum")
        if f.metadata.get("flag_default", MISSING) is not MISSING and value is not None and minimum is not None \
                and value < minimum:
            value = f.default
        kw[f.name] = value
    if "lora_adapters" in kw:  # --lora-modules NAME=PATH ... -> {name: folder}
        kw["lora_adapters"] = lora_modules(kw["lora_adapters"])
    return kw


def lora_modules(pairs: list[str] | None) -> dict[str, str] | None:
    """--lora-modules NAME=PATH ... as {name: folder} (None without the flag); ValueError naming a malformed pair, a
    name given twice or a folder without adapter_config.json."""
    if not pairs:
        return None
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH pairs, got {pair!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        path = os.path.expanduser(path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"--lora-modules {name}={path}: not a PEFT adapter folder (no adapter_config.json)")
        out[name] = path
    return out


def check_engine_args(args: argparse.Namespace) -> None:
    """Mistakes that can be named before anything loads; raises ValueError with a one-line message."""
    device = str(getattr(args, "device", "auto"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"--device {device}: {why}; use --device cpu (or auto)")
    elif device not in ("auto", "cpu"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    lora_modules(getattr(args, "lora_adapters", None))  # NAME=PATH pairs naming adapter folders
    model = getattr(args, "model", None)
    if model and not os.path.isdir(os.path.expanduser(model)):
        from prefixrt.hub.catalogue import ENTRIES

        entry = ENTRIES.get(model.strip().lower())
        if entry is None:
            from prefixrt.hub.registry import resolve_model

            resolve_model(model)  # raises the registry's one-line InvalidRequest (names the built-in models)
        elif entry.kind == "dummy" and getattr(args, "load_format", "auto") != "dummy":
            raise ValueError(f"{entry.name!r} is a shape without weights: use --load-format dummy")


def progress_printer() -> Callable[[str], None]:
    """A progress callback: each message on stderr with the seconds since this call."""
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[prefixrt {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


def start_engine(args: argparse.Namespace, make: Callable[..., Any], where: str = "in this process"):
    """`make(args.model, progress=..., **engine_kwargs(args))` (Engine, ProcessEngine, ...), saying on stderr that
    it starts (and `where`) and when it is ready."""
    progress = progress_printer()
    progress(f"starting engine for {args.model!r} ({where})")
    eng = make(args.model, progress=progress, **engine_kwargs(args))
    progress(f"engine ready: {eng.model_name} on {eng.device}, context {eng.max_context} tokens")
    return eng
