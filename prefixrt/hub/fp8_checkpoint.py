"""Pre-quantized FP8 checkpoints: which formats load, how their tensors map onto our FP8 linears (model/quantize.py)
and where their activation and K/V cache scales go.

Formats (config.json's `quantization_config`), as the quantizing tools write them:
- `compressed-tensors` FP8, format `float-quantized` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): `weight` e4m3,
  `weight_scale` per channel [N, 1], per tensor [1] or per 128 x 128 block; input activations either dynamic (per
  token, or per group of 128 values) or static per tensor (`dynamic: false`, a calibrated `input_scale` [1] per
  linear); an optional `kv_cache_scheme` stores per-tensor (or per-head) `self_attn.k_scale` / `v_scale`;
- `fbgemm_fp8` (transformers' FbgemmFp8Config): `weight` e4m3, `weight_scale` [N, 1], dynamic activations (its
  `input_scale_ub` bound is not used);
- `fp8` (transformers' FineGrainedFP8Config, and the older per-tensor `fp8` checkpoints): `weight` e4m3 and
  `weight_scale_inv` (or `weight_scale`) per 128 x 128 block (`weight_block_size`, DeepSeek-style) or one per tensor
  (`weight_block_size` null, a [] or [1, 1] scale); the "inv" scale multiplies. `activation_scheme: "static"` carries
  one `activation_scale` (or `input_scale`) per linear.
Every weight scale becomes `weight_scale` (float32): per channel [N] (a per-tensor scale is spread over its rows,
which gives the same numbers), or the block grid [ceil(N / 128), ceil(K / 128)]. The bytes of the e4m3 weights are
used as they are.
Activations: static scales are used as the checkpoint fixed them (model/fp8_static_linear.py); the q/k/v or
gate/up shards of a merged linear share its input, so it takes the largest of their scales (a calibration gives
them one and the same value). Dynamic schemes run with the engine's `fp8_activation_scale` (one scale per 64
values of a token by default: at least as fine as per token or per 128 values).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
_ACTIVATION_SCALES = ("input_scale", "activation_scale")  # a linear's static activation scale (format-dependent name)
_DROPPED = ("input_scale_ub", "output_scale")  # fbgemm's activation bound; output scales other than K/V's: unused
_KV_SCALE = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.self_attn)\.(?:(?P<kv>[kv])_scale|"
                       r"(?P<proj>[kv])_proj\.output_scale)$")


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    method: str  # one of SUPPORTED_METHODS
    block_scales: bool  # 128 x 128 block scales (else per channel or per tensor)
    kv_cache_scales: bool  # the checkpoint carries K/V cache scales
    static_activation_scales: bool = False  # activations quantized with one calibrated scale per linear it carries


def _bad(method: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{method} checkpoint: {what} is not supported (FP8 e4m3 weights with per-channel, "
                               f"per-tensor or 128x128 block scales are)")


def _check_block(method: str, block) -> bool:
    if block is None:
        return False
    if [int(b) for b in block] != [128, 128]:
        raise _bad(method, f"weight block size {list(block)}")
    return True


def _compressed_tensors(qc: dict) -> Fp8CheckpointFormat:
    method = "compressed-tensors"
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _bad(method, "a quantization_config without config_groups")
    blocks, static = set(), set()
    for group in groups.values():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8 or w.get("symmetric") is False:
            raise _bad(method, f"weights {w.get('type')}{w.get('num_bits')} (symmetric={w.get('symmetric')})")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise _bad(method, f"weight strategy {strategy!r}")
        blocks.add(_check_block(method, w.get("block_structure")) if strategy == "block" else False)
        a = group.get("input_activations")
        if a is not None and (a.get("type") != "float" or int(a.get("num_bits", 0)) != 8):
            raise _bad(method, f"input activations {a.get('type')}{a.get('num_bits')}")
        static.add(a is not None and a.get("dynamic", True) is False)
        if a is not None and a.get("dynamic", True) is False and a.get("strategy") != "tensor":
            raise _bad(method, f"static input activations with strategy {a.get('strategy')!r} (static per tensor is)")
    if len(blocks) != 1:
        raise _bad(method, "block-wise and per-channel groups in one checkpoint")
    if len(static) != 1:
        raise _bad(method, "static and dynamic input activations in one checkpoint")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and (kv.get("type") != "float" or int(kv.get("num_bits", 0)) != 8):
        raise _bad(method, f"a K/V cache scheme {kv.get('type')}{kv.get('num_bits')}")
    return Fp8CheckpointFormat(method, blocks.pop(), kv is not None, static.pop())


def read_fp8_format(path: str | Path) -> Fp8CheckpointFormat | None:
    """The FP8 format of a model folder's checkpoint (config.json's quantization_config), or None for an unquantized
    one. Raises NotImplementedError, naming what is unsupported, for any other quantization."""
    config = json.loads((Path(path) / "config.json").read_text())
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return Fp8CheckpointFormat(method, False, False)
    if method == "fp8":
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise _bad(method, f"activation scheme {qc.get('activation_scheme')!r}")
        return Fp8CheckpointFormat(method, _check_block(method, qc.get("weight_block_size")), False, scheme == "static")
    raise NotImplementedError(f"quantization method {method!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_METHODS)} (FP8), or an unquantized checkpoint")


def fp8_module_names(names: Iterable[str], checkpoint_to_module: dict[str, str]) -> set[str]:
    """Our module names of the linears whose weights a checkpoint stores in FP8 (those with a weight scale), from its
    tensor names (ours, after hub.loader.checkpoint_name). checkpoint_to_module: a MergedLinear shard's checkpoint
    module name -> the merged module (model/quantize.merged_module_of)."""
    out = set()
    for name in names:
        for suffix in (".weight_scale", ".weight_scale_inv"):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                out.add(checkpoint_to_module.get(module, module))
    return out


class KVScaleCollector:
    """Receives a checkpoint's K/V cache scales ([] / [1] per tensor, or [num_kv_heads] per head) and stacks them into
    the pool's [num_layers, num_kv_heads] layout."""

    def __init__(self):
        self._scales: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep the tensor if it is a K/V cache scale; returns whether it was one."""
        m = _KV_SCALE.match(name)
        if m is None:
            return False
        self._scales[(int(m["layer"]), m["kv"] or m["proj"])] = tensor.float().reshape(-1)
        return True

    def stacked(self, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scales, v_scales) [num_layers, num_kv_heads] float32, or None when the checkpoint had none. Raises
        ValueError when some layers lack them or a shape fits neither per tensor nor per head."""
        if not self._scales:
            return None
        out = []
        for kind in ("k", "v"):
            rows = []
            for layer in range(num_layers):
                t = self._scales.get((layer, kind))
                if t is None:
                    raise ValueError(f"the checkpoint's K/V cache scales lack layer {layer}'s {kind}_scale")
                if t.numel() not in (1, num_kv_heads):
                    raise ValueError(f"layer {layer}'s {kind}_scale has {t.numel()} values; expected 1 or "
                                     f"{num_kv_heads} (one per kv head)")
                rows.append(t.expand(num_kv_heads) if t.numel() == 1 else t)
            out.append(torch.stack(rows))
        return out[0], out[1]


