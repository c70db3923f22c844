"""FP8 GEMM layout choices measured per GPU model, checked in so an engine starts without measuring (as
kernels/gemv_table.py does for bf16). Keys: (n, k, rows); a value is the Triton layout (kernels/fp8_gemm.py) that
beat quantize + `torch._scaled_mm` by more than 2%, or None (cuBLAS at least as fast). Shapes, row counts or GPUs
not listed run quantize + `_scaled_mm`; `prefixrt/model/fp8_linear.fp8_plan_for(..., mode="measure")` measures them instead.

benchmarks/gpu_fp8.py measures the Llama-3-8B shapes and prints the lines to paste here.
"""

from __future__ import annotations

from prefixrt.kernels.fp8_gemm import Fp8GemmConfig

# GPU name -> {(n, k, rows): config or None}
MEASURED: dict[str, dict[tuple[int, int, int], Fp8GemmConfig | None]] = {
    # benchmarks/gpu_fp8.py, 2026-12-04 (benchmarks/results/h200-fp8-layouts.json); Fp8GemmConfig(block_n, block_k,
    # num_warps, num_stages, quantize_input)
    "NVIDIA H200": {
        (6144, 4096, 1): Fp8GemmConfig(32, 256, 4, 4, False),  # qkv: quantize+_scaled_mm 22.36 us, best layout 15.21 us
        (6144, 4096, 2): Fp8GemmConfig(32, 256, 4, 4, False),  # qkv: quantize+_scaled_mm 23.17 us, best layout 15.04 us
        (6144, 4096, 4): Fp8GemmConfig(32, 256, 4, 4, False),  # qkv: quantize+_scaled_mm 23.02 us, best layout 15.06 us
        (6144, 4096, 8): Fp8GemmConfig(32, 256, 4, 4, False),  # qkv: quantize+_scaled_mm 22.31 us, best layout 15.02 us
        (6144, 4096, 16): Fp8GemmConfig(32, 256, 4, 4, False),  # qkv: quantize+_scaled_mm 22.11 us, best layout 15.70 us
        (6144, 4096, 32): Fp8GemmConfig(32, 256, 4, 3, False),  # qkv: quantize+_scaled_mm 21.07 us, best layout 18.97 us
        (6144, 4096, 64): Fp8GemmConfig(32, 256, 4, 3, False),  # qkv: quantize+_scaled_mm 18.41 us, best layout 16.15 us
        (4096, 4096, 1): Fp8GemmConfig(32, 256, 4, 4, False),  # o: quantize+_scaled_mm 18.22 us, best layout 13.20 us
        (4096, 4096, 2): Fp8GemmConfig(32, 256, 4, 4, False),  # o: quantize+_scaled_mm 18.1 us, best layout 13.04 us
        (4096, 4096, 4): Fp8GemmConfig(32, 256, 4, 4, False),  # o: quantize+_scaled_mm 18.49 us, best layout 12.79 us
        (4096, 4096, 8): Fp8GemmConfig(32, 256, 4, 4, False),  # o: quantize+_scaled_mm 17.67 us, best layout 12.81 us
        (4096, 4096, 16): Fp8GemmConfig(32, 256, 4, 4, False),  # o: quantize+_scaled_mm 17.59 us, best layout 13.70 us
        (4096, 4096, 32): Fp8GemmConfig(32, 256, 4, 3, False),  # o: quantize+_scaled_mm 17.61 us, best layout 16.71 us
        (4096, 4096, 64): Fp8GemmConfig(32, 256, 4, 3, False),  # o: quantize+_scaled_mm 17.64 us, best layout 14.44 us
        (28672, 4096, 1): Fp8GemmConfig(128, 128, 8, 4, False),  # gate_up: quantize+_scaled_mm 53.56 us, best layout 37.10 us
        (28672, 4096, 2): Fp8GemmConfig(64, 128, 4, 4, False),  # gate_up: quantize+_scaled_mm 52.09 us, best layout 36.97 us
        (28672, 4096, 4): Fp8GemmConfig(64, 128, 4, 4, False),  # gate_up: quantize+_scaled_mm 51.43 us, best layout 37.36 us
        (28672, 4096, 8): Fp8GemmConfig(64, 128, 4, 4, False),  # gate_up: quantize+_scaled_mm 51.82 us, best layout 38.45 us
        (28672, 4096, 16): Fp8GemmConfig(128, 128, 8, 4, False),  # gate_up: quantize+_scaled_mm 54.2 us, best layout 38.16 us
        (28672, 4096, 32): Fp8GemmConfig(64, 128, 4, 3, False),  # gate_up: quantize+_scaled_mm 52.55 us, best layout 42.65 us
        (28672, 4096, 64): Fp8GemmConfig(64, 128, 4, 3, False),  # gate_up: quantize+_scaled_mm 53.47 us, best layout 39.74 us
        (4096, 14336, 1): Fp8GemmConfig(32, 256, 4, 4, False),  # down: quantize+_scaled_mm 55.19 us, best layout 37.73 us
        (4096, 14336, 2): Fp8GemmConfig(32, 256, 4, 4, False),  # down: quantize+_scaled_mm 56.25 us, best layout 37.66 us
        (4096, 14336, 4): Fp8GemmConfig(32, 256, 4, 4, False),  # down: quantize+_scaled_mm 57.55 us, best layout 38.37 us
        (4096, 14336, 8): Fp8GemmConfig(32, 256, 4, 4, False),  # down: quantize+_scaled_mm 55.07 us, best layout 38.21 us
        (4096, 14336, 16): Fp8GemmConfig(32, 256, 4, 4, False),  # down: quantize+_scaled_mm 52.97 us, best layout 40.71 us
        (4096, 14336, 32): None,  # down: quantize+_scaled_mm 52.26 us, best layout 51.81 us
        (4096, 14336, 64): Fp8GemmConfig(32, 256, 4, 3, False),  # down: quantize+_scaled_mm 51.8 us, best layout 44.16 us
    },
}
