"""Small-batch linear layers (M <= 64 rows): y = x @ W^T (+ bias), W the nn.Linear weight [N, K].

Decode at small batch is bound by reading W, so the kernel is laid out for bandwidth: a program owns
BLOCK_N output columns and 1/SPLIT_K of the K range, streams its [BLOCK_N, BLOCK_K] weight tiles through
the pipeline once, and multiplies them with the (padded) [BLOCK_M, BLOCK_K] input tile (BLOCK_M = 16, 32 or 64) on the tensor
cores (float32 accumulation). With SPLIT_K > 1 the partials go to a float32 workspace and a second, tiny
kernel sums them (+ bias) in a fixed order, so results are deterministic.

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

MAX_M = 64  # the tallest input tile; larger batches go to cuBLAS
PDL_SMEM_BYTES = 200 << 10  # shared memory the pipelined tiles may take with PDL (Hopper: 227 KB a block)


def block_m(num_rows: int) -> int:
    """The input tile's height for num_rows rows: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(num_rows))


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"


@triton.jit
def _load_w(w_rows, offs_k, mask_n, k_hi, EVEN: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] weight tile."""
    if EVEN:  # N % BLOCK_N == 0 and K % (SPLIT_K * BLOCK_K) == 0: unmasked, vectorised weight loads
        return tl.load(w_rows + offs_k[None, :])
    return tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < k_hi)[None, :], other=0.0)


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
    X, W, Bias, Y, Partial, M, N, K, stride_xm, stride_wn, stride_ym, stride_ps,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = X + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = k_lo
    if USE_PDL:  # the first weight tile is read while the kernel before this one finishes (W is never written)
        w0 = _load_w(w_rows, k_lo + offs_kb, mask_n, k_hi, EVEN)
        pdl_wait(USE_PDL)
        pdl_trigger(USE_PDL)
        x0 = _load_x(x_rows, k_lo + offs_kb, mask_m, k_hi, K, ACT, w0.dtype)
        acc += mma(x0, tl.trans(w0), DOT_PRECISION, UPCAST_DOT)
        k_first = k_lo + BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        offs_k = k0 + offs_kb
        w = _load_w(w_rows, offs_k, mask_n, k_hi, EVEN)
        x = _load_x(x_rows, offs_k, mask_m, k_hi, K, ACT, w.dtype)
        acc += mma(x, tl.trans(w), DOT_PRECISION, UPCAST_DOT)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        p = Partial + pid_k * stride_ps + offs_m[:, None] * N + offs_n[None, :]
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
    x: torch.Tensor,  # [M, K] (or [M, 2K] with act_input), M <= MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig = GemvConfig(),
    act_input: str | None = None,  # None | "silu" | "gelu_tanh"
) -> torch.Tensor:  # [M, N] in weight's dtype
    """x @ weight.T + bias for at most MAX_M rows (see the module docstring)."""
    num_rows = x.shape[0]
    n, k = weight.shape
    in_k = 2 * k if act_input else k
    if x.dim() != 2 or x.shape[1] != in_k or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' (gate_up input)' if act_input else ''}, or a last dim is not contiguous")
    if num_rows > MAX_M:
        raise ValueError(f"gemv handles at most {MAX_M} rows, got {num_rows}")
    if act_input is not None and act_input not in ACTIVATIONS:
        raise ValueError(f"act_input must be one of {ACTIVATIONS}, got {act_input!r}")
    y = torch.empty((num_rows, n), dtype=weight.dtype, device=weight.device)
    if num_rows == 0:
        return y
    c = config
    split = max(1, min(c.split_k, triton.cdiv(k, c.block_k)))
    even = n % c.block_n == 0 and k % (split * c.block_k) == 0
    partial = torch.empty((split, num_rows, n), dtype=torch.float32, device=weight.device) if split > 1 else y
    grid = (triton.cdiv(n, c.block_n), split)
    pdl = pdl_args(weight, num_rows)
    stages = c.num_stages
    if pdl:  # the tile read before the wait takes one pipeline stage's worth of shared memory more
        tile_bytes = (block_m(num_rows) + c.block_n) * c.block_k * weight.element_size()
        stages = max(1, min(stages, PDL_SMEM_BYTES // tile_bytes - 1))
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, y, partial, num_rows, n, k, x.stride(0),
        weight.stride(0), y.stride(0), partial.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, ACT=act_input or "none", BLOCK_M=block_m(num_rows), BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, SPLIT_K=split, EVEN=even, num_warps=c.num_warps, num_stages=stages,
        **dot_args(weight.dtype), **pdl,
    )  # fmt: skip
    if split > 1:
        block = min(triton.next_power_of_2(n), 1024)
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block))](
            partial, bias if bias is not None else weight, y, num_rows, n, partial.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, num_warps=4, **pdl,
        )  # fmt: skip
    return y


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
