"""The FP8 K/V pool (cache/kv_pool.py) and its scales (model/kv_calibration.py): writes quantize with fixed
per-layer, per-kv-head scales and reads dequantize; the same prefix gives the same bytes (again in a fresh row, and
within one e4m3 step when computed in other chunks); the calibration is deterministic and covers K's rotary pairs; the torch
reference attention over the FP8 pool equals attention over its dequantized values."""

from __future__ import annotations

import pytest
import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.hub.loader import load_model
from prefixrt.model.kv_calibration import HEADROOM, calibrate_kv_scales
from tests.helpers.checkpoints import save_tiny_checkpoint
from tests.helpers.harness import PagedHarness

FP8 = torch.float8_e4m3fn


def test_pool_quantizes_with_fixed_scales_and_dequantizes():
    pool = KVPool(16, 2, 2, 8, FP8, "cpu")
    assert pool.quantized and pool.kv_scales(0)[0].shape == (2,)
    k_scales = torch.tensor([[0.01, 0.02], [0.03, 0.04]])
    pool.set_scales(k_scales, k_scales * 2, "given")
    k = torch.randn(3, 2, 8) * 2
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([3, 7, 9])
    pool.write(1, slots, k, v)
    assert pool.k_buffers[1].dtype == FP8
    k_back, v_back = pool.read(1, slots)
    assert ((k_back - k).abs() <= k.abs() / 16 + 1e-6).all()  # within half an e4m3 step (3 mantissa bits)
    assert ((v_back - v).abs() <= v.abs() / 16 + 1e-6).all()
    assert torch.equal(pool.k_buffers[1][slots].float() * k_scales[1][None, :, None], k_back)
    big = torch.full((1, 2, 8), 1e6)
    pool.write(0, torch.tensor([2]), big, big)  # saturates at 448 x scale, never inf or NaN
    assert torch.equal(pool.read(0, torch.tensor([2]))[0][0, :, 0], 448 * k_scales[0])
    pool.poison(torch.tensor([3]))
    assert pool.read(1, torch.tensor([3]))[0].isnan().all()
    for bad in (torch.zeros(2, 2), torch.ones(3, 2), torch.full((2, 2), float("inf"))):
        with pytest.raises(ValueError, match="scales"):
            pool.set_scales(bad, bad, "given")
    with pytest.raises(ValueError, match="no scales"):
        KVPool(16, 2, 2, 8, torch.float32, "cpu").set_scales(k_scales, k_scales, "given")
    assert KVPool(16, 2, 2, 8, torch.float32, "cpu").kv_scales(0) == (None, None)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    save_tiny_checkpoint("gemma3", path)
    return load_model(str(path), dtype=torch.float32)


PROMPT = [1] + list(range(20, 60))


def test_same_prefix_same_bytes(gemma):
    """Exact reuse relative to the FP8 cache: a prefix computed again in a fresh row gives the same bytes; computed
    in other chunks (float rounding differs slightly), a value lands at most one e4m3 step away, rarely."""
    scales = calibrate_kv_scales(gemma, list(range(3, 200)), "cpu")
    harness = PagedHarness(gemma, num_slots=256, max_rows=4, max_context=64, kv_dtype=FP8, kv_scales=scales)
    rows = [harness.new_row() for _ in range(3)]
    harness.forward([(rows[0], PROMPT)])
    harness.forward([(rows[1], PROMPT)])
    harness.forward([(rows[2], PROMPT[:13])])
    harness.forward([(rows[2], PROMPT[13:30])])
    harness.forward([(rows[2], PROMPT[30:])])
    slots = [harness.req_to_token[r, : len(PROMPT)].long() for r in rows]
    for layer in range(gemma.num_layers):
        for buf in (harness.pool.k_buffers[layer], harness.pool.v_buffers[layer]):
            a, b, c = (buf[s].view(torch.uint8).int() for s in slots)
            assert torch.equal(a, b)
            signed = [torch.where(x >= 128, 128 - x, x) for x in (a, c)]  # e4m3 codes in value order
            steps = (signed[0] - signed[1]).abs()
            assert steps.max() <= 1 and (steps > 0).float().mean() < 0.02


def test_calibration_is_deterministic_and_covers_rotated_keys(gemma):
    ids = list(range(3, 120))
    k1, v1 = calibrate_kv_scales(gemma, ids, "cpu")
    k2, v2 = calibrate_kv_scales(gemma, ids, "cpu")
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert k1.shape == (gemma.num_layers, gemma.num_kv_heads) and (k1 > 0).all() and (v1 > 0).all()
    # K's magnitude is its largest rotary pair norm (what RoPE at any position can put into one component): the
    # scale of K is at least the largest K component the text produced, with the headroom on top
    pool = PagedHarness(gemma, num_slots=128, max_rows=1, max_context=128)
    row = pool.new_row()
    pool.forward([(row, ids)])
    for layer in range(gemma.num_layers):
        k = pool.pool.k_buffers[layer][pool.req_to_token[row, : len(ids)].long()]
        assert (k.abs().amax(dim=(0, 2)) * HEADROOM / 448 <= k1[layer] * 1.0001).all()
    with pytest.raises(ValueError, match="vocabulary"):
        calibrate_kv_scales(gemma, [10**9], "cpu")


def test_torch_attention_over_fp8_pool_is_attention_over_its_values(gemma):
    """The reference backend reads the FP8 pool dequantized: an fp32 pool holding the dequantized values of the same
    prefix gives the same logits for the next tokens."""
    scales = calibrate_kv_scales(gemma, list(range(3, 200)), "cpu")
    fp8 = PagedHarness(gemma, num_slots=128, max_rows=2, max_context=64, kv_dtype=FP8, kv_scales=scales)
    ref = PagedHarness(gemma, num_slots=128, max_rows=2, max_context=64)
    row = fp8.new_row()
    assert ref.new_row() == row
    fp8.forward([(row, PROMPT[:30])])
    ref.forward([(row, PROMPT[:30])])
    slots = fp8.req_to_token[row, :30].long()
    ref_slots = ref.req_to_token[row, :30].long()
    for layer in range(gemma.num_layers):  # the reference pool takes the FP8 pool's (dequantized) values
        k, v = fp8.pool.read(layer, slots)
        ref.pool.k_buffers[layer][ref_slots], ref.pool.v_buffers[layer][ref_slots] = k, v
    # the next tokens' own K/V: fp32 in one pool, e4m3 in the other, so compare a one-token step (its own key is
    # rounded in the FP8 pool) loosely and the cached-prefix part through the equality above
    got = fp8.forward([(row, PROMPT[30:31])])[0]
    want = ref.forward([(row, PROMPT[30:31])])[0]
    assert ((got - want).norm() / want.norm()).item() < 2e-2
