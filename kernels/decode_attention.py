"""Split-KV flash-decoding over the paged pool: one query per sequence.

Stage 1 (grid [B, KVH, num_splits]): each program takes one sequence, one kv head and one chunk of the
sequence's slots, and computes the partial output and log-sum-exp of all the query heads that share the kv
head (a [heads_per_kv, D] x [D, BLOCK_N] product per block, so K/V is loaded once per group).
Stage 2 (grid [B, H]): merges the partials by their LSE.

CUDA-graph safe: the grid depends only on B, the head counts and `num_kv_splits`, all static; split
boundaries are computed on the device from seq_lens, and a split past the end of its sequence writes
lse = -inf so stale workspace never leaks into the merge. Stage 1 also serves the per-sequence suffix part
of cascade decode (kv_start, split_offset).

Paged pools (page_size P > 1, constexpr PAGE_SPAN = gcd(P, BLOCK_N)): stage 1 reads the request table once per
run of PAGE_SPAN positions and derives the run's slots as base + [0, PAGE_SPAN) (kernels/_common.paged_slots),
instead of one table entry per position. This relies on the KVManager's layout: a request's position p lives
in slot pages[p // P] * P + p % P, pages are aligned and a page's slots contiguous; shared prefixes are whole
pages (radix matches are page multiples; there is no mid-page copy-on-write), so the layout holds for every
row. A range starting mid-run (sliding window, a cascade suffix starting mid-page) is handled by starting the
first block at the run boundary and masking the positions before it. P = 1 compiles the per-slot path
unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels import _common
from prefixrt.kernels._common import attend_block, kv_head_scales, paged_slots, pdl_begin, store_split


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, KvStart, MidO, MidLse, KScale, VScale,
    qk_scale, logit_softcap, sliding_window,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    split_offset,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE_SPAN: tl.constexpr = 1, USE_PDL: tl.constexpr = False, HAS_KV_SCALE: tl.constexpr = False,
):  # fmt: skip
    pdl_begin(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    qk_scale, v_scale = kv_head_scales(qk_scale, KScale, VScale, kv_head, HAS_KV_SCALE)

    seq_len = tl.load(SeqLens + b)
    kv_lo = seq_len * 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    if HAS_WINDOW:  # the query at seq_len-1 sees positions > seq_len-1-window
        kv_lo = tl.maximum(kv_lo, seq_len - sliding_window)
    kv_len = tl.maximum(seq_len - kv_lo, 0)
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * HEADS_PER_KV + offs_h
    mask_h = offs_h < HEADS_PER_KV
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # q: [BLOCK_H, BLOCK_D]
    req_row = tl.load(ReqPoolIdx + b).to(tl.int64)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    loop_lo = start
    if PAGE_SPAN > 1:  # blocks start on a run boundary; the first one masks the positions before `start`
        loop_lo = tl.where(start < end, start - start % PAGE_SPAN, start)  # an empty split stays empty
    for n0 in range(loop_lo, end, BLOCK_N):
        pos = n0 + offs_n
        if PAGE_SPAN > 1:
            mask_n = (pos >= start) & (pos < end)
            slots = paged_slots(ReqToToken + req_row * stride_rt, n0, end, BLOCK_N, PAGE_SPAN)
        else:
            mask_n = pos < end
            slots = tl.load(ReqToToken + req_row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(Q.dtype.element_ty)  # k: [BLOCK_N, BLOCK_D] (e4m3 widens exactly)
        v = tl.load(
            V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(Q.dtype.element_ty)  # v: [BLOCK_N, BLOCK_D]
        # Every block holds a key of the split (a window already moved kv_lo), so no row's max stays -inf.
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, k, v, offs_h, offs_h, pos, mask_n, qk_scale, logit_softcap, 0,
            MASK_KEYS=True, CAUSAL=False, HAS_WINDOW=False, HAS_SOFTCAP=HAS_SOFTCAP, DOT_PRECISION=DOT_PRECISION,
            UPCAST_DOT=UPCAST_DOT,
        )

    out_split = split_offset + split
    o_ptrs = MidO + b * stride_mob + heads[:, None] * stride_moh + out_split * stride_mos + offs_d[None, :]
    lse_ptrs = MidLse + b * stride_mlb + heads * stride_mlh + out_split
    store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, v_scale, mask_h, mask_d, end > start, HAS_KV_SCALE)


@triton.jit
def _merge_splits(
    MidO, MidLse, Out, KvStart,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    NUM_GUARDED: tl.constexpr, BLOCK_HM: tl.constexpr = 1, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Out[b, h] = LSE-weighted mean of the split partials, for BLOCK_HM heads of one sequence a program. The
    first NUM_GUARDED splits (cascade prefix splits) count only for sequences with KvStart[b] > 0, i.e. members
    of a prefix group."""
    pdl_begin(USE_PDL)
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_hs = (offs_h[:, None] < num_heads) & (offs_s[None, :] < NUM_SPLITS)  # [BLOCK_HM, BLOCK_S]
    # All loads are issued together (none waits on another's value): a dead split's partial may be stale
    # workspace, even NaN, so it is dropped by a select, never by multiplying it with a zero weight.
    lse = tl.load(MidLse + b * stride_mlb + offs_h[:, None] * stride_mlh + offs_s[None, :], mask=mask_hs,
                  other=float("-inf"))  # fmt: skip
    parts = tl.load(
        MidO + b * stride_mob + offs_h[:, None, None] * stride_moh + offs_s[None, :, None] * stride_mos
        + offs_d[None, None, :],
        mask=mask_hs[:, :, None] & (offs_d[None, None, :] < HEAD_DIM),
        other=0.0,
    )  # parts: [BLOCK_HM, BLOCK_S, BLOCK_D]
    if NUM_GUARDED > 0:
        first_split = NUM_GUARDED * (tl.load(KvStart + b) <= 0).to(tl.int32)
        lse = tl.where(offs_s[None, :] >= first_split, lse, float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 1)
    m = tl.where(m > float("-inf"), m, 0.0)  # nothing live (padded entry): output 0, not NaN
    w = tl.where(live, tl.exp(lse - m[:, None]), 0.0)  # w: [BLOCK_HM, BLOCK_S]
    parts = tl.where(live[:, :, None], parts, 0.0)
    out = tl.sum(parts * w[:, :, None], 1) / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]  # [BLOCK_HM, BLOCK_D]
    tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM))  # fmt: skip


