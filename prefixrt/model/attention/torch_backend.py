"""TorchAttentionBackend: the reference attention over the paged KV pool, in plain torch (CPU and CUDA).

Slow by design (a Python loop over sequences, dense scores per sequence) and simple enough to trust:
faster backends are tested against it. Scores, softmax and the weighted sum run in float32, over the K/V as the
pool returns them (an FP8 pool's dequantized: the CPU reference of the FP8 KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.forward_batch import ForwardBatch


@dataclass
class _Plan:
    """Per-forward state built by prepare(), shared by all layers of that forward."""

    batch: ForwardBatch
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64, pool slots of every sequence's positions 0..seq_len-1
    q_starts: list[int]  # offset of sequence i's new tokens in the flat token list
    kv_starts: list[int]  # offset of sequence i's slots in kv_slots
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)  # (seq, window) -> mask


class TorchAttentionBackend(AttentionBackend):
    bidirectional_spans = True  # honours ForwardBatch.mm.spans (image blocks that attend both ways)

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._plan: _Plan | None = None

    def close(self) -> None:
        self._plan = None

    def prepare(self, batch: ForwardBatch) -> None:
        """Gather the slot ids of every sequence once per forward (no device sync: host lengths only)."""
        rows = []
        for i, seq_len in enumerate(batch.seq_lens_cpu):
            # index_select with a device index keeps this sync-free (indexing with a 0-d tensor would not).
            row = batch.req_to_token[:, :seq_len].index_select(0, batch.req_pool_indices[i : i + 1])
            rows.append(row[0])  # [seq_len]
        kv_slots = torch.cat(rows).long() if rows else batch.out_cache_loc.new_zeros(0)
        q_starts, kv_starts, q_acc, kv_acc = [], [], 0, 0
        for extend_len, seq_len in zip(batch.extend_lens_cpu, batch.seq_lens_cpu):
            q_starts.append(q_acc)
            kv_starts.append(kv_acc)
            q_acc += extend_len
            kv_acc += seq_len
        self._plan = _Plan(batch=batch, kv_slots=kv_slots, q_starts=q_starts, kv_starts=kv_starts)

    def _mask(self, i: int, window: int | None) -> torch.Tensor:  # [extend_len, seq_len] bool, True = attend
        plan = self._plan
        key = (i, window)
        if key not in plan.masks:
            seq_len, prefix_len = plan.batch.seq_lens_cpu[i], plan.batch.prefix_lens_cpu[i]
            device = plan.kv_slots.device
            q_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]  # [E, 1]
            k_pos = torch.arange(seq_len, device=device)[None, :]  # [1, S]
            mask = k_pos <= q_pos
            mm = plan.batch.mm
            for start, end in mm.spans[i] if mm is not None and mm.spans else ():
                if end > seq_len:
                    raise ValueError(f"image block [{start}, {end}) ends past the sequence's {seq_len} tokens")
                mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
            if window is not None:
                mask &= k_pos > q_pos - window
            plan.masks[key] = mask
        return plan.masks[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:  # shapes as in AttentionBackend.forward
        plan = self._plan
        if plan is None or plan.batch is not batch:
            raise RuntimeError("TorchAttentionBackend.prepare(batch) must be called before forward(batch)")
        num_tokens = q.shape[0]
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        group = h // kvh
        if k is not None:  # None: already stored by the caller (fused RoPE + K/V store)
            self.pool.write(layer.layer_id, batch.out_cache_loc, k.view(num_tokens, kvh, d), v.view(num_tokens, kvh, d))

        # [sum(S), kvh, d] float32 (dequantized in an FP8 pool), includes the new tokens as the pool stores them
        k_all, v_all = self.pool.read(layer.layer_id, plan.kv_slots)
        q = q.view(num_tokens, kvh, group, d)  # query head j*group+g uses kv head j (transformers' repeat_kv)
        out = torch.empty(num_tokens, h * d, dtype=q.dtype, device=q.device)
        for i, (extend_len, seq_len) in enumerate(zip(batch.extend_lens_cpu, batch.seq_lens_cpu)):
            if extend_len == 0:
                continue
            qs, ks = plan.q_starts[i], plan.kv_starts[i]
            qi = q[qs : qs + extend_len].float().permute(1, 2, 0, 3)  # [kvh, group, E, d]
            ki = k_all[ks : ks + seq_len].permute(1, 0, 2)[:, None]  # [kvh, 1, S, d]
            vi = v_all[ks : ks + seq_len].permute(1, 0, 2)[:, None]  # [kvh, 1, S, d]
            scores = (qi @ ki.transpose(-1, -2)) * layer.scaling  # [kvh, group, E, S]
            if layer.logit_softcap is not None:
                scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
            scores = scores.masked_fill(~self._mask(i, layer.sliding_window), float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # every query sees at least itself: no empty rows
            oi = probs @ vi  # [kvh, group, E, d]
            out[qs : qs + extend_len] = oi.permute(2, 0, 1, 3).reshape(extend_len, h * d).to(q.dtype)
        return out
