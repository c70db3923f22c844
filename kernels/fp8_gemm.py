"""FP8 (e4m3) linear layers: y = x @ W^T (+ bias) with W stored in e4m3 and its scales (kernels/fp8_reference.py
states the scheme and is the oracle).

- `quantize_activations`: x [M, K] -> (x_q e4m3, fp32 scales per group of K values [M, ceil(K / G)], or per token
  [M]), one program a row.
- `fp8_gemm`: the Triton GEMM for skinny inputs (decode: 1-64 rows; any M runs, on a grid over row blocks). A
  program owns BLOCK_N output columns and streams its [BLOCK_K, BLOCK_N] e4m3 weight tiles once (half the bytes
  of bf16), multiplying them with the e4m3 input tile on the tensor cores (fp32 accumulation); the scales apply
  to the accumulator: per output channel once at the end, or per 128 x 128 block after each K tile (BLOCK_K
  divides 128, so a tile never straddles two blocks). The activation scales: per group of G K values (the
  default), each group's product is scaled by its rows' group scale before it is accumulated (a BLOCK_K tile wider
  than G is computed as BLOCK_K / G dots); per token, once at the end. With `quantize_input` x comes in its float
  dtype and each program computes its rows' scales itself (per group: from the tile it loads, or from the whole
  group when G > BLOCK_K; per token: a first pass over x, which is small and stays in L2) and quantizes each tile as
  it loads it: no separate quantization launch, which is what a batch-1 decode step wants.
  Split-K (`split_k` > 1, for the few rows of decode): a program then owns BLOCK_N columns of one of split_k
  slices of K, so the grid has split_k times more programs (N / BLOCK_N alone is about one wave on an H200, each
  program streaming all of K: far below HBM bandwidth); each writes its scaled fp32 partial sums and a second
  launch (gemv.py's split-K sum) adds the split_k partials in a fixed order (deterministic), adds the bias and
  rounds once.
- `scaled_mm`: cuBLAS's FP8 GEMM through `torch._scaled_mm` with row-wise scales (CUDA, Hopper and Ada), for
  larger M with per-token activation scales only: it takes one scale per row of x, not one per K group, so the
  default group scheme runs the Triton GEMM at every M (its large-M speed is not measured yet: docs/benchmarks.md,
  "FP8").

Which of the Triton layouts or `_scaled_mm` is fastest depends on the shape and the GPU: `choose_config` measures
them inside a CUDA graph (weights cycled past L2, as kernels/gemv.py does for bf16) and kernels/fp8_table.py keeps
the measured choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import interpreting, pdl_args, pdl_trigger, pdl_wait, to_e4m3
from prefixrt.kernels.fp8_reference import (
    FP8,
    FP8_MAX,
    MIN_AMAX,
    SCALE_BLOCK,
    activation_group_size,
    check_activation_scale,
)
from prefixrt.kernels.gemv import _sum_splits_kernel  # the split-K sum: fp32 partials [S, M, N] -> y

# The scheme's constants as the kernels see them (a Triton kernel reads only constexpr globals).
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)

MAX_M = 64  # the tallest row block (rows beyond it take further row blocks)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    quantize_input: bool = True  # x comes in its float dtype and is quantized inside the GEMM
    split_k: int = 1  # slices of K run by separate programs (a power of two; 1: no split, one launch)
    block_m: int = 0  # rows per program (a power of two >= 16); 0: the rows' next power of two, at most MAX_M

    def __str__(self) -> str:
        return (f"n{self.block_n}k{self.block_k}w{self.num_warps}p{self.num_stages}"
                f"{'q' if self.quantize_input else ''}{f's{self.split_k}' if self.split_k > 1 else ''}"
                f"{f'm{self.block_m}' if self.block_m else ''}")


@triton.jit
def _quantize_tile(x, x_scale):
    """A float tile [BLOCK_M, BLOCK_K] and its rows' scales [BLOCK_M] -> e4m3 (round to nearest even)."""
    return to_e4m3(tl.math.div_rn(x.to(tl.float32), x_scale[:, None]))


@triton.jit
def _tile_scales(x):
    """amax(|row|) / 448 of each row of a float tile [BLOCK_M, G] (one activation group)."""
    amax = tl.max(tl.abs(x.to(tl.float32)), axis=1)
    return tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), tl.full(amax.shape, _FP8_MAX, tl.float32))


