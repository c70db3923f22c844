"""Small-batch linear layers (M <= 64 rows): y = x @ W^T (+ bias), W the nn.Linear weight [N, K].

Decode at small batch is bound by reading W, so the kernel is laid out for bandwidth: a program owns
BLOCK_N output columns and 1/SPLIT_K of the K range, streams its [BLOCK_N, BLOCK_K] weight tiles through
the pipeline once, and multiplies them with the (padded) [BLOCK_M, BLOCK_K] input tile (BLOCK_M = 16, 32 or 64) on the tensor
cores (float32 accumulation). With SPLIT_K > 1 the partials go to a float32 workspace and a second, tiny
kernel sums them (+ bias) in a fixed order, so results are deterministic.

Weight-only FP8 (`w_scale` given): W is e4m3 with float32 scales per output channel [N] or per 128 x 128 block
[ceil(N / 128), ceil(K / 128)] (kernels/fp8_reference.py's weight scheme); each tile is widened to x's dtype in
registers and multiplied with x as it is (no activation quantization), the scales applied to the fp32 products: per
channel once at the end, per block after each K tile (BLOCK_K divides 128, so a tile never straddles two blocks).
Half the weight bytes of bf16 through the same pipeline: what a bandwidth-bound decode step wants. The torch
reference is `kernels/fp8_reference.py: weight_only_linear`.

`act_input="silu" | "gelu_tanh"` makes x the fused gate_up output [M, 2K] and feeds act(gate) * up
(rounded to the weight dtype, as the unfused path rounds it) into the product: the MLP's activation kernel
disappears into the down projection.

Which configuration (or cuBLAS) is fastest depends on the shape and the GPU: `choose_config` measures the
candidates inside a CUDA graph (as decode runs them) with weights cycled past the L2 cache, and returns
None when cuBLAS wins. The torch reference is `kernels/fused_reference.py: linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import dot_args, mma, pdl_args, pdl_begin, pdl_trigger, pdl_wait
from prefixrt.kernels.activation import ACTIVATIONS, gated_act

MAX_M = 64  # the tallest input tile a config sizes to the rows (block_m 0); taller inputs need a config's block_m
PDL_SMEM_BYTES = 200 << 10  # shared memory the pipelined tiles may take with PDL (Hopper: 227 KB a block)


def block_m(num_rows: int, config: GemvConfig | None = None) -> int:
    """The input tile's height: the config's block_m, else num_rows' next power of two, at least 16 (tl.dot's
    minimum) and at most MAX_M."""
    if config is not None and config.block_m:
        return config.block_m
    return min(MAX_M, max(16, triton.next_power_of_2(num_rows)))


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 0  # rows per program (a power of two >= 16); 0: the rows' next power of two, at most MAX_M
    swap_ab: bool = False  # compute y^T = W x^T: the weight tile is the tensor cores' first operand

    def __str__(self) -> str:
        return (f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"
                f"{f'm{self.block_m}' if self.block_m else ''}{'t' if self.swap_ab else ''}")


@triton.jit
def _load_w(w_rows, offs_k, mask_n, k_hi, EVEN: tl.constexpr, dtype: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] weight tile in `dtype` (an e4m3 tile is widened in registers)."""
    if EVEN:  # N % BLOCK_N == 0 and K % (SPLIT_K * BLOCK_K) == 0: unmasked, vectorised weight loads
        w = tl.load(w_rows + offs_k[None, :])
    else:
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < k_hi)[None, :], other=0.0)
    return w.to(dtype)


