"""Build a model from a local transformers folder (config.json + *.safetensors), or random weights.

Nothing is downloaded: configs are read with local_files_only. Checkpoint names are transformers'
(`model.layers.N...`); multimodal Gemma-3 checkpoints (`model.language_model.` / `language_model.model.`, with
`vision_tower.` and `multi_modal_projector.`) load with their vision tower (Gemma3ForConditionalGeneration,
LlavaForConditionalGeneration, LlavaNextVideoForConditionalGeneration: its any-resolution `image_newline` is
not loaded).
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from prefixrt.hub import fp8_checkpoint
from prefixrt.hub.fp8_checkpoint import read_fp8_format
from prefixrt.model.base import CausalLM
from prefixrt.model.gemma3 import Gemma3Config, Gemma3ForCausalLM
from prefixrt.model.gemma3_vlm import Gemma3ForConditionalGeneration, Gemma3VLMConfig
from prefixrt.model.layers import GemmaRMSNorm, RMSNorm
from prefixrt.model.llama import LLAMA_ARCHITECTURES, LlamaConfig, LlamaForCausalLM
from prefixrt.model.llava import LlavaConfig, LlavaForConditionalGeneration
from prefixrt.model.llava_next_video import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

if TYPE_CHECKING:  # a tensor-parallel rank's shard only: parallel/ is imported when one is loaded
    from prefixrt.parallel.layers import TPGroup

LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = (None, "fp8")
DUMMY_STD = 0.02  # small enough that activations stay finite through any depth


@dataclass(frozen=True)
class ModelSpec:
    """What builds a model without transformers: its class and its own (frozen, picklable) config. Tensor-parallel
    ranks get it from rank 0 instead of reading config.json through transformers (seconds of imports)."""

    cls: type
    config: object

    def build(self) -> CausalLM:
        return self.cls(self.config)


def _build_llama(hf_config, architecture: str) -> ModelSpec:
    return ModelSpec(LlamaForCausalLM, LlamaConfig.from_hf(hf_config, architecture))


def _build_gemma3(hf_config, architecture: str) -> ModelSpec:
    if architecture != "Gemma3ForConditionalGeneration":
        return ModelSpec(Gemma3ForCausalLM, Gemma3Config.from_hf(hf_config))
    return ModelSpec(Gemma3ForConditionalGeneration, Gemma3VLMConfig.from_hf(hf_config))


def _build_llava(hf_config, architecture: str) -> ModelSpec:
    text_type = getattr(hf_config.text_config, "model_type", "llama")
    text_arch = _ARCH_OF_MODEL_TYPE.get(text_type)
    if text_arch not in LLAMA_ARCHITECTURES:
        raise ValueError(f"LLaVA over a {text_type!r} text model is not supported; supported: "
                         f"{', '.join(LLAMA_ARCHITECTURES)}")
    if architecture == "LlavaNextVideoForConditionalGeneration":
        return ModelSpec(LlavaNextVideoForConditionalGeneration, LlavaNextVideoConfig.from_hf(hf_config, text_arch))
    return ModelSpec(LlavaForConditionalGeneration, LlavaConfig.from_hf(hf_config, text_arch))


def model_spec(hf_config) -> ModelSpec:
    """The ModelSpec of a transformers config (raises for an unsupported architecture)."""
    arch = architecture_of(hf_config)
    return _BUILDERS[arch](hf_config, arch)


# config.json read as plain JSON for these architectures when it spells out every field their builder reads whose
# transformers default differs from the builder's (a missing eos_token_id is 2 in LlamaConfig, for one); anything
# else goes through AutoConfig. Importing any transformers config class imports its auto classes, which on some
# installs (transformers 5.17 with accelerate) pull in the generation, masking and FSDP modules: ~5 s of an
# engine's start-up on an H200 host (docs/benchmarks.md). Mistral is left out: a missing sliding_window is 4096
# there.
PLAIN_JSON_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PLAIN_JSON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_id")


def plain_config(path: str | Path) -> SimpleNamespace | None:
    """A local folder's config.json as attributes when the llama-family builder can read it without transformers
    (see PLAIN_JSON_ARCHITECTURES), else None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" in config:
        return None
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in PLAIN_JSON_ARCHITECTURES or any(f not in config for f in PLAIN_JSON_FIELDS):
        return None
    if "rope_theta" not in config and "rope_parameters" not in config:
        return None
    return SimpleNamespace(**config)


