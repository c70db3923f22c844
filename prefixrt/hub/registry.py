"""The model registry: built-in model names or local folders -> local Hugging Face folders. Nothing downloads.

Every model resolves to "a folder" (config.json + tokenizer files, and weights unless `dummy_only`): a
catalogue name (catalogue.py) is built on first use under `cache_dir()` (materialize.py); any local folder
path is returned as is. `load_tokenizer` reads the folder's tokenizer with the catalogue's chat template.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.hub import materialize
from prefixrt.hub.catalogue import ENTRIES, registry_names
from prefixrt.hub.materialize import cache_dir
from prefixrt.stage_clock import StageClock

__all__ = ["ResolvedModel", "cache_dir", "list_models", "load_tokenizer", "registry_names", "resolve_model"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model made concrete: a local folder plus what the runtime needs beyond config.json.

    `path`: folder with config.json and tokenizer files (and weights unless `dummy_only`).
    `chat_template`: Jinja template the registry supplies (None: use the tokenizer's own, if any).
    `extra_eos_token_ids`: ids that end generation in addition to the config's `eos_token_id`
    (e.g. Gemma's `<end_of_turn>`).
    `dummy_only`: the folder has no weights; only `load_format="dummy"` can load it.
    `revision`: stable content identifier, for cache keys (changes when the folder's content would).
    """

    name: str
    path: Path
    chat_template: str | None
    extra_eos_token_ids: tuple[int, ...]
    dummy_only: bool
    revision: str


def _local_folder(path: Path, name_or_path: str) -> ResolvedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidRequest(f"model folder {str(path)!r} has no config.json", param="model")
    extra_eos: tuple[int, ...] = ()
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        # generation_config's eos list names the turn-end tokens a chat model stops on.
        config_eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token_id")
        generation_eos = json.loads(generation_file.read_text(encoding="utf-8")).get("eos_token_id")
        config_eos_ids = set(config_eos if isinstance(config_eos, list) else [config_eos])
        generation_eos_ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        extra_eos = tuple(i for i in generation_eos_ids if isinstance(i, int) and i not in config_eos_ids)
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return ResolvedModel(
        name=name_or_path,
        path=path,
        chat_template=None,
        extra_eos_token_ids=extra_eos,
        dummy_only=not has_weights,
        revision=f"sha256:{materialize.folder_digest(path)[:16]}",
    )


def resolve_model(name_or_path: str, clock: StageClock | None = None) -> ResolvedModel:
    """Turn a registry name or a local HF folder path into a `ResolvedModel`.

    A registry name builds its folder under `materialize.cache_dir()` on first use (the Gemma conversion takes about a
    minute, once) and returns it from then on. A local folder is returned as is; its revision is a hash of
    its small files (config.json, tokenizer files) and the sizes of its weight files.
    Raises `InvalidRequest` (a ValueError) for an unknown name or a folder without config.json, and
    ImportError naming the pip command when a built-in model's optional package is missing.
    clock: where a build's stages are timed (the engine's start-up report).
    """
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return _local_folder(candidate.resolve(), name_or_path)
    entry = ENTRIES.get(name_or_path.strip().lower())
    if entry is None:
        looks_like_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
        what = f"no folder at {name_or_path!r}" if looks_like_path else f"unknown model {name_or_path!r}"
        raise InvalidRequest(
            f"{what}; built-in models: {', '.join(ENTRIES)}; or pass a local Hugging Face folder "
            "(config.json + *.safetensors + tokenizer files). Nothing is downloaded.",
            param="model",
        )
    reason = entry.is_available()
    if reason is not None:
        raise ImportError(f"Model {entry.name!r} is unavailable: {reason}")
    folder, marker = materialize.materialize(entry.name, entry.build, entry.source(), clock)
    return ResolvedModel(
        name=entry.name,
        path=folder,
        chat_template=entry.chat_template,
        extra_eos_token_ids=entry.extra_eos_token_ids,
        dummy_only=entry.kind == "dummy",
        revision=str(marker.get("revision", entry.name)),
    )


def list_models() -> list[dict[str, Any]]:
    """One dict per built-in model, for `prefixrt models`: name, kind ("embedded" | "dummy"), params,
    description, available (its packages are installed), unavailable_reason, cached (its folder is built),
    path (where the folder is or will be). Builds nothing."""
    rows = []
    for entry in ENTRIES.values():
        reason = entry.is_available()
        folder = materialize.entry_folder(entry.name)
        rows.append(
            {
                "name": entry.name,
                "kind": entry.kind,
                "params": entry.params,
                "description": entry.description,
                "available": reason is None,
                "unavailable_reason": reason,
                "cached": reason is None and materialize.is_current(folder, materialize.recipe_id(entry.name, entry.source())),
                "path": str(folder),
            }
        )
    return rows


# Tokenizer classes with nothing model-specific, loaded as themselves: AutoTokenizer would give the same class, but
# importing it imports transformers.models.auto, which on some installs (transformers 5.17 with accelerate) pulls
# in the generation, masking and FSDP modules: 10 s of an engine's start-up on an H200 host (docs/benchmarks.md).
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_class(folder: Path) -> Any:
    """The transformers class that reads folder's tokenizer: the generic one its tokenizer_config.json names, when
    the installed transformers has it, else AutoTokenizer."""
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in GENERIC_TOKENIZERS:
        import transformers

        try:
            return getattr(transformers, name)
        except AttributeError:
            pass
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(resolved: ResolvedModel) -> Any:
    """The model's transformers tokenizer, read from its folder only (never the network).

    The registry's chat template, if the model has one, replaces the tokenizer's own.
    """
    tokenizer = tokenizer_class(resolved.path).from_pretrained(str(resolved.path), local_files_only=True)
    if resolved.chat_template is not None:
        tokenizer.chat_template = resolved.chat_template
    return tokenizer