@triton.jit
def _scaled_part(part, WScale, offs_n, mask_n, k0, stride_wsn, W_SCALE: tl.constexpr, N_FIRST: tl.constexpr):
    """One K tile's products ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with N_FIRST) times the scales of the 128 x 128
    weight blocks the tile lies in (W_SCALE 2; other weights: unchanged)."""
    if W_SCALE == 2:
        scale = tl.load(WScale + (offs_n // 128) * stride_wsn + k0 // 128, mask=mask_n, other=0.0)
        if N_FIRST:
            part = part * scale[:, None]
        else:
            part = part * scale[None, :]
    return part


@triton.jit
def _load_x(x_rows, offs_k, mask_m, k_hi, K, ACT: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input tile (act(gate) * up from the fused gate_up row [gate (K) | up (K)] with
    ACT), in the weight's dtype."""
    mask_x = mask_m[:, None] & (offs_k < k_hi)[None, :]
    if ACT == "none":
        return tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0)
    g = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
    u = tl.load(x_rows + K + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
    return (gated_act(g, ACT) * u).to(dtype)


@triton.jit
def _gemv_kernel(
    X, W, WScale, Bias, Y, Partial, M, N, K, stride_xm, stride_wn, stride_wsn, stride_ym, stride_ps,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, W_SCALE: tl.constexpr = 0, SWAP_AB: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # W_SCALE: 0 float weights; 1 e4m3 weights with per-channel scales WScale [N]; 2 e4m3 with 128 x 128 block scales
    # WScale [ceil(N / 128), ceil(K / 128)] (row stride stride_wsn). The products are in x's dtype either way.
    # SWAP_AB: the products are taken as W x^T ([BLOCK_N, BLOCK_M]) and transposed once at the end.
    dtype: tl.constexpr = X.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    if SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = k_lo
    if USE_PDL:  # the first weight tile is read while the kernel before this one finishes (W is never written)
        w0 = _load_w(w_rows, k_lo + offs_kb, mask_n, k_hi, EVEN, dtype)
        pdl_wait(USE_PDL)
        pdl_trigger(USE_PDL)
        x0 = _load_x(x_rows, k_lo + offs_kb, mask_m, k_hi, K, ACT, dtype)
        k_s = tl.minimum(k_lo, K - 1)  # an empty split (its tile is 0) reads the last block scale, not past it
        if SWAP_AB:
            acc_t += _scaled_part(mma(w0, tl.trans(x0), DOT_PRECISION, UPCAST_DOT), WScale, offs_n, mask_n, k_s,
                                  stride_wsn, W_SCALE, True)
        else:
            acc += _scaled_part(mma(x0, tl.trans(w0), DOT_PRECISION, UPCAST_DOT), WScale, offs_n, mask_n, k_s,
                                stride_wsn, W_SCALE, False)
        k_first = k_lo + BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        offs_k = k0 + offs_kb
        w = _load_w(w_rows, offs_k, mask_n, k_hi, EVEN, dtype)
        x = _load_x(x_rows, offs_k, mask_m, k_hi, K, ACT, dtype)
        if SWAP_AB:
            acc_t += _scaled_part(mma(w, tl.trans(x), DOT_PRECISION, UPCAST_DOT), WScale, offs_n, mask_n, k0,
                                  stride_wsn, W_SCALE, True)
        else:
            acc += _scaled_part(mma(x, tl.trans(w), DOT_PRECISION, UPCAST_DOT), WScale, offs_n, mask_n, k0,
                                stride_wsn, W_SCALE, False)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    if W_SCALE == 1:
        acc = acc * tl.load(WScale + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        p = Partial + pid_k * stride_ps + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(p, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    Partial, Bias, Y, M, N, stride_ps, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_begin(USE_PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(Partial + s * stride_ps + m * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor,  # [M, K] (or [M, 2K] with act_input), last dim contiguous; M <= MAX_M unless config.block_m
    weight: torch.Tensor,  # [N, K] contiguous: x's dtype, or e4m3 with w_scale
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig = GemvConfig(),
    act_input: str | None = None,  # None | "silu" | "gelu_tanh"
    w_scale: torch.Tensor | None = None,  # e4m3 weights: [N] float32 per channel, or [ceil(N/128), ceil(K/128)]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ weight.T + bias (see the module docstring); with w_scale, weight-only FP8. A config sized to the rows
    (block_m 0) takes at most MAX_M rows; one with block_m runs any number in row blocks."""
    num_rows = x.shape[0]
    n, k = weight.shape
    in_k = 2 * k if act_input else k
    if x.dim() != 2 or x.shape[1] != in_k or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' (gate_up input)' if act_input else ''}, or a last dim is not contiguous")
    if num_rows > MAX_M and not config.block_m:
        raise ValueError(f"gemv: a config without block_m handles at most {MAX_M} rows, got {num_rows}")
    if act_input is not None and act_input not in ACTIVATIONS:
        raise ValueError(f"act_input must be one of {ACTIVATIONS}, got {act_input!r}")
    w_scale_kind = _weight_scale_kind(weight, w_scale, x.dtype, config)
    y = torch.empty((num_rows, n), dtype=x.dtype, device=weight.device)
    if num_rows == 0:
        return y
    c = config
    split = max(1, min(c.split_k, triton.cdiv(k, c.block_k)))
    even = n % c.block_n == 0 and k % (split * c.block_k) == 0
    partial = torch.empty((split, num_rows, n), dtype=torch.float32, device=weight.device) if split > 1 else y
    bm = block_m(num_rows, c)
    grid = (triton.cdiv(n, c.block_n), split, triton.cdiv(num_rows, bm))
    pdl = pdl_args(weight, num_rows)
    stages = c.num_stages
    if pdl:  # the tile read before the wait takes one pipeline stage's worth of shared memory more
        tile_bytes = (bm * x.element_size() + c.block_n * weight.element_size()) * c.block_k
        stages = max(1, min(stages, PDL_SMEM_BYTES // tile_bytes - 1))
    _gemv_kernel[grid](
        x, weight, w_scale if w_scale is not None else weight, bias if bias is not None else weight, y, partial,
        num_rows, n, k, x.stride(0), weight.stride(0), w_scale.stride(0) if w_scale_kind == 2 else 0, y.stride(0),
        partial.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, ACT=act_input or "none", BLOCK_M=bm, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, SPLIT_K=split, EVEN=even, W_SCALE=w_scale_kind, SWAP_AB=c.swap_ab,
        num_warps=c.num_warps, num_stages=stages,
        **dot_args(x.dtype), **pdl,
    )  # fmt: skip
    if split > 1:
        block = min(triton.next_power_of_2(n), 1024)
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block))](
            partial, bias if bias is not None else weight, y, num_rows, n, partial.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, num_warps=4, **pdl,
        )  # fmt: skip
    return y


def _weight_scale_kind(weight: torch.Tensor, w_scale: torch.Tensor | None, x_dtype: torch.dtype,
                       config: GemvConfig) -> int:  # fmt: skip
    """The kernel's W_SCALE for these weights: 0 (float weights in x's dtype), 1 (e4m3, per-channel scales) or 2
    (e4m3, 128 x 128 block scales; BLOCK_K must divide 128). Raises ValueError on anything else."""
    n, k = weight.shape
    if w_scale is None:
        if weight.dtype != x_dtype:
            raise ValueError(f"gemv: weight {weight.dtype} and x {x_dtype} differ (e4m3 weights need w_scale)")
        return 0
    if weight.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32 or w_scale.stride(-1) != 1:
        raise ValueError(f"gemv: weight-only FP8 needs e4m3 weights and contiguous float32 scales, got "
                         f"{weight.dtype} and {w_scale.dtype}")
    if w_scale.dim() == 1 and w_scale.shape[0] == n:
        return 1
    if w_scale.dim() == 2 and tuple(w_scale.shape) == (-(-n // 128), -(-k // 128)):
        if 128 % config.block_k:
            raise ValueError(f"gemv: block-wise FP8 scales need block_k dividing 128, got {config.block_k}")
        return 2
    raise ValueError(f"gemv: weight scales {tuple(w_scale.shape)} fit neither [{n}] nor 128 x 128 blocks of [{n}, {k}]")


# ------------------------------------------------------------------------------------- choosing a config


def candidate_configs(n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """A handful of layouts per shape: narrow and wide column blocks, with a K split when the column
    blocks alone would leave SMs idle (fewer than ~4 programs per SM)."""
    out = []
    for block_n, block_k in ((16, 256), (32, 256), (64, 128), (128, 64)):
        programs = triton.cdiv(n, block_n)
        split = 1
        while programs * split < 4 * num_sms and k // (2 * split * block_k) >= 1 and split < 8:
            split *= 2
        out.append(GemvConfig(block_n, block_k, 1))
        if split > 1:
            out.append(GemvConfig(block_n, block_k, split))
    return list(dict.fromkeys(out))


def graph_time_us(fn, copies: int, reps: int = 5) -> float:
    """Median time of one call, measured by replaying a CUDA graph of `copies` calls (launch overhead off,
    as under the decode graphs)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / copies)
    return sorted(times)[len(times) // 2]


def measure(n: int, k: int, m: int, dtype: torch.dtype, device, configs: list[GemvConfig | None],
            act_input: str | None = None, l2_bytes: int = 128 << 20) -> dict[GemvConfig | None, float]:
    """Microseconds per call of each config (None = cuBLAS through F.linear) for an [m, k] x [k, n]
    product, with enough weight copies that every call reads its weight from HBM. A config whose result
    differs from cuBLAS's is dropped (not returned)."""
    copies = max(4, min(16, -(-2 * l2_bytes // (n * k * torch.empty((), dtype=dtype).element_size()))))
    weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, 2 * k if act_input else k, device=device, dtype=dtype)

    from prefixrt.kernels import fused_reference
    from prefixrt.kernels.activation import act_mul

    def unfused(i):  # what the model runs without this kernel: the activation kernel, then cuBLAS
        return torch.nn.functional.linear(act_mul(x, act_input) if act_input else x, weights[i])

    expected = fused_reference.linear(x, weights[0], None, act_input).float()
    out: dict[GemvConfig | None, float] = {}
    for cfg in configs:
        if cfg is None:
            out[None] = graph_time_us(unfused, copies)
            continue
        try:
            got = gemv(x, weights[0], None, cfg, act_input).float()
            err = ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item()
            if err > 1e-2:
                continue
            out[cfg] = graph_time_us(lambda i, c=cfg: gemv(x, weights[i], None, c, act_input), copies)
        except Exception:  # a layout this GPU cannot run (shared memory, registers): not a candidate
            continue
    return out


def choose_config(n: int, k: int, m: int, dtype: torch.dtype, device, act_input: str | None = None
                  ) -> tuple[GemvConfig | None, dict[GemvConfig | None, float]]:
    """(fastest Triton config, or None when cuBLAS is at least as fast; all timings in us)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    timings = measure(n, k, m, dtype, device, [None, *candidate_configs(n, k, num_sms)], act_input)
    triton_timings = {c: t for c, t in timings.items() if c is not None}
    if not triton_timings or None not in timings:
        return None, timings
    best = min(triton_timings, key=triton_timings.get)
    # cuBLAS unless a layout is clearly faster (2%): the choice should not flip on measurement noise
    return (best if timings[best] < 0.98 * timings[None] else None), timings


# ------------------------------------------------------------------------------ weight-only FP8: choosing a layout


def weight_only_candidates(n: int, k: int, rows: int, num_sms: int, block_scales: bool = False) -> list[GemvConfig]:
    """Layouts for e4m3 weights (half the bytes of bf16 per tile, so wider K tiles): for up to MAX_M rows, column
    blocks of 16-128 with a K split where the column blocks alone leave the GPU under three waves, each also with
    the weight tile as the first operand (swap_ab); for taller inputs, 64- and 128-row tiles. Block scales keep
    BLOCK_K <= 128 (a tile inside one scale block)."""
    out = []
    if rows <= MAX_M:
        stages = 4 if rows <= 16 else 3
        shapes = ((16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 128, 4), (128, 128, 8))
        for block_n, block_k, warps in shapes:
            block_k = min(block_k, 128) if block_scales else block_k
            split = 1
            while -(-n // block_n) * split < 3 * num_sms and k // (2 * split * block_k) >= 1 and split < 8:
                split *= 2
            for s in dict.fromkeys((1, split)):
                out.append(GemvConfig(block_n, block_k, s, warps, stages))
                if block_n >= 64:
                    out.append(GemvConfig(block_n, block_k, s, warps, stages, swap_ab=True))
    else:
        for bm, bn, bk, warps, stages in ((64, 128, 128, 4, 4), (64, 256, 64, 8, 4), (128, 128, 64, 8, 4),
                                          (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 5)):
            for swap in (False, True):
                out.append(GemvConfig(bn, min(bk, 128) if block_scales else bk, 1, warps, stages, bm, swap))
    return list(dict.fromkeys(out))


def choose_weight_only_config(n: int, k: int, rows: int, device, block_scales: bool = False,
                              l2_bytes: int = 128 << 20) -> tuple[GemvConfig | None, dict[GemvConfig, float]]:
    """(fastest weight-only FP8 layout for an [rows, k] x [k, n] product with bf16 input, all timings in us), each
    measured inside a CUDA graph with enough weight copies that every call reads its weight from HBM; a layout whose
    result is off the reference (fp8_reference.weight_only_linear) by more than 1e-2 relative is dropped."""
    from prefixrt.kernels import fp8_reference

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    copies = max(4, min(16, -(-2 * l2_bytes // (n * k))))
    quantize = fp8_reference.quantize_blocks if block_scales else fp8_reference.quantize_weight
    weights = [quantize(torch.randn(n, k, device=device) / k**0.5) for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    expected = fp8_reference.weight_only_linear(x, *weights[0]).float()
    timings: dict[GemvConfig, float] = {}
    for cfg in weight_only_candidates(n, k, rows, num_sms, block_scales):
        try:
            got = gemv(x, weights[0][0], None, cfg, w_scale=weights[0][1]).float()
            if ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item() > 1e-2:
                continue
            timings[cfg] = graph_time_us(_weight_only_call(x, weights, cfg), copies)
        except Exception:  # a layout this GPU cannot run (shared memory, registers): not a candidate
            continue
    best = min(timings, key=timings.get) if timings else None
    return best, timings


def _weight_only_call(x, weights, cfg):
    return lambda i: gemv(x, weights[i][0], None, cfg, w_scale=weights[i][1])
