"""TorchAttentionBackend against a dense, non-paged reference (GQA, sliding window, softcap)."""

from __future__ import annotations

import pytest
import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.model.attention.base import AttentionLayer
from prefixrt.model.attention.torch_backend import TorchAttentionBackend
from prefixrt.model.forward_batch import ForwardBatch, ForwardMode

H, KVH, D = 4, 2, 8


def dense_attention(q, k, v, layer: AttentionLayer) -> torch.Tensor:
    """q: [S, H, D], k/v: [S, KVH, D] of one whole sequence -> [S, H*D], causal, in float64."""
    s = q.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)  # [S, H, D]
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * layer.scaling
    if layer.logit_softcap is not None:
        scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    pos = torch.arange(s)
    allowed = pos[None, :] <= pos[:, None]
    if layer.sliding_window is not None:
        allowed &= pos[None, :] > pos[:, None] - layer.sliding_window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).reshape(s, H * D).float()


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0), (5, 2.0)])
def test_matches_dense_reference_across_forwards(window, softcap):
    torch.manual_seed(0)
    layer = AttentionLayer(layer_id=1, num_heads=H, num_kv_heads=KVH, head_dim=D, scaling=0.7,
                           sliding_window=window, logit_softcap=softcap)
    pool = KVPool(64, 2, KVH, D, torch.float32, "cpu")
    backend = TorchAttentionBackend(pool)
    lens = [11, 6, 9]
    q = [torch.randn(n, H, D) for n in lens]
    k = [torch.randn(n, KVH, D) for n in lens]
    v = [torch.randn(n, KVH, D) for n in lens]
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    free = torch.randperm(63).add(1).tolist()
    for row, n in zip([2, 0, 3], lens):
        req_to_token[row, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    rows = [2, 0, 3]
    # forward 1: prefixes of 4, 1, 6 tokens; forward 2: the rest (reads the cached prefix from the pool)
    splits = [(0, [4, 1, 6]), (1, lens)]
    out = [[] for _ in lens]
    done = [0, 0, 0]
    for _, ends in splits:
        starts = list(done)
        slots = torch.cat([req_to_token[r, s:e] for r, s, e in zip(rows, starts, ends)]).long()
        batch = ForwardBatch.build(
            req_pool_indices=rows, prefix_lens=starts,
            extend_tokens=[[0] * (e - s) for s, e in zip(starts, ends)],
            out_cache_loc=slots, req_to_token=req_to_token, logits_indices=[0], device="cpu",
        )
        assert batch.mode == ForwardMode.EXTEND
        qf = torch.cat([x[s:e] for x, s, e in zip(q, starts, ends)]).reshape(-1, H * D)
        kf = torch.cat([x[s:e] for x, s, e in zip(k, starts, ends)]).reshape(-1, KVH * D)
        vf = torch.cat([x[s:e] for x, s, e in zip(v, starts, ends)]).reshape(-1, KVH * D)
        backend.prepare(batch)
        res = backend.forward(qf, kf, vf, layer, batch).split([e - s for s, e in zip(starts, ends)])
        for i, r in enumerate(res):
            out[i].append(r)
        done = list(ends)
    for i in range(3):
        ref = dense_attention(q[i], k[i], v[i], layer)
        torch.testing.assert_close(torch.cat(out[i]), ref, rtol=1e-5, atol=1e-5)


def test_forward_without_prepare_raises():
    pool = KVPool(8, 1, KVH, D, torch.float32, "cpu")
    backend = TorchAttentionBackend(pool)
    layer = AttentionLayer(layer_id=0, num_heads=H, num_kv_heads=KVH, head_dim=D, scaling=1.0)
    batch = ForwardBatch.build(req_pool_indices=[0], prefix_lens=[0], extend_tokens=[[1]], out_cache_loc=[1],
                               req_to_token=torch.zeros(1, 4, dtype=torch.int32), logits_indices=[0], device="cpu")
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(torch.zeros(1, H * D), torch.zeros(1, KVH * D), torch.zeros(1, KVH * D), layer, batch)