@triton.jit
def _row_scales(x_rows, mask_m, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """amax(|row|) / 448 for BLOCK_M rows of length K (x_rows: pointers to each row's start)."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), tl.full([BLOCK_M], _FP8_MAX, tl.float32))


@triton.jit
def _quantize_rows_kernel(X, XQ, Scale, K, stride_x, stride_q, stride_s, BLOCK_K: tl.constexpr,
                          GROUP: tl.constexpr = 0, USE_PDL: tl.constexpr = False):  # fmt: skip
    # GROUP 0: one scale per row (Scale [M]); else one per GROUP values (Scale [M, ceil(K / GROUP)], BLOCK_K = GROUP)
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.full([1], 1, tl.int1)
    if GROUP == 0:
        scale = _row_scales(X + row * stride_x + tl.zeros([1, 1], tl.int64), mask_row, K, 1, BLOCK_K)  # [1]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * stride_x + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)  # [1, BLOCK_K]
        if GROUP:
            scale = _tile_scales(x)  # [1]: this group's
            tl.store(Scale + row * stride_s + k0 // GROUP + tl.arange(0, 1), scale)
        tl.store(XQ + row * stride_q + offs_k[None, :], _quantize_tile(x, scale), mask=(offs_k < K)[None, :])
    if GROUP == 0:
        tl.store(Scale + row + tl.arange(0, 1), scale)


def quantize_activations(x: torch.Tensor, activation_scale: str = "group", block_k: int = 1024
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """e4m3 quantization of x [M, K] (last dim contiguous): (x_q [M, K] e4m3, scale), scale [M] fp32 per token
    ("token") or [M, ceil(K / G)] per group of G = activation_group_size(K) values ("group"). Equals
    fp8_reference.quantize_activations."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_activations needs a 2-d x with a contiguous last dim, got {tuple(x.shape)}")
    num_rows, k = x.shape
    group = _group_size(k, activation_scale)
    x_q = torch.empty((num_rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((num_rows, -(-k // group)) if group else num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block = group or min(block_k, triton.next_power_of_2(k))
        _quantize_rows_kernel[(num_rows,)](x, x_q, scale, k, x.stride(0), x_q.stride(0), scale.stride(0),
                                           BLOCK_K=block, GROUP=group, num_warps=1 if interpreting() else 4,
                                           **pdl_args(x, num_rows))  # fmt: skip
    return x_q, scale


def _group_size(k: int, activation_scale: str) -> int:
    """K values per activation scale: activation_group_size(K) for "group", 0 (the whole row) for "token"."""
    check_activation_scale(activation_scale)
    if activation_scale == "none":
        raise ValueError("the w8a8 kernels quantize activations: 'none' (weight-only) runs kernels/gemv.py")
    return activation_group_size(k) if activation_scale == "group" else 0


@triton.jit
def _fp8_gemm_kernel(
    X, XScale, W, WScale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_wsn, stride_xsm, k_per_split,
    HAS_BIAS: tl.constexpr, QUANTIZE_INPUT: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    GROUP: tl.constexpr = 0, SUB_K: tl.constexpr = 128, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # SPLIT_K > 1: Y is the fp32 partial buffer [SPLIT_K, M, N] (row stride stride_ym), this program's slice of K is
    # [pid_k * k_per_split, (pid_k + 1) * k_per_split) (k_per_split a multiple of BLOCK_K), and the bias is left to
    # the reduction.
    # GROUP 0: one activation scale per row (XScale [M]), applied to the accumulator at the end. GROUP > 0: one per
    # GROUP values of a row (XScale [M, ceil(K / GROUP)], row stride stride_xsm); a K tile is then taken as
    # BLOCK_K / SUB_K sub-tiles of SUB_K = min(BLOCK_K, GROUP) values, each inside one group, and each sub-tile's
    # product is multiplied by its group's scales (per row) before it is added: the e4m3 products of two groups
    # have different units and cannot share one dot. (GROUP 0: SUB_K = BLOCK_K.)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, SUB_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    # W is [N, K] row-major: the [SUB_K, BLOCK_N] tile of W^T is read column by column (K contiguous), the
    # operand layout the FP8 tensor-core product wants for its second input.
    w_cols = W + offs_n.to(tl.int64)[None, :] * stride_wn
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    if GROUP == 0:
        if QUANTIZE_INPUT:
            x_scale = _row_scales(x_rows, mask_m, K, BLOCK_M, BLOCK_K)  # [BLOCK_M]
        else:
            x_scale = tl.load(XScale + offs_m, mask=mask_m, other=1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        if BLOCK_SCALES:  # this K tile lies inside one 128-wide scale block
            w_scale = tl.load(WScale + (offs_n // _SCALE_BLOCK) * stride_wsn + k0 // _SCALE_BLOCK, mask=mask_n, other=0.0)
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + sub * SUB_K
            offs_k = ks + offs_kb
            mask_k = offs_k < K
            w = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [SK, BN] e4m3
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, SK]
            if GROUP == 0:
                if QUANTIZE_INPUT:
                    x = _quantize_tile(x, x_scale)
                part = tl.dot(x, w)  # [BM, BN] fp32: the e4m3 products are exact, their sum is fp32
            else:
                if not QUANTIZE_INPUT:  # a sub-tile past K (its x and w are 0) reads the last group's scale
                    g_col = tl.minimum(ks, K - 1) // GROUP
                    g_scale = tl.load(XScale + offs_m.to(tl.int64) * stride_xsm + g_col, mask=mask_m, other=1.0)
                elif SUB_K == GROUP:  # the sub-tile is the whole group
                    g_scale = _tile_scales(x)
                else:  # the group is wider than the tile: its amax from the whole group (x is small, in L2)
                    g0 = ks // GROUP * GROUP
                    g_scale = _row_scales(x_rows + g0, mask_m, tl.minimum(GROUP, K - g0), BLOCK_M, SUB_K)
                if QUANTIZE_INPUT:
                    x = _quantize_tile(x, g_scale)
                part = tl.dot(x, w) * g_scale[:, None]  # [BM, BN] fp32 in x's units
            if BLOCK_SCALES:
                acc += part * w_scale[None, :]
            else:
                acc += part
    if not BLOCK_SCALES:
        acc = acc * tl.load(WScale + offs_n, mask=mask_n, other=0.0)[None, :]
    if GROUP == 0:
        acc = acc * x_scale[:, None]
    if SPLIT_K > 1:
        Y += pid_k.to(tl.int64) * M * stride_ym
    elif HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _check_weight(w_q: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """-> whether the scales are block-wise; raises on shapes that do not fit W_q [N, K]."""
    n, k = w_q.shape
    if w_q.dtype != FP8 or not w_q.is_contiguous():
        raise ValueError(f"fp8 weights must be contiguous {FP8}, got {w_q.dtype}")
    blocks = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    if w_scale.dim() == 2 and tuple(w_scale.shape) == blocks and w_scale.stride(1) == 1:
        return True
    if w_scale.dim() == 1 and w_scale.shape[0] == n:
        return False
    raise ValueError(f"weight scales {tuple(w_scale.shape)} fit neither per-channel [{n}] nor 128x128 blocks {blocks}")


def fp8_gemm(
    x: torch.Tensor,  # [M, K]: float (quantized here) or e4m3 with x_scale
    w_q: torch.Tensor,  # [N, K] e4m3, contiguous
    w_scale: torch.Tensor,  # [N] fp32, or [ceil(N / 128), ceil(K / 128)] fp32 (block-wise)
    bias: torch.Tensor | None = None,  # [N]
    config: Fp8GemmConfig = Fp8GemmConfig(),
    x_scale: torch.Tensor | None = None,  # when x is already e4m3: [M, ceil(K / G)] fp32 ("group"), [M] ("token")
    out_dtype: torch.dtype | None = None,  # default: x's dtype (bfloat16 when x is e4m3)
    activation_scale: str = "group",  # x's scales: per group of G = activation_group_size(K) values, or per token
) -> torch.Tensor:  # [M, N]
    """x @ (W_q * w_scale)^T + bias with x quantized per group of K values or per token (see the module docstring)."""
    num_rows, k = x.shape
    n = w_q.shape[0]
    block_scales = _check_weight(w_q, w_scale)
    group = _group_size(k, activation_scale)
    quantized_in = x.dtype == FP8
    if x.dim() != 2 or w_q.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"fp8_gemm: x {tuple(x.shape)} does not fit W {tuple(w_q.shape)} or is not row-contiguous")
    if quantized_in == (x_scale is None):
        raise ValueError("give x_scale exactly when x is already e4m3")
    if quantized_in:
        want = (num_rows, -(-k // group)) if group else (num_rows,)
        if tuple(x_scale.shape) != want or x_scale.dtype != torch.float32 or x_scale.stride(-1) != 1:
            raise ValueError(f"x_scale for activation_scale={activation_scale!r} must be contiguous float32 {want}, "
                             f"got {x_scale.dtype} {tuple(x_scale.shape)}")
    c = config
    if c.block_k & (c.block_k - 1):
        raise ValueError(f"block_k must be a power of two, got {c.block_k}")
    if block_scales and SCALE_BLOCK % c.block_k:
        raise ValueError(f"block-wise scales need block_k dividing {SCALE_BLOCK}, got {c.block_k}")
    if c.split_k < 1 or c.split_k & (c.split_k - 1):
        raise ValueError(f"split_k must be a power of two, got {c.split_k}")
    out_dtype = out_dtype or (torch.bfloat16 if quantized_in else x.dtype)
    y = torch.empty((num_rows, n), dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return y
    bm = c.block_m or max(16, min(MAX_M, triton.next_power_of_2(num_rows)))
    # each slice of K a whole number of BLOCK_K tiles (the last slice may be shorter, or empty: its partial is 0)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split = c.split_k > 1
    out = torch.empty((c.split_k, num_rows, n), dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(num_rows, bm), c.split_k)
    _fp8_gemm_kernel[grid](
        x, x_scale if quantized_in else w_scale, w_q, w_scale, bias if bias is not None else w_scale, out,
        num_rows, n, k, x.stride(0), w_q.stride(0), n if split else y.stride(0),
        w_scale.stride(0) if block_scales else 0, x_scale.stride(0) if quantized_in and group else 0, k_per_split,
        HAS_BIAS=bias is not None, QUANTIZE_INPUT=not quantized_in, BLOCK_SCALES=block_scales,
        BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
        GROUP=group, SUB_K=min(c.block_k, group) if group else c.block_k,
        num_warps=1 if interpreting() else c.num_warps, num_stages=1 if interpreting() else c.num_stages,
        **pdl_args(x, num_rows),
    )  # fmt: skip
    if split:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block))](
            out, bias if bias is not None else out, y, num_rows, n, out.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=c.split_k, BLOCK=block, num_warps=1 if interpreting() else 4,
            **pdl_args(x, num_rows),
        )  # fmt: skip
    return y


# ------------------------------------------------------------------------------------------ cuBLAS (_scaled_mm)

_SCALED_MM_OK: dict[tuple, bool] = {}  # (device index) -> whether torch._scaled_mm with row-wise scales runs


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs e4m3 x e4m3 with row-wise fp32 scales and bf16 output on this device (tried
    once on a small product: the op exists on CUDA builds, but only Ada/Hopper and later run it)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    key = (device.index if device.index is not None else torch.cuda.current_device(),)
    if key not in _SCALED_MM_OK:
        try:
            a = torch.ones(16, 32, device=device).to(FP8)
            b = torch.ones(16, 32, device=device).to(FP8)
            ones_a = torch.ones(16, 1, device=device)
            ones_b = torch.ones(1, 16, device=device)
            out = torch._scaled_mm(a, b.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16)
            _SCALED_MM_OK[key] = bool((out.float() == 32).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _SCALED_MM_OK[key] = False
    return _SCALED_MM_OK[key]


def scaled_mm_fits(w_q: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether `scaled_mm` takes this weight: per-channel scales and N, K multiples of 16 (cuBLAS's FP8 layouts)."""
    n, k = w_q.shape
    return w_scale.dim() == 1 and n % 16 == 0 and k % 16 == 0


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """x_q [M, K] e4m3 (scales [M]) @ (W_q [N, K] e4m3 * w_scale [N])^T + bias via torch._scaled_mm (cuBLAS), row-wise
    scales. out_dtype: bfloat16 (row-wise scaling writes bf16 only; another dtype is cast afterwards)."""
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


# ------------------------------------------------------------------------------------------- choosing a layout


SPLIT_K_MAX_ROWS = 64  # split-K layouts are candidates up to this many rows


def candidate_configs(n: int, k: int, num_rows: int, block_scales: bool = False) -> list[Fp8GemmConfig]:
    """A handful of layouts: narrow and wide column blocks, input quantized inside the GEMM or before it; for a few
    rows also split-K layouts (2-8 slices of K) whose grids fill the GPU several times over."""
    out = []
    stages = 3 if num_rows > 16 else 4
    for block_n, block_k in ((32, 256), (64, 128), (128, 128), (128, 64)):
        if block_scales and SCALE_BLOCK % block_k:
            continue
        for quantize_input in (True, False):
            out.append(Fp8GemmConfig(block_n, block_k, 4 if block_n <= 64 else 8, stages, quantize_input))
    if num_rows <= SPLIT_K_MAX_ROWS:
        for block_n, block_k, split_k in ((32, 256, 2), (32, 256, 4), (64, 128, 4), (32, 128, 8), (64, 256, 8)):
            if block_scales and SCALE_BLOCK % block_k or k < 2 * split_k * block_k:
                continue
            for quantize_input in (False, True) if split_k == 4 else (False,):
                out.append(Fp8GemmConfig(block_n, block_k, 4, stages, quantize_input, split_k))
    return out


def run_config(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               config: Fp8GemmConfig | None, activation_scale: str = "group") -> torch.Tensor:  # fmt: skip
    """One linear the way a config runs it: the Triton GEMM (quantizing x inside it or in a launch before), or
    (config None, per-token activation scales only) the quantize launch and `scaled_mm`."""
    if config is None and activation_scale != "token":
        raise ValueError("quantize + _scaled_mm takes one activation scale per token: activation_scale='token'")
    if config is not None and config.quantize_input:
        return fp8_gemm(x, w_q, w_scale, bias, config, activation_scale=activation_scale)
    x_q, x_scale = quantize_activations(x, activation_scale)
    if config is None:
        return scaled_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype)
    return fp8_gemm(x_q, w_q, w_scale, bias, config, x_scale=x_scale, out_dtype=x.dtype,
                    activation_scale=activation_scale)


def measure(n: int, k: int, m: int, device, configs: list[Fp8GemmConfig | None], block_scales: bool = False,
            l2_bytes: int = 128 << 20, activation_scale: str = "group") -> dict[Fp8GemmConfig | None, float]:  # fmt: skip
    """Microseconds per call of each config (None = quantize + _scaled_mm, measured with per-token activation scales
    only) for an [m, k] x [k, n] product with bf16 input, enough weight copies that each call reads its weight from
    HBM. A config whose result differs from the reference (fp8_reference.fp8_linear) by more than 1e-2 relative is
    dropped."""
    from prefixrt.kernels import fp8_reference
    from prefixrt.kernels.gemv import graph_time_us

    copies = max(4, min(16, -(-2 * l2_bytes // (n * k))))
    quantize = fp8_reference.quantize_blocks if block_scales else fp8_reference.quantize_rows
    weights = [quantize(torch.randn(n, k, device=device) / k**0.5) for _ in range(copies)]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    expected = fp8_reference.fp8_linear(x, *weights[0], activation_scale=activation_scale).float()
    out: dict[Fp8GemmConfig | None, float] = {}
    for cfg in configs:
        if cfg is None and (block_scales or activation_scale != "token" or not scaled_mm_supported(x.device)):
            continue
        try:
            got = run_config(x, *weights[0], None, cfg, activation_scale).float()
            if ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item() > 1e-2:
                continue
            out[cfg] = graph_time_us(lambda i, c=cfg: run_config(x, *weights[i], None, c, activation_scale), copies)
        except Exception:  # a layout this GPU cannot run (shared memory, registers): not a candidate
            continue
    return out


def choose_config(n: int, k: int, m: int, device, block_scales: bool = False, activation_scale: str = "group"
                  ) -> tuple[Fp8GemmConfig | None, dict[Fp8GemmConfig | None, float]]:  # fmt: skip
    """(fastest Triton layout, or None when quantize + _scaled_mm is at least as fast, which per-token activation
    scales only can run; all timings in us)."""
    timings = measure(n, k, m, device, [None, *candidate_configs(n, k, m, block_scales)], block_scales,
                      activation_scale=activation_scale)
    triton_timings = {c: t for c, t in timings.items() if c is not None}
    if not triton_timings:
        return None, timings
    best = min(triton_timings, key=triton_timings.get)
    if None in timings and not timings[best] < 0.98 * timings[None]:  # cuBLAS unless clearly slower (2%)
        return None, timings
    return best, timings
