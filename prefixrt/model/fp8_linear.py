"""How a linear layer with FP8 (e4m3) weights computes, and which kernel serves which batch size.

A Linear holds FP8 weights when its `weight_scale` is set (model/quantize.py puts them there): `weight` [N, K] e4m3
and `weight_scale` [N] (per output channel) or [ceil(N / 128), ceil(K / 128)] (128 x 128 blocks).

The scheme (kernels/fp8_reference.py states it; every path below computes it, on every device):
- an input of at most WEIGHT_ONLY_MAX_ROWS rows (a decode batch) runs weight-only: x as it is (bf16) times the
  dequantized weight. Decode is bound by reading the weights, so half their bytes is the whole gain, and leaving
  the activations unquantized is also the more accurate choice;
- a taller input (prefill, large decode batches) follows the Linear's `fp8_activation_scale`: "token" (one scale
  per token, what cuBLAS's FP8 GEMM takes: the fastest at large batches, and the default; the least accurate
  without the smoothing quantize-at-load applies first, model/smoothing.py), "none" (weight-only as well) or
  "group" (activations quantized per group of 64 K values of a token); docs/benchmarks.md, "FP8".

The kernels:
- weight-only on CUDA: kernels/gemv.py with `w_scale` (e4m3 tiles widened in registers), its layout per row count
  from the Linear's plan (`fp8_plan_for`: measured per GPU model and checked in as kernels/fp8_table.py; a GPU not
  in the table gets the default layouts, or measures them with mode "measure");
- "group": the Triton w8a8 GEMM (kernels/fp8_gemm.py); "token": per-token quantization, then cuBLAS's FP8 GEMM
  (`torch._scaled_mm`), or the Triton GEMM where that cannot run (an older GPU, block scales, N or K not multiples of
  16);
- the CPU: the torch references (the oracle the kernels are tested against).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prefixrt.kernels.gemv import GemvConfig

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
WEIGHT_ONLY_MAX_ROWS = 64  # inputs of at most this many rows run weight-only whatever fp8_activation_scale says
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode row counts measured; others take the next measured one up
LARGE_ROWS = (128, 256, 1024)  # taller inputs (weight-only): the layout of the next of these up, else the last
PLAN_MODES = ("table", "measure", "always", "never")


@functools.cache
def _kernels() -> SimpleNamespace:
    """The Triton kernels, imported on first use (the CPU path never needs Triton)."""
    from prefixrt.kernels import fp8_gemm, gemv

    return SimpleNamespace(gemv=gemv.gemv, GemvConfig=gemv.GemvConfig, choose_weight_only=gemv.choose_weight_only_config,
                           fp8_gemm=fp8_gemm.fp8_gemm, quantize_activations=fp8_gemm.quantize_activations,
                           scaled_mm=fp8_gemm.scaled_mm, scaled_mm_supported=fp8_gemm.scaled_mm_supported,
                           scaled_mm_fits=fp8_gemm.scaled_mm_fits, Fp8GemmConfig=fp8_gemm.Fp8GemmConfig)


def weight_only(rows: int, activation_scale: str) -> bool:
    """Whether an input of `rows` rows runs weight-only under this activation scheme (see the module docstring)."""
    return rows <= WEIGHT_ONLY_MAX_ROWS or activation_scale == "none"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               plan: dict[int, GemvConfig], activation_scale: str = "none") -> torch.Tensor:  # fmt: skip
    """x [..., K] (float) -> [..., N] in x's dtype: x @ (weight * scale)^T + bias under the scheme of the module
    docstring. plan: rows -> weight-only layout (Linear.fp8_plan; empty: the default layouts)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if weight_only(rows, activation_scale) and (x2.is_cuda or plan):  # (a plan on the CPU: Triton's interpreter)
        y = _kernels().gemv(x2, weight, bias, plan_config(plan, rows, weight_scale.dim() == 2), w_scale=weight_scale)
    elif not x2.is_cuda:
        from prefixrt.kernels import fp8_reference

        y = fp8_reference.fp8_linear(x2, weight, weight_scale, bias, "none" if weight_only(rows, activation_scale)
                                     else activation_scale)
    else:
        k = _kernels()
        if (activation_scale == "token" and k.scaled_mm_supported(x2.device)
                and k.scaled_mm_fits(weight, weight_scale)):  # fmt: skip
            x_q, x_scale = k.quantize_activations(x2, "token")
            y = k.scaled_mm(x_q, x_scale, weight, weight_scale, bias, x2.dtype)
        else:
            y = k.fp8_gemm(x2, weight, weight_scale, bias, k.Fp8GemmConfig(), activation_scale=activation_scale)
    return y.view(*lead, y.shape[-1])


