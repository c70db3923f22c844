"""Batched LoRA for a forward that mixes adapters and the base model: two launches per projection, whatever the mix.

`lora_shrink` computes xa = x @ A_s^T for every row under slot s ([rows, num_shards * R], float32, the K range
split over SPLIT_K programs whose partials the expand sums in a fixed order: deterministic, no atomics);
`lora_expand` adds (xa_shard @ B_s[shard]^T) * scale[s, shard] into the base projection's output y in place. Both
take one block of the plan per program (kernels/lora_plan.py: rows grouped by slot through an index list, so
rows are gathered and scattered, never moved); padding blocks (slot -1) do nothing, so a plan padded to a fixed
block count and the fixed grids below run inside CUDA graphs. Adapter weights live in fixed per-slot buffers
(A [S, num_shards * R, K], B [S, N, R]: ranks zero-padded to R), so a graph reads whatever the slots hold
when it is replayed.

The torch reference is kernels/lora_reference.py (what the tests compare with, under TRITON_INTERPRET=1 on
the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels._common import dot_args, interpreting, mma
from prefixrt.kernels.lora_plan import EXPAND_BLOCK_N as BLOCK_N
from prefixrt.kernels.lora_plan import expand_tiles


@triton.jit
def _shrink_kernel(
    X, A, XA, SortedTokens, BlockSlot, BlockStart, BlockEnd, K, RT,
    stride_xm, stride_as, stride_ar, stride_xas, stride_xam,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(BlockSlot + pid_b)
    if slot >= 0:
        start = tl.load(BlockStart + pid_b)
        end = tl.load(BlockEnd + pid_b)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(SortedTokens + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < RT
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        x_rows = X + rows[:, None] * stride_xm  # [BLOCK_M, 1] gathered rows of x
        a_rows = A + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar  # [BLOCK_R, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_rows + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            acc += mma(x, tl.trans(a), DOT_PRECISION, UPCAST_DOT)
        out = XA + pid_k * stride_xas + rows[:, None] * stride_xam + offs_r[None, :]
        tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    XA, B, Scale, Y, SortedTokens, BlockSlot, BlockStart, BlockEnd, TileShard, TileFirst, TileEnd,
    R, NUM_SHARDS, NUM_TILES, stride_xas, stride_xam, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    # One block of rows, TILES_PER_PROGRAM consecutive column tiles (each inside one shard): the block's rows and
    # its slot are read once for all of them.
    pid_b = tl.program_id(0)
    pid_g = tl.program_id(1)
    slot = tl.load(BlockSlot + pid_b)
    if slot >= 0:
        start = tl.load(BlockStart + pid_b)
        end = tl.load(BlockEnd + pid_b)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(SortedTokens + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        mask_xa = mask_m[:, None] & mask_r[None, :]
        b_slot = B + slot.to(tl.int64) * stride_bs
        y_rows = Y + rows[:, None] * stride_ym
        t_lo = pid_g * TILES_PER_PROGRAM
        for t in range(t_lo, tl.minimum(t_lo + TILES_PER_PROGRAM, NUM_TILES)):
            shard = tl.load(TileShard + t)
            offs_n = tl.load(TileFirst + t) + tl.arange(0, BLOCK_N)
            mask_n = offs_n < tl.load(TileEnd + t)
            xa_ptr = XA + rows[:, None] * stride_xam + shard * R + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
            xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # the shrink's K partials, summed in a fixed order
                xa += tl.load(xa_ptr + s * stride_xas, mask=mask_xa, other=0.0)
            b_ptr = b_slot + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :]
            b = tl.load(b_ptr, mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            delta = mma(xa.to(b.dtype), tl.trans(b), DOT_PRECISION, UPCAST_DOT)  # [BLOCK_M, BLOCK_N] float32
            delta = delta * tl.load(Scale + slot * NUM_SHARDS + shard)
            y_ptr = y_rows + offs_n[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr, (y + delta).to(Y.dtype.element_ty), mask=mask)


def _block_r(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def shrink_split(num_blocks: int, k: int, num_sms: int, block_k: int, per_sm: int = 2, max_split: int = 8) -> int:
    """K splits of the shrink: enough programs for about `per_sm` per SM when the plan has few blocks (a decode
    batch of few adapters), at most max_split and never more than K's tiles. Depends on the plan's size alone, so
    a graph's choice is fixed at capture."""
    if num_sms <= 0:
        return 1
    want = -(-per_sm * num_sms // max(num_blocks, 1))
    split = 1
    while split * 2 <= min(want, max_split, max(1, k // block_k)):
        split *= 2
    return split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, block_slot: torch.Tensor,
                block_start: torch.Tensor, block_end: torch.Tensor, block_m: int, split_k: int = 1,
                block_k: int | None = None, stages: int = 2) -> torch.Tensor:  # fmt: skip
    """xa partials [split_k, T, num_shards * R] float32 (rows outside every block are left unwritten)."""
    num_tokens, k = x.shape
    num_slots, rt, ka = a.shape
    if ka != k or x.stride(-1) != 1 or not a.is_contiguous():
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} does not fit A {tuple(a.shape)}, or is not contiguous")
    xa = torch.empty((split_k, num_tokens, rt), dtype=torch.float32, device=x.device)
    num_blocks = block_slot.shape[0]
    if num_tokens == 0 or num_blocks == 0:
        return xa
    block_r = min(_block_r(rt), 64)
    block_k = block_k or (32 if interpreting() else 64)
    grid = (num_blocks, triton.cdiv(rt, block_r), split_k)
    _shrink_kernel[grid](
        x, a, xa, sorted_tokens, block_slot, block_start, block_end, k, rt,
        x.stride(0), a.stride(0), a.stride(1), xa.stride(0), xa.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=stages,
        **dot_args(x.dtype),
    )  # fmt: skip
    return xa


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, tiles: torch.Tensor,
                sorted_tokens: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
                block_end: torch.Tensor, block_m: int, tiles_per_program: int = 1) -> torch.Tensor:  # fmt: skip
    """y (updated in place) += each block's (xa of its shard) @ B_s^T * scale. tiles: [3, NT] int32 from
    lora_plan.expand_tiles(shard_sizes, BLOCK_N); tiles_per_program: column tiles one program adds (the same
    result: a launch parameter, fewer and longer programs)."""
    num_slots, n, rank = b.shape
    num_shards = scale.shape[1]
    if y.shape[1] != n or xa.shape[2] != num_shards * rank or not b.is_contiguous() or y.stride(-1) != 1:
        raise ValueError(f"lora_expand: y {tuple(y.shape)}, xa {tuple(xa.shape)} and B {tuple(b.shape)} do not fit")
    num_blocks = block_slot.shape[0]
    if y.shape[0] == 0 or num_blocks == 0:
        return y
    if tiles_per_program < 1:
        raise ValueError(f"tiles_per_program must be at least 1, got {tiles_per_program}")
    num_tiles = tiles.shape[1]
    grid = (num_blocks, triton.cdiv(num_tiles, tiles_per_program))
    _expand_kernel[grid](
        xa, b, scale, y, sorted_tokens, block_slot, block_start, block_end, tiles[0], tiles[1], tiles[2],
        rank, num_shards, num_tiles, xa.stride(0), xa.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(rank), SPLIT_K=xa.shape[0],
        TILES_PER_PROGRAM=tiles_per_program, num_warps=4, num_stages=1, **dot_args(y.dtype),
    )  # fmt: skip
    return y


def tile_table(shard_sizes: list[int], device) -> torch.Tensor:
    """The expand kernel's tile table for a projection ([3, NT] int32 on device); build it once per projection."""
    return torch.tensor(expand_tiles(shard_sizes, BLOCK_N), dtype=torch.int32, device=device)


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
               tiles: torch.Tensor, sorted_tokens: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
               block_end: torch.Tensor, block_m: int, split_k: int = 1, tiles_per_program: int = 1,
               shrink_stages: int = 2) -> torch.Tensor:  # fmt: skip
    """Shrink then expand (the kernels' counterpart of lora_reference.lora_apply): y updated in place. split_k,
    tiles_per_program and shrink_stages are launch parameters (the same result)."""
    xa = lora_shrink(x, a, sorted_tokens, block_slot, block_start, block_end, block_m, split_k, stages=shrink_stages)
    return lora_expand(y, xa, b, scale, tiles, sorted_tokens, block_slot, block_start, block_end, block_m,
                       tiles_per_program)
