"""Plain torch references of the fused layer kernels (norm.py, activation.py, rope.py, gemv.py).

Each has its Triton counterpart's signature and follows the model's torch path op by op (the same casts
in the same places), so the kernels are checked against exactly what the unfused model computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) scaled by weight (Llama) or 1 + weight (Gemma), x + residual)."""
    summed = x if residual is None else x + residual
    s32 = summed.float()
    normed = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype), summed
    return weight * normed.to(x.dtype), summed


def act_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(act)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE as the model's torch path does it. x: [T, heads, D]; cos, sin: [T, D] float32."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def qk_norm_rope_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_cache_loc: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6, gemma_norm: bool = False, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Per-head q/k norm (optional), RoPE, K/V stored into the pool at out_cache_loc (an e4m3 pool: divided by the
    kv head's scale, kernels/fp8_reference.quantize_kv); returns q [T, H, D]."""
    num_tokens = qkv.shape[0]
    h, kvh, d = num_heads, num_kv_heads, head_dim
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(num_tokens, h, d), k.view(num_tokens, kvh, d), v.view(num_tokens, kvh, d)
    if q_norm_weight is not None:
        q = add_rms_norm(q, q_norm_weight, norm_eps, gemma=gemma_norm)[0]
        k = add_rms_norm(k, k_norm_weight, norm_eps, gemma=gemma_norm)[0]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if k_scale is not None:
        from prefixrt.kernels.fp8_reference import quantize_kv

        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)
    return q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           act_input: str | None = None) -> torch.Tensor:
    """x @ weight.T + bias; with act_input, x is a gate_up row and the product takes act(gate) * up."""
    return F.linear(act_mul(x, act_input) if act_input else x, weight, bias)
