"""The attention-backend seam: models call `backend.forward(q, k, v, layer, batch)` and know nothing else.

A backend owns the write of new K/V into the paged pool and the read of cached K/V through
`batch.req_to_token`. The torch backend is the reference; the Triton backend must agree with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from prefixrt.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer, built by the model at construction."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # multiplies q·k
    # Sliding window in tokens: a query at position p sees keys at positions k with p - window < k <= p
    # (transformers' convention). None = full causal attention.
    sliding_window: int | None = None
    logit_softcap: float | None = None  # tanh soft-capping of scores (Gemma-2 style); None = off

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")


class AttentionBackend(ABC):
    """Computes attention over the paged KV pool. One instance per engine; holds a reference to the pool."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the forward (split sizes, index arrays). Called once per forward before layer 0.
        Mutates only the backend's own per-forward state."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads * head_dim], already RoPE'd and normed
        v: torch.Tensor | None,  # [T, num_kv_heads * head_dim]
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """Write k, v into the pool at batch.out_cache_loc for layer.layer_id, then attend each new token to
        its sequence's positions [0, its own position] (causal, windowed if layer.sliding_window).
        k = v = None: the caller already stored them there (fused RoPE + K/V store, see kv_buffers)."""

    @abstractmethod
    def close(self) -> None:
        """Drop what the backend keeps between forwards (the last batch's plan, workspaces); the engine frees the
        pool after it. The backend is unusable afterwards."""

    def kv_buffers(self, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_buffer, v_buffer), each [num_slots, num_kv_heads, head_dim], of this layer in the pool the
        backend reads: for a caller that stores the new K/V itself and then calls forward(q, None, None)."""
        pool = self.pool  # every backend holds its pool as self.pool
        return pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]

    def kv_scales(self, layer: AttentionLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) [num_kv_heads] float32 of this layer when the pool stores e4m3 K/V (a caller storing
        K/V itself quantizes with them), else (None, None)."""
        return self.pool.kv_scales(layer.layer_id)
