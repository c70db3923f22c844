"""A model's recommended sampling defaults: what `prefixrt serve` samples with when a request leaves a setting out
(vLLM's `--generation-config auto`).

The defaults are the sampling fields of the model folder's `generation_config.json` (temperature, top_p,
top_k, min_p, repetition_penalty), over the catalogue's recommendation for a built-in model (its converted
folder's generation config keeps only the token ids). `--generation-config vllm` turns them off (the engine's
own defaults: temperature 1.0, no top-p/top-k); `--generation-config FOLDER` reads another folder's file.
Reads two small files at most; builds nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixrt.errors import InvalidRequest
from prefixrt.hub import materialize
from prefixrt.hub.catalogue import ENTRIES

# generation_config.json field -> SamplingParams field.
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty"}


def generation_defaults(model: str, source: str = "auto") -> dict[str, float]:
    """SamplingParams defaults for `model` (a registry name or a local folder): {} with `source` "vllm" (the
    engine's defaults), else the catalogue's recommendation overlaid with the generation_config.json of the
    model's folder (`source` "auto") or of the folder `source` names. An unknown model (an engine built from
    parts, a name the registry lacks) has none."""
    if source == "vllm":
        return {}
    out: dict[str, float] = {}
    folder = Path(model).expanduser()
    if not folder.is_dir():
        entry = ENTRIES.get(model.strip().lower())
        if entry is None:
            folder = None
        else:
            out.update(entry.generation_defaults)
            folder = materialize.entry_folder(entry.name)
    if source != "auto":
        folder = Path(source).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise InvalidRequest(f"--generation-config {source!r}: no generation_config.json there "
                                 "(give auto, vllm or a folder that has one)", param="generation_config")
    if folder is not None:
        out.update(read_generation_config(folder))
    return out


def read_generation_config(folder: Path) -> dict[str, float]:
    """The sampling fields of `folder`/generation_config.json ({} when there is none)."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return {}
    config = json.loads(file.read_text(encoding="utf-8"))
    return {field: config[key] for key, field in SAMPLING_FIELDS.items()
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}
