"""FP8 kernels against their torch references, under TRITON_INTERPRET=1 on the CPU (see conftest.py):
- the FP8 linear (kernels/fp8_gemm.py) against kernels/fp8_reference.py (dequantize, multiply in float32), with
  activation scales per group of K values and per token, and the reference's own quantizers;
- the weight-only FP8 linear (kernels/gemv.py with e4m3 weights) against fp8_reference.weight_only_linear, in every
  layout kind (K split, the weight as the first operand, row blocks for tall inputs, the gated activation fused);
- the attention kernels (extend, decode, cascade, split merge) reading an e4m3 K/V pool with per-kv-head scales,
  against kernels/reference.py given the same scales, and that reference against attention over the dequantized
  float pool;
- the fused RoPE + K/V store quantizing into an e4m3 pool, against kernels/fused_reference.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from prefixrt.kernels import fp8_reference as fp8_ref  # noqa: E402
from prefixrt.kernels import fused_reference  # noqa: E402
from prefixrt.kernels import reference as ref  # noqa: E402
from prefixrt.kernels.cascade_decode import cascade_decode_attention  # noqa: E402
from prefixrt.kernels.cascade_plan import plan_cascade  # noqa: E402
from prefixrt.kernels.decode_attention import decode_attention  # noqa: E402
from prefixrt.kernels.extend_attention import block_m_for, block_map, extend_attention  # noqa: E402
from prefixrt.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, quantize_activations, run_config  # noqa: E402
from prefixrt.kernels.gemv import GemvConfig, gemv  # noqa: E402
from prefixrt.kernels.rope import qk_norm_rope_store  # noqa: E402

from tests.kernels.test_attention_kernels import (  # noqa: E402
    DEVICE,
    make_cascade_case,
    make_decode_case,
    make_extend_case,
    rel_err,
)

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ------------------------------------------------------------------------------------------------ FP8 linear


@pytest.mark.parametrize("activation_scale", ["group", "token"])
def test_quantize_activations_matches_reference_bytes(activation_scale):
    """Per-group (K = 300: groups of 64, the last of 44) and per-token quantization: the kernel's bytes and scales
    equal the reference's, including values whose rounding carries into the next power of two (124.1 -> 128), exact
    ties, a row of zeros and subnormals."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=gen) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 1.0, 1e-6])[:, None]
    x[3] = 0.0
    x[4, :5] = torch.tensor([124.1, -125.0, 448.0, 0.0, 3.5]) / 448.0 * 448.0  # amax 448: scale 1, values as is
    x[4, 5:] = torch.linspace(-447.0, 447.0, 295)
    x_q, scale = quantize_activations(x.to(DEVICE), activation_scale)
    r_q, r_scale = fp8_ref.quantize_activations(x, activation_scale)
    assert scale.shape == ((6, 5) if activation_scale == "group" else (6,))
    assert same_bytes(x_q.cpu(), r_q)
    assert torch.equal(scale.cpu(), r_scale)
    assert x_q[4, 0].float().item() == 128.0
    assert torch.all(x_q[3].float() == 0)


