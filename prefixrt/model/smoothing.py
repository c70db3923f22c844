"""Smoothing of the FP8 linears' inputs (SmoothQuant): exact weight transforms of a float model, applied before its
weights are quantized (model/quantize.py, `quantize_fp8_at_load`), so nothing changes at run time.

Why: with per-token activation scales (`fp8_activation_scale="token"`) a token's scale comes from its largest value,
and a few channels carry values far above the rest in every token, which pushes the rest down e4m3's range. For a
linear y = x W^T and factors s_j > 0 per input channel, y = (x / s) (W diag(s))^T: dividing the large channels down
and multiplying the matching weight columns up moves the spread from the activations, quantized per token at run
time, to the weights, quantized once per output channel with the least-squares scale.

The factors: s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha) (alpha = `fp8_smoothing`), X's maxima over one forward
of the K/V calibration's fixed text (model/kv_calibration.py: the same ids on every start, so the same weights), each
rounded to the nearest power of two. Multiplying by a power of two changes only exponents, so every fold below is
exact in bf16 as in float32 and the smoothed float model computes the same values (Gemma's norms: to float32
rounding, see below). A channel that never fired (max |X_j| = 0) or has an all-zero weight column keeps s_j = 1.

Where x / s comes from (per decoder layer):
- qkv_proj and gate_up_proj read an RMSNorm's output, norm(h) * w: the norm's weight becomes w / s. Gemma's norm
  multiplies by (1 + w) in float32: its weight becomes (1 + w) / s - 1, kept in float32 (stored in bf16 it would be
  rounded to 8 bits of 1 rather than of itself: a norm output of 2^-6 would keep ~2 bits);
- o_proj reads the attention output, per head a convex combination of V rows: v_proj's output rows (and bias) are
  divided by s. Heads sharing a kv head (GQA) read the same V, so their factors must agree: the largest of the
  group's factors for each channel;
- down_proj reads act(gate) * up: up_proj's output rows (and bias) are divided by s.
o_proj and down_proj are folded first: they change rows of qkv_proj and gate_up_proj, whose column maxima the other
two factors read. The inputs' maxima all come from the one forward, since no fold changes another smoothed linear's
input. The LM head is not an FP8 linear and is not smoothed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.gemma3 import Gemma3DecoderLayer
from prefixrt.model.kv_calibration import calibration_forward
from prefixrt.model.layers import Linear, MergedLinear, RMSNorm
from prefixrt.model.llama import LlamaDecoderLayer


@dataclass(frozen=True)
class LayerLinears:
    """The modules of one decoder layer that smoothing reads and folds into."""

    attn_norm: RMSNorm  # its output is qkv_proj's input
    qkv: MergedLinear  # [q; k; v] rows
    o: Linear
    mlp_norm: RMSNorm  # its output is gate_up_proj's input
    gate_up: MergedLinear  # [gate; up] rows
    down: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The four linears smoothed (the layer's FP8 linears, model/quantize.fp8_linears)."""
        return self.qkv, self.o, self.gate_up, self.down


def layer_linears(layer: nn.Module) -> LayerLinears:
    """The smoothing-relevant modules of a Llama-family or Gemma-3 decoder layer (which norm feeds the MLP differs:
    Gemma-3 normalizes the attention output itself, post_attention_layernorm, and the MLP's input with
    pre_feedforward_layernorm). Raises NotImplementedError for any other layer class."""
    if isinstance(layer, Gemma3DecoderLayer):
        mlp_norm = layer.pre_feedforward_layernorm
    elif isinstance(layer, LlamaDecoderLayer):
        mlp_norm = layer.post_attention_layernorm
    else:
        raise NotImplementedError(f"FP8 smoothing does not know the decoder layer {type(layer).__name__}")
    attn = layer.self_attn
    return LayerLinears(layer.input_layernorm, attn.qkv_proj, attn.o_proj, mlp_norm, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj, attn.layer.num_heads, attn.layer.num_kv_heads, attn.layer.head_dim)


def decoder_layers(model: nn.Module) -> list[LayerLinears]:
    """layer_linears of every decoder layer of a CausalLM (`model.model.layers`)."""
    return [layer_linears(layer) for layer in model.model.layers]


