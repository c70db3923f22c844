"""How a linear layer with FP8 (e4m3) weights computes when its checkpoint fixed the activations' scale ahead: one
static, calibrated `input_scale` per linear (compressed-tensors' static per-tensor input activations, transformers'
`fp8` with `activation_scheme: "static"`; hub/fp8_checkpoint.py reads them, model/quantize.set_static_activation_scales
puts them on the Linear).

- An input of at most model/fp8_linear.WEIGHT_ONLY_MAX_ROWS rows (a decode batch) runs weight-only, as it does under
  every scheme (model/fp8_linear.py: the weights' bytes are the step's cost, and unquantized activations are the more
  accurate choice).
- A taller input is quantized with the checkpoint's scale instead of one computed from each token, which is what the
  checkpoint was calibrated and published for (kernels/fp8_reference.quantize_static: x_q = saturate(x /
  input_scale), one scale for every row), then multiplied as per-token scales whose entries are all equal:
  on the CPU (any device without CUDA) the torch reference, dequantize then multiply in float32; on CUDA cuBLAS's FP8
  GEMM with row-wise scales (`torch._scaled_mm`) where it runs and the weight fits it, else the Triton FP8 GEMM
  given the quantized input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixrt.kernels.fp8_reference import fp8_matmul_quantized, quantize_static
from prefixrt.model.fp8_linear import WEIGHT_ONLY_MAX_ROWS, fp8_linear

if TYPE_CHECKING:
    from prefixrt.kernels.gemv import GemvConfig


def fp8_linear_static(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      input_scale: torch.Tensor, plan: dict[int, GemvConfig]) -> torch.Tensor:  # fmt: skip
    """x [..., K] (float) -> [..., N] in x's dtype: (weight * weight_scale) times x as it is (a decode batch: plan
    holds the weight-only layouts, Linear.fp8_plan) or x quantized with the static input_scale (one value), plus
    bias."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
        return fp8_linear(x, weight, weight_scale, bias, plan, "none")
    x_q, x_scale = quantize_static(x2, input_scale)  # [M, K] e4m3, [M] float32 (all input_scale)
    if x2.is_cuda:
        y = gemm_quantized(x_q, x_scale, weight, weight_scale, bias, x.dtype)
    else:
        y = fp8_matmul_quantized(x_q, x_scale, weight, weight_scale, bias, x.dtype)
    return y.view(*lead, y.shape[-1])


def gemm_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The kernels' product of an e4m3 input x_q [M, K] with per-row scales x_scale [M] (float32, contiguous) and the
    FP8 weight: cuBLAS's `_scaled_mm` where it runs and the weight fits it (per-channel scales, N and K multiples of
    16), the Triton FP8 GEMM otherwise (block-wise scales included)."""
    from prefixrt.kernels import fp8_gemm

    if fp8_gemm.scaled_mm_supported(x_q.device) and fp8_gemm.scaled_mm_fits(weight, weight_scale):
        return fp8_gemm.scaled_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype)
    return fp8_gemm.fp8_gemm(x_q, weight, weight_scale, bias, fp8_gemm.Fp8GemmConfig(), x_scale=x_scale,
                             out_dtype=out_dtype, activation_scale="token")
