"""Fused gated activation: out = act(gate) * up, reading the fused gate_up projection [T, 2I] once.

act is SiLU (Llama, Mistral, Qwen) or tanh-approximated GELU (Gemma's gelu_pytorch_tanh); the math runs in
float32 and is rounded once. The torch reference is `kernels/fused_reference.py: act_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import pdl_args, pdl_begin

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def gated_act(g, ACT: tl.constexpr):
    """act(g) in float32 for ACT 'silu' or 'gelu_tanh' (tanh written with exp: no libdevice needed)."""
    if ACT == "silu":
        return g / (1.0 + tl.exp(-g))
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (g + 0.044715 g^3)
    t = tl.exp(-2.0 * tl.abs(inner))
    th = (1.0 - t) / (1.0 + t)
    return 0.5 * g * (1.0 + tl.where(inner < 0, -th, th))


@triton.jit
def _act_mul_kernel(GateUp, Out, stride_gu, stride_o, inter, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(GateUp + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (gated_act(g, ACT) * u).to(Out.dtype.element_ty), mask=mask)


def act_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """gate_up: [T, 2I] (gate then up, last dim contiguous) -> act(gate) * up: [T, I] in gate_up's dtype."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"act_mul expects [T, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(inter), 2048)
    grid = (num_rows, triton.cdiv(inter, block))
    _act_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, ACT=act, BLOCK=block,
                          num_warps=4, **pdl_args(gate_up, num_rows))
    return out
