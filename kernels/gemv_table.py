"""GEMV layout choices measured on an H200 (benchmarks/gpu_fused.py for 1-16 rows, benchmarks/gpu_tune.py --only=gemm
for 32 and 64 rows; Llama-3-8B shapes, bf16), checked in so
an engine starts without measuring. None = cuBLAS was at least as fast (within 2%). Shapes or GPUs not
listed run cuBLAS; `layers.use_fused_kernels(model, gemv="measure")` measures them instead.
"""

from __future__ import annotations

from prefixrt.kernels.gemv import GemvConfig

# GPU name -> {(n, k, rows, act_input): config or None}
MEASURED: dict[str, dict[tuple[int, int, int, str | None], GemvConfig | None]] = {
    "NVIDIA H200": {
        (6144, 4096, 1, None): GemvConfig(32, 256, 1, 4, 4),  # qkv: cuBLAS 17.72 us, best layout 16.76 us
        (6144, 4096, 2, None): None,  # qkv: cuBLAS 16.27 us, best layout 16.71 us
        (6144, 4096, 4, None): None,  # qkv: cuBLAS 16.32 us, best layout 16.29 us
        (6144, 4096, 8, None): None,  # qkv: cuBLAS 16.74 us, best layout 17.01 us
        (6144, 4096, 16, None): None,  # qkv: cuBLAS 16.51 us, best layout 17.34 us
        (6144, 4096, 32, None): None,  # qkv: cuBLAS 16.93 us, best layout 19.54 us
        (6144, 4096, 64, None): None,  # qkv: cuBLAS 18.25 us, best layout 18.21 us
        (4096, 4096, 1, None): GemvConfig(32, 256, 1, 4, 4),  # o: cuBLAS 13.02 us, best layout 12.55 us
        (4096, 4096, 2, None): GemvConfig(32, 256, 1, 4, 4),  # o: cuBLAS 12.91 us, best layout 12.5 us
        (4096, 4096, 4, None): GemvConfig(32, 256, 1, 4, 4),  # o: cuBLAS 13.06 us, best layout 12.39 us
        (4096, 4096, 8, None): GemvConfig(32, 256, 1, 4, 4),  # o: cuBLAS 12.93 us, best layout 12.46 us
        (4096, 4096, 16, None): GemvConfig(32, 256, 1, 4, 4),  # o: cuBLAS 13.11 us, best layout 12.84 us
        (4096, 4096, 32, None): None,  # o: cuBLAS 13.44 us, best layout 13.52 us
        (4096, 4096, 64, None): None,  # o: cuBLAS 12.74 us, best layout 13.02 us
        (28672, 4096, 1, None): GemvConfig(128, 64, 1, 4, 4),  # gate_up: cuBLAS 63.04 us, best layout 59.87 us
        (28672, 4096, 2, None): None,  # gate_up: cuBLAS 58.7 us, best layout 60.65 us
        (28672, 4096, 4, None): None,  # gate_up: cuBLAS 58.7 us, best layout 60.98 us
        (28672, 4096, 8, None): None,  # gate_up: cuBLAS 58.89 us, best layout 61.61 us
        (28672, 4096, 16, None): None,  # gate_up: cuBLAS 59.5 us, best layout 61.42 us
        (28672, 4096, 32, None): GemvConfig(128, 128, 1, 8, 3),  # gate_up: cuBLAS 64.90 us, best layout 61.22 us
        (28672, 4096, 64, None): GemvConfig(128, 64, 1, 8, 3),  # gate_up: cuBLAS 67.37 us, best layout 62.24 us
        (4096, 14336, 1, None): None,  # down: cuBLAS 32.7 us, best layout 34.51 us
        (4096, 14336, 2, None): None,  # down: cuBLAS 32.73 us, best layout 34.28 us
        (4096, 14336, 4, None): None,  # down: cuBLAS 32.95 us, best layout 34.27 us
        (4096, 14336, 8, None): None,  # down: cuBLAS 32.97 us, best layout 34.36 us
        (4096, 14336, 16, None): None,  # down: cuBLAS 33.38 us, best layout 34.1 us
        (4096, 14336, 32, None): None,  # down: cuBLAS 34.53 us, best layout 36.91 us
        (4096, 14336, 64, None): GemvConfig(32, 256, 1, 4, 4),  # down: cuBLAS 36.56 us, best layout 35.44 us
        (4096, 14336, 1, 'silu'): None,  # down+silu: cuBLAS 34.46 us, best layout 49.57 us
        (4096, 14336, 2, 'silu'): None,  # down+silu: cuBLAS 34.51 us, best layout 49.69 us
        (4096, 14336, 4, 'silu'): None,  # down+silu: cuBLAS 34.74 us, best layout 49.58 us
        (4096, 14336, 8, 'silu'): None,  # down+silu: cuBLAS 34.9 us, best layout 49.25 us
        (4096, 14336, 16, 'silu'): None,  # down+silu: cuBLAS 35.57 us, best layout 50.92 us
        (128256, 4096, 1, None): GemvConfig(64, 128, 1, 4, 4),  # lm_head: cuBLAS 249.49 us, best layout 239.82 us
        (128256, 4096, 2, None): GemvConfig(64, 128, 1, 4, 4),  # lm_head: cuBLAS 251.41 us, best layout 240.03 us
        (128256, 4096, 4, None): GemvConfig(64, 128, 1, 4, 4),  # lm_head: cuBLAS 251.93 us, best layout 241.54 us
        (128256, 4096, 8, None): GemvConfig(64, 128, 1, 4, 4),  # lm_head: cuBLAS 252.58 us, best layout 242.94 us
        (128256, 4096, 16, None): GemvConfig(64, 128, 1, 4, 4),  # lm_head: cuBLAS 256.7 us, best layout 245.88 us
        (128256, 4096, 32, None): GemvConfig(128, 128, 1, 8, 3),  # lm_head: cuBLAS 268.98 us, best layout 252.29 us
        (128256, 4096, 64, None): GemvConfig(128, 128, 1, 8, 3),  # lm_head: cuBLAS 285.70 us, best layout 262.42 us
    },
}
