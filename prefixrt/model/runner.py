"""ModelRunner: one forward step of a model over the paged KV pool.

The single place where a step is executed: eagerly, or, for a decode batch that DecodeGraphs can run, by
replaying the CUDA graph captured for its batch-size bucket (model/cuda_graphs.py).
"""

from __future__ import annotations

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.model.attention.base import AttentionBackend
from prefixrt.model.base import CausalLM
from prefixrt.model.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, attn_backend: AttentionBackend):
        if pool.num_layers != model.num_layers:
            raise ValueError(f"KV pool has {pool.num_layers} layers, the model {model.num_layers}")
        if (pool.num_kv_heads, pool.head_dim) != (model.num_kv_heads, model.head_dim):
            raise ValueError(
                f"KV pool slots are [{pool.num_kv_heads}, {pool.head_dim}], the model needs "
                f"[{model.num_kv_heads}, {model.head_dim}]"
            )
        self.model = model
        self.pool = pool
        self.attn_backend = attn_backend
        self.graphs = None  # DecodeGraphs once capture_decode_graphs() ran

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step: writes the new tokens' K/V into the pool, returns float32 logits
        [len(batch.logits_indices), vocab_size]."""
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.can_run(batch):
                return self.graphs.replay(batch)
            return self._forward_eager(batch)

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.prepare(batch)
        return self.model(batch, self.attn_backend)

    def capture_decode_graphs(self, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int,
                              max_context: int) -> None:
        """Capture one CUDA graph per decode batch-size bucket (CUDA only). pad_row: a request-table row
        that stays all zeros, read by padded batch rows."""
        from prefixrt.model.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self._forward_eager, self.attn_backend, req_to_token, pad_row, max_batch_size,
                              max_context, self.pool.device)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs
