"""Kernel variants that only a GPU runs, compiled for Hopper (sm_90) to a cubin on the CPU: the programmatic dependent
launch branches (USE_PDL, never taken under the interpreter: pdl_args is empty off the GPU) of the weight-only FP8
GEMV with block scales and split-K and of the w8a8 GEMM, and the LoRA expand covering several column tiles a
program. The interpreter checks these kernels' values; this checks that Triton's GPU compiler accepts every branch.
Compiled in a subprocess without TRITON_INTERPRET (conftest sets it for this folder: @triton.jit would give
interpreted functions, with nothing to compile)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from prefixrt.kernels import fp8_gemm, gemv, lora

    def build(fn, pointers, constexprs, floats=()):
        # every other parameter is an int32 scalar
        names = fn.arg_names
        sig = {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n in floats else "i32")
               for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
        return triton_compile(src, target=GPUTarget("cuda", 90, 32))

    CASES = {
        "gemv weight-only, block scales, split-K 8, PDL": (gemv._gemv_kernel, {
            "X": "*bf16", "W": "*fp8e4nv", "WScale": "*fp32", "Bias": "*bf16", "Y": "*bf16", "Partial": "*fp32"}, {
            "HAS_BIAS": False, "ACT": "none", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8,
            "EVEN": False, "DOT_PRECISION": "tf32", "UPCAST_DOT": False, "W_SCALE": 2, "SWAP_AB": True,
            "USE_PDL": True}),
        "fp8 GEMM, group scales given, split-K 4, PDL": (fp8_gemm._fp8_gemm_kernel, {
            "X": "*fp8e4nv", "XScale": "*fp32", "W": "*fp8e4nv", "WScale": "*fp32", "Bias": "*bf16",
            "Y": "*fp32"}, {
            "HAS_BIAS": False, "QUANTIZE_INPUT": False, "BLOCK_SCALES": False, "BLOCK_M": 16, "BLOCK_N": 32,
            "BLOCK_K": 256, "SPLIT_K": 4, "GROUP": 64, "SUB_K": 64, "USE_PDL": True}),
        "LoRA expand, 8 tiles a program": (lora._expand_kernel, {
            "XA": "*fp32", "B": "*bf16", "Scale": "*fp32", "Y": "*bf16", "SortedTokens": "*i32", "BlockSlot": "*i32",
            "BlockStart": "*i32", "BlockEnd": "*i32", "TileShard": "*i32", "TileFirst": "*i32", "TileEnd": "*i32"}, {
            "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16, "SPLIT_K": 4, "TILES_PER_PROGRAM": 8,
            "DOT_PRECISION": "tf32", "UPCAST_DOT": False}),
    }
    for label, (fn, pointers, constexprs) in CASES.items():
        kernel = build(fn, pointers, constexprs)
        print(f"{label}: cubin {len(kernel.asm['cubin'])} bytes", flush=True)
""")


def test_gpu_only_variants_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = tmp_path / "compile_check.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line for line in out.stdout.splitlines() if "cubin" in line]
    assert len(lines) == 3 and all(int(line.split()[-2]) > 0 for line in lines), out.stdout