def nan_after(t: torch.Tensor) -> torch.Tensor:
    """t's values in a buffer whose memory after t holds NaN: a kernel reading past t's end (a K tile's tail past
    the last scale column) turns its output into NaN instead of reading whatever memory follows."""
    buf = torch.full((t.numel() + 256,), float("nan"), dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


def gemm_case(m: int, k: int, block_scales: bool, quantize_input: bool, split_k: int, seed: int,
              activation_scale: str = "group"):  # fmt: skip
    """(y from fp8_gemm, the reference's product, the float product) for random x [m, k] bf16, W [n, k] (n 200
    with 128 x 128 block scales, else 48), a bias, 32 x 64 tiles."""
    gen = torch.Generator().manual_seed(seed)
    n = 200 if block_scales else 48
    w = torch.randn(n, k, generator=gen) / k**0.5
    w_q, w_scale = (fp8_ref.quantize_blocks if block_scales else fp8_ref.quantize_rows)(w)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    config = Fp8GemmConfig(block_n=32, block_k=64, quantize_input=quantize_input, split_k=split_k)
    args = [t.to(DEVICE) for t in (w_q, w_scale, bias)]
    if quantize_input:
        y = fp8_gemm(x.to(DEVICE), *args, config=config, activation_scale=activation_scale)
    else:
        x_q, x_scale = quantize_activations(x.to(DEVICE), activation_scale)
        y = fp8_gemm(x_q, *args, config=config, x_scale=nan_after(x_scale), activation_scale=activation_scale)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    expected = fp8_ref.fp8_linear(x, w_q, w_scale, bias, activation_scale)
    return y.cpu(), expected, x.float() @ w.T + bias.float()


@pytest.mark.parametrize("block_scales", [False, True], ids=["per-channel", "block-128"])
def test_static_activation_scale_gemm_matches_reference(block_scales):
    """A checkpoint's static activation scale (model/fp8_static_linear.py): the input quantized with it, past-448
    values saturating, then the kernel a GPU runs where cuBLAS's row-wise _scaled_mm cannot (here the Triton GEMM,
    given the equal per-row scales) computes what the reference computes."""
    from prefixrt.model.fp8_static_linear import gemm_quantized

    gen = torch.Generator().manual_seed(3)
    n, k = (200, 300) if block_scales else (48, 96)
    w = torch.randn(n, k, generator=gen) / k**0.5
    w_q, w_scale = (fp8_ref.quantize_blocks if block_scales else fp8_ref.quantize_rows)(w)
    x = (torch.randn(9, k, generator=gen) * 2).to(torch.bfloat16)
    input_scale = torch.tensor([x.float().abs().amax().item() / 448 / 1.5])  # the largest values saturate
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x_q, x_scale = fp8_ref.quantize_static(x, input_scale)
    assert torch.all(x_scale == input_scale) and (x_q.float().abs() == 448).any()
    y = gemm_quantized(x_q.to(DEVICE), x_scale.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE),
                       torch.bfloat16)
    expected = fp8_ref.fp8_linear_static(x, w_q, w_scale, input_scale, bias)
    assert y.dtype == torch.bfloat16 and rel_err(y.cpu(), expected) < 1e-2
    assert rel_err(expected, x.float() @ w.T + bias.float()) < 0.1  # (saturation costs a little)


@pytest.mark.parametrize("m", [1, 7, 16, 33, 70])
@pytest.mark.parametrize("block_scales", [False, True], ids=["per-channel", "block-128"])
@pytest.mark.parametrize("quantize_input", [True, False], ids=["quantize-in-gemm", "quantized-before"])
@pytest.mark.parametrize("activation_scale", ["group", "token"])
def test_fp8_gemm_matches_reference(m, block_scales, quantize_input, activation_scale):
    y, expected, unquantized = gemm_case(m, 300 if block_scales else 96, block_scales, quantize_input, 1, seed=m,
                                         activation_scale=activation_scale)
    assert rel_err(y, expected) < 1e-2
    # and the quantized product is close to the unquantized one (the reference is not trivially wrong)
    assert rel_err(expected, unquantized) < 0.08


@pytest.mark.parametrize("split_k", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 16, 33])
@pytest.mark.parametrize("block_scales", [False, True], ids=["per-channel", "block-128"])
def test_fp8_gemm_split_k_matches_reference(split_k, m, block_scales):
    """Split-K: K = 300 in 64-wide tiles over 2-8 slices (with 8, five slices of 64 and three empty ones), the
    partials summed by the second launch with the bias; input quantized in the GEMM (m = 1, 33) or before (m = 16)."""
    y, expected, _ = gemm_case(m, 300, block_scales, m != 16, split_k, seed=10 * m + split_k)
    assert rel_err(y, expected) < 1e-2


