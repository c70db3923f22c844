"""Extend (prefill / chunked prefill / multi-token) attention over the paged pool.

Grid [B, H, cdiv(max_extend_len, BLOCK_M)]: one program per (sequence, query head, block of BLOCK_M new
tokens); with pack_heads, [B, KVH, cdiv(max_extend_len * G, BLOCK_M)]: one program per (sequence, kv head,
block of BLOCK_M / G new tokens), its rows being each token's G query heads of that kv head. It streams keys
from the start of the visible range up to its last query's position, with an online softmax in fp32. The new
tokens' K/V is already in the pool, so by default everything is read through req_to_token; with
k_extend/v_extend the new tokens are read from those contiguous tensors instead (one indirection less per key
block on the diagonal part).

Visibility: a query at position p sees keys k with k <= p, and p - window < k when sliding_window is set.
With span_end (bidirectional blocks, Gemma-3's image tokens): a query sees keys k < span_end[query] instead,
span_end being p + 1 outside a block and the block's end inside one, so a block's tokens see each other both
ways and nothing past the block; the window still applies.

Paged pools (page_size > 1): key blocks start at BLOCK_N multiples of the position (kv_lo is one), so the
pool keys are read a page run at a time (kernels/_common.paged_slots, the layout it relies on is stated in
decode_attention.py); a prefix ending mid-page is masked like any range end. page_size 1 compiles the per-slot
loads unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixrt.kernels import _common
from prefixrt.kernels._common import attend_block, kv_head_scales, paged_slots
from prefixrt.kernels.decode_attention import decode_workspace, launch_merge


@triton.jit
def _extend_kernel(
    Q, Out, K, V, KExt, VExt, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart,
    qk_scale, logit_softcap, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ket, stride_keh, stride_vet, stride_veh, stride_rt,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    CONTIGUOUS_NEW_KV: tl.constexpr, POOL_NEEDS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BlockSeq, BlockMb, HAS_BLOCK_MAP: tl.constexpr,
    MidO, MidLse, stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, NUM_SPLITS: tl.constexpr,
    KScale, VScale, HAS_KV_SCALE: tl.constexpr, SpanEnd, HAS_SPANS: tl.constexpr,
    PAGE_SPAN: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1,
):  # fmt: skip
    # BLOCK_G > 1 packs the query heads of one kv head into the rows: row r is token r // BLOCK_G of the
    # block and head r % BLOCK_G of the group (grid axis 1 then runs over kv heads), so a block of BLOCK_M
    # rows holds BLOCK_M // BLOCK_G tokens and each K/V block it loads serves every head of the group.
    TOKENS: tl.constexpr = BLOCK_M // BLOCK_G
    if HAS_BLOCK_MAP:  # grid [num_blocks, H (KVH packed)]: block i is query block BlockMb[i] of sequence BlockSeq[i] (-1 = pad)
        h = tl.program_id(1)
        b = tl.load(BlockSeq + tl.program_id(0))
        if b < 0:
            return
        mb = tl.load(BlockMb + tl.program_id(0))
    else:  # grid [B, H, cdiv(max_extend_len, BLOCK_M)]; the last (longest: causal) query blocks run first
        b = tl.program_id(0)
        h = tl.program_id(1)
        mb = tl.num_programs(2) - 1 - tl.program_id(2)
    extend_len = tl.load(ExtendLens + b)
    if mb * TOKENS >= extend_len:
        return
    prefix_len = tl.load(PrefixLens + b)
    start_loc = tl.load(ExtendStart + b)
    req_row = tl.load(ReqPoolIdx + b).to(tl.int64)
    if BLOCK_G > 1:
        kv_head = h
        first_head = h * HEADS_PER_KV
    else:
        kv_head = h // HEADS_PER_KV
        first_head = h
    qk_scale, v_scale = kv_head_scales(qk_scale, KScale, VScale, kv_head, HAS_KV_SCALE)

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = mb * TOKENS + offs_r // BLOCK_G  # each row's token, within the sequence's new tokens
    heads = first_head + offs_r % BLOCK_G  # each row's query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_m < extend_len) & (offs_r % BLOCK_G < HEADS_PER_KV)
    mask_d = offs_d < HEAD_DIM
    rows = (start_loc + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # q: [BLOCK_M, BLOCK_D]
    q_pos = prefix_len + offs_m
    q_hi = q_pos + 1  # each row sees keys below q_hi (and above q_pos - window)

    # Visible keys of this query block: [kv_lo, kv_hi).
    kv_hi = prefix_len + tl.minimum((mb + 1) * TOKENS, extend_len)
    if HAS_SPANS:  # a bidirectional block's rows see up to its end (never past the sequence's new tokens)
        q_hi = tl.minimum(tl.maximum(q_hi, tl.load(SpanEnd + rows, mask=mask_m, other=0)), prefix_len + extend_len)
        kv_hi = tl.maximum(kv_hi, tl.max(tl.where(mask_m, q_hi, 0), 0))
    kv_lo = kv_hi * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(prefix_len + mb * TOKENS - sliding_window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys from the pool: the cached prefix only, or everything. Whole blocks before the first query of
    # this block (and before pool_hi) need no causal or bounds mask; the rest are masked.
    pool_hi = kv_hi
    if CONTIGUOUS_NEW_KV:
        pool_hi = prefix_len
    unmasked_hi = kv_lo + (tl.maximum(tl.minimum(pool_hi, prefix_len + mb * TOKENS) - kv_lo, 0) // BLOCK_N) * BLOCK_N
    # Split-KV (grid axis 2): this program takes keys [s_lo, s_hi) of [kv_lo, pool_hi), cut at BLOCK_N
    # multiples from kv_lo, so the unmasked/masked boundary above stays on a block edge.
    s_lo = kv_lo
    s_hi = pool_hi
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        split_len = tl.cdiv(tl.cdiv(tl.maximum(pool_hi - kv_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = kv_lo + split * split_len
        s_hi = tl.minimum(s_lo + split_len, pool_hi)
    for n0 in range(s_lo, tl.minimum(unmasked_hi, s_hi), BLOCK_N):
        k_pos = n0 + offs_n
        if PAGE_SPAN > 1:  # n0 - kv_lo is a BLOCK_N multiple and kv_lo one too: a run boundary
            slots = paged_slots(ReqToToken + req_row * stride_rt, n0, s_hi, BLOCK_N, PAGE_SPAN)
        else:
            slots = tl.load(ReqToToken + req_row * stride_rt + k_pos).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=mask_d[None, :],
                    other=0.0).to(Q.dtype.element_ty)  # e4m3 widens exactly
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=mask_d[None, :],
                    other=0.0).to(Q.dtype.element_ty)
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, k, v, q_pos, q_hi, k_pos, k_pos < pool_hi, qk_scale, logit_softcap, sliding_window,
            MASK_KEYS=False, CAUSAL=False, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP,
            DOT_PRECISION=DOT_PRECISION, UPCAST_DOT=UPCAST_DOT,
        )  # fmt: skip
    for n0 in range(tl.maximum(unmasked_hi, s_lo), s_hi, BLOCK_N):
        k_pos = n0 + offs_n
        key_ok = k_pos < s_hi
        if PAGE_SPAN > 1:
            slots = paged_slots(ReqToToken + req_row * stride_rt, n0, s_hi, BLOCK_N, PAGE_SPAN)
        else:
            slots = tl.load(ReqToToken + req_row * stride_rt + k_pos, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, k, v, q_pos, q_hi, k_pos, key_ok, qk_scale, logit_softcap, sliding_window,
            MASK_KEYS=True, CAUSAL=POOL_NEEDS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP,
            DOT_PRECISION=DOT_PRECISION, UPCAST_DOT=UPCAST_DOT,
        )  # fmt: skip

    if CONTIGUOUS_NEW_KV:
        # New tokens' keys from the contiguous k/v of this forward, rows start_loc + (pos - prefix_len).
        new_lo = tl.maximum(kv_lo, prefix_len)
        for n0 in range(new_lo, kv_hi, BLOCK_N):
            k_pos = n0 + offs_n
            key_ok = k_pos < kv_hi
            ext_rows = (start_loc + k_pos - prefix_len).to(tl.int64)
            kv_mask = key_ok[:, None] & mask_d[None, :]
            k = tl.load(
                KExt + ext_rows[:, None] * stride_ket + kv_head * stride_keh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                VExt + ext_rows[:, None] * stride_vet + kv_head * stride_veh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            acc, m_i, l_i = attend_block(
                q, acc, m_i, l_i, k, v, q_pos, q_hi, k_pos, key_ok, qk_scale, logit_softcap, sliding_window,
                MASK_KEYS=True, CAUSAL=True, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, DOT_PRECISION=DOT_PRECISION, UPCAST_DOT=UPCAST_DOT,
            )  # fmt: skip

    # Every valid query sees at least itself (l_i > 0); padded rows may see nothing under a window.
    if HAS_KV_SCALE:
        acc = acc * v_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS > 1:  # partial result of this split: normalised output and log-sum-exp (-inf: saw nothing)
        # natural-log LSE for the merge (m_i is in base 2)
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        split_id = tl.program_id(2)
        tl.store(
            MidO + rows[:, None] * stride_mot + heads[:, None] * stride_moh + split_id * stride_mos + offs_d[None, :],
            out,
            mask=mask_m[:, None] & mask_d[None, :],
        )
        tl.store(MidLse + rows * stride_mlt + heads * stride_mlh + split_id, lse, mask=mask_m)
        return
    tl.store(
        Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def span_ends(prefix_lens: list[int], extend_lens: list[int], spans: list[list[tuple[int, int]]]) -> list[int]:
    """Host-side span_end for extend_attention: per new token (sequences concatenated), its position + 1, or the
    end of the bidirectional block [start, end) (positions in its sequence) holding it. Raises ValueError for a
    block that ends past its sequence's new tokens (a prefill chunk never splits one)."""
    out: list[int] = []
    for i, (prefix, ext) in enumerate(zip(prefix_lens, extend_lens)):
        ends = list(range(prefix + 1, prefix + ext + 1))
        for start, end in spans[i] if i < len(spans) else ():
            if end > prefix + ext:
                raise ValueError(f"bidirectional block [{start}, {end}) ends past the sequence's {prefix + ext} tokens")
            for p in range(max(start, prefix), end):
                ends[p - prefix] = end
        out.extend(ends)
    return out


