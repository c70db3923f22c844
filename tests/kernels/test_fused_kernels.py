"""Fused layer kernels (kernels/norm.py, activation.py, rope.py, gemv.py) against their torch references
(kernels/fused_reference.py). Under TRITON_INTERPRET=1 (see conftest.py) this runs on the CPU; with CUDA it
runs the compiled kernels. Tolerance: relative norm error 1e-2 in bf16, 1e-5 in fp32."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from prefixrt.kernels import fused_reference as ref  # noqa: E402
from prefixrt.kernels.activation import act_mul  # noqa: E402
from prefixrt.kernels.gemv import GemvConfig, gemv  # noqa: E402
from prefixrt.kernels.norm import add_rms_norm  # noqa: E402
from prefixrt.kernels.rope import qk_norm_rope_store  # noqa: E402

from prefixrt.model.layers import RopeConfig, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 80])
def test_add_rms_norm(dtype, gemma, with_residual, hidden):
    x = randn(5, hidden, dtype=dtype, seed=1, scale=3.0)
    residual = randn(5, hidden, dtype=dtype, seed=2) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=3, scale=0.5) + (0.0 if gemma else 1.0)
    out, summed = add_rms_norm(x, weight, 1e-6, residual, gemma=gemma)
    exp_out, exp_summed = ref.add_rms_norm(x, weight, 1e-6, residual, gemma=gemma)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(summed, exp_summed)  # the residual stream is bit-identical to torch's add
    else:  # the interpreter truncates float32 -> bfloat16 instead of rounding to nearest
        assert rel_err(summed, exp_summed) < TOL[dtype]
    assert rel_err(out, exp_out) < TOL[dtype]


def test_add_rms_norm_strided_rows_and_empty():
    x = randn(4, 128, dtype=torch.float32, seed=4)[:, :64]  # row stride 128
    w = randn(64, dtype=torch.float32, seed=5)
    out, summed = add_rms_norm(x, w, 1e-5)
    assert summed is x and rel_err(out, ref.add_rms_norm(x, w, 1e-5)[0]) < 1e-6
    empty = torch.empty(0, 64, device=DEVICE)
    assert add_rms_norm(empty, w, 1e-5)[0].shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul(dtype, act):
    gate_up = randn(3, 2 * 96, dtype=dtype, seed=6, scale=3.0)
    out = act_mul(gate_up, act)
    assert out.shape == (3, 96)
    assert rel_err(out, ref.act_mul(gate_up, act)) < TOL[dtype]


ROPES = {
    "default": RopeConfig(head_dim=0, theta=10000.0),
    "linear": RopeConfig(head_dim=0, theta=1_000_000.0, rope_type="linear", factor=4.0),
    "llama3": RopeConfig(head_dim=0, theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
}
ROPE_CASES = [  # (rope, num_heads, num_kv_heads, head_dim, norm)
    ("default", 4, 2, 16, None),
    ("llama3", 8, 2, 32, None),
    ("linear", 4, 1, 64, "gemma"),
    ("default", 4, 4, 80, "llama"),  # head_dim / 2 not a power of two
    ("llama3", 3, 1, 32, "llama"),  # head count not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope,num_heads,num_kv_heads,head_dim,norm", ROPE_CASES)
def test_qk_norm_rope_store(dtype, rope, num_heads, num_kv_heads, head_dim, norm):
    import dataclasses

    cfg = dataclasses.replace(ROPES[rope], head_dim=head_dim)
    num_tokens, num_slots = 6, 40
    positions = torch.tensor([0, 1, 7, 63, 1000, 40000], device=DEVICE)  # long-context positions too
    cos, sin = RotaryEmbedding(cfg)(positions)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=7, scale=2.0)
    loc = torch.tensor([5, 17, 3, 39, 22, 8], device=DEVICE)
    norm_w = {}
    if norm:
        base = 0.0 if norm == "gemma" else 1.0
        norm_w = dict(q_norm_weight=randn(head_dim, dtype=dtype, seed=8, scale=0.3) + base,
                      k_norm_weight=randn(head_dim, dtype=dtype, seed=9, scale=0.3) + base,
                      norm_eps=1e-6, gemma_norm=norm == "gemma")
    pools = [torch.full((num_slots, num_kv_heads, head_dim), 7.0, device=DEVICE, dtype=dtype) for _ in range(4)]
    q = qk_norm_rope_store(qkv, cos, sin, loc, pools[0], pools[1], num_heads, num_kv_heads, head_dim, **norm_w)
    exp_q = ref.qk_norm_rope_store(qkv, cos, sin, loc, pools[2], pools[3], num_heads, num_kv_heads, head_dim,
                                   **norm_w)
    assert q.shape == (num_tokens, num_heads, head_dim)
    assert rel_err(q, exp_q) < TOL[dtype]
    assert rel_err(pools[0][loc], pools[2][loc]) < TOL[dtype]
    assert torch.equal(pools[1], pools[3])  # V copied exactly
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.all(pools[0][untouched] == 7.0)  # no other slot written


def test_qk_norm_rope_store_rejects_mismatched_shapes():
    qkv = torch.zeros(2, 4 * 16, device=DEVICE)
    cos = sin = torch.zeros(2, 16, device=DEVICE)
    buf = torch.zeros(8, 1, 16, device=DEVICE)
    loc = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="not"):
        qk_norm_rope_store(qkv, cos, sin, loc, buf, buf, 4, 1, 16)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_store(qkv, cos, sin, loc, buf, buf, 2, 1, 16, q_norm_weight=cos[0])


GEMV_CASES = [  # (m, n, k, config, bias, act)
    (1, 64, 256, GemvConfig(16, 64, 1), False, None),  # even: unmasked weight loads
    (3, 48, 96, GemvConfig(32, 32, 1), True, None),  # ragged N and K
    (16, 64, 256, GemvConfig(32, 64, 2), False, None),  # split-K, even
    (5, 40, 200, GemvConfig(16, 32, 4), True, None),  # split-K, ragged
    (2, 32, 64, GemvConfig(16, 32, 2), False, "silu"),  # activation fused into the input
    (1, 48, 96, GemvConfig(16, 32, 1), True, "gelu_tanh"),
    (23, 48, 96, GemvConfig(16, 32, 1), True, None),  # a 32-row input tile
    (64, 64, 128, GemvConfig(32, 32, 2), False, None),  # a 64-row tile, split-K
    (40, 32, 64, GemvConfig(16, 32, 1), False, "silu"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config,bias,act", GEMV_CASES)
def test_gemv(dtype, m, n, k, config, bias, act):
    x = randn(m, 2 * k if act else k, dtype=dtype, seed=10)
    w = randn(n, k, dtype=dtype, seed=11, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=12) if bias else None
    y = gemv(x, w, b, config, act)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, ref.linear(x, w, b, act)) < TOL[dtype]


def test_gemv_rejects_too_many_rows():
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.zeros(65, 32, device=DEVICE), torch.zeros(16, 32, device=DEVICE))