def outlier_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """x [m, k] float32 whose rows have a few channels 100x the rest (as real activations do): per-token scales then
    round the other channels far more coarsely than per-group ones, so the two schemes' products differ by far
    more than float rounding and a kernel applying a group's scale to the wrong values shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:3]] *= 100.0
    return x


@pytest.mark.parametrize("k", [576, 384, 200])  # 9 groups of 64 (SmolLM2's hidden size), 6, 4 (the last of 8)
@pytest.mark.parametrize("block_k", [32, 64, 128, 256])  # inside a group, one group, two or four groups a tile
@pytest.mark.parametrize("quantize_input", [True, False], ids=["quantize-in-gemm", "quantized-before"])
@pytest.mark.parametrize("split_k", [1, 4])
def test_fp8_gemm_group_scales_are_tight(k, block_k, quantize_input, split_k):
    """Group activation scales with an fp32 input and output: the kernel equals the reference to float rounding for
    every relation of the K tile to the group (narrower, equal, wider), with and without split-K (K 576 in slices of
    160 at block_k 32: a slice ends inside a group), the input quantized inside the GEMM or before it; 1, 5 and 33 rows (one
    and two row blocks). The per-token reference is far off (the test tells the schemes apart)."""
    gen = torch.Generator().manual_seed(k + block_k)
    w_q, w_scale = fp8_ref.quantize_weight(torch.randn(40, k, generator=gen) / k**0.5)
    bias = torch.randn(40, generator=gen)
    config = Fp8GemmConfig(32, block_k, quantize_input=quantize_input, split_k=split_k)
    args = [t.to(DEVICE) for t in (w_q, w_scale, bias)]
    for m in (1, 5, 33):
        x = outlier_activations(m, k, seed=m)
        if quantize_input:
            y = fp8_gemm(x.to(DEVICE), *args, config=config)
        else:
            x_q, x_scale = quantize_activations(x.to(DEVICE))
            y = fp8_gemm(x_q, *args, config=config, x_scale=nan_after(x_scale), out_dtype=torch.float32)
        expected = fp8_ref.fp8_linear(x, w_q, w_scale, bias)
        assert rel_err(y.cpu(), expected) < 1e-5
        assert rel_err(fp8_ref.fp8_linear(x, w_q, w_scale, bias, "token"), expected) > 1e-3


@pytest.mark.parametrize("k", [576, 256])
@pytest.mark.parametrize("block_k", [64, 128])
@pytest.mark.parametrize("quantize_input", [True, False], ids=["quantize-in-gemm", "quantized-before"])
def test_fp8_gemm_group_scales_with_block_weights(k, block_k, quantize_input):
    """128 x 128 weight blocks with group activation scales (two groups of 64 inside each block), fp32: the
    weight block's scale and the activation group's both multiply each tile's product; split-K 2."""
    gen = torch.Generator().manual_seed(k)
    w_q, w_scale = fp8_ref.quantize_blocks(torch.randn(200, k, generator=gen) / k**0.5)
    config = Fp8GemmConfig(64, block_k, quantize_input=quantize_input, split_k=2)
    x = outlier_activations(7, k, seed=1)
    if quantize_input:
        y = fp8_gemm(x.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE), config=config)
    else:
        x_q, x_scale = quantize_activations(x.to(DEVICE))
        y = fp8_gemm(x_q, w_q.to(DEVICE), w_scale.to(DEVICE), config=config, x_scale=nan_after(x_scale), out_dtype=torch.float32)
    assert rel_err(y.cpu(), fp8_ref.fp8_linear(x, w_q, w_scale)) < 1e-5


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("activation_scale", ["group", "token"])
def test_fp8_gemm_fp32_output_is_tight(split_k, activation_scale):
    """With an fp32 input and output the kernel equals the reference to float rounding (no bf16 output rounding),
    with and without split-K."""
    gen = torch.Generator().manual_seed(3)
    w_q, w_scale = fp8_ref.quantize_rows(torch.randn(64, 256, generator=gen))
    x = torch.randn(5, 256, generator=gen)
    bias = torch.randn(64, generator=gen)
    config = Fp8GemmConfig(32, 64, split_k=split_k)
    y = fp8_gemm(x.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE), config=config,
                 activation_scale=activation_scale)
    assert rel_err(y.cpu(), fp8_ref.fp8_linear(x, w_q, w_scale, bias, activation_scale)) < 1e-6