class ActivationScaleCollector:
    """Receives a checkpoint's static activation scales (`input_scale` / `activation_scale`, one value per linear)
    and keeps one per module of ours: a MergedLinear's shards share its input, so it keeps the largest of theirs."""

    def __init__(self, checkpoint_to_module: dict[str, str]):
        """checkpoint_to_module: a MergedLinear shard's checkpoint module name -> the merged module
        (model/quantize.merged_module_of)."""
        self._to_module = checkpoint_to_module
        self.scales: dict[str, torch.Tensor] = {}  # our module name -> float32 [1]

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """Keep the scale of the tensor named `<checkpoint module>.input_scale` (or `.activation_scale`). Raises
        ValueError when it is not one value (a static scale per token or per channel is not supported)."""
        if tensor.numel() != 1:
            raise ValueError(f"{name} has {tensor.numel()} values: static activation scales are supported per "
                             f"tensor (one value per linear)")
        checkpoint_module = name.rsplit(".", 1)[0]
        module = self._to_module.get(checkpoint_module, checkpoint_module)
        value = tensor.float().reshape(1)
        self.scales[module] = value if module not in self.scales else torch.maximum(self.scales[module], value)


def translate(weights: Iterable[tuple[str, torch.Tensor]], kv_scales: KVScaleCollector,
              activation_scales: ActivationScaleCollector | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """A checkpoint's tensors (our names) -> what load_weights takes: `weight_scale_inv` renamed `weight_scale`,
    K/V cache scales handed to kv_scales, static activation scales handed to activation_scales (dropped without
    one: a checkpoint whose activations are dynamic), fbgemm's activation bound dropped."""
    for name, tensor in weights:
        if kv_scales.take(name, tensor):
            continue
        kind = name.rsplit(".", 1)[-1]
        if kind in _ACTIVATION_SCALES:
            if activation_scales is not None:
                activation_scales.take(name, tensor)
            continue
        if kind in _DROPPED:
            continue
        if kind == "weight_scale_inv":
            name = name[: -len("_inv")]
        elif kind == "weight" and tensor.dtype.is_floating_point and tensor.element_size() == 1 \
                and tensor.dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"{name} is {tensor.dtype}: only float8_e4m3fn weights are supported")
        yield name, tensor