@torch.no_grad()
def input_channel_amax(model: nn.Module, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """module name -> max |x_j| over every token of one calibration forward of token_ids (kv_calibration.
    calibration_forward, on the model's device), [in_features] float32, for the four linears of every decoder
    layer: what each saw as its input, through forward pre-hooks. The model is left as it was. Raises ValueError
    for a model on the fused kernels (its MLP may call down_proj's kernel past the module's forward)."""
    if any(getattr(m, "fused", False) for m in model.modules()):
        raise ValueError("calibrate FP8 smoothing before use_fused_kernels: the fused MLP bypasses down_proj's forward")
    smoothed = {linear for parts in decoder_layers(model) for linear in parts.linears}
    amax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()  # [in_features]
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)

        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in model.named_modules() if m in smoothed]
    try:
        calibration_forward(model, list(token_ids), model.lm_head.weight.device)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def smoothing_factors(x_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] float32 for a linear of weight [N, K] whose input channels reached x_amax [K]: max|X_j|^alpha /
    max_i |W_ij|^(1 - alpha), rounded to the nearest power of two; 1 where either maximum is 0."""
    w_amax = weight.detach().float().abs().amax(0)  # [K]
    x_amax = x_amax.float().to(w_amax.device)
    s = x_amax.pow(alpha) / w_amax.pow(1.0 - alpha)
    usable = (x_amax > 0) & (w_amax > 0) & torch.isfinite(s)
    return torch.where(usable, torch.exp2(torch.round(torch.log2(s.clamp_min(1e-30)))), torch.ones_like(s))


def _scale_columns(linear: Linear, s: torch.Tensor) -> None:
    linear.weight.data.mul_(s.to(linear.weight.dtype)[None, :])


def _divide_rows(linear: Linear, start: int, s: torch.Tensor) -> None:
    """Rows [start, start + len(s)) of the linear's output (weight rows and bias) divided by s."""
    rows = slice(start, start + s.numel())
    linear.weight.data[rows].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias.data[rows].div_(s.to(linear.bias.dtype))


def _divide_norm(norm: RMSNorm, s: torch.Tensor) -> None:
    """The norm's output divided by s (see the module docstring for Gemma's (1 + w) form)."""
    if norm.gemma:
        weight = (1.0 + norm.weight.detach().float()) / s - 1.0
        norm.weight = nn.Parameter(weight, requires_grad=False)
    else:
        norm.weight.data.div_(s.to(norm.weight.dtype))


@torch.no_grad()
def smooth_layer(parts: LayerLinears, amax: dict[nn.Module, torch.Tensor], alpha: float) -> None:
    """Fold the four factors of one decoder layer, in the module docstring's order. amax: linear -> its input
    channels' maxima (input_channel_amax)."""
    h, kvh, d = parts.num_heads, parts.num_kv_heads, parts.head_dim
    s_o = smoothing_factors(amax[parts.o], parts.o.weight, alpha).view(kvh, h // kvh, d).amax(1)  # [kvh, d]
    _scale_columns(parts.o, s_o[:, None, :].expand(kvh, h // kvh, d).reshape(h * d))  # head j*group+g: kv head j
    _divide_rows(parts.qkv, (h + kvh) * d, s_o.reshape(kvh * d))  # v_proj's rows
    s_down = smoothing_factors(amax[parts.down], parts.down.weight, alpha)  # [intermediate]
    _scale_columns(parts.down, s_down)
    _divide_rows(parts.gate_up, parts.gate_up.shard_slice("up_proj")[0], s_down)
    for linear, norm in ((parts.qkv, parts.attn_norm), (parts.gate_up, parts.mlp_norm)):
        s = smoothing_factors(amax[linear], linear.weight, alpha)  # [hidden]
        _scale_columns(linear, s)
        _divide_norm(norm, s)


def check_smoothing_alpha(alpha: float) -> None:
    """Raise ValueError unless 0 < alpha <= 1 (alpha 0 or None is "off" to the callers, never passed here)."""
    if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ValueError(f"FP8 smoothing alpha must be in (0, 1], got {alpha!r}")


@torch.no_grad()
def smooth_fp8_inputs(model: nn.Module, alpha: float, token_ids: Sequence[int]) -> int:
    """Smooth the inputs of every decoder layer's linears (the module docstring) of a float model, in place, from one
    calibration forward of token_ids. Returns the number of layers smoothed. Raises ValueError for a bad alpha, for
    a model whose linears already hold FP8 weights (a pre-quantized checkpoint: its weights cannot be rescaled
    exactly) or on the fused kernels; NotImplementedError for a decoder layer it does not know."""
    check_smoothing_alpha(alpha)
    layers = decoder_layers(model)  # (raises before anything changes)
    if any(linear.weight_scale is not None for parts in layers for linear in parts.linears):
        raise ValueError("FP8 smoothing applies to float weights before quantization; this model holds FP8 weights")
    amax = input_channel_amax(model, token_ids)
    by_module = {module: amax[name] for name, module in model.named_modules() if name in amax}
    for parts in layers:
        smooth_layer(parts, by_module, alpha)
    return len(layers)
