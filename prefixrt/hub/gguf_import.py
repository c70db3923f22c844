"""Convert a GGUF checkpoint into a plain Hugging Face folder (config.json + model.safetensors + tokenizer).

The conversion goes through transformers' own GGUF support (config parsing, tokenizer rebuild, tensor
renaming, dequantisation), so the folder holds exactly the weights transformers itself would run for the
GGUF file. Weights are stored in float32: k-quant blocks dequantise to values that bfloat16 cannot hold
exactly, and the folder is the reference the engine is compared against.

`transformers.AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` insists on `accelerate` although it
only needs the state dict; we call the loader it wraps (`load_gguf_checkpoint`) directly instead, which
yields the same tensors without that dependency.

A conversion is the first start's main cost, so it does no work twice: transformers' GGUF code parses the file's
metadata once each for the config, the tokenizer's config and the tensors (three parses of a 49k-entry vocabulary,
most of a SmolLM2 conversion), and builds the same GGUF-to-HF tensor-name map once per submodule (hundreds of
times); `_each_read_once` makes both happen once per conversion. The model that receives the GGUF's weights is
not randomly initialised first. Each stage is timed on the caller's StageClock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixrt.hub.chat_templates import store_chat_template_in_tokenizer_config
from prefixrt.stage_clock import StageClock

logger = logging.getLogger(__name__)

# Prompt for the post-conversion check: long enough to exercise several positions.
_CHECK_PROMPT = "The capital of France is Paris, and the capital of Germany is"


def require_gguf() -> None:
    """Raise an ImportError naming the install command if the `gguf` reader is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "Reading a GGUF checkpoint needs the `gguf` package: pip install 'prefixrt[gemma]'"
        ) from exc


def _float32_shortest(value: float) -> float:
    # GGUF stores hyper-parameters as float32 (1e-6 comes back as 9.99999997e-07). Rewrite them as the
    # shortest decimal with the same float32 value, so config.json reads like the original release.
    return float(str(np.float32(value)))


def load_gguf_config(gguf_path: Path) -> Any:
    """The transformers config that transformers derives from the GGUF metadata, tidied for saving.

    Returns a `PretrainedConfig` with `architectures` set, the GGUF-derived name removed and float32
    hyper-parameters written as short decimals. Reads metadata only (fast).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, _float32_shortest(getattr(config, key)))
    # The GGUF's `general.name` lands in `_model_name_or_path`; a saved folder must not carry it.
    config.__dict__.pop("_model_name_or_path", None)
    config._name_or_path = ""
    return config


def load_gguf_model(gguf_path: Path, config: Any) -> torch.nn.Module:
    """Build the causal-LM for `config` and fill it with the GGUF's dequantised float32 weights.

    Raises RuntimeError if a parameter of the model has no tensor in the file (tied output embeddings
    excepted) or a tensor has no parameter.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with no_init_weights():  # every parameter is overwritten below (a missing one raises)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF tensors do not match {type(model).__name__}: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    return model.eval()


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    """The fast tokenizer transformers rebuilds from the GGUF vocabulary (slow: ~30 s for 262k tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@contextlib.contextmanager
def _each_read_once(gguf_path: Path) -> Iterator[None]:
    """Within the block, transformers' GGUF loader gets one parsed `gguf.GGUFReader` of `gguf_path` however often it
    asks (a reader is a read-only memory map: nothing the loader does changes it), and `gguf.get_tensor_name_map`
    answers each (architecture, layer count) once. Both are looked up on the `gguf` module at each call, so they are
    swapped there for the block and put back after it; other files get a reader of their own."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = reader_class(str(gguf_path))

    def read(path, *args, **kwargs):
        if not args and not kwargs and os.path.samefile(path, gguf_path):
            return reader
        return reader_class(path, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@torch.no_grad()
def _logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
    return model(input_ids=input_ids).logits[0]  # [T, vocab]


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    *,
    chat_template: str | None = None,
    generation_eos_token_ids: list[int] | None = None,
    clock: StageClock | None = None,
) -> dict[str, Any]:
    """Write `out_dir` as a Hugging Face folder equivalent to the GGUF file at `gguf_path`.

    Writes config.json, generation_config.json, model.safetensors (float32) and the tokenizer files, with
    `chat_template` stored in the tokenizer config. `generation_eos_token_ids` become generation_config's
    `eos_token_id` list (how transformers' `generate` learns about turn-end tokens).
    Then reloads the folder with transformers and checks that weights and logits on a fixed prompt are
    bit-identical to the GGUF-loaded model; raises RuntimeError if not.
    clock: where the stages' seconds go (import transformers, read GGUF, dequantize, tokenizer from GGUF, write
    shards, verify). Returns a summary: the config dict and the conversion's check results.
    """
    clock = clock or StageClock()
    with clock.stage("import transformers"):
        from transformers import AutoModelForCausalLM, GenerationConfig

        require_gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    with clock.stage("read GGUF"), _each_read_once(gguf_path):
        config = load_gguf_config(gguf_path)
        with clock.stage("dequantize"):
            model = load_gguf_model(gguf_path, config)
        with clock.stage("tokenizer from GGUF"):
            tokenizer = load_gguf_tokenizer(gguf_path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template

    with clock.stage("write shards"):
        model.save_pretrained(str(out_dir), safe_serialization=True)
        eos_ids = list(generation_eos_token_ids or [])
        if config.eos_token_id is not None and config.eos_token_id not in eos_ids:
            eos_ids.insert(0, config.eos_token_id)
        generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=eos_ids or None,
            pad_token_id=config.pad_token_id,
        )
        generation_config.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
        store_chat_template_in_tokenizer_config(out_dir, chat_template)

    with clock.stage("verify"):  # the folder must reproduce the GGUF-loaded model exactly
        reloaded = AutoModelForCausalLM.from_pretrained(
            str(out_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True
        ).eval()
        expected_state = model.state_dict()
        for name, tensor in reloaded.state_dict().items():
            if not torch.equal(tensor, expected_state[name]):
                raise RuntimeError(f"saved weight {name} differs from the GGUF-loaded one")
        check_ids = tokenizer.encode(_CHECK_PROMPT)
        if not torch.equal(_logits(model, check_ids), _logits(reloaded, check_ids)):
            raise RuntimeError("logits of the saved folder differ from the GGUF-loaded model")
    logger.info("converted %s -> %s (weights and logits identical)", gguf_path, out_dir)
    return {"config": config.to_dict(), "checked_token_ids": check_ids}
