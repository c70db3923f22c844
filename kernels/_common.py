"""Small pieces shared by the Triton attention kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): launch configs then favour small
    blocks, and GPU-only tuning is skipped."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_args(dtype: torch.dtype) -> dict:
    """Constexpr kernel arguments for `mma`. fp32 inputs would otherwise go through TF32 on tensor cores
    (~1e-3 relative error), so they ask for IEEE products. The CPU interpreter multiplies bf16 tiles as raw
    integers (triton 3.9), so there the tiles are widened to fp32 first; values are unchanged."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST_DOT": interpreting() and dtype == torch.bfloat16,
    }


def check_pool_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> tuple[int, int, int]:
    """-> (num_heads, num_kv_heads, head_dim) after checking the shapes the kernels rely on."""
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"expected q [T, H, D] and k/v buffers [slots, KVH, D]; got {q.shape}, {k_buffer.shape}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv buffers {tuple(k_buffer.shape)}")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("head_dim must be the contiguous (last) dimension of q and the kv buffers")
    return num_heads, num_kv_heads, head_dim


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def softcap_scores(s, logit_softcap):
    """logit_softcap * tanh(s / logit_softcap), written with exp so it runs everywhere (no libdevice)."""
    x = s / logit_softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return logit_softcap * tl.where(x < 0, -th, th)
