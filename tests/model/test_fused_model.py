"""The fused path (layers.use_fused_kernels: Triton add+RMSNorm, act*mul, q/k-norm + RoPE + K/V store, GEMV)
against the torch reference path on tiny checkpoints of every architecture: the same prefill with a
reused prefix, then a decode step, on identically prepared pools, with the Triton attention backend in
both runs (so the only difference is the fused layer kernels). Under TRITON_INTERPRET=1 (conftest.py)
this runs on the CPU. The unfused path is itself checked against transformers in tests/model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixrt.hub.loader import load_model  # noqa: E402
from prefixrt.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from prefixrt.model.layers import GatedMLP, Linear, use_fused_kernels  # noqa: E402
from tests.helpers.checkpoints import save_tiny_checkpoint  # noqa: E402
from tests.helpers.harness import PagedHarness  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL_FP32 = 1e-5  # whole-model logits and pool contents, fused vs unfused


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_steps(model, **kv) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill A, then B reusing A's first 4 tokens plus a fresh C (one ragged extend of 10 tokens: every
    linear sees <= 16 rows, so the GEMV runs), then one decode step of all three. -> (logits, K pool).
    kv: PagedHarness's kv_dtype / kv_scales (an FP8 pool)."""
    harness = PagedHarness(model, num_slots=128, max_rows=4, max_context=32, device=DEVICE, **kv)
    harness.runner.attn_backend = TritonAttentionBackend(harness.pool, max_batch_size=4, num_sms=8)
    out = []
    row_a = harness.new_row()
    out += harness.forward([(row_a, tokens(6, 1))])
    row_b, row_c = harness.new_row(row_a, 4), harness.new_row()
    out += harness.forward([(row_b, tokens(3, 2)), (row_c, tokens(7, 3))])
    out += harness.forward([(row, tokens(1, 4 + row)) for row in (row_a, row_b, row_c)])
    return out, [k.clone() for k in harness.pool.k_buffers]


CASES = [  # llama3 rope scaling, qkv bias (qwen2), Llama-style q/k norms (qwen3), Gemma-3 (windows, 1+w norms)
    ("llama3_rope", torch.float32), ("qwen2", torch.float32), ("qwen3", torch.float32), ("gemma3", torch.float32),
    ("llama", torch.bfloat16), ("gemma3", torch.bfloat16),
]


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen2", "qwen3", "gemma3"])
def test_fused_path_matches_unfused_fp32(arch, tmp_path):
    """llama3 rope scaling, qkv bias (qwen2), Llama-style q/k norms (qwen3), Gemma-3 (windows, 1 + w norms,
    GELU-tanh): logits and the K pool agree to float32 rounding."""
    save_tiny_checkpoint(arch, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=DEVICE)
    with torch.inference_mode():
        expected, expected_k = run_steps(model)
        use_fused_kernels(model, gemv="always")
        assert all(m.gemv_plan for m in model.modules() if isinstance(m, Linear))
        assert all(m.down_act_plan for m in model.modules() if isinstance(m, GatedMLP))
        got, got_k = run_steps(model)
        use_fused_kernels(model, enabled=False)
        again, _ = run_steps(model)
    for g, e, a in zip(got, expected, again):
        assert rel_err(g, e) < TOL_FP32
        assert torch.equal(a, e)  # switching back restores the reference path exactly
    for g, e in zip(got_k, expected_k):
        assert rel_err(g, e) < TOL_FP32


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_path_bf16_as_close_to_fp32_as_unfused(arch, tmp_path):
    """In bf16 the two paths round at different places through every layer (and the interpreter truncates
    float32 -> bf16 instead of rounding), so they are compared by their distance to the float32 logits:
    the fused path may be at most 2.5x as far from them as the torch path, and within 5e-2."""
    save_tiny_checkpoint(arch, tmp_path)
    with torch.inference_mode():
        truth, _ = run_steps(load_model(str(tmp_path), dtype=torch.float32, device=DEVICE))
        model = load_model(str(tmp_path), dtype=torch.bfloat16, device=DEVICE)
        unfused, _ = run_steps(model)
        use_fused_kernels(model, gemv="always")
        fused, _ = run_steps(model)
    for f, u, t in zip(fused, unfused, truth):
        assert rel_err(f, t) < min(5e-2, max(2.5 * rel_err(u, t), 1e-2))


def test_fused_path_without_gemv_keeps_cublas_linears(tmp_path):
    save_tiny_checkpoint("qwen3", tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=DEVICE)
    with torch.inference_mode():
        expected, _ = run_steps(model)
        use_fused_kernels(model, gemv="never")
        assert not any(m.gemv_plan for m in model.modules() if isinstance(m, Linear))
        got, _ = run_steps(model)
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("arch,activation_scale", [("qwen3", "none"), ("gemma3", "none"), ("qwen3", "token")])
def test_fused_path_fp8_weights_and_kv_matches_reference(arch, activation_scale, tmp_path):
    """FP8 weights (the weight-only Triton kernel for the decode-sized inputs, the scheme's path for taller ones) and
    an FP8 K/V pool (the fused
    RoPE store quantizing into it) against the reference path (dequantize-then-fp32 linears, the pool's torch
    quantization): the same computation, so logits agree closely; a K/V value may round one e4m3 step the other way
    where the two paths' float rounding differs, rarely."""
    from prefixrt.model.kv_calibration import calibrate_kv_scales
    from prefixrt.model.quantize import set_fp8_activation_scale

    save_tiny_checkpoint(arch, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=DEVICE, quantization="fp8")
    assert set_fp8_activation_scale(model, activation_scale) == 4 * model.num_layers
    kv = {"kv_dtype": torch.float8_e4m3fn, "kv_scales": calibrate_kv_scales(model, tokens(40, 9), DEVICE)}
    with torch.inference_mode():
        expected, expected_k = run_steps(model, **kv)
        use_fused_kernels(model, gemv="always")
        fp8 = [m for m in model.modules() if isinstance(m, Linear) and m.weight_scale is not None]
        assert len(fp8) == 4 * model.num_layers and all(m.fp8_plan and not m.gemv_plan for m in fp8)
        assert all(m.fp8_activation_scale == activation_scale for m in fp8)
        assert not any(m.down_act_plan for m in model.modules() if isinstance(m, GatedMLP))
        got, got_k = run_steps(model, **kv)
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-3
    for g, e in zip(got_k, expected_k):
        assert g.dtype == torch.float8_e4m3fn
        assert (g.view(torch.uint8) != e.view(torch.uint8)).float().mean() < 0.01
        assert rel_err(g.float(), e.float()) < 1e-2