def read_model_spec(path: str | Path) -> ModelSpec:
    """The ModelSpec of a local folder's config.json."""
    config = plain_config(path)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return model_spec(config)


_BUILDERS: dict[str, Callable[[object, str], ModelSpec]] = {
    **{arch: _build_llama for arch in LLAMA_ARCHITECTURES},
    "Gemma3ForCausalLM": _build_gemma3,
    "Gemma3ForConditionalGeneration": _build_gemma3,
    "LlavaForConditionalGeneration": _build_llava,
    "LlavaNextVideoForConditionalGeneration": _build_llava,
}
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_BUILDERS)


def architecture_of(hf_config) -> str:
    """The config's architecture name; raises a ValueError naming the supported ones if we lack it."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _ARCH_OF_MODEL_TYPE:
        archs = [_ARCH_OF_MODEL_TYPE[model_type]]
    for arch in archs:
        if arch in _BUILDERS:
            return arch
    raise ValueError(
        f"unsupported model architecture {archs or model_type!r}; supported: {', '.join(supported_architectures())}"
    )


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    return resolved


# torch.nn.init's in-place initialisers, which the module constructors call (nn.Linear, nn.Embedding).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextlib.contextmanager
def _no_parameter_init():
    """torch.nn.init's initialisers made no-ops while a model is built on the meta device: there they compute
    nothing (the parameters are materialised empty, then loaded), but torch runs them on meta through its Python
    references, whose first use imports torch._dynamo: seconds of start-up on some hosts."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _materialise(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device` (floating ones as `dtype`), as
    `model.to(dtype).to_empty(device)` would, without running an op on a meta tensor: torch runs those through
    its Python references, whose first use imports torch._prims and sympy (seconds of start-up on some hosts)."""
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or t.device.type != "meta":
                continue
            fresh = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
            else:
                module._buffers[name] = fresh


def _instantiate(
    hf_config, *, dtype: torch.dtype | str, device: torch.device | str, extra_eos_ids: tuple[int, ...] = (),
    tp: TPGroup | None = None,
) -> CausalLM:
    """Construct the model (hf_config: a transformers config or a ModelSpec) with uninitialised parameters of
    `dtype` on `device` (no init cost); with a tensor-parallel group of more than one rank, only this rank's
    shard (parallel/layers.py)."""
    spec = hf_config if isinstance(hf_config, ModelSpec) else model_spec(hf_config)
    with torch.device("meta"), _no_parameter_init():
        model = spec.build()
        if tp is not None and tp.size > 1:
            from prefixrt.parallel.layers import shard_model

            shard_model(model, tp)
    _materialise(model, _resolve_dtype(dtype), torch.device(device))
    model.tie_weights()
    for eos in extra_eos_ids:
        if eos not in model.eos_token_ids:
            model.eos_token_ids.append(eos)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, std: float = DUMMY_STD) -> None:
    """Random weights: N(0, std) everywhere; norm weights at their identity value plus N(0, std).
    Deterministic given the torch seed (uses the default generator of the parameters' device). A tensor-parallel
    shard draws each parameter from a generator seeded by the torch seed and the parameter's name, so the
    replicated ones (norms) are equal on every rank."""
    seen: set[int] = set()
    sharded = getattr(model, "tp", None) is not None
    base_seed = torch.initial_seed()
    for mod_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if sharded:
                gen = torch.Generator(param.device).manual_seed(base_seed + zlib.crc32(f"{mod_name}.{name}".encode()))
                param.normal_(0.0, std, generator=gen)
            else:
                param.normal_(0.0, std)
            if isinstance(module, (RMSNorm, GemmaRMSNorm)):
                param.add_(module.identity_weight)
            elif isinstance(module, torch.nn.LayerNorm) and name == "weight":  # the vision towers' norms
                param.add_(1.0)


def load_model_from_config(
    hf_config, *, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """A model with random (dummy) weights built from a transformers config object."""
    model = _instantiate(hf_config, dtype=dtype, device=device)
    init_dummy_weights(model)
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index if there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Some repos ship a second, differently named copy (Mistral's consolidated.safetensors): skip it.
    files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {path}")
    return files


_TEXT_PREFIXES = (  # multimodal checkpoints -> our text-model names
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (  # multimodal checkpoints -> our vision-model names (longest spelling first)
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


_UNUSED = ("model.image_newline", "image_newline")  # LLaVA-NeXT's any-resolution image separator


def checkpoint_name(name: str, vision: bool = False) -> str | None:
    """Our parameter name for a checkpoint tensor name; None for tensors outside the model (the vision tower
    and projector of a multimodal checkpoint unless `vision`, and LLaVA-NeXT's image_newline)."""
    if name in _UNUSED:
        return None
    for old, new in _VISION_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :] if vision else None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def iter_checkpoint(files: list[Path], vision: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every model tensor of the given safetensors files, one at a time (the vision
    tower's and projector's only with `vision`)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = checkpoint_name(key, vision)
                if name is not None:
                    yield name, f.get_tensor(key)


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """eos ids from generation_config.json (instruct models often list more stop tokens there)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def checkpoint_tensor_names(files: list[Path]) -> list[str]:
    """Our names of the text-model tensors in the given safetensors files (their headers only are read)."""
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(n for n in map(checkpoint_name, f.keys()) if n is not None)
    return names


def load_model(
    path: str | Path,
    *,
    load_format: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    tp: TPGroup | None = None,
    spec: ModelSpec | None = None,
    quantization: str | None = None,
    fp8_smoothing: float | None = None,
    calibration_ids: Sequence[int] | None = None,
) -> CausalLM:
    """Load a model from a local transformers folder.

    load_format "auto" reads the safetensors weights (single file or sharded); "dummy" needs only
    config.json and fills random weights (see init_dummy_weights). tp: this rank's shard only (each checkpoint
    tensor is sliced as it is read). spec: the folder's ModelSpec when the caller has it (config.json is then not
    read through transformers). quantization: None loads the weights as the checkpoint stores them (a pre-quantized
    FP8 checkpoint, hub/fp8_checkpoint.py, as FP8); "fp8" gives the decoder linears FP8 weights either way (a float
    checkpoint, or dummy weights, quantized at load per output channel: model/quantize.py). K/V cache scales an FP8
    checkpoint carries end up in `model.kv_cache_scales`, its static activation scales on its linears
    (`input_scale`). fp8_smoothing: with quantization "fp8" on float weights, the alpha of the smoothing applied
    before quantizing (model/smoothing.py; None or 0: off), calibrated on calibration_ids
    (kv_calibration.calibration_tokens of the model's tokenizer; dummy weights may leave it None); a pre-quantized
    checkpoint is never smoothed. Returns the model in eval mode.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    extra_eos = _generation_eos_ids(path)
    fp8_format = read_fp8_format(path) if load_format != "dummy" else None
    if (fp8_format is not None or quantization) and tp is not None and tp.size > 1:
        raise NotImplementedError("FP8 weights are not supported with tensor parallelism")
    model = _instantiate(spec or read_model_spec(path), dtype=dtype, device=device, extra_eos_ids=extra_eos, tp=tp)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        files = checkpoint_files(path)
        weights = iter_checkpoint(files, getattr(model, "vision", None) is not None)
        if fp8_format is not None:
            from prefixrt.model.quantize import merged_module_of, prepare_fp8_linears

            merged = merged_module_of(model)
            names = fp8_checkpoint.fp8_module_names(checkpoint_tensor_names(files), merged)
            prepare_fp8_linears(model, names, fp8_format.block_scales)
            kv_scales = fp8_checkpoint.KVScaleCollector()
            activation_scales = fp8_checkpoint.ActivationScaleCollector(merged)
            weights = fp8_checkpoint.translate(weights, kv_scales,
                                               activation_scales if fp8_format.static_activation_scales else None)
        with torch.no_grad():
            model.load_weights(weights)
        if fp8_format is not None:
            model.kv_cache_scales = kv_scales.stacked(model.num_layers, model.num_kv_heads)
            if fp8_format.static_activation_scales:
                from prefixrt.model.quantize import set_static_activation_scales

                set_static_activation_scales(model, activation_scales.scales)
    if quantization == "fp8":
        from prefixrt.model.quantize import quantize_fp8_at_load

        smoothing = fp8_smoothing if fp8_format is None else None  # (FP8 weights cannot be rescaled exactly)
        if smoothing and calibration_ids is None and load_format != "dummy":
            raise ValueError("FP8 smoothing of a checkpoint's weights needs calibration_ids (the tokenizer's "
                             "kv_calibration.calibration_tokens)")
        quantize_fp8_at_load(model, smoothing, calibration_ids)  # (a pre-quantized checkpoint's linears: as loaded)
    return model


__all__ = [
    "architecture_of",
    "init_dummy_weights",
    "load_model",
    "load_model_from_config",
    "model_spec",
    "read_model_spec",
    "supported_architectures",
]
