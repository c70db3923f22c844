"""Plain torch references of the FP8 (e4m3) linear kernels (kernels/fp8_gemm.py): quantize, dequantize, multiply
in float32. They are the oracle of the kernel tests and the path a model with FP8 weights runs on the CPU.

The scheme (the one every FP8 path here computes):
- weights: e4m3 with one float32 scale per output channel (row of W, `w_scale` [N]; quantize_weight picks it) or
  per 128 x 128 block
  (`w_scale` [ceil(N / 128), ceil(K / 128)], DeepSeek-style checkpoints); W ~= W_q * scale;
- activations: left as they are (`activation_scale="none"`, weight-only: y = x @ (W_q * w_scale)^T; what every input
  of at most model/fp8_linear.WEIGHT_ONLY_MAX_ROWS rows runs), or quantized at run time with one scale per group of
  G consecutive K values of a token (`"group"`: x_scale [M, ceil(K / G)], G from `activation_group_size(K)`) or one
  per token (`"token"`: x_scale [M], the engine's default for taller inputs); scale = amax(|values it covers|) / 448;
  or, for a checkpoint that carries them, with one static scale per linear fixed ahead (its calibrated
  `input_scale`: quantize_static, x_scale [M] all equal, values past 448 x scale saturate);
- y = (x_q * x_scale) @ (W_q * w_scale)^T + bias, accumulated in float32, rounded once to x's dtype.

Perplexity over bf16 on the embedded models (SmolLM2-135M / Gemma-3-270M, docs/benchmarks.md, "FP8", 2026-12-06):
per-token activation scales cost +1.82% / +2.57% as the weights come, +0.73% / +1.11% after the smoothing that
quantize-at-load applies (model/smoothing.py, alpha 0.75); weight-only costs +1.17% / +1.15%, smoothed +0.05% /
+0.75%, and at decode sizes it is also the fastest (the step reads the weights; x is small).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12  # a row of zeros gets this amax (its scale stays finite, its values 0)
SCALE_BLOCK = 128  # block-wise weight scales cover SCALE_BLOCK x SCALE_BLOCK tiles of W
ACTIVATION_SCALES = ("none", "group", "token")  # weight-only; one e4m3 scale per group of K values; one per token
ACTIVATION_GROUP = 64  # K values per activation scale with "group" (activation_group_size)


def activation_group_size(k: int) -> int:
    """K values per activation scale for a linear of input width K: ACTIVATION_GROUP (64) for every K (every K of the
    registry's models is a multiple of 64; any other K runs with ceil(K / 64) groups, the last one shorter). Why not
    128 where K allows it (DeepSeek-V3's groups): on SmolLM2-135M, groups of 128 for its 1536-wide down projection
    and 64 for its 576-wide inputs cost +2.34% perplexity over bf16, past the 2% line, where groups of 64 throughout
    cost +1.69% (docs/benchmarks.md, "FP8"). 64 divides 128, so a 128 x 128 weight block holds whole groups and a
    kernel's K tile (a power of two) lies inside one group or covers whole groups."""
    return ACTIVATION_GROUP


def _per_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, correctly rounded on every device (the kernels' div_rn): CUDA torch divides by a Python scalar as a
    multiplication by its rounded reciprocal, which is one ulp off for some values, and so a few quantized bytes."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of x [M, K] (a float dtype): (x_q [M, K] e4m3, scale [M] float32), x ~= x_q * scale.
    Used for activations (per token) and for weights at load (per output channel). Out-of-range values cannot occur
    (the scale comes from the row's own amax); the clamp only guards the rounding of the largest value."""
    x32 = x.float()
    scale = _per_max(x32.abs().amax(dim=-1).clamp_min(MIN_AMAX))  # [M]
    return (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization of x [M, K] with one scale per group of `group` consecutive values of a row: (x_q [M, K]
    e4m3, scale [M, ceil(K / group)] float32), x ~= x_q * expand_group_scales(scale, K, group). The last group is
    shorter when group does not divide K."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = _per_max(padded.view(m, groups, group).abs().amax(dim=-1).clamp_min(MIN_AMAX))  # [M, groups]
    x_q = (x.float() / expand_group_scales(scale, k, group)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_q, scale


def expand_group_scales(scale: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """Group scales [M, ceil(K / group)] -> one scale per value [M, K]."""
    return scale.repeat_interleave(group, 1)[:, :k]


def check_activation_scale(activation_scale: str) -> None:
    """Raise ValueError unless activation_scale names one of ACTIVATION_SCALES."""
    if activation_scale not in ACTIVATION_SCALES:
        raise ValueError(f"activation_scale must be one of {ACTIVATION_SCALES}, got {activation_scale!r}")


def quantize_activations(x: torch.Tensor, activation_scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q e4m3, x_scale): [M, ceil(K / G)] for "group" (G = activation_group_size(K)), [M] for
    "token"."""
    check_activation_scale(activation_scale)
    if activation_scale == "none":
        raise ValueError("activation_scale 'none' (weight-only) quantizes no activations")
    if activation_scale == "group":
        return quantize_groups(x, activation_group_size(x.shape[-1]))
    return quantize_rows(x)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized with one static scale (input_scale: one float value, a checkpoint's calibrated activation
    scale, x ~= x_q * input_scale): (x_q [M, K] e4m3, x_scale [M] float32, every entry input_scale), the per-token
    layout every FP8 product here takes. Values past 448 x input_scale saturate at +-448."""
    if input_scale.numel() != 1:
        raise ValueError(f"a static activation scale is one value per linear, got shape {tuple(input_scale.shape)}")
    scale = input_scale.float().reshape(1)
    x_q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_q, scale.expand(x.shape[0]).contiguous()


def dequantize_activations(x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M] (per token) or [M, ceil(K / G)] (per group, G = activation_group_size(K))
    -> x [M, K] float32."""
    m, k = x_q.shape
    if x_scale.dim() == 2:
        group = activation_group_size(k)
        if tuple(x_scale.shape) != (m, -(-k // group)):
            raise ValueError(f"group scales of x [{m}, {k}] must be [{m}, {-(-k // group)}], got {tuple(x_scale.shape)}")
        return x_q.float() * expand_group_scales(x_scale.float(), k, group)
    return x_q.float() * x_scale.float()[:, None]


def quantize_weight(w: torch.Tensor, steps: int = 32, chunk_elements: int = 1 << 24
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-output-channel e4m3 quantization of a weight W [N, K] with the scale of least squared error: (W_q, scale [N]).

    e4m3 keeps 3 mantissa bits, so a value's rounding error depends on where it falls inside its power-of-two
    interval, and that moves with the scale. Scales amax * c / 448 for c in [1, 2) (c >= 1 keeps the largest value
    representable; c = 2 would repeat c = 1 one interval down) are tried in `steps` steps and each row keeps the one
    whose dequantized row is closest to W (never worse than amax / 448, c = 1, which is among them; the perplexity
    cost on the embedded models is in docs/benchmarks.md, "FP8"). Rows are processed chunk_elements at a time."""
    n, k = w.shape
    w_q = torch.empty(n, k, dtype=FP8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    rows = max(1, chunk_elements // max(k, 1))
    for r0 in range(0, n, rows):
        w32 = w[r0 : r0 + rows].float()
        amax = w32.abs().amax(dim=-1).clamp_min(MIN_AMAX)
        best_scale, best_err = None, None
        for i in range(steps):
            s = _per_max(amax * (1.0 + i / steps))
            err = ((w32 / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s[:, None] - w32).square().sum(-1)
            if best_scale is None:
                best_scale, best_err = s, err
            else:
                better = err < best_err
                best_scale = torch.where(better, s, best_scale)
                best_err = torch.where(better, err, best_err)
        scale[r0 : r0 + rows] = best_scale
        w_q[r0 : r0 + rows] = (w32 / best_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w_q, scale


def quantize_blocks(w: torch.Tensor, block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization of W [N, K]: (W_q, scale [ceil(N / block), ceil(K / block)] float32)."""
    n, k = w.shape
    w32 = w.float()
    padded = torch.zeros(-(-n // block) * block, -(-k // block) * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w32
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = _per_max(tiles.abs().amax(dim=(1, 3)).clamp_min(MIN_AMAX))  # [N / block, K / block]
    return (w32 / expand_block_scales(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand_block_scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(N / b), ceil(K / b)] -> one scale per element [N, K] (b = SCALE_BLOCK)."""
    return scale.repeat_interleave(SCALE_BLOCK, 0)[:n].repeat_interleave(SCALE_BLOCK, 1)[:, :k]


def dequantize_weight(w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W_q [N, K] e4m3 and its scales (per channel [N], or block-wise 2-d) -> W [N, K] float32."""
    if w_scale.dim() == 2:
        return w_q.float() * expand_block_scales(w_scale.float(), *w_q.shape)
    return w_q.float() * w_scale.float()[:, None]


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               activation_scale: str = "group") -> torch.Tensor:  # fmt: skip
    """x [M, K] -> [M, N] in x's dtype: x quantized (per group of K values, or per token), then dequantize-and-multiply
    in float32; "none": weight_only_linear."""
    if activation_scale == "none":
        return weight_only_linear(x, w_q, w_scale, bias)
    x_q, x_scale = quantize_activations(x, activation_scale)
    return fp8_matmul_quantized(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def fp8_linear_static(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> [M, N] in x's dtype: x quantized with a static activation scale (quantize_static), then
    dequantize-and-multiply in float32."""
    x_q, x_scale = quantize_static(x, input_scale)
    return fp8_matmul_quantized(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def weight_only_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
                       ) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> [M, N] in x's dtype: weight-only FP8, x as it is (no activation quantization) times the dequantized
    weight, in float32. What the weight-only GEMV (kernels/gemv.py with w_scale) computes; with its gated activation
    fused, x is fused_reference.act_mul(gate_up) (rounded to the model dtype, as the model's torch path rounds it)."""
    y = x.float() @ dequantize_weight(w_q, w_scale).T  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_matmul_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The product of an already quantized x_q [M, K] (scales [M] or [M, groups]) with W_q: what fp8_gemm computes
    for e4m3 x."""
    y = dequantize_activations(x_q, x_scale) @ dequantize_weight(w_q, w_scale).T  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V [T, KVH, D] (any float dtype) -> e4m3 with one scale per kv head ([KVH]): round(x / scale), saturating.
    What an e4m3 KV pool stores (cache/kv_pool.py computes the same)."""
    return (x.float() / scale.float()[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
