"""The batched LoRA kernels (kernels/lora.py) against their torch reference, and the plan they read
(kernels/lora_plan.py); under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import random

import pytest
import torch
from prefixrt.kernels import lora as lora_kernels
from prefixrt.kernels.lora_plan import block_m_for, expand_tiles, max_blocks, plan_lists
from prefixrt.kernels.lora_reference import lora_apply as lora_apply_reference


def _plan_tensors(plan, device="cpu"):
    return [torch.tensor(v, dtype=torch.int32, device=device)
            for v in (plan.sorted_tokens, plan.block_slot, plan.block_start, plan.block_end)]


def test_plan_groups_rows_by_slot_and_pads():
    slots, lens = [2, -1, 0, 2, 0], [3, 2, 1, 20, 1]
    plan = plan_lists(slots, lens, block_m=16, num_blocks=10)
    # rows of sequence i: [sum(lens[:i]), sum(lens[:i+1]))
    assert sorted(plan.sorted_tokens) == list(range(sum(lens)))
    covered = {}
    for s, b0, b1 in zip(plan.block_slot, plan.block_start, plan.block_end):
        if s < 0:
            continue
        assert 0 < b1 - b0 <= 16
        for t in plan.sorted_tokens[b0:b1]:
            assert t not in covered
            covered[t] = s
    want = {}
    acc = 0
    for s, n in zip(slots, lens):
        for t in range(acc, acc + n):
            if s >= 0:
                want[t] = s
        acc += n
    assert covered == want
    assert plan.num_blocks == 10 and plan.block_slot[-1] == -1
    assert plan.num_blocks >= len([s for s in plan.block_slot if s >= 0])
    with pytest.raises(ValueError):
        plan_lists(slots, lens, block_m=16, num_blocks=2)


def test_plan_bound_holds_for_random_batches():
    rng = random.Random(0)
    for _ in range(200):
        b = rng.randint(1, 12)
        lens = [rng.randint(1, 40) for _ in range(b)]
        slots = [rng.randint(-1, 5) for _ in range(b)]
        bm = block_m_for(sum(lens), b)
        plan = plan_lists(slots, lens, bm)
        segments = len({s for s in slots if s >= 0})
        assert plan.num_blocks <= max_blocks(sum(lens), min(segments, b), bm)


def test_expand_tiles_never_straddle_shards():
    shard, first, end = expand_tiles([128, 32, 32], 64)
    assert shard == [0, 0, 1, 2] and first == [0, 64, 128, 160] and end == [128, 128, 160, 192]


@pytest.mark.parametrize("tiles_per_program", [1, 3, 64])  # one tile a program; 2-4 tiles in 1-2 programs; all
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shards,rank,split_k", [([96], 8, 1), ([64, 32, 32], 16, 2), ([80, 80], 64, 1)])
def test_kernels_equal_reference(dtype, shards, rank, split_k, tiles_per_program):
    torch.manual_seed(0)
    rng = random.Random(1)
    k, num_slots = 48, 4
    n = sum(shards)
    lens = [1, 5, 1, 17, 2, 1, 3]
    slots = [rng.randint(-1, num_slots - 1) for _ in lens]
    slots[0], slots[1] = 3, -1
    t = sum(lens)
    x = torch.randn(t, k, dtype=dtype)
    a = torch.randn(num_slots, len(shards) * rank, k, dtype=dtype) * 0.3
    b = torch.randn(num_slots, n, rank, dtype=dtype) * 0.3
    a[1, :, :] = 0  # an empty slot: contributes nothing
    b[1] = 0
    scale = torch.rand(num_slots, len(shards), dtype=torch.float32) + 0.5
    y0 = torch.randn(t, n, dtype=dtype)
    bm = block_m_for(t, len(lens))
    plan = plan_lists(slots, lens, bm, num_blocks=max_blocks(t, len(lens), bm))
    idx = _plan_tensors(plan)
    want = lora_apply_reference(x.float(), y0.float().clone(), a.float(), b.float(), scale, shards, *idx)
    tiles = lora_kernels.tile_table(shards, "cpu")
    got = lora_kernels.lora_apply(x, y0.clone(), a, b, scale, tiles, *idx, block_m=bm, split_k=split_k,
                                  tiles_per_program=tiles_per_program)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol)
    base_rows = [r for r, s in zip(range(len(lens)), slots) if s < 0]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i in base_rows:  # the base model's rows are left as they were
        rows = slice(starts[i], starts[i] + lens[i])
        assert torch.equal(got[rows], y0[rows])


def test_reference_equals_per_token_peft_formula():
    torch.manual_seed(2)
    k, rank, shards = 16, 8, [24, 8]
    a = torch.randn(2, 2 * rank, k)
    b = torch.randn(2, sum(shards), rank)
    scale = torch.tensor([[2.0, 0.5], [1.0, 4.0]])
    x = torch.randn(5, k)
    y = torch.randn(5, sum(shards))
    slots, lens = [1, -1, 0], [2, 1, 2]
    plan = plan_lists(slots, lens, 16)
    got = lora_apply_reference(x, y.clone(), a, b, scale, shards, *_plan_tensors(plan))
    want = y.clone()
    token_slot = [1, 1, -1, 0, 0]
    for t, s in enumerate(token_slot):
        if s < 0:
            continue
        for i, (off, size) in enumerate([(0, 24), (24, 8)]):
            lora_a = a[s, i * rank:(i + 1) * rank]
            lora_b = b[s, off:off + size]
            want[t, off:off + size] += (x[t] @ lora_a.T) @ lora_b.T * scale[s, i]
    torch.testing.assert_close(got, want)