def decode_workspace(
    batch_size: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate (mid_o [B, H, S, D] fp32, mid_lse [B, H, S] fp32) for up to num_splits partials."""
    mid_o = torch.empty(batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def _stage1_config(head_dim: int, work_items: int, kv_bytes: int = 2) -> dict:
    """Launch parameters for work_items (sequence, kv head) pairs over K/V of kv_bytes bytes a value. Measured on an
    H200 (Llama-3-8B heads, benchmarks/gpu_tune.py --only=decode): a 3-stage pipeline reads B=256 x 1.1k context
    at 4074 GB/s (2 stages: 3796) and is neutral at B=64 x 2k; with a handful of work items (batch 1-2) 128-key
    blocks halve each split's loop (B=1 x 4k: 9.4 vs 10.9 us). e4m3 K/V (half the bytes a key): 128-key blocks in
    2 stages, measured on an H100 (benchmarks/gpu_fp8_gemv.py --only 5, B=256 x 1k): 243 us (2.2 TB/s) against
    286 us in the bf16 layout."""
    if _common.interpreting():
        return {"BLOCK_N": 16, "num_warps": 1}
    if head_dim > 128:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if kv_bytes == 1 and work_items > 16:
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 128 if work_items <= 16 else 64, "num_warps": 4, "num_stages": 2 if work_items <= 16 else 3}


def launch_decode_stage1(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, sm_scale,
    sliding_window, logit_softcap, num_splits, kv_start=None, split_offset=0, page_size=1, config=None, pdl=False,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """Write partials for splits [split_offset, split_offset + num_splits) of mid_o / mid_lse. page_size > 1:
    the slots are read a page run at a time (see paged_slots for the layout this relies on). config: launch
    parameters (BLOCK_N, num_warps, num_stages) in place of _stage1_config's. k_scale/v_scale: an e4m3 pool's
    per-kv-head scales (kv_scale_args)."""
    num_heads, num_kv_heads, head_dim = _common.check_pool_args(q, k_buffer, v_buffer)
    heads_per_kv = num_heads // num_kv_heads
    batch_size = q.shape[0]
    if batch_size == 0:
        return
    cfg = config or _stage1_config(head_dim, batch_size * num_kv_heads, k_buffer.element_size())
    scales = _common.kv_scale_args(k_buffer, k_scale, v_scale)
    _decode_stage1[(batch_size, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        kv_start if kv_start is not None else seq_lens, mid_o, mid_lse, scales.pop("KScale"), scales.pop("VScale"),
        _common.qk_scale(sm_scale, logit_softcap), logit_softcap or 0.0, sliding_window or 0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        split_offset,
        HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(heads_per_kv)),
        BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
        HAS_KV_START=kv_start is not None, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, **_common.dot_args(q.dtype), **cfg,
        PAGE_SPAN=_common.page_span(page_size, cfg["BLOCK_N"]), **(_common.pdl_args(q, batch_size) if pdl else {}), **scales,
    )  # fmt: skip


def launch_merge(o, mid_o, mid_lse, num_splits, kv_start=None, num_guarded=0, pdl=False, heads_per_program=1,
                 num_warps=None):  # fmt: skip
    """Merge splits [0, num_splits) of mid_o / mid_lse into o [B, H, D]; heads_per_program (a power of two) and
    num_warps are launch parameters (the same result). One warp a program by default: measured on an H200
    (benchmarks/gpu_tune.py --only=merge, RAG cascade shape, 64 x 32 heads x 11 splits) 3.2 us against 8.1 us
    with 4 warps, whose reduction over the splits crosses warps."""
    batch_size, num_heads, head_dim = o.shape
    if batch_size == 0:
        return
    _merge_splits[(batch_size, triton.cdiv(num_heads, heads_per_program))](
        mid_o, mid_lse, o, kv_start if kv_start is not None else mid_lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), NUM_GUARDED=num_guarded, BLOCK_HM=heads_per_program,
        num_warps=1 if _common.interpreting() else num_warps or 1, **(_common.pdl_args(o, batch_size) if pdl else {}),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,  # [B, H, D] one query per sequence, at position seq_lens[i] - 1
    o: torch.Tensor,  # [B, H, D] output, written in place
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, D]
    req_to_token: torch.Tensor,  # [R, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] tokens with K/V, the query's own included; 0 = padded entry (output 0)
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_kv_splits: int = 8,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    page_size: int = 1,
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an e4m3 pool's K scales (K ~= k_buffer * k_scale)
    v_scale: torch.Tensor | None = None,  # [KVH] fp32
) -> None:
    """Attention of each sequence's single new query over its slots [0, seq_len) (windowed if asked).
    mid_o [>=B, H, >=S, D] / mid_lse [>=B, H, >=S] (fp32) are the split workspace; pass preallocated
    ones under CUDA graphs, else they are allocated here. num_kv_splits is static (part of the grid).
    page_size: the pool's; above 1 the table is read once per page run instead of once per position.
    An e4m3 pool (k_scale, v_scale given) is read as is: the keys and values widen to q's dtype in registers, the
    K scale multiplies the scores and the V scale the output."""
    batch_size, num_heads, head_dim = q.shape
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = decode_workspace(batch_size, num_heads, head_dim, num_kv_splits, q.device)
    launch_decode_stage1(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, sm_scale,
        sliding_window, logit_softcap, num_kv_splits, page_size=page_size, pdl=True, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    launch_merge(o, mid_o, mid_lse, num_kv_splits, pdl=True)
