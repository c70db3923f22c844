"""Fused per-head q/k RMSNorm (optional) + rotary embedding + store of the new K/V into the paged pool.

One program per token reads the token's row of the fused qkv projection [T, (H + 2 KVH) * D] once and:
  - q: optional per-head RMSNorm (Qwen3 `w * norm`, Gemma `(1 + w) * norm`), then neox (rotate-half) RoPE,
    written to q_out [T, H, D];
  - k: the same norm and rotation, written to k_buffer[out_cache_loc[t]] ([num_slots, KVH, D]);
  - v: copied to v_buffer[out_cache_loc[t]].
cos/sin are the float32 tables [T, D] of RotaryEmbedding (its two halves are equal): every rotary variant
the models use (default, linear, llama3 scaling) differs only in those tables. The normalised q/k are
rounded to the model dtype before the rotation, as the torch path does; the rotation is float32, rounded
once (and, into an e4m3 pool, then divided by its kv head's scale and rounded to e4m3). The torch reference is `kernels/fused_reference.py: qk_norm_rope_store`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import kv_scale_args, pdl_args, pdl_begin, to_e4m3


@triton.jit
def _norm_rotate(
    x1, x2, cos, sin, NormW, offs_half, mask_half, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr,
):  # fmt: skip
    """x1, x2: [BLOCK_HEADS, BLOCK_HALF] halves of each head (model dtype) -> rotated halves, float32."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(NormW + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(NormW + HALF + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
        a = a * inv_rms[:, None]
        b = b * inv_rms[:, None]
        if GEMMA:
            a = (a * (1.0 + w1)).to(dtype).to(tl.float32)
            b = (b * (1.0 + w2)).to(dtype).to(tl.float32)
        else:
            a = a.to(dtype).to(tl.float32) * w1
            b = b.to(dtype).to(tl.float32) * w2
            a = a.to(dtype).to(tl.float32)
            b = b.to(dtype).to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _qk_norm_rope_store_kernel(
    QKV, Cos, Sin, Loc, QNormW, KNormW, QOut, KBuf, VBuf, KScale, VScale,
    stride_qkv, stride_cos, stride_sin, stride_qo_t, stride_qo_h, stride_kb_n, stride_kb_h,
    stride_vb_n, stride_vb_h, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, GEMMA: tl.constexpr, USE_PDL: tl.constexpr = False, HAS_KV_SCALE: tl.constexpr = False,
):  # fmt: skip
    pdl_begin(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = tl.load(Cos + t * stride_cos + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_sin + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    row = QKV + t * stride_qkv

    # q heads: columns [h * D, (h + 1) * D) of the row
    offs_h = tl.arange(0, BLOCK_H)
    mask_q = (offs_h < NUM_HEADS)[:, None] & mask_half[None, :]
    q_ptr = row + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
    q1 = tl.load(q_ptr, mask=mask_q, other=0.0)
    q2 = tl.load(q_ptr + HALF, mask=mask_q, other=0.0)
    r1, r2 = _norm_rotate(q1, q2, cos, sin, QNormW, offs_half, mask_half, eps, HEAD_DIM, HALF, NORM, GEMMA)
    qo_ptr = QOut + t * stride_qo_t + offs_h[:, None] * stride_qo_h + offs_half[None, :]
    tl.store(qo_ptr, r1.to(QOut.dtype.element_ty), mask=mask_q)
    tl.store(qo_ptr + HALF, r2.to(QOut.dtype.element_ty), mask=mask_q)

    # k heads follow the q heads; v heads follow the k heads
    slot = tl.load(Loc + t).to(tl.int64)
    offs_kh = tl.arange(0, BLOCK_KVH)
    mask_k = (offs_kh < NUM_KV_HEADS)[:, None] & mask_half[None, :]
    k_ptr = row + (NUM_HEADS + offs_kh[:, None]) * HEAD_DIM + offs_half[None, :]
    k1 = tl.load(k_ptr, mask=mask_k, other=0.0)
    k2 = tl.load(k_ptr + HALF, mask=mask_k, other=0.0)
    r1, r2 = _norm_rotate(k1, k2, cos, sin, KNormW, offs_half, mask_half, eps, HEAD_DIM, HALF, NORM, GEMMA)
    kb_ptr = KBuf + slot * stride_kb_n + offs_kh[:, None] * stride_kb_h + offs_half[None, :]
    v_ptr = k_ptr + NUM_KV_HEADS * HEAD_DIM
    vb_ptr = VBuf + slot * stride_vb_n + offs_kh[:, None] * stride_vb_h + offs_half[None, :]
    v1 = tl.load(v_ptr, mask=mask_k, other=0.0)
    v2 = tl.load(v_ptr + HALF, mask=mask_k, other=0.0)
    if HAS_KV_SCALE:  # e4m3 pool: K rounded to the model dtype first (as the torch path stores it), then / scale
        k_scale = tl.load(KScale + offs_kh, mask=offs_kh < NUM_KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(VScale + offs_kh, mask=offs_kh < NUM_KV_HEADS, other=1.0)[:, None]
        dtype = k1.dtype
        tl.store(kb_ptr, to_e4m3(tl.math.div_rn(r1.to(dtype).to(tl.float32), k_scale)), mask=mask_k)
        tl.store(kb_ptr + HALF, to_e4m3(tl.math.div_rn(r2.to(dtype).to(tl.float32), k_scale)), mask=mask_k)
        tl.store(vb_ptr, to_e4m3(tl.math.div_rn(v1.to(tl.float32), v_scale)), mask=mask_k)
        tl.store(vb_ptr + HALF, to_e4m3(tl.math.div_rn(v2.to(tl.float32), v_scale)), mask=mask_k)
    else:
        tl.store(kb_ptr, r1.to(KBuf.dtype.element_ty), mask=mask_k)
        tl.store(kb_ptr + HALF, r2.to(KBuf.dtype.element_ty), mask=mask_k)
        tl.store(vb_ptr, v1.to(VBuf.dtype.element_ty), mask=mask_k)
        tl.store(vb_ptr + HALF, v2.to(VBuf.dtype.element_ty), mask=mask_k)


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D], last dim contiguous: q heads, then k heads, then v heads
    cos: torch.Tensor,  # [T, D] float32 (RotaryEmbedding); only the first D/2 columns are read
    sin: torch.Tensor,  # [T, D] float32
    out_cache_loc: torch.Tensor,  # [T] int64 pool slots of the new tokens
    k_buffer: torch.Tensor,  # [num_slots, KVH, D] this layer's pool K, written in place
    v_buffer: torch.Tensor,  # [num_slots, KVH, D] written in place
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]; given together with k_norm_weight
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    gemma_norm: bool = False,
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an e4m3 pool's scales; the stored K is K / k_scale
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns the rotated queries [T, H, D] (qkv's dtype); writes the new K (normed, rotated) and V into
    the pool at out_cache_loc (quantized to e4m3 with the per-kv-head scales when the pool is e4m3). qkv is not
    modified."""
    num_tokens = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (H + 2 KVH) * D] for H={num_heads}, "
                         f"KVH={num_kv_heads}, D={head_dim} with a contiguous last dim")
    if head_dim % 2 or k_buffer.shape[1:] != (num_kv_heads, head_dim) or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"k/v buffers {tuple(k_buffer.shape)} do not hold [KVH={num_kv_heads}, D={head_dim}]")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("k/v buffers and cos/sin need a contiguous last dim")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    scales = kv_scale_args(k_buffer, k_scale, v_scale)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    norm = q_norm_weight is not None
    _qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, cos, sin, out_cache_loc, q_norm_weight if norm else cos, k_norm_weight if norm else cos,
        q_out, k_buffer, v_buffer, scales.pop("KScale"), scales.pop("VScale"),
        qkv.stride(0), cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), norm_eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), NORM=norm, GEMMA=gemma_norm, num_warps=4,
        **pdl_args(qkv, num_tokens), **scales,
    )  # fmt: skip
    return q_out
