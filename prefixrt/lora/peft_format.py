"""PEFT LoRA adapters on disk (`adapter_config.json` + `adapter_model.safetensors`, as `save_pretrained` writes them)
-> LoraAdapter: the A/B matrices and scale of every targeted projection, on the host.

What runs here is exactly what PEFT computes at inference: `base(x) + lora_B(lora_A(x)) * scaling` per target
module, scaling = alpha / r (alpha / sqrt(r) with use_rslora), r and alpha per module when rank_pattern /
alpha_pattern name it (PEFT's own key match: the pattern is a suffix of the module name at a dot). Anything that
would compute something else is refused with the reason: DoRA, trained biases, modules_to_save, embedding or
lm_head adapters, fan_in_fan_out, other PEFT types, target modules this runtime does not serve.

An adapter's identity in every cache key is `digest`, the sha256 of its two files: two names of the same files
share K/V, and a name reloaded with other weights never meets the K/V of the old ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prefixrt.model.lora import TARGET_MODULES

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class ModuleWeights:
    """One target projection of one layer: lora_A [r, in], lora_B [out, r], scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    """An adapter read from a PEFT folder (or made in memory: benchmarks). modules: (layer, target module name,
    e.g. "q_proj") -> its weights."""

    name: str
    digest: str  # sha256 hex of the adapter's files: its identity in cache keys
    modules: dict[tuple[int, str], ModuleWeights]
    path: str | None = None
    targets: frozenset[str] = field(default=frozenset())

    def __post_init__(self):
        if not self.targets:
            self.targets = frozenset(t for _, t in self.modules)

    @property
    def rank(self) -> int:
        """The largest rank of any of its modules."""
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def _pattern_value(patterns: dict, module_name: str, default):
    for key, value in (patterns or {}).items():  # PEFT's get_pattern_key: the first key that matches wins
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_config(folder: Path) -> dict:
    """The adapter's config, checked for what this runtime can compute (ValueError naming the field)."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: no {CONFIG_NAME}")
    cfg = json.loads(path.read_text())

    def refuse(what: str):
        raise ValueError(f"LoRA adapter {folder}: {what} is not supported")

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse("use_dora (DoRA)")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg.get('bias')!r} (trained biases)")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg.get('modules_to_save')!r}")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    for key in ("trainable_token_indices", "target_parameters", "layer_replication", "lora_bias"):
        if cfg.get(key):
            refuse(key)
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise ValueError(f"LoRA adapter {folder}: r must be a positive integer, got {cfg.get('r')!r}")
    return cfg


def read_adapter(name: str, folder: str | Path, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder into host tensors of `dtype`. Raises ValueError on anything it cannot serve
    exactly (see the module docstring)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_config(folder)
    weights_path = folder / WEIGHTS_NAME
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no {WEIGHTS_NAME} (only safetensors adapters are read)")
    digest = hashlib.sha256()
    digest.update((folder / CONFIG_NAME).read_bytes())
    with open(weights_path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    tensors = load_file(str(weights_path))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {folder}: tensor {key!r} is not a lora_A / lora_B of a decoder layer's "
                             f"projection (embedding and lm_head adapters are not supported)")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGET_MODULES:
            raise ValueError(f"LoRA adapter {folder}: target module {target!r} is not supported; supported: "
                             f"{', '.join(TARGET_MODULES)}")
        parts.setdefault((layer, target), {})[ab] = tensor
    alpha = cfg.get("lora_alpha", 8)
    modules = {}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {folder}: layer {layer} {target} has lora_{''.join(ab)} alone")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"LoRA adapter {folder}: layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} do not chain")
        module_name = f"model.layers.{layer}.{'mlp' if target in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{target}"
        module_alpha = _pattern_value(cfg.get("alpha_pattern"), module_name, alpha)
        scale = module_alpha / math.sqrt(r) if cfg.get("use_rslora") else module_alpha / r
        modules[(layer, target)] = ModuleWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    if not modules:
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_NAME} holds no lora_A / lora_B weights")
    return LoraAdapter(name, digest.hexdigest(), modules, str(folder))


def random_adapter(name: str, num_layers: int, dims: dict[str, tuple[int, int]], rank: int, seed: int,
                   dtype: torch.dtype = torch.float32, std: float = 0.02, alpha: float | None = None
                   ) -> LoraAdapter:  # fmt: skip
    """An adapter of random weights for benchmarks (load_format="dummy"): dims maps each target module to its
    (in, out) features (registry.target_dims). Its digest is derived from (name, seed, rank)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    modules = {}
    for layer in range(num_layers):
        for target, (fan_in, fan_out) in dims.items():
            a = (torch.randn(rank, fan_in, generator=gen) * std).to(dtype)
            b = (torch.randn(fan_out, rank, generator=gen) * std).to(dtype)
            modules[(layer, target)] = ModuleWeights(a, b, (alpha or 2 * rank) / rank)
    digest = hashlib.sha256(f"random-lora:{name}:{seed}:{rank}".encode()).hexdigest()
    return LoraAdapter(name, digest, modules)


def scaled_adapter(base: LoraAdapter, name: str, factor: float) -> LoraAdapter:
    """Another adapter made from `base` with every lora_A scaled by factor (B shared): distinct weights and digest at
    the cost of one A copy, for benchmarks that need hundreds of adapters."""
    modules = {key: ModuleWeights(m.a * factor, m.b, m.scale) for key, m in base.modules.items()}
    digest = hashlib.sha256(f"scaled-lora:{base.digest}:{name}:{factor!r}".encode()).hexdigest()
    return LoraAdapter(name, digest, modules)
