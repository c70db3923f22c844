"""Plain torch reference implementations of the attention kernels (float32 math, one sequence at a time).

Each function has exactly the signature of its Triton counterpart, so a test can call either with the same
arguments. Arguments that only steer the Triton launch (split counts, workspaces, page_size) are accepted and ignored:
the references read every position's slot from req_to_token on its own, whatever the page size.
They are slow and simple on purpose: they are the oracle, not a fallback path.
"""

from __future__ import annotations

import torch
from prefixrt.kernels.cascade_plan import CascadePlan


def _softcap(scores: torch.Tensor, logit_softcap: float | None) -> torch.Tensor:
    if logit_softcap is None:
        return scores
    return logit_softcap * torch.tanh(scores / logit_softcap)


def _attend(
    q: torch.Tensor,  # [M, H, D] float32
    k: torch.Tensor,  # [N, KVH, D] float32
    v: torch.Tensor,  # [N, KVH, D] float32
    visible: torch.Tensor,  # [M, N] bool
    sm_scale: float,
    logit_softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [M, H, D], lse [M, H] (natural log; -inf if nothing visible)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # k: [N, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * sm_scale  # scores: [H, M, N]
    scores = _softcap(scores, logit_softcap)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # lse: [H, M]
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])  # rows with nothing visible -> zeros
    out = torch.einsum("hmn,nhd->mhd", probs, v)
    return out, lse.transpose(0, 1)


def _read(buffer: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Pool rows [N, KVH, D] as float32: an e4m3 pool's values times their kv head's scale ([KVH])."""
    out = buffer[rows].float()
    return out if scale is None else out * scale.float()[None, :, None]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None,
             q_hi: torch.Tensor | None = None) -> torch.Tensor:
    visible = k_pos[None, :] <= q_pos[:, None]  # causal
    if q_hi is not None:  # bidirectional blocks: a query also sees the later keys of its block
        visible |= k_pos[None, :] < q_hi[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return visible


def extend_attention(
    q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
    max_extend_len: int, sm_scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
    k_extend=None, v_extend=None, page_size: int = 1, k_scale=None, v_scale=None, span_end=None,
) -> None:  # the arguments and their shapes: kernels/extend_attention.py
    """Causal attention of each sequence's new tokens over its positions [0, own position], read from the
    pool (the new tokens' K/V included). k_extend/v_extend ([T, KVH, D]), when given, hold the new tokens'
    K/V contiguously; the result is the same either way. k_scale/v_scale ([KVH]): an e4m3 pool, dequantized.
    span_end ([T]): a new token also sees the keys below span_end[t] (its bidirectional block's end)."""
    for i in range(req_pool_indices.shape[0]):
        prefix, ext, start = int(prefix_lens[i]), int(extend_lens[i]), int(extend_start_loc[i])
        if ext == 0:
            continue
        slots = req_to_token[req_pool_indices[i], : prefix + ext].long()
        k = _read(k_buffer, slots, k_scale)
        v = _read(v_buffer, slots, v_scale)
        if k_extend is not None:
            k[prefix:] = k_extend[start : start + ext].float()
            v[prefix:] = v_extend[start : start + ext].float()
        q_pos = torch.arange(prefix, prefix + ext, device=q.device)
        k_pos = torch.arange(prefix + ext, device=q.device)
        q_hi = None if span_end is None else span_end[start : start + ext].to(q.device)
        out, _ = _attend(
            q[start : start + ext].float(), k, v, _visible(q_pos, k_pos, sliding_window, q_hi), sm_scale,
            logit_softcap,
        )
        o[start : start + ext] = out.to(o.dtype)


def _decode_one(q, k_buffer, v_buffer, slots, kv_lo, seq_len, sm_scale, sliding_window, logit_softcap,
                k_scale=None, v_scale=None):  # fmt: skip
    """One decode query q: [H, D] at position seq_len-1 over positions [kv_lo, seq_len). -> out, lse"""
    k_pos = torch.arange(kv_lo, seq_len, device=q.device)
    q_pos = torch.tensor([seq_len - 1], device=q.device)
    rows = slots[kv_lo:seq_len].long()
    return _attend(
        q[None].float(),
        _read(k_buffer, rows, k_scale),
        _read(v_buffer, rows, v_scale),
        _visible(q_pos, k_pos, sliding_window),
        sm_scale,
        logit_softcap,
    )


def _each_sequence(o: torch.Tensor, seq_lens: torch.Tensor, attend_one) -> None:
    """o[i] = attend_one(i, seq_len) ([1, H, D]) for each decode sequence; 0 for a padded entry (seq_len 0)."""
    for i, seq_len in enumerate(seq_lens.tolist()):
        o[i] = attend_one(i, seq_len)[0].to(o.dtype) if seq_len else 0


def decode_attention(
    q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None, num_kv_splits: int = 8, mid_o=None,
    mid_lse=None, page_size: int = 1, k_scale=None, v_scale=None,
) -> None:  # the arguments and their shapes: kernels/decode_attention.py
    """Attention of each sequence's single new query over its slots [0, seq_len) (windowed if asked)."""

    def attend_one(i: int, seq_len: int) -> torch.Tensor:
        return _decode_one(
            q[i], k_buffer, v_buffer, req_to_token[req_pool_indices[i]], 0, seq_len, sm_scale, sliding_window, logit_softcap,
            k_scale, v_scale,
        )[0]

    _each_sequence(o, seq_lens, attend_one)


def cascade_decode_attention(
    q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale: float, plan: CascadePlan,
    logit_softcap: float | None = None, num_prefix_splits: int = 4, num_suffix_splits: int = 4, mid_o=None,
    mid_lse=None, page_size: int = 1, k_scale=None, v_scale=None,
) -> None:  # the arguments and their shapes: kernels/cascade_decode.py
    """Decode attention computed the cascade way: every grouped sequence attends to its group's shared
    prefix (read through the group's lead sequence) and to its own suffix, and the two parts are merged by
    their log-sum-exp. Equals decode_attention when the plan's groups really share their prefix slots."""
    group_of, prefix_len_of = {}, {}
    seq_ids = plan.group_seq_ids.tolist()
    starts = plan.group_seq_start.tolist()
    for g, prefix_len in enumerate(plan.group_prefix_lens.tolist()):
        for s in seq_ids[starts[g] : starts[g + 1]]:
            group_of[s], prefix_len_of[s] = g, prefix_len

    def attend_one(i: int, seq_len: int) -> torch.Tensor:
        own_slots = req_to_token[req_pool_indices[i]]
        if i not in group_of:
            return _decode_one(q[i], k_buffer, v_buffer, own_slots, 0, seq_len, sm_scale, None, logit_softcap,
                               k_scale, v_scale)[0]
        lead = int(plan.group_lead_seq[group_of[i]])
        prefix_slots = req_to_token[req_pool_indices[lead]]
        p = prefix_len_of[i]
        out_p, lse_p = _decode_one(q[i], k_buffer, v_buffer, prefix_slots, 0, p, sm_scale, None, logit_softcap,
                                   k_scale, v_scale)
        out_s, lse_s = _decode_one(q[i], k_buffer, v_buffer, own_slots, p, seq_len, sm_scale, None, logit_softcap,
                                   k_scale, v_scale)
        lse = torch.logaddexp(lse_p, lse_s)  # [1, H]
        return out_p * torch.exp(lse_p - lse)[..., None] + out_s * torch.exp(lse_s - lse)[..., None]

    _each_sequence(o, seq_lens, attend_one)
