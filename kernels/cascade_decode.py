"""Shared-prefix (cascade) decode: a prefix shared by a group of sequences is read once per tile of the group.

Three launches, all on flat index arrays from a CascadePlan (on a GPU the first two run concurrently, the
prefix stage on a side stream: they write disjoint splits of the workspace, and the prefix stage alone
leaves most of the GPU idle):
1. prefix stage, grid [num_tiles, KVH * head_blocks, num_prefix_splits]: the tile's queries times the query
   heads of one kv head form a [BLOCK_Q * BLOCK_G, D] matrix that is multiplied against [D, BLOCK_N]
   chunks of the group's shared prefix (tensor-core sized, K/V loaded once for all of them), giving
   partial outputs + LSE for splits [0, num_prefix_splits);
2. suffix stage: decode stage 1 over each sequence's own slots [suffix_start, seq_len) (the whole sequence
   when ungrouped), splits [num_prefix_splits, num_prefix_splits + num_suffix_splits);
3. the decode merge over all splits; prefix splits count only for grouped sequences.
The result equals plain decode attention (up to float rounding). No sliding window: a windowed layer
reads only its last `window` positions anyway, so callers use plain decode there.
With page_size > 1 both stages read the request table once per page run (decode_attention.py says how and
what layout that relies on); a prefix ending mid-page needs no special case: the prefix stage masks past
its end, and each member's suffix stage starts its first block at the run boundary before suffix_start.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from prefixrt.kernels import _common
from prefixrt.kernels._common import attend_block, kv_head_scales, paged_slots, store_split
from prefixrt.kernels.cascade_plan import CascadePlan
from prefixrt.kernels.decode_attention import decode_workspace, launch_decode_stage1, launch_merge


@triton.jit
def _cascade_prefix_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, GroupPrefixLens, GroupLeadSeq, GroupSeqIds,
    TileGroup, TileSeqStart, TileNumSeqs, MidO, MidLse, KScale, VScale,
    qk_scale, logit_softcap,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    HEADS_PER_KV: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE_SPAN: tl.constexpr = 1, HAS_KV_SCALE: tl.constexpr = False,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    qk_scale, v_scale = kv_head_scales(qk_scale, KScale, VScale, kv_head, HAS_KV_SCALE)

    num_seqs = tl.load(TileNumSeqs + tile)
    if num_seqs <= 0:  # a padding tile (plans padded to a fixed tile count for CUDA graphs)
        return
    group = tl.load(TileGroup + tile)
    seq_start = tl.load(TileSeqStart + tile)
    prefix_len = tl.load(GroupPrefixLens + group)
    lead_row = tl.load(ReqPoolIdx + tl.load(GroupLeadSeq + group)).to(tl.int64)

    split_len = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    # Row r of the query matrix = (sequence r // BLOCK_G of the tile, head r % BLOCK_G of this head block).
    offs_r = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = offs_r // BLOCK_G
    head_in_kv = head_block * BLOCK_G + offs_r % BLOCK_G
    row_ok = (q_idx < num_seqs) & (head_in_kv < HEADS_PER_KV)
    seqs = tl.load(GroupSeqIds + seq_start + q_idx, mask=q_idx < num_seqs, other=0).to(tl.int64)
    heads = kv_head * HEADS_PER_KV + head_in_kv
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + seqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & mask_d[None, :],
        other=0.0,
    )  # q: [BLOCK_Q * BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        if PAGE_SPAN > 1:  # n0 is a BLOCK_N multiple, so a run boundary
            slots = paged_slots(ReqToToken + lead_row * stride_rt, n0, end, BLOCK_N, PAGE_SPAN)
        else:
            slots = tl.load(ReqToToken + lead_row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)  # e4m3 widens exactly
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, k, v, offs_r, offs_r, pos, mask_n, qk_scale, logit_softcap, 0,
            MASK_KEYS=True, CAUSAL=False, HAS_WINDOW=False, HAS_SOFTCAP=HAS_SOFTCAP, DOT_PRECISION=DOT_PRECISION,
            UPCAST_DOT=UPCAST_DOT,
        )

    o_ptrs = MidO + seqs[:, None] * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    lse_ptrs = MidLse + seqs * stride_mlb + heads * stride_mlh + split
    store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, v_scale, row_ok, mask_d, end > start, HAS_KV_SCALE)


def _prefix_config(head_dim: int, heads_per_kv: int, queries_per_tile: int) -> dict:
    block_g = triton.next_power_of_2(heads_per_kv)
    block_q = triton.next_power_of_2(queries_per_tile)
    max_rows = 64 if _common.interpreting() or head_dim > 128 else 128
    block_g = min(block_g, max(1, max_rows // block_q))  # cap the matrix at max_rows rows
    block_q = max(block_q, 16 // block_g)  # tl.dot needs at least 16 rows
    cfg = {"BLOCK_G": block_g, "BLOCK_Q": block_q, "HEAD_BLOCKS": triton.cdiv(heads_per_kv, block_g)}
    if _common.interpreting():
        return {**cfg, "BLOCK_N": 16, "num_warps": 1}
    return {**cfg, "BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 8 if block_q * block_g >= 128 else 4,
            "num_stages": 3}  # fmt: skip


def _suffix_config(head_dim: int) -> dict | None:
    """Decode stage 1 over the short own suffixes: a deeper pipeline than plain decode's (measured on an H200:
    RAG suffixes of 80-280 keys, 25.8 -> 20.3 us a layer)."""
    if _common.interpreting():
        return None
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 3}


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[index]


def cascade_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    o: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, D]
    req_to_token: torch.Tensor,  # [R, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    sm_scale: float,
    plan: CascadePlan,
    logit_softcap: float | None = None,
    num_prefix_splits: int = 4,
    num_suffix_splits: int = 4,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    page_size: int = 1,
    concurrent_stages: bool = True,
    merge_launch: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention for a batch with shared-prefix groups (see plan_cascade); equals decode_attention.
    Workspace: mid_o [>=B, H, >=Sp+Ss, D], mid_lse [>=B, H, >=Sp+Ss] fp32 (allocated when None).
    page_size: the pool's; above 1 both stages read the table once per page run (any prefix length, a
    prefix ending mid-page included, as long as each row keeps the page layout of paged_slots).
    concurrent_stages: on CUDA, run the prefix stage on a side stream beside the suffix stage (the same
    result; False runs them one after the other). merge_launch: launch_merge's launch parameters
    (heads_per_program, num_warps) in place of its defaults. k_scale/v_scale ([KVH] fp32): an e4m3 pool's scales
    (both stages read it as decode_attention does)."""
    num_heads, num_kv_heads, head_dim = _common.check_pool_args(q, k_buffer, v_buffer)
    batch_size = q.shape[0]
    num_splits = num_prefix_splits + num_suffix_splits
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = decode_workspace(batch_size, num_heads, head_dim, num_splits, q.device)
    heads_per_kv = num_heads // num_kv_heads
    cfg = _prefix_config(head_dim, heads_per_kv, plan.queries_per_tile)
    concurrent = q.is_cuda and plan.num_tiles > 0 and not _common.interpreting() and concurrent_stages
    main = torch.cuda.current_stream(q.device) if concurrent else None
    if concurrent:
        side = _side_stream(q.device)
        side.wait_stream(main)  # the prefix stage reads q, the plan and the pool as the main stream left them
    with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
        _launch_prefix(q, k_buffer, v_buffer, req_to_token, req_pool_indices, mid_o, mid_lse, sm_scale, plan,
                       logit_softcap, num_prefix_splits, cfg, page_size, k_scale, v_scale)
    launch_decode_stage1(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, sm_scale,
        None, logit_softcap, num_suffix_splits, kv_start=plan.suffix_start, split_offset=num_prefix_splits,
        page_size=page_size, config=_suffix_config(head_dim), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if concurrent:
        main.wait_stream(side)  # the merge reads both stages' partials
    launch_merge(o, mid_o, mid_lse, num_splits, kv_start=plan.suffix_start, num_guarded=num_prefix_splits,
                 **(merge_launch or {}))


def _launch_prefix(q, k_buffer, v_buffer, req_to_token, req_pool_indices, mid_o, mid_lse, sm_scale, plan,
                   logit_softcap, num_prefix_splits, cfg, page_size, k_scale=None, v_scale=None):  # fmt: skip
    num_heads, num_kv_heads, head_dim = _common.check_pool_args(q, k_buffer, v_buffer)
    heads_per_kv = num_heads // num_kv_heads
    scales = _common.kv_scale_args(k_buffer, k_scale, v_scale)
    if plan.num_tiles:
        grid = (plan.num_tiles, num_kv_heads * cfg["HEAD_BLOCKS"], num_prefix_splits)
        _cascade_prefix_kernel[grid](
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan.group_prefix_lens, plan.group_lead_seq,
            plan.group_seq_ids, plan.tile_group, plan.tile_seq_start, plan.tile_num_seqs, mid_o, mid_lse,
            scales.pop("KScale"), scales.pop("VScale"), _common.qk_scale(sm_scale, logit_softcap), logit_softcap or 0.0,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
            v_buffer.stride(1), req_to_token.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_prefix_splits, HAS_SOFTCAP=logit_softcap is not None,
            **_common.dot_args(q.dtype), **cfg, PAGE_SPAN=_common.page_span(page_size, cfg["BLOCK_N"]), **scales,
        )  # fmt: skip
