"""How a linear layer with FP8 (e4m3) weights computes, and which kernel serves which batch size.

A Linear holds FP8 weights when its `weight_scale` is set (model/quantize.py puts them there): `weight` [N, K] e4m3
and `weight_scale` [N] (per output channel) or [ceil(N / 128), ceil(K / 128)] (128 x 128 blocks). Activations are
quantized at run time, with the Linear's `fp8_activation_scale`: one scale per group of 64 K values of a
token ("group", the default: the one within the acceptance's perplexity line, docs/benchmarks.md "FP8") or one per
token ("token"). kernels/fp8_reference.py states the scheme; every path below computes it:
- the CPU (and any device without a plan entry and without CUDA): the torch reference, dequantize then multiply in
  float32 (the oracle the kernels are tested against);
- CUDA, a row count the plan maps to a Triton layout (the small batches of decode; chosen from the measured table,
  kernels/fp8_table.py): the Triton FP8 GEMM;
- CUDA otherwise, per-token scales: per-token quantization, then cuBLAS's FP8 GEMM (`torch._scaled_mm`, row-wise
  scales); where that cannot run (an older GPU or torch, block-wise scales, N or K not a multiple of 16), the Triton
  GEMM;
- CUDA otherwise, group scales: the Triton GEMM in its default layout (cuBLAS's row-wise path takes one scale per
  token; its speed at prefill sizes is not measured yet).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from prefixrt.kernels.fp8_reference import check_activation_scale

if TYPE_CHECKING:
    from prefixrt.kernels.fp8_gemm import Fp8GemmConfig

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
MAX_PLAN_ROWS = 64  # row counts a plan covers (= kernels.fp8_gemm.MAX_M)
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts measured; others use the next measured one up
PLAN_MODES = ("table", "measure", "always", "never")


@functools.cache
def _kernels() -> SimpleNamespace:
    """The Triton FP8 kernels, imported on first use (the CPU path never needs Triton)."""
    from prefixrt.kernels import fp8_gemm

    return SimpleNamespace(fp8_gemm=fp8_gemm.fp8_gemm, quantize_activations=fp8_gemm.quantize_activations,
                           run_config=fp8_gemm.run_config, scaled_mm=fp8_gemm.scaled_mm,
                           scaled_mm_supported=fp8_gemm.scaled_mm_supported, scaled_mm_fits=fp8_gemm.scaled_mm_fits,
                           Fp8GemmConfig=fp8_gemm.Fp8GemmConfig, choose_config=fp8_gemm.choose_config)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               plan: dict[int, Fp8GemmConfig], activation_scale: str = "group") -> torch.Tensor:  # fmt: skip
    """x [..., K] (float) -> [..., N] in x's dtype: x @ (weight * scale)^T + bias, x quantized per group of K values
    or per token (activation_scale; see the module docstring for which kernel runs). plan: rows -> Triton layout
    (Linear.fp8_plan)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    config = plan.get(x2.shape[0])
    if config is not None:
        y = _kernels().run_config(x2, weight, weight_scale, bias, config, activation_scale)
    elif not x2.is_cuda:
        from prefixrt.kernels.fp8_reference import fp8_linear as reference

        y = reference(x2, weight, weight_scale, bias, activation_scale)
    else:
        k = _kernels()
        if (activation_scale == "token" and k.scaled_mm_supported(x2.device)
                and k.scaled_mm_fits(weight, weight_scale)):  # fmt: skip
            x_q, x_scale = k.quantize_activations(x2, "token")
            y = k.scaled_mm(x_q, x_scale, weight, weight_scale, bias, x2.dtype)
        else:
            y = k.fp8_gemm(x2, weight, weight_scale, bias, k.Fp8GemmConfig(), activation_scale=activation_scale)
    return y.view(*lead, y.shape[-1])


_CHOICES: dict[tuple, Fp8GemmConfig | None] = {}  # (n, k, rows, block, gpu, activation_scale) -> measured here


def _table_choice(n: int, k: int, rows: int, gpu: str) -> Fp8GemmConfig | None:
    from prefixrt.kernels.fp8_table import MEASURED

    return MEASURED.get(gpu, {}).get((n, k, rows))


def fp8_plan_for(weight: torch.Tensor, weight_scale: torch.Tensor, mode: str = "table",
                 activation_scale: str = "group") -> dict[int, Fp8GemmConfig]:  # fmt: skip
    """rows (1..MAX_PLAN_ROWS) -> Triton layout for one FP8 weight; row counts left out run quantize + _scaled_mm
    (per-token activation scales) or the Triton GEMM's default layout (group scales). mode: "table" (CUDA: the
    layouts measured on this GPU model and checked in, kernels/fp8_table.py; measured with per-token scales, used
    for both), "measure" (CUDA: measured now, once per shape, scheme and process), "always" (the default layout for
    every row count: tests, the interpreter) or "never"."""
    check_activation_scale(activation_scale)
    if mode not in PLAN_MODES:
        raise ValueError(f"fp8 plan mode must be one of {PLAN_MODES}, got {mode!r}")
    if mode == "never":
        return {}
    if mode == "always":
        return {rows: _kernels().Fp8GemmConfig() for rows in range(1, MAX_PLAN_ROWS + 1)}
    if weight.device.type != "cuda":
        return {}
    n, k = weight.shape
    block = weight_scale.dim() == 2
    gpu = torch.cuda.get_device_name(weight.device)
    measured = {}
    for rows in MEASURED_ROWS:
        key = (n, k, rows, block, gpu, activation_scale)
        if mode == "measure" and key not in _CHOICES:
            _CHOICES[key] = _kernels().choose_config(n, k, rows, weight.device, block_scales=block,
                                                     activation_scale=activation_scale)[0]
        if key in _CHOICES:
            measured[rows] = _CHOICES[key]
        else:  # (the table holds per-channel weights' layouts)
            measured[rows] = None if block else _table_choice(n, k, rows, gpu)
    return expand_plan(measured, MAX_PLAN_ROWS)


def expand_plan(measured: dict, max_rows: int) -> dict:
    """{measured row count (MEASURED_ROWS): config or None} -> {rows 1..max_rows: config}, each row count taking the
    next measured one up; None (cuBLAS) leaves the row count out. Also builds the bf16 GEMV plans
    (layers.gemv_plan_for)."""
    plan = {}
    for rows in range(1, max_rows + 1):
        config = measured[next(m for m in MEASURED_ROWS if m >= rows)]
        if config is not None:
            plan[rows] = config
    return plan