def _config(head_dim: int, max_extend_len: int, block_m: int | None = None, interpret: bool | None = None) -> dict:
    """Launch parameters for rows = max_extend_len query rows a program column (x the packed heads).
    interpret: None = as this process runs (TRITON_INTERPRET); False gives the GPU's choice anywhere."""
    if _common.interpreting() if interpret is None else interpret:
        return {"BLOCK_M": block_m or 16, "BLOCK_N": 16, "num_warps": 1}
    if block_m is None:
        block_m = 128 if max_extend_len > 64 else 64
    if head_dim > 128:
        block_m = min(block_m, 64)
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "num_warps": 8 if block_m == 64 else 4, "num_stages": 2}
    if block_m == 128:  # measured on an H200 (benchmarks/gpu_kernels.py sweep): 4 warps, 3 stages
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def eager_variant(head_dim: int, heads_per_kv: int, max_extend_len: int, interpret: bool | None = None) -> tuple:
    """What extend_attention compiles for a batch without a block map whose longest extend is max_extend_len
    (the head layout fixed): the per-batch constexprs and launch parameters, as a hashable key. Two batches
    with the same key run the same compiled kernel."""
    block_g = triton.next_power_of_2(heads_per_kv) if pack_heads_by_default(heads_per_kv, False) else 1
    cfg = _config(head_dim, max_extend_len * block_g, None, interpret)
    return (("BLOCK_G", block_g), *sorted(cfg.items()))