@pytest.mark.parametrize("m", [1, 5, 33, 70])
@pytest.mark.parametrize("block_scales", [False, True], ids=["per-channel", "block-128"])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("config", [GemvConfig(32, 64, 1, 4, 1), GemvConfig(16, 128, 2, 4, 1, block_m=32),
                                    GemvConfig(64, 64, 1, 4, 1, swap_ab=True),
                                    GemvConfig(32, 128, 1, 4, 1, block_m=16, swap_ab=True)], ids=str)
def test_weight_only_gemv_matches_reference(m, block_scales, act, config):
    """e4m3 weights widened in the kernel, bf16 activations as they are: the reference's dequantize-then-multiply
    (float32 products of the same bf16 inputs, the same act(gate) * up rounding); N and K not multiples of the
    tiles; the output is poisoned first, so every element must be written."""
    if m > 64 and not config.block_m:
        pytest.skip("a layout sized to the rows takes at most 64 (tall inputs need a block_m layout)")
    gen = torch.Generator().manual_seed(m)
    n, k = 90, 200
    w = torch.randn(n, k, generator=gen) / k**0.5
    w_q, w_scale = fp8_ref.quantize_blocks(w) if block_scales else fp8_ref.quantize_weight(w)
    x = (torch.randn(m, 2 * k if act else k, generator=gen) * 2).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = fp8_ref.weight_only_linear(fused_reference.act_mul(x, act) if act else x, w_q, w_scale, bias)
    got = gemv(x, w_q, bias, config, act, w_scale=w_scale)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    assert rel_err(got, want) < 1e-2
    assert rel_err(want, fused_reference.linear(x, fp8_ref.dequantize_weight(w_q, w_scale).to(torch.bfloat16),
                                                bias, act)) < 2e-2  # (the reference is the dequantized linear)


def test_weight_only_gemv_rejects_bad_arguments():
    w_q, w_scale = fp8_ref.quantize_weight(torch.randn(64, 128))
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3 weights need w_scale"):
        gemv(x, w_q)
    with pytest.raises(ValueError, match="fit neither"):
        gemv(x, w_q, w_scale=w_scale[:10])
    w_b, s_b = fp8_ref.quantize_blocks(torch.randn(64, 128))
    with pytest.raises(ValueError, match="block_k dividing 128"):
        gemv(x, w_b, config=GemvConfig(32, 256), w_scale=s_b)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemv(torch.randn(65, 128).to(torch.bfloat16), w_q, w_scale=w_scale)


