"""Weight-only FP8 layouts (kernels/gemv.py with e4m3 weights) measured per GPU model, checked in so an engine starts
without measuring (as kernels/gemv_table.py does for bf16). Keys: (n, k, rows) with rows one of
model/fp8_linear.MEASURED_ROWS or LARGE_ROWS; a value is the fastest layout measured (per-channel weight scales).
Shapes, row counts or GPUs not listed get model/fp8_linear.default_config; `fp8_plan_for(..., mode="measure")`
measures them instead.

benchmarks/gpu_fp8_gemv.py measures the Llama-3-8B shapes and prints the lines to paste here.
"""

from __future__ import annotations

from prefixrt.kernels.gemv import GemvConfig

# GPU name -> {(n, k, rows): GemvConfig(block_n, block_k, split_k, num_warps, num_stages, block_m, swap_ab)}
MEASURED: dict[str, dict[tuple[int, int, int], GemvConfig]] = {
    # benchmarks/gpu_fp8_gemv.py, 2026-12-06 (benchmarks/results/gpu_fp8_gemv-NVIDIA_H100_80GB_HBM3.json)
    "NVIDIA H100 80GB HBM3": {
        (6144, 4096, 1): GemvConfig(64, 128, 8, 4, 4),  # qkv: bf16 cuBLAS 23.95 us, weight-only 15.68 us
        (6144, 4096, 2): GemvConfig(64, 128, 8, 4, 4),  # qkv: bf16 cuBLAS 21.28 us, weight-only 15.93 us
        (6144, 4096, 4): GemvConfig(64, 128, 8, 4, 4),  # qkv: bf16 cuBLAS 21.34 us, weight-only 16.16 us
        (6144, 4096, 8): GemvConfig(32, 256, 1, 4, 4),  # qkv: bf16 cuBLAS 21.28 us, weight-only 16.12 us
        (6144, 4096, 16): GemvConfig(64, 128, 8, 4, 4),  # qkv: bf16 cuBLAS 21.45 us, weight-only 16.40 us
        (6144, 4096, 32): GemvConfig(128, 128, 8, 8, 3),  # qkv: bf16 cuBLAS 22.13 us, weight-only 18.46 us
        (6144, 4096, 64): GemvConfig(64, 128, 8, 4, 3, 0, True),  # qkv: bf16 cuBLAS 21.04 us, weight-only 23.47 us
        (4096, 4096, 1): GemvConfig(32, 256, 4, 4, 4),  # o: bf16 cuBLAS 15.76 us, weight-only 12.09 us
        (4096, 4096, 2): GemvConfig(32, 256, 4, 4, 4),  # o: bf16 cuBLAS 15.69 us, weight-only 11.67 us
        (4096, 4096, 4): GemvConfig(32, 256, 4, 4, 4),  # o: bf16 cuBLAS 15.55 us, weight-only 11.72 us
        (4096, 4096, 8): GemvConfig(32, 256, 4, 4, 4),  # o: bf16 cuBLAS 15.68 us, weight-only 11.72 us
        (4096, 4096, 16): GemvConfig(32, 256, 4, 4, 4),  # o: bf16 cuBLAS 15.91 us, weight-only 11.98 us
        (4096, 4096, 32): GemvConfig(64, 128, 8, 4, 3),  # o: bf16 cuBLAS 14.87 us, weight-only 13.65 us
        (4096, 4096, 64): GemvConfig(128, 128, 8, 8, 3, 0, True),  # o: bf16 cuBLAS 15.28 us, weight-only 16.05 us
        (28672, 4096, 1): GemvConfig(32, 256, 1, 4, 4),  # gate_up: bf16 cuBLAS 83.78 us, weight-only 48.22 us
        (28672, 4096, 2): GemvConfig(32, 256, 1, 4, 4),  # gate_up: bf16 cuBLAS 84.13 us, weight-only 46.52 us
        (28672, 4096, 4): GemvConfig(32, 256, 1, 4, 4),  # gate_up: bf16 cuBLAS 86.94 us, weight-only 47.59 us
        (28672, 4096, 8): GemvConfig(32, 256, 1, 4, 4),  # gate_up: bf16 cuBLAS 84.76 us, weight-only 49.34 us
        (28672, 4096, 16): GemvConfig(32, 256, 1, 4, 4),  # gate_up: bf16 cuBLAS 84.90 us, weight-only 48.48 us
        (28672, 4096, 32): GemvConfig(64, 128, 1, 4, 3, 0, True),  # gate_up: bf16 cuBLAS 82.27 us, weight-only 55.88 us
        (28672, 4096, 64): GemvConfig(128, 128, 1, 8, 3, 0, True),  # gate_up: bf16 cuBLAS 84.35 us, weight-only 68.66 us
        (4096, 14336, 1): GemvConfig(32, 256, 4, 4, 4),  # down: bf16 cuBLAS 44.14 us, weight-only 28.02 us
        (4096, 14336, 2): GemvConfig(32, 256, 4, 4, 4),  # down: bf16 cuBLAS 44.31 us, weight-only 27.40 us
        (4096, 14336, 4): GemvConfig(32, 256, 4, 4, 4),  # down: bf16 cuBLAS 44.49 us, weight-only 27.67 us
        (4096, 14336, 8): GemvConfig(32, 256, 4, 4, 4),  # down: bf16 cuBLAS 44.45 us, weight-only 28.01 us
        (4096, 14336, 16): GemvConfig(32, 256, 4, 4, 4),  # down: bf16 cuBLAS 45.18 us, weight-only 29.75 us
        (4096, 14336, 32): GemvConfig(64, 128, 8, 4, 3),  # down: bf16 cuBLAS 45.24 us, weight-only 32.34 us
        (4096, 14336, 64): GemvConfig(128, 128, 8, 8, 3, 0, True),  # down: bf16 cuBLAS 46.64 us, weight-only 39.52 us
    },
}
