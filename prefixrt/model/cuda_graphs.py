"""Decode CUDA graphs: one captured forward per batch-size bucket, replayed with the batch copied into
static buffers (gpt-fast / SGLang style). Removes the per-kernel launch cost that dominates small-batch
decode. Padded rows read and write only the padding slot 0 through a reserved all-zero table row.
"""

from __future__ import annotations

import torch

from prefixrt.model.forward_batch import ForwardBatch, ForwardMode

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 512)


class DecodeGraphs:
    def __init__(self, forward_eager, attn_backend, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int,
                 max_context: int, device: torch.device):
        """forward_eager(batch) -> logits runs prepare + model forward (what gets captured)."""
        self.forward_eager = forward_eager
        self.attn = attn_backend
        self.req_to_token = req_to_token
        self.pad_row = pad_row
        self.max_context = max_context
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_batch_size]
        if not self.buckets or self.buckets[-1] < max_batch_size:
            self.buckets.append(max_batch_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((n,), pad_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.extend_start_loc = torch.arange(n, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _static_batch(self, bs: int) -> ForwardBatch:
        # Host lengths at their maximum: the backend plans (split counts) for the worst case of the bucket,
        # so one graph serves every context length.
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs], req_to_token=self.req_to_token,
            logits_indices=self.logits_indices[:bs], seq_lens_cpu=[self.max_context] * bs,
            prefix_lens_cpu=[self.max_context - 1] * bs, extend_lens_cpu=[1] * bs,
        )

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in reversed(self.buckets):
                self.forward_eager(self._static_batch(bs))  # warm-up: compiles Triton kernels, sizes workspaces
        torch.cuda.current_stream().wait_stream(side)
        for bs in reversed(self.buckets):
            batch = self._static_batch(bs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward_eager(batch)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.DECODE and batch.batch_size <= self.buckets[-1]
                and batch.prefix_groups is None and batch.logits_indices.shape[0] == batch.batch_size)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.batch_size
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        self.req_pool_indices[:n].copy_(batch.req_pool_indices)
        self.seq_lens[:n].copy_(batch.seq_lens)
        if bs > n:  # padding rows: token 0 at position 0 into slot 0, reading the all-zero table row
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_cache_loc[n:bs].zero_()
            self.req_pool_indices[n:bs].fill_(self.pad_row)
            self.seq_lens[n:bs].fill_(1)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
