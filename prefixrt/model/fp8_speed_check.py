"""The start-up check that FP8 weights pay on this GPU: a model's FP8 linears timed against bf16 before serving.

FP8 weights are chosen for speed (and memory). On a GPU whose kernels or layout table serve them badly (a GPU model
kernels/fp8_table.py does not know, a bad table entry), they can be slower than the bf16 weights they replace.
`check_fp8_speed` times what a decode step's FP8 linears cost against bf16 cuBLAS on weights of the same shapes
(each distinct shape once, counted as often as the model has it, at 1 and 64 rows, inside CUDA graphs with the
weights cycled past the L2 cache, as decode runs them). If FP8 is slower:
- "fallback" (the default): one log line says so, and the FP8 linears get bf16 weights (their e4m3 values
  dequantized: the same numbers, in the model's dtype) before the KV pool is sized and the plans are made;
- "error": FP8 was asked for at any price: start-up fails with a message naming both times;
- "off": no check (FP8 as configured).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("prefixrt")

SPEED_CHECKS = ("fallback", "error", "off")
CHECK_ROWS = (1, 64)  # decode batch sizes the check times (batch 1 and a full GEMV batch)
MARGIN = 1.02  # FP8 counts as slower only beyond this factor (timing noise must not flip the choice)


@dataclass(frozen=True)
class SpeedCheck:
    fp8_us: float  # the FP8 linears of one pass at each of CHECK_ROWS rows, summed
    bf16_us: float  # the same with bf16 weights through cuBLAS

    @property
    def fp8_slower(self) -> bool:
        return self.fp8_us > MARGIN * self.bf16_us

    def describe(self) -> str:
        return (f"FP8 linears {self.fp8_us / 1000:.2f} ms against bf16 {self.bf16_us / 1000:.2f} ms for one pass at "
                f"{' and '.join(map(str, CHECK_ROWS))} rows on {torch.cuda.get_device_name()}")


def _on_gpu(modules: list[nn.Module]) -> bool:
    return modules[0].weight.device.type == "cuda"


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """The model's linears holding FP8 weights."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and getattr(m, "weight_scale", None) is not None]


def time_fp8_linears(model: nn.Module, dtype: torch.dtype) -> SpeedCheck:
    """Time the model's FP8 linears against bf16 (see the module docstring). CUDA only."""
    modules = fp8_modules(model)
    shapes = Counter((tuple(m.weight.shape), m.weight_scale.dim(), m.fp8_activation_scale) for m in modules)
    fp8_us = bf16_us = 0.0
    for (shape, scale_dim, scheme), count in shapes.items():
        example = next(m for m in modules if tuple(m.weight.shape) == shape and m.weight_scale.dim() == scale_dim)
        fp8, bf16 = _time_shape(example, scheme, dtype)
        fp8_us += count * fp8
        bf16_us += count * bf16
    torch.cuda.empty_cache()
    return SpeedCheck(fp8_us, bf16_us)


def _time_shape(linear: nn.Module, scheme: str, dtype: torch.dtype, l2_bytes: int = 128 << 20) -> tuple[float, float]:
    """(FP8 us, bf16 us) of one linear's shape summed over CHECK_ROWS: its FP8 weight (copies cycled past L2) with
    its plan, against random bf16 weights of the same shape through cuBLAS."""
    from prefixrt.kernels.gemv import graph_time_us
    from prefixrt.model.fp8_linear import fp8_linear, fp8_plan_for

    n, k = linear.weight.shape
    device = linear.weight.device
    plan = fp8_plan_for(linear.weight, linear.weight_scale)
    copies = max(2, min(8, -(-2 * l2_bytes // (n * k))))
    w_q = [linear.weight.clone() for _ in range(copies)]
    w16 = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
    fp8_us = bf16_us = 0.0
    for rows in CHECK_ROWS:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        fp8_us += graph_time_us(lambda i, x=x: fp8_linear(x, w_q[i], linear.weight_scale, None, plan, scheme), copies)
        bf16_us += graph_time_us(lambda i, x=x: torch.nn.functional.linear(x, w16[i]), copies)
    return fp8_us, bf16_us


@torch.no_grad()
def serve_dequantized(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every FP8 linear its weights dequantized to `dtype` (and no scales): the same values, served by the bf16
    paths. Returns the number of linears changed."""
    from prefixrt.kernels.fp8_reference import dequantize_weight

    modules = fp8_modules(model)
    for m in modules:
        m.weight = nn.Parameter(dequantize_weight(m.weight.data, m.weight_scale.data).to(dtype), requires_grad=False)
        m.weight_scale = None
        m.fp8_plan = {}
    if modules and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return len(modules)


def check_fp8_speed(model: nn.Module, dtype: torch.dtype, mode: str = "fallback", say=None) -> SpeedCheck | None:
    """Run the check of the module docstring on a CUDA model with FP8 linears (None when there is nothing to check
    or mode is "off"). Mutates the model when it falls back; raises RuntimeError with mode "error"."""
    if mode not in SPEED_CHECKS:
        raise ValueError(f"fp8 speed check must be one of {SPEED_CHECKS}, got {mode!r}")
    modules = fp8_modules(model)
    if mode == "off" or not modules or not _on_gpu(modules):
        return None
    result = time_fp8_linears(model, dtype)
    say = say or log.info
    if not result.fp8_slower:
        say(f"FP8 weights: {result.describe()}")
        return result
    if mode == "error":
        raise RuntimeError(f"FP8 weights would be slower than bf16 here ({result.describe()}); start with "
                           f"fp8_speed_check='fallback' to serve bf16 weights, or measure this GPU's FP8 layouts "
                           f"(benchmarks/gpu_fp8_gemv.py) into kernels/fp8_table.py")
    serve_dequantized(model, dtype)
    say(f"FP8 weights would be slower than bf16 on this GPU ({result.describe()}): serving them as {dtype} "
        f"(dequantized) instead")
    return result
