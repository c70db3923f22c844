"""FP8 GEMM layout choices measured per GPU model, checked in so an engine starts without measuring (as
kernels/gemv_table.py does for bf16). Keys: (n, k, rows); a value is the Triton layout (kernels/fp8_gemm.py) that
beat quantize + `torch._scaled_mm` by more than 2%, or None (cuBLAS at least as fast). Shapes, row counts or GPUs
not listed run quantize + `_scaled_mm`; `model.fp8.fp8_plan_for(..., mode="measure")` measures them instead.

benchmarks/gpu_fp8.py measures the Llama-3-8B shapes and prints the lines to paste here.
"""

from __future__ import annotations

from prefixrt.kernels.fp8_gemm import Fp8GemmConfig

# GPU name -> {(n, k, rows): config or None}
MEASURED: dict[str, dict[tuple[int, int, int], Fp8GemmConfig | None]] = {}
