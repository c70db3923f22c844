"""ModelRunner: one forward step of a model over the paged KV pool.

The single place where a step is executed: a captured CUDA graph replays it when one fits the batch
(decode: DecodeGraphs; small EXTEND batches: ExtendGraphs), else it runs eagerly.
"""

from __future__ import annotations

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.model.attention.base import AttentionBackend
from prefixrt.model.base import CausalLM
from prefixrt.model.cuda_graphs import CascadeSpec, LoraGraphSpec
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
        self.graphs = None  # DecodeGraphs once capture_graphs() ran
        self.extend_graphs = None  # ExtendGraphs once capture_graphs(max_extend_tokens > 0) ran
        self.verify_graphs = None  # VerifyGraphs once capture_graphs(max_verify_tokens > 0) ran
        self.replays = {"decode": 0, "cascade": 0, "extend": 0, "verify": 0, "eager": 0}  # forwards by how they ran

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step: writes the new tokens' K/V into the pool, returns float32 logits
        [len(batch.logits_indices), vocab_size]. A graph's logits are valid until the next forward."""
        with torch.inference_mode():
            if batch.mm is not None:  # image embeddings / image blocks: graphs capture neither
                self.replays["eager"] += 1
                return self._forward_eager(batch)
            if self.graphs is not None and self.graphs.can_run(batch):
                if batch.kv_ready is not None:  # a replay cannot wait per layer: the loads in flight finish first
                    batch.kv_ready.wait_all()
                logits = self.graphs.replay(batch)
                self.replays["cascade" if isinstance(self.graphs.last_key, tuple) else "decode"] += 1
                return logits
            if self.extend_graphs is not None and self.extend_graphs.can_run(batch):
                if batch.kv_ready is not None:
                    batch.kv_ready.wait_all()
                self.replays["extend"] += 1
                return self.extend_graphs.replay(batch)
            if self.verify_graphs is not None and self.verify_graphs.can_run(batch):
                if batch.kv_ready is not None:
                    batch.kv_ready.wait_all()
                self.replays["verify"] += 1
                return self.verify_graphs.replay(batch)
            self.replays["eager"] += 1
            return self._forward_eager(batch)

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.prepare(batch)
        return self.model(batch, self.attn_backend)

    def capture_graphs(self, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int, max_context: int,
                       max_extend_tokens: int = 0, emulate: bool = False,
                       cascade: CascadeSpec | None = None, max_verify_tokens: int = 0,
                       warm_only: bool = False, lora: LoraGraphSpec | None = None) -> list[str]:
        """Capture one CUDA graph per decode batch-size bucket and, with max_extend_tokens > 0, per EXTEND
        (token, sequence) bucket up to that many tokens. pad_row: a request-table row that stays all zeros,
        read by padded decode rows. emulate: no CUDA graphs, the static batches run eagerly (CPU tests).
        cascade: a CascadeSpec (decode graphs for batches with prefix_groups, from a padded plan), or None.
        max_verify_tokens > 0: also EXTEND graphs with logits at every token up to that many tokens (speculative
        decoding's verify forwards). warm_only: run only the eager forwards that precede capture, keep no graph
        (the dry pass of engine/parallel_builds.py). lora: LoRA adapters inside every graph (static plans), or None.
        Returns one line per bank: graphs, seconds, memory."""
        from prefixrt.model.cuda_graphs import DecodeGraphs, ExtendGraphs, VerifyGraphs

        self.release_graphs()
        device = self.pool.device
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" and not emulate else None
        lines = []
        with torch.inference_mode():
            graphs = DecodeGraphs(self._forward_eager, self.attn_backend, req_to_token, pad_row, max_batch_size,
                                  max_context, device, emulate=emulate)
            graphs.lora = lora
            if cascade is not None:
                graphs.enable_cascade(cascade)
            graphs.capture(pool, warm_only)
            self.graphs = graphs
            if not warm_only:
                lines.append(_describe("decode", graphs.report))
            for name, cls, tokens in (("extend", ExtendGraphs, max_extend_tokens),
                                      ("verify", VerifyGraphs, max_verify_tokens)):
                if tokens <= 0:
                    continue
                ext = cls(self._forward_eager, self.attn_backend, req_to_token, pad_row, max_batch_size,
                          self.model.head_dim, device, max_tokens=tokens, logits_out=graphs.logits_out,
                          emulate=emulate, num_heads=self.model.attention_layers[0].num_heads,
                          num_kv_heads=self.model.attention_layers[0].num_kv_heads,
                          num_sms=getattr(self.attn_backend, "num_sms", 0))
                ext.lora = lora
                ext.capture(pool, warm_only)
                setattr(self, f"{name}_graphs", ext)
                if not warm_only:
                    lines.append(_describe(name, ext.report))
        if warm_only:
            self.release_graphs()
        return lines

    def capture_decode_graphs(self, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int,
                              max_context: int) -> None:
        """Decode graphs only (see capture_graphs)."""
        self.capture_graphs(req_to_token, pad_row, max_batch_size, max_context)

    def release_graphs(self) -> None:
        for bank in (self.graphs, self.extend_graphs, self.verify_graphs):
            if bank is not None:
                bank.close()
        self.graphs = self.extend_graphs = self.verify_graphs = None

    def close(self) -> None:
        """Free the runner's device memory: its CUDA graphs and the attention backend's workspaces (the pool
        and the weights belong to others). The runner is unusable afterwards."""
        self.release_graphs()
        self.attn_backend.close()

    def warm_up(self, batches) -> float:
        """Run the given batches eagerly once (compiles the kernel variants a workload will hit, outside
        any request). Returns the seconds it took."""
        import time

        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                self._forward_eager(batch)
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        return time.perf_counter() - t0


def _describe(name: str, report) -> str:
    return (f"{name} CUDA graphs: {report.graphs} captured in {report.seconds:.2f}s, "
            f"{report.bytes_allocated / 2**20:.0f} MiB allocated, {report.bytes_reserved / 2**20:.0f} MiB taken")
