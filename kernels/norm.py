"""Fused residual add + RMSNorm (Llama's `w * norm(x)` and Gemma's `(1 + w) * norm(x)`), one program per row.

    summed = x + residual          (rounded to x's dtype, exactly as the torch `x + residual` is)
    out    = norm(summed) * weight (float32 math; Llama casts the normalised row to the dtype before the
                                    weight multiply, Gemma after, as transformers does)

Without a residual it is a plain RMSNorm (summed is x itself). The torch reference is
`kernels/fused_reference.py: add_rms_norm`; both return (out, summed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import pdl_args, pdl_begin


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, Summed,
    stride_x, stride_r, stride_o, stride_s, N, eps,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum is rounded, as in torch
        tl.store(Summed + row * stride_s + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    normed = x32 * inv_rms
    if GEMMA:
        out = normed * (1.0 + w)
    else:
        out = normed.to(x.dtype).to(tl.float32) * w
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, N], last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N] or None
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [T, N] in x's dtype, summed [T, N]). summed = x + residual (a new tensor), or x itself when
    residual is None. Inputs are not modified."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"add_rms_norm expects a [T, N] tensor with a contiguous last dim, got {tuple(x.shape)}")
    num_rows, n = x.shape
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        summed = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    else:
        summed = x
    if num_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n)
    r = residual if residual is not None else x
    _add_rms_norm_kernel[(num_rows,)](
        x, r, weight, out, summed, x.stride(0), r.stride(0), out.stride(0), summed.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        **pdl_args(x, num_rows),
    )  # fmt: skip
    return out, summed