def pack_heads_by_default(heads_per_kv: int, has_map: bool, block_m: int | None = None) -> bool:
    """Whether extend_attention packs a kv head's query heads into one program when not told. With a block map (the
    CUDA graphs' launch, block_m tokens a block) only for short blocks, whose packed rows fit 64: a few tokens a
    sequence (speculative verify, forced tokens) over its context then read each K/V block once for the group
    instead of once per query head. Taller packed blocks lose on long prefixes: on an H200 (Llama-3-8B heads,
    docs/benchmarks.md) 200 tokens over 60,000 took 1.87 ms packed in 128-row blocks against 0.92 ms per head."""
    if not 1 < heads_per_kv <= 16:  # 16: the interpreter's 16-row blocks hold a token
        return False
    return not has_map or (block_m is not None and block_m * triton.next_power_of_2(heads_per_kv) <= 64)


def block_m_for(head_dim: int, max_extend_len: int, block_m: int | None = None) -> int:
    """The query-block height extend_attention uses for these arguments (for building a block map)."""
    return _config(head_dim, max_extend_len, block_m)["BLOCK_M"]


def block_map(extend_lens: list[int], block_m: int, num_blocks: int) -> tuple[list[int], list[int]]:
    """Host-side block map for extend_attention: (sequence, query block) of every non-empty query block,
    padded with (-1, 0) to num_blocks entries. sum(ceil(e / block_m)) <= num_tokens / block_m + B, so
    num_blocks = B_max + cdiv(T_max, block_m) fits every batch of at most B_max sequences and T_max tokens.
    Raises ValueError when the batch needs more than num_blocks."""
    seqs, mbs = [], []
    for i, e in enumerate(extend_lens):
        n = -(-e // block_m)
        seqs.extend([i] * n)
        mbs.extend(range(n))
    if len(seqs) > num_blocks:
        raise ValueError(f"batch needs {len(seqs)} query blocks, the map holds {num_blocks}")
    pad = num_blocks - len(seqs)
    return seqs + [-1] * pad, mbs + [0] * pad


def extend_attention(
    q: torch.Tensor,  # [T, H, D] new queries of all sequences, concatenated
    o: torch.Tensor,  # [T, H, D] output, written in place
    k_buffer: torch.Tensor,  # [num_slots, KVH, D] pool K of this layer
    v_buffer: torch.Tensor,  # [num_slots, KVH, D]
    req_to_token: torch.Tensor,  # [R, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    extend_start_loc: torch.Tensor,  # [B]
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_extend: torch.Tensor | None = None,
    v_extend: torch.Tensor | None = None,
    block_seq: torch.Tensor | None = None,
    block_mb: torch.Tensor | None = None,
    block_m: int | None = None,
    num_splits: int = 1,
    config: dict | None = None,
    page_size: int = 1,
    pack_heads: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    span_end: torch.Tensor | None = None,
) -> None:
    """Causal attention of each sequence's new tokens over its positions [0, own position], read from the
    pool (the new tokens' K/V included). k_extend/v_extend ([T, KVH, D]), when given, hold the new tokens'
    K/V contiguously and are read instead of the pool for those positions; the result is the same.
    max_extend_len (a host int) sizes the grid; shorter sequences' extra programs exit at once.
    block_seq/block_mb ([num_blocks] int32, see block_map) replace that grid by [num_blocks, H], one program
    per listed query block (entries with block_seq < 0 exit at once): with static map buffers the grid is
    fixed, so a CUDA graph captured once serves any batch the map fits. block_m overrides the block height
    (pass the one the map was built with). num_splits > 1 (with a block map, pool K/V only) cuts each query
    block's keys into that many ranges run by separate programs, merged by their log-sum-exp afterwards:
    parallelism for a few new tokens over a long cached prefix (hot-prefix prefills). config overrides
    launch parameters (BLOCK_N, num_warps, num_stages; benchmarks/gpu_kernels.py sweeps them). page_size: the
    pool's; above 1 pool keys are read a page run per table lookup. pack_heads: put the query heads that share
    a kv head into one program's rows (K/V loaded once for the group, short extends fill the tile); None
    decides by pack_heads_by_default. With a block map block_m still counts tokens (a packed block has
    block_m x the group's rows).
    k_scale/v_scale ([KVH] fp32): the scales of an e4m3 pool, read as decode_attention reads it.
    span_end ([T] int32, optional): per new token, the end (exclusive) of the keys it sees: its position + 1,
    or, inside a bidirectional block (an image of Gemma-3), the block's end; see span_ends."""
    num_heads, num_kv_heads, head_dim = _common.check_pool_args(q, k_buffer, v_buffer)
    batch_size = req_pool_indices.shape[0]
    if batch_size == 0 or max_extend_len == 0:
        return
    if span_end is not None and span_end.shape != (q.shape[0],):
        raise ValueError(f"span_end must be [T] = [{q.shape[0]}]; got {tuple(span_end.shape)}")
    scales = _common.kv_scale_args(k_buffer, k_scale, v_scale)
    contiguous = k_extend is not None
    if contiguous and scales["HAS_KV_SCALE"]:
        raise ValueError("an e4m3 pool is read from the pool only (no k_extend/v_extend): the new tokens' K/V must be "
                         "the quantized values every later read sees")
    if contiguous and (v_extend is None or k_extend.shape != (q.shape[0], num_kv_heads, head_dim)):
        raise ValueError(f"k_extend/v_extend must both be [T, KVH, D]; got {k_extend.shape}")
    k_ext = k_extend if contiguous else k_buffer
    v_ext = v_extend if contiguous else v_buffer
    has_map = block_seq is not None
    heads_per_kv = num_heads // num_kv_heads
    if has_map and (block_mb is None or block_m is None):
        raise ValueError("a block map needs block_seq, block_mb and the block_m it was built with")
    if pack_heads is None:
        pack_heads = pack_heads_by_default(heads_per_kv, has_map, block_m)
    block_g = triton.next_power_of_2(heads_per_kv) if pack_heads else 1
    # A map's blocks count tokens: packed, a block's rows are its tokens x the group's heads.
    cfg = _config(head_dim, max_extend_len * block_g, block_m * block_g if has_map else block_m)
    if config:
        cfg = {**cfg, **config}
    if block_g > cfg["BLOCK_M"]:
        raise ValueError(f"pack_heads: {heads_per_kv} heads per kv head do not fit a {cfg['BLOCK_M']}-row block")
    if num_splits > 1:  # split partials: [T, H, S, D] and [T, H, S] fp32 (a graph's pool holds them)
        mid_o, mid_lse = decode_workspace(q.shape[0], num_heads, head_dim, num_splits, q.device)
    else:
        mid_o, mid_lse = o.unsqueeze(2), o[:, :, 0]  # placeholders, never touched
    if num_splits > 1 and (not has_map or contiguous):
        raise ValueError("num_splits > 1 needs a block map and pool K/V (no k_extend)")
    if has_map:
        if cfg["BLOCK_M"] != block_m * block_g:
            raise ValueError(f"a config of {cfg['BLOCK_M']} rows does not fit the map's {block_m}-token blocks"
                             f"{f' x {block_g} packed heads' if block_g > 1 else ''}")
        grid = (block_seq.shape[0], num_kv_heads if pack_heads else num_heads, num_splits)
    else:
        grid = (batch_size, num_kv_heads if pack_heads else num_heads, triton.cdiv(max_extend_len * block_g, cfg["BLOCK_M"]))
    _extend_kernel[grid](
        q, o, k_buffer, v_buffer, k_ext, v_ext, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, _common.qk_scale(sm_scale, logit_softcap), logit_softcap or 0.0, sliding_window or 0,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), k_ext.stride(0), k_ext.stride(1), v_ext.stride(0),
        v_ext.stride(1), req_to_token.stride(0),
        HEADS_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None,
        CONTIGUOUS_NEW_KV=contiguous, POOL_NEEDS_CAUSAL=not contiguous, **_common.dot_args(q.dtype), **cfg,
        BlockSeq=block_seq if has_map else extend_lens, BlockMb=block_mb if has_map else extend_lens,
        HAS_BLOCK_MAP=has_map,
        MidO=mid_o, MidLse=mid_lse, stride_mot=mid_o.stride(0), stride_moh=mid_o.stride(1),
        stride_mos=mid_o.stride(2), stride_mlt=mid_lse.stride(0), stride_mlh=mid_lse.stride(1),
        NUM_SPLITS=num_splits, PAGE_SPAN=_common.page_span(page_size, cfg["BLOCK_N"]), BLOCK_G=block_g, **scales,
        SpanEnd=span_end if span_end is not None else extend_lens, HAS_SPANS=span_end is not None,
    )  # fmt: skip
    if num_splits > 1:
        launch_merge(o, mid_o, mid_lse, num_splits)
