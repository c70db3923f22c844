"""apply_token_bitmask against a naive per-bit loop; bitmask packing helpers."""

from __future__ import annotations

import pytest
import torch

from prefixrt.constrained.logits import (
    allocate_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    fill_only,
    pack_bitmask,
    unpack_bitmask,
)


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    batch, vocab = logits.shape
    for b in range(batch):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[b, word]) >> (t % 32)) & 1
            if not allowed:
                out[b, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,width", [(100, 4), (128, 4), (130, 4), (64, 4), (1, 1)],
                         ids=["V<32W", "V=32W", "V>32W", "V<<32W", "tiny"])
def test_apply_matches_naive_loop(vocab, width):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, width), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # an unconstrained row
    expected = naive_apply(logits, bitmask)
    got = logits.clone()
    apply_token_bitmask(got, bitmask)
    assert torch.equal(got, expected)
    if vocab <= 32 * width:
        assert torch.equal(got[1], logits[1])  # all-ones row untouched


def test_apply_bf16_and_validation():
    logits = torch.randn(2, 70, dtype=torch.bfloat16)
    bitmask = allocate_bitmask(2, 70)
    fill_only(bitmask, 0, [0, 31, 69])
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 69]
    assert torch.isfinite(logits[1]).all()
    with pytest.raises(ValueError):
        apply_token_bitmask(logits, bitmask.to(torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask(logits[:1], bitmask)


def test_allocate_bitmask_all_ones_on_one_thread(monkeypatch):
    # The host bitmask is filled without torch.full (which would wake torch's OpenMP workers every step).
    def no_full(*a, **k):
        raise AssertionError("torch.full on the host")

    monkeypatch.setattr(torch, "full", no_full)
    for batch, vocab in [(1, 1), (3, 70), (64, 128256)]:
        bm = allocate_bitmask(batch, vocab)
        assert bm.dtype == torch.int32 and bm.shape == (batch, (vocab + 31) // 32) and bm.device.type == "cpu"
        assert bool((bm == -1).all())
        assert unpack_bitmask(bm, vocab).all()


def test_pack_unpack_roundtrip_and_sign_bit():
    allowed = torch.rand(4, 77, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[:, 31] = True  # bit 31: the int32 sign bit
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (4, 3)
    assert torch.equal(unpack_bitmask(packed, 77), allowed)
    assert allowed_token_ids(packed, 2, 77).tolist() == allowed[2].nonzero().flatten().tolist()
    bm = allocate_bitmask(1, 77)
    fill_only(bm, 0, [31, 63, 76])
    assert allowed_token_ids(bm, 0).tolist() == [31, 63, 76]


@pytest.mark.gpu
def test_cuda_matches_torch_reference():
    gen = torch.Generator().manual_seed(1)
    for vocab, width in [(151936, 4748), (151936, 4740), (1000, 40)]:
        logits = torch.randn(8, vocab, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (8, width), generator=gen, dtype=torch.int64).to(torch.int32)
        expected = logits.clone()
        apply_token_bitmask_torch(expected, bitmask)
        got = logits.cuda()
        apply_token_bitmask(got, bitmask.cuda())
        assert torch.equal(got.cpu(), expected)
