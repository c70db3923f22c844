"""FP8 weights as a transform of a built model (the model classes know nothing about quantization).

- `quantize_fp8_weights(model)`: a loaded float model -> e4m3 weights with one scale per output channel, in place.
- `quantize_fp8_at_load(model, smoothing, calibration_ids)`: what `quantization="fp8"` does to a bf16/fp32 checkpoint
  or dummy weights: the linears' inputs smoothed first (model/smoothing.py, exact on the float model), then
  quantize_fp8_weights.
- `set_fp8_activation_scale(model, scheme)`: how the FP8 linears run inputs taller than a decode batch ("none",
  "group" or "token"; model/fp8_linear.py, kernels/fp8_reference.py).
- `prepare_fp8_linears(model, names, block_scales)`: before loading a pre-quantized checkpoint, give the linears the
  checkpoint holds in FP8 their e4m3 weight and scale parameters, so `load_weights` fills them directly
  (hub/fp8_checkpoint.py reads the checkpoint formats).
- `set_static_activation_scales(model, scales)`: after loading such a checkpoint with static activation scales, give
  each FP8 linear its `input_scale` (one value), which it then quantizes its activations with
  (model/fp8_static_linear.py) instead of the run-time scheme.

Which linears: those of the decoder layers (q/k/v, o, gate/up, down). The LM head stays in the model dtype (it is
tied to the embedding in many models, and checkpoints keep it unquantized). Embeddings and norms are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prefixrt.kernels.fp8_reference import check_activation_scale
from prefixrt.model.fp8_linear import FP8_WEIGHT_DTYPE
from prefixrt.model.layers import Linear, MergedLinear


def fp8_linears(model: nn.Module) -> dict[str, Linear]:
    """name -> the linears FP8 applies to: every Linear inside `model.model.layers` (not the LM head)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, Linear) and ".layers." in f".{name}"}


@torch.no_grad()
def quantize_fp8_weights(model: nn.Module) -> int:
    """Quantize every linear of fp8_linears to e4m3 with per-output-channel scales (weight_scale [N] float32, the scale
    of least squared error per channel: kernels/fp8_reference.quantize_weight), on the weights' device, one layer at a
    time. Returns the number of linears quantized; already quantized ones are left
    as they are. Mutates the modules' parameters (the float weights are released)."""
    from prefixrt.kernels.fp8_reference import quantize_weight

    count = 0
    for module in fp8_linears(model).values():
        if module.weight_scale is not None:
            continue
        w_q, scale = quantize_weight(module.weight.data)
        module.weight = nn.Parameter(w_q, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        count += 1
    if count and torch.cuda.is_initialized():
        # hand the float weights' memory back to the device: the KV pool is sized from the free memory, which
        # memory held by the caching allocator does not count (an 8B model: ~7.5 GB more for K/V)
        torch.cuda.empty_cache()
    return count


def quantize_fp8_at_load(model: nn.Module, smoothing: float | None, calibration_ids: Sequence[int] | None) -> int:
    """Quantize-at-load (`quantization="fp8"`): with `smoothing` (the alpha of model/smoothing.py; None or 0: off)
    the inputs of the decoder linears are smoothed first, from one calibration forward of calibration_ids
    (kv_calibration.calibration_tokens of the model's tokenizer; None: its pseudo-random ids, for dummy weights),
    unless some linear already holds FP8 weights (a pre-quantized checkpoint, or a model quantized before): those
    are never rescaled. Then quantize_fp8_weights. Returns the number of linears quantized."""
    if smoothing and not any(m.weight_scale is not None for m in fp8_linears(model).values()):
        from prefixrt.model.kv_calibration import calibration_tokens
        from prefixrt.model.smoothing import smooth_fp8_inputs

        ids = calibration_ids if calibration_ids is not None else calibration_tokens(None)
        smooth_fp8_inputs(model, smoothing, ids)
    return quantize_fp8_weights(model)


def set_fp8_activation_scale(model: nn.Module, activation_scale: str) -> int:
    """Set `fp8_activation_scale` (one of kernels/fp8_reference.py's ACTIVATION_SCALES) on every linear of fp8_linears; those with
    FP8 weights quantize their activations that way from the next forward. Call before use_fused_kernels (the
    kernel plans depend on it) and before capturing CUDA graphs. Returns the number of FP8 linears it applies to.
    Raises ValueError for an unknown scheme."""
    check_activation_scale(activation_scale)
    count = 0
    for module in fp8_linears(model).values():
        module.fp8_activation_scale = activation_scale
        count += module.weight_scale is not None
    return count


def prepare_fp8_linears(model: nn.Module, names: set[str], block_scales: bool) -> None:
    """Give the linears named (our module names, e.g. 'model.layers.0.self_attn.qkv_proj') empty e4m3 weights and
    float32 scales ([N], or [ceil(N / 128), ceil(K / 128)] with block_scales) on their weights' device, for a
    pre-quantized checkpoint to be loaded into. Raises ValueError for a name that is not an FP8-capable linear."""
    from prefixrt.kernels.fp8_reference import SCALE_BLOCK

    linears = fp8_linears(model)
    unknown = sorted(names - set(linears))
    if unknown:
        raise ValueError(f"the checkpoint holds FP8 weights for modules that cannot take them here: {unknown[:5]}")
    for name in sorted(names):
        module = linears[name]
        n, k = module.out_features, module.in_features
        device = module.weight.device
        module.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_WEIGHT_DTYPE, device=device), requires_grad=False)
        shape = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)) if block_scales else (n,)
        module.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


@torch.no_grad()
def set_static_activation_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Give every linear with FP8 weights its static activation scale: scales maps our module name (e.g.
    'model.layers.0.self_attn.qkv_proj') to one positive float value; each becomes the Linear's `input_scale`
    (float32 [1] on its weights' device). Raises ValueError naming the modules when an FP8 linear has no scale, a
    scale names no FP8 linear, or a value is not one positive finite number. Mutates the modules."""
    fp8 = {name: module for name, module in fp8_linears(model).items() if module.weight_scale is not None}
    missing, unknown = sorted(set(fp8) - set(scales)), sorted(set(scales) - set(fp8))
    if missing or unknown:
        raise ValueError("static activation scales (input_scale) must cover exactly the FP8 linears: "
                         f"missing for {missing[:5]}, given for non-FP8 modules {unknown[:5]}")
    for name, scale in scales.items():
        value = scale.float().reshape(-1)
        if value.numel() != 1 or not torch.isfinite(value).all() or not (value > 0).all():
            raise ValueError(f"{name}: a static activation scale (input_scale) must be one positive finite value, "
                             f"got {scale.tolist()}")
        module = fp8[name]
        module.input_scale = nn.Parameter(value.to(module.weight.device), requires_grad=False)


def merged_module_of(model: nn.Module) -> dict[str, str]:
    """Checkpoint module name (e.g. 'model.layers.0.self_attn.q_proj') -> our module name ('...self_attn.qkv_proj')
    for the shards of every MergedLinear; other linears keep their names."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            for shard in module.shard_names:
                out[f"{parent}.{shard}" if parent else shard] = name
    return out