def default_config(rows: int, block_scales: bool) -> GemvConfig:
    """The weight-only layout for `rows` rows where the plan has none (a GPU not in the table): the small-row layout
    that was fastest or near it for every Llama-3-8B shape on an H100, and a 128-row tiling for tall inputs."""
    config_cls = _kernels().GemvConfig
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return config_cls(32, 128 if block_scales else 256, 1, 4, 4 if rows <= 16 else 3)
    return config_cls(128, 64, 1, 8, 4, block_m=128, swap_ab=False)


def plan_config(plan: dict[int, GemvConfig], rows: int, block_scales: bool) -> GemvConfig:
    """The weight-only layout for an input of `rows` rows: the plan's (a row count up to WEIGHT_ONLY_MAX_ROWS, or the
    next LARGE_ROWS bucket up, else the last one), else default_config."""
    key = rows if rows <= WEIGHT_ONLY_MAX_ROWS else next((r for r in LARGE_ROWS if r >= rows), LARGE_ROWS[-1])
    config = plan.get(key)
    return config if config is not None else default_config(rows, block_scales)


_CHOICES: dict[tuple, GemvConfig] = {}  # (n, k, rows, block, gpu) -> measured in this process


def _table_choice(n: int, k: int, rows: int, block: bool, gpu: str) -> GemvConfig | None:
    from prefixrt.kernels.fp8_table import MEASURED

    config = MEASURED.get(gpu, {}).get((n, k, rows))
    if config is not None and block and 128 % config.block_k:  # (the table is measured with per-channel scales)
        config = None
    return config


def fp8_plan_for(weight: torch.Tensor, weight_scale: torch.Tensor, mode: str = "table") -> dict[int, GemvConfig]:
    """rows -> weight-only layout for one FP8 weight: keys 1..WEIGHT_ONLY_MAX_ROWS and LARGE_ROWS (plan_config reads
    it). mode: "table" (CUDA: the layouts measured on this GPU model and checked in, kernels/fp8_table.py; shapes or
    GPUs not in it get default_config), "measure" (CUDA: like "table", shapes missing from it measured now, once per
    shape and process), "always" (default_config for every key: tests, the interpreter) or "never" (an empty plan:
    default_config at run time)."""
    if mode not in PLAN_MODES:
        raise ValueError(f"fp8 plan mode must be one of {PLAN_MODES}, got {mode!r}")
    block = weight_scale.dim() == 2
    if mode == "never":
        return {}
    if mode == "always" or weight.device.type != "cuda":
        return {rows: default_config(rows, block) for rows in (*range(1, WEIGHT_ONLY_MAX_ROWS + 1), *LARGE_ROWS)}
    n, k = weight.shape
    gpu = torch.cuda.get_device_name(weight.device)
    measured = {}
    for rows in (*MEASURED_ROWS, *LARGE_ROWS):
        key = (n, k, rows, block, gpu)
        config = _CHOICES.get(key) or _table_choice(n, k, rows, block, gpu)
        if config is None and mode == "measure":
            config = _CHOICES[key] = _kernels().choose_weight_only(n, k, rows, weight.device, block)[0]
        measured[rows] = config if config is not None else default_config(rows, block)
    plan = expand_plan({r: measured[r] for r in MEASURED_ROWS}, WEIGHT_ONLY_MAX_ROWS)
    plan.update({rows: measured[rows] for rows in LARGE_ROWS})
    return plan


def expand_plan(measured: dict, max_rows: int) -> dict:
    """{measured row count (MEASURED_ROWS): config or None} -> {rows 1..max_rows: config}, each row count taking the
    next measured one up; None leaves the row count out. Also builds the bf16 GEMV plans (layers.gemv_plan_for)."""
    plan = {}
    for rows in range(1, max_rows + 1):
        config = measured[next(m for m in MEASURED_ROWS if m >= rows)]
        if config is not None:
            plan[rows] = config
    return plan