def test_fp8_gemm_rejects_bad_arguments():
    w_q, w_scale = fp8_ref.quantize_rows(torch.randn(32, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemm(x.to(FP8), w_q, w_scale)
    with pytest.raises(ValueError, match="scales"):
        fp8_gemm(x, w_q, w_scale[:16])
    bq, bs = fp8_ref.quantize_blocks(torch.randn(32, 256))
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm(torch.randn(2, 256), bq, bs, config=Fp8GemmConfig(block_k=256))
    with pytest.raises(ValueError, match="split_k"):
        fp8_gemm(x, w_q, w_scale, config=Fp8GemmConfig(split_k=3))
    with pytest.raises(ValueError, match="activation_scale"):
        fp8_gemm(x, w_q, w_scale, activation_scale="tensor")
    x_q, token_scale = fp8_ref.quantize_activations(x, "token")
    with pytest.raises(ValueError, match="x_scale"):  # per-token scales given to the group scheme
        fp8_gemm(x_q, w_q, w_scale, x_scale=token_scale)
    with pytest.raises(ValueError, match="_scaled_mm"):  # cuBLAS's row-wise path takes no group scales
        run_config(x, w_q, w_scale, None, None, "group")


def test_activation_group_size_covers_the_registry_shapes():
    """Groups of 64 for every K of the registry's models (SmolLM2-135M 576 / 1536, Gemma-3-270M 640 / 1024 / 2048,
    Llama-3-8B 4096 / 14336, Qwen3-0.6B 1024 / 2048 / 3072), each a whole number of groups; any other K runs with a
    shorter last group."""
    for k in (576, 1536, 640, 1024, 2048, 4096, 14336, 3072):
        assert fp8_ref.activation_group_size(k) == 64 and k % 64 == 0
    x_q, scale = fp8_ref.quantize_activations(torch.randn(2, 200))
    assert scale.shape == (2, 4) and x_q.shape == (2, 200)


def test_group_quantization_reference():
    """Each group's scale is its own amax / 448 (the last group of 8 values too), the round trip is within e4m3's
    relative step, a group of zeros stays zero, and a row's outliers leave the other groups' rounding fine where a
    per-token scale coarsens them."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))
    x[:, 5] *= 1e5  # an outlier channel in the first group: under its scale the other values are e4m3 subnormals
    x[1, 64:128] = 0.0
    x_q, scale = fp8_ref.quantize_groups(x, 64)
    assert scale.shape == (3, 4)
    for g, (lo, hi) in enumerate(((0, 64), (64, 128), (128, 192), (192, 200))):
        assert torch.equal(scale[:, g], x[:, lo:hi].abs().amax(-1).clamp_min(fp8_ref.MIN_AMAX) / 448.0)
    assert torch.all(x_q[1, 64:128].float() == 0)
    deq = fp8_ref.dequantize_activations(x_q, scale)
    assert ((deq - x).abs() <= x.abs() * 2**-4 + scale.repeat_interleave(64, 1)[:, :200] * 2**-9).all()
    others = slice(64, 200)  # the groups without the outlier
    token_err = (fp8_ref.dequantize_activations(*fp8_ref.quantize_rows(x)) - x)[:, others].abs().mean()
    assert (deq - x)[:, others].abs().mean() < token_err / 2
    with pytest.raises(ValueError, match="group scales"):
        fp8_ref.dequantize_activations(x_q, scale[:, :3])
    with pytest.raises(ValueError, match="activation_scale"):
        fp8_ref.quantize_activations(x, "channel")


def test_block_quantization_round_trip():
    w = torch.randn(130, 260)
    w_q, scale = fp8_ref.quantize_blocks(w)
    assert scale.shape == (2, 3)
    assert rel_err(fp8_ref.dequantize_weight(w_q, scale), w) < 0.05
    assert fp8_ref.dequantize_weight(w_q, scale).abs().amax() <= w.abs().amax() * 1.001


# --------------------------------------------------------------------------------------------- FP8 K/V pool


def quantize_pool(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A float pool [slots, KVH, D] -> (k_q, v_q, k_scale, v_scale): e4m3 with one scale per kv head."""
    k_scale = k.float().abs().amax(dim=(0, 2)) / 448.0
    v_scale = v.float().abs().amax(dim=(0, 2)) / 448.0
    return fp8_ref.quantize_kv(k, k_scale), fp8_ref.quantize_kv(v, v_scale), k_scale, v_scale


def fp8_args(args: tuple) -> tuple[tuple, tuple, dict]:
    """Kernel arguments (k, v, ...) -> (e4m3 arguments, dequantized float arguments, scale keywords)."""
    k_q, v_q, k_scale, v_scale = quantize_pool(args[0], args[1])
    deq = (k_q.float() * k_scale[None, :, None], v_q.float() * v_scale[None, :, None])
    return (k_q, v_q, *args[2:]), (*deq, *args[2:]), {"k_scale": k_scale, "v_scale": v_scale}


def test_fp8_reference_equals_attention_over_dequantized_pool():
    """The oracle: reading an e4m3 pool with its scales is attention over the dequantized values."""
    rng = random.Random(11)
    q, args, _, _ = make_extend_case(rng, 2, 64, torch.float32)
    q8_args, deq_args, scales = fp8_args(args)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    ref.extend_attention(q, out, *q8_args, **scales)
    ref.extend_attention(q, expected, *deq_args)
    assert rel_err(out, expected) < 1e-6
    # and the quantization itself is a small perturbation of the float attention
    ref.extend_attention(q, expected, *args)
    assert rel_err(out, expected) < 0.1


@pytest.mark.parametrize("heads_per_kv,head_dim,window,softcap,pack,dtype", [
    (1, 64, None, None, False, torch.float32),
    (2, 64, 8, None, True, torch.float32),
    (4, 128, None, 30.0, True, torch.bfloat16),
    (3, 64, None, None, False, torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_attention_fp8(heads_per_kv, head_dim, window, softcap, pack, dtype, page_size):
    rng = random.Random(f"fp8-extend-{heads_per_kv}-{head_dim}-{page_size}")
    q, args, _, _ = make_extend_case(rng, heads_per_kv, head_dim, torch.float32, page_size=page_size,
                                     prefix_lens=[0, 19, 33])
    q = q.to(dtype)
    q8_args, _, scales = fp8_args(args)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *q8_args, sliding_window=window, logit_softcap=softcap, pack_heads=pack,
                     page_size=page_size, **scales)
    ref.extend_attention(q, expected, *q8_args, sliding_window=window, logit_softcap=softcap, **scales)
    assert rel_err(out, expected) < TOL[dtype]


def test_extend_attention_fp8_block_map_splits():
    """The EXTEND graphs' fixed-grid launch with split keys (merged by LSE) over an e4m3 pool."""
    rng = random.Random(5)
    q, args, _, _ = make_extend_case(rng, 2, 64, torch.float32, num_seqs=3, prefix_lens=[0, 40, 25])
    q8_args, _, scales = fp8_args(args)
    block_m = block_m_for(64, 64, 16)
    seqs, mbs = block_map(args[5].tolist(), block_m, 12)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out, expected = torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *q8_args, block_seq=torch.tensor(seqs, **i32), block_mb=torch.tensor(mbs, **i32),
                     block_m=block_m, num_splits=3, **scales)
    ref.extend_attention(q, expected, *q8_args, **scales)
    assert rel_err(out, expected) < 1e-4


@pytest.mark.parametrize("heads_per_kv,head_dim,window,softcap,num_splits,dtype,page_size", [
    (2, 64, None, None, 1, torch.float32, 1),
    (4, 64, 5, 20.0, 4, torch.float32, 4),
    (4, 128, None, None, 3, torch.bfloat16, 16),
])  # fmt: skip
def test_decode_attention_fp8(heads_per_kv, head_dim, window, softcap, num_splits, dtype, page_size):
    rng = random.Random(f"fp8-decode-{heads_per_kv}-{num_splits}")
    q, args = make_decode_case(rng, heads_per_kv, head_dim, torch.float32, page_size=page_size)
    q = q.to(dtype)
    q8_args, _, scales = fp8_args(args)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, out, *q8_args, sliding_window=window, logit_softcap=softcap, num_kv_splits=num_splits,
                     page_size=page_size, **scales)
    ref.decode_attention(q, expected, *q8_args, sliding_window=window, logit_softcap=softcap, **scales)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("heads_per_kv,head_dim,softcap,per_tile,dtype,page_size", [
    (2, 64, None, 2, torch.float32, 1),
    (4, 128, 25.0, 3, torch.bfloat16, 4),
])  # fmt: skip
def test_cascade_decode_fp8(heads_per_kv, head_dim, softcap, per_tile, dtype, page_size):
    """Prefix stage, suffix stage and the split merge over an e4m3 pool equal plain decode's reference."""
    q, args, groups, seq_lens = make_cascade_case(heads_per_kv, head_dim, torch.float32, page_size=page_size)
    q = q.to(dtype)
    q8_args, _, scales = fp8_args(args)
    plan = plan_cascade(groups, seq_lens, DEVICE, queries_per_tile=per_tile)
    out, by_ref, expected = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    cascade_decode_attention(q, out, *q8_args, plan=plan, logit_softcap=softcap, num_prefix_splits=2,
                             num_suffix_splits=2, page_size=page_size, **scales)
    ref.cascade_decode_attention(q, by_ref, *q8_args, plan=plan, logit_softcap=softcap, **scales)
    ref.decode_attention(q, expected, *q8_args, logit_softcap=softcap, **scales)
    assert rel_err(by_ref.float(), expected.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(out, expected) < TOL[dtype]


def test_kernels_refuse_an_fp8_pool_without_scales():
    rng = random.Random(2)
    q, args = make_decode_case(rng, 2, 64, torch.float32)
    q8_args, _, scales = fp8_args(args)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q, torch.empty_like(q), *q8_args)
    with pytest.raises(ValueError, match="neither"):
        decode_attention(q, torch.empty_like(q), *args, **scales)
    q, eargs, k_new, v_new = make_extend_case(rng, 2, 64, torch.float32)
    q8_args, _, scales = fp8_args(eargs)
    with pytest.raises(ValueError, match="pool only"):
        extend_attention(q, torch.empty_like(q), *q8_args, k_extend=k_new, v_extend=v_new, **scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope_store_quantizes_into_fp8_pool(dtype, norm):
    gen = torch.Generator().manual_seed(4)
    t, h, kvh, d, slots = 9, 4, 2, 32, 40
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 3).to(DEVICE, dtype)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    cos, sin = torch.cat([pos.cos()] * 2, dim=-1).to(DEVICE), torch.cat([pos.sin()] * 2, dim=-1).to(DEVICE)
    loc = torch.randperm(slots - 1, generator=gen)[:t].to(DEVICE) + 1
    k_scale = (torch.rand(kvh, generator=gen) * 0.05 + 0.01).to(DEVICE)
    v_scale = (torch.rand(kvh, generator=gen) * 0.05 + 0.01).to(DEVICE)
    extra = {}
    if norm:
        extra = dict(q_norm_weight=torch.randn(d, generator=gen).to(DEVICE, dtype),
                     k_norm_weight=torch.randn(d, generator=gen).to(DEVICE, dtype), norm_eps=1e-6)
    fp8_bufs = [torch.zeros(slots, kvh, d, dtype=FP8, device=DEVICE) for _ in range(2)]
    float_bufs = [torch.zeros(slots, kvh, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    q = qk_norm_rope_store(qkv, cos, sin, loc, *fp8_bufs, h, kvh, d, **extra, k_scale=k_scale, v_scale=v_scale)
    q_float = qk_norm_rope_store(qkv, cos, sin, loc, *float_bufs[:2], h, kvh, d, **extra)
    q_ref = fused_reference.qk_norm_rope_store(qkv, cos, sin, loc, *float_bufs[2:], h, kvh, d, **extra)
    assert torch.equal(q, q_float) and rel_err(q, q_ref) < TOL[dtype]
    # Storing into the e4m3 pool is storing into a model-dtype pool, then quantizing per kv head: the same bytes.
    assert same_bytes(fp8_bufs[0], fp8_ref.quantize_kv(float_bufs[0], k_scale))
    assert same_bytes(fp8_bufs[1], fp8_ref.quantize_kv(float_bufs[1], v_scale))
    # and the torch reference's quantizing store is that too
    ref_bufs = [torch.zeros(slots, kvh, d, dtype=FP8, device=DEVICE) for _ in range(2)]
    fused_reference.qk_norm_rope_store(qkv, cos, sin, loc, *ref_bufs, h, kvh, d, **extra, k_scale=k_scale,
                                       v_scale=v_scale)
    assert same_bytes(ref_bufs[0], fp8_ref.quantize_kv(float_bufs[2], k_scale))
    assert rel_err(fp8_bufs[0].float() * k_scale[None, :, None], float_bufs[2]) < 0.05
    assert fp8_bufs[0][loc].float().abs().amax() > 0  # something was stored
    assert math.isfinite(fp8_bufs[0].float().sum().item())
