"""CUDA graphs for small batches: one captured forward per bucket, replayed with the batch copied into
static buffers (gpt-fast / SGLang style). Removes the per-kernel launch cost that dominates small steps.

Two banks share one memory pool and one static logits buffer (they never run at the same time):
- DecodeGraphs: DECODE batches, one graph per batch-size bucket. Padded rows write and read only the
  padding slot 0 through a reserved all-zero request-table row (with page_size P > 1 the kernels read that
  row's positions as slots of page 0, which the allocator never hands out either).
- ExtendGraphs: EXTEND batches (jump-forward steps, decode + forced tokens, hot-prefix prefills, small
  mixed batches), one graph per (token bucket, sequence bucket). The whole forward is captured; the extend
  attention kernel runs on a fixed grid through a block map (ForwardBatch.extend_plan) in static buffers:
  one program per listed (sequence, query block), padding entries exit at once. Padded tokens write their
  K/V to slot 0 and no query block reads them; padded sequences are in no block.

With LoRA adapters (LoraGraphSpec) every static batch also holds a static LoRA plan (model/lora.py LoraPlan) sized for
its bucket; a replay writes the batch's plan into it (all padding when no row runs under an adapter), and the
adapter weights are read from the fixed slot buffers, so one graph serves every mix of adapters and the base model.

Invariant of both: a replay reads only the static buffers, so the caller's batch may be dropped after
replay() returns; the returned logits are a view of the shared output buffer, valid until the next replay.

`emulate=True` (CPU tests) runs forward_eager on the static padded batch instead of a captured graph, so
bucket choice, padding and buffer filling are tested without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from prefixrt.model.forward_batch import ExtendPlan, ForwardBatch, ForwardMode
from prefixrt.model.lora import LoraBatch, LoraPlan

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 512)
# Token buckets of EXTEND graphs: fine where the forward is compute bound (padding costs compute there).
EXTEND_TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
# Sequence buckets of EXTEND graphs: they size the block map and the logits rows (lm_head runs on them).
EXTEND_SEQ_BUCKETS = (1, 4, 16, 64, 128, 256)
# Above this many tokens a forward's GPU time hides its launches: EXTEND runs eagerly there.
DEFAULT_MAX_EXTEND_TOKENS = 1024


@dataclass(frozen=True)
class CascadeSpec:
    """Cascade (shared-prefix) decode graphs: which decode batches run them and how their padded plan is tiled
    (kernels/cascade_plan.py). Built by the engine from its attention backend and config."""

    queries_per_tile: int  # query rows per tile of the cascade kernel (the attention backend's)
    min_prefix_len: int  # the shortest shared prefix, in tokens, that makes a group
    min_group_size: int  # the fewest rows sharing it
    max_groups: int = 8  # groups one padded plan holds (at most half the bucket's rows)

    def __post_init__(self):
        for name in ("queries_per_tile", "min_prefix_len", "min_group_size", "max_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"CascadeSpec.{name} must be >= 1, got {getattr(self, name)}")


def pick(buckets, n: int) -> int | None:
    """The smallest bucket >= n, or None."""
    return next((b for b in buckets if b >= n), None)


def extend_buckets(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(token bucket, sequence bucket) pairs to capture: every token bucket up to max_tokens, each with the
    sequence buckets up to min(its tokens, max_seqs) (every sequence brings at least one token)."""
    out = []
    tokens = [t for t in EXTEND_TOKEN_BUCKETS if t < max_tokens] + [max_tokens]
    for t in tokens:
        cap = min(t, max_seqs)
        seqs = sorted({min(s, cap) for s in EXTEND_SEQ_BUCKETS})
        out.extend((t, s) for s in seqs)
    return out


def decode_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes DecodeGraphs captures: DEFAULT_BUCKETS up to max_batch_size, and max_batch_size."""
    out = [b for b in DEFAULT_BUCKETS if b <= max_batch_size]
    if not out or out[-1] < max_batch_size:
        out.append(max_batch_size)
    return out


def extend_key_for(keys: list[tuple[int, int]], num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
    """The (token bucket, sequence bucket) of keys that runs an EXTEND batch of this size, or None (eager)."""
    t = pick(sorted({tt for tt, _ in keys}), num_tokens)
    if t is None:
        return None
    b = pick(sorted(s for tt, s in keys if tt == t), num_seqs)
    return None if b is None else (t, b)


def extend_block_m(num_tokens: int, num_seqs: int, head_dim: int) -> int:
    """Query-block height of a bucket: short per-sequence extends (jump-forward, decode + forced tokens)
    take small blocks so little of each block is padding; longer ones taller blocks."""
    from prefixrt.kernels.extend_attention import block_m_for

    per_seq = num_tokens / max(num_seqs, 1)
    want = 16 if per_seq <= 16 else 32 if per_seq <= 128 else 64
    return block_m_for(head_dim, num_tokens, want)


def extend_splits(num_blocks: int, num_heads: int, num_sms: int, max_splits: int = 8) -> int:
    """Key splits per query block of a bucket (a power of two <= max_splits): enough programs for about four
    per SM when the bucket has few query blocks (a short extend over a long cached prefix), else 1."""
    want = -(-4 * num_sms // max(num_blocks * num_heads, 1))
    splits = 1
    while splits * 2 <= min(want, max_splits):
        splits *= 2
    return splits


@dataclass(frozen=True)
class LoraGraphSpec:
    """LoRA inside the graphs: the engine's slot count (bounds a plan's segments) and how the update runs."""

    num_slots: int
    kernels: bool
    num_sms: int = 0


@dataclass
class CaptureReport:
    """What a bank's capture cost (printed at start-up)."""

    graphs: int
    seconds: float
    bytes_allocated: int  # torch.cuda.memory_allocated growth
    bytes_reserved: int  # device memory the capture took from the driver (mem_get_info)


class _Bank:
    """Common machinery: static logits output, capture into a shared pool, replay, release."""

    def __init__(self, forward_eager, attn_backend, req_to_token: torch.Tensor, pad_row: int,
                 device: torch.device, logits_out: torch.Tensor | None, emulate: bool):
        self.forward_eager = forward_eager
        self.attn = attn_backend
        self.req_to_token = req_to_token
        self.pad_row = pad_row
        self.device = torch.device(device)
        self.logits_out = logits_out  # [max rows, vocab] float32, shared by banks; sized on first capture
        self.emulate = emulate
        self.graphs: dict = {}  # key -> (torch.cuda.CUDAGraph or None when emulating, static batch)
        self.report: CaptureReport | None = None
        self.lora: LoraGraphSpec | None = None  # set by the runner before capture (LoRA adapters served)

    def _lora_static(self, num_tokens: int, num_seqs: int) -> LoraBatch | None:
        """A static LoRA plan for a bucket of num_tokens rows in num_seqs sequences (None without LoRA)."""
        if self.lora is None:
            return None
        from prefixrt.kernels.lora_plan import block_m_for, max_blocks

        bm = block_m_for(num_tokens, num_seqs)
        plan = LoraPlan.static(num_tokens, max_blocks(num_tokens, min(num_seqs, self.lora.num_slots), bm), bm,
                               self.device)
        return LoraBatch([-1] * num_seqs, [0] * num_seqs, self.device, self.lora.kernels, self.lora.num_sms, plan)

    def _fill_lora(self, key, batch: ForwardBatch) -> None:
        """Write batch's LoRA plan into the static plan of key's graph (padding when no row runs an adapter)."""
        static = self.graphs[key][1].lora
        if static is not None:
            lora = batch.lora
            static.plan.fill(None if lora is None else lora.row_slots, batch.extend_lens_cpu)

    def _static_batch(self, key) -> ForwardBatch:
        raise NotImplementedError

    def _warm_keys(self, keys: list) -> list:
        """Keys run eagerly before capture (each distinct kernel configuration once)."""
        return keys

    def _run_into_out(self, batch: ForwardBatch) -> None:
        logits = self.forward_eager(batch)
        rows = logits.shape[0]
        if self.logits_out is None or self.logits_out.shape[0] < rows:  # only before the first capture
            self.logits_out = torch.empty(rows, logits.shape[1], dtype=logits.dtype, device=logits.device)
        self.logits_out[:rows].copy_(logits)

    def _warm(self, keys: list) -> None:
        """The eager forwards before capture: compile the Triton variants, size workspaces and logits_out."""
        for key in self._warm_keys(keys):
            self._run_into_out(self._static_batch(key))

    def capture(self, keys, pool=None, warm_only: bool = False) -> None:
        """Capture one graph per key, largest first (later ones reuse its pool memory). warm_only: run the eager
        warm phase alone (engine/parallel_builds.py's dry pass) and capture nothing."""
        keys = list(keys)
        if warm_only:
            with torch.inference_mode():
                self._warm(keys)
            return
        t0 = time.perf_counter()
        on_cuda = self.device.type == "cuda" and not self.emulate
        if on_cuda:
            torch.cuda.synchronize(self.device)
            alloc0 = torch.cuda.memory_allocated(self.device)
            free0 = torch.cuda.mem_get_info(self.device)[0]
            if pool is None:
                pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._warm(keys)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            for key in keys:
                batch = self._static_batch(key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._run_into_out(batch)
                self.graphs[key] = (graph, batch)
            torch.cuda.synchronize(self.device)
            alloc = torch.cuda.memory_allocated(self.device) - alloc0
            reserved = free0 - torch.cuda.mem_get_info(self.device)[0]
        else:
            for key in keys:
                batch = self._static_batch(key)
                self._run_into_out(batch)  # sizes logits_out like the CUDA warm-up does
                self.graphs[key] = (None, batch)
            alloc = reserved = 0
        self.report = CaptureReport(len(keys), time.perf_counter() - t0, alloc, reserved)

    def _replay(self, key, rows: int) -> torch.Tensor:
        graph, batch = self.graphs[key]
        if graph is None:  # emulation (CPU tests): the same static batch, run eagerly
            self._run_into_out(batch)
        else:
            graph.replay()
        return self.logits_out[:rows]

    def close(self) -> None:
        """Drop every graph and static buffer (their pool memory returns to the allocator)."""
        for graph, _ in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self.cascade, self._cascade_last = {}, {}
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, None)
        self.forward_eager = self.attn = None


class DecodeGraphs(_Bank):
    def __init__(self, forward_eager, attn_backend, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int,
                 max_context: int, device: torch.device, logits_out: torch.Tensor | None = None,
                 emulate: bool = False):
        """forward_eager(batch) -> logits runs prepare + model forward (what gets captured)."""
        super().__init__(forward_eager, attn_backend, req_to_token, pad_row, device, logits_out, emulate)
        self.max_context = max_context
        self.buckets = decode_buckets(max_batch_size)
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

    def enable_cascade(self, spec: CascadeSpec) -> None:
        """Also capture, per bucket of >= 2 rows, a graph running cascade (shared-prefix) decode from a
        static plan padded to a fixed tile count (call before capture)."""
        from prefixrt.kernels.cascade_plan import PLAN_FIELDS, CascadePlan, padded_sizes

        self.cascade_spec = spec
        queries_per_tile = spec.queries_per_tile
        self.cascade: dict[int, tuple] = {}  # bs -> (buffer, sizes, CascadePlan, max_groups)
        for bs in self.buckets:
            if bs < 2:
                continue
            groups = min(spec.max_groups, bs // 2)
            sizes = padded_sizes(bs, groups, queries_per_tile)
            buf = torch.zeros(sum(sizes.values()), dtype=torch.int32, device=self.device)
            views, off = [], 0
            for name in PLAN_FIELDS:
                views.append(buf[off : off + sizes[name]])
                off += sizes[name]
            plan = CascadePlan(*views, queries_per_tile=queries_per_tile, num_tiles=sizes["tile_group"],
                               max_prefix_len=self.max_context, max_suffix_len=self.max_context,
                               split_tiles=-(-bs // queries_per_tile))
            self.cascade[bs] = (buf, sizes, plan, groups)
        self._cascade_last: dict[int, object] = {}  # bs -> prefix_groups object whose plan the buffer holds

    def _static_batch(self, key) -> ForwardBatch:
        cascade = isinstance(key, tuple)
        bs = key[1] if cascade else key
        batch = self._plain_static_batch(bs)
        if cascade:
            batch.cascade_plan = self.cascade[bs][2]
        return batch

    def _plain_static_batch(self, bs: int) -> ForwardBatch:
        # Host lengths at their maximum: the backend plans (split counts) for the worst case of the bucket,
        # so one graph serves every context length.
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs], req_to_token=self.req_to_token,
            logits_indices=self.logits_indices[:bs], seq_lens_cpu=[self.max_context] * bs,
            prefix_lens_cpu=[self.max_context - 1] * bs, extend_lens_cpu=[1] * bs, lora=self._lora_static(bs, bs),
        )

    def capture(self, pool=None, warm_only: bool = False) -> None:  # noqa: D102
        keys = list(reversed(self.buckets))
        keys += [("cascade", bs) for bs in reversed(self.buckets) if bs in getattr(self, "cascade", {})]
        super().capture(keys, pool, warm_only)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The plain bucket of this decode batch (prefix_groups or not), or None (eager)."""
        if batch.mode is not ForwardMode.DECODE or batch.logits_indices.shape[0] != batch.batch_size:
            return None
        bs = pick(self.buckets, batch.batch_size)
        return bs if bs in self.graphs else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.bucket_for(batch) is not None

    def _cascade_key(self, batch: ForwardBatch, bs: int):
        """("cascade", bs) with the batch's plan written into that graph's static plan, or None (plain
        decode: no groups worth sharing, or no cascade graphs). Groups unchanged since the last step of this
        bucket (the same prefix_groups object) leave the static plan as it is."""
        groups = batch.prefix_groups
        key = ("cascade", bs)
        if groups is None or key not in self.graphs:
            return None
        if self._cascade_last.get(bs) is groups:
            return key
        from prefixrt.kernels.cascade_plan import pad_lists, plan_lists

        buf, sizes, _, max_groups = self.cascade[bs]
        spec = self.cascade_spec
        lists = plan_lists(groups, batch.seq_lens_cpu, spec.queries_per_tile, spec.min_prefix_len,
                           spec.min_group_size, max_groups=max_groups)
        if lists is None:
            return None
        host = torch.tensor(pad_lists(lists, sizes), dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        buf.copy_(host, non_blocking=True)
        self._cascade_last[bs] = groups
        return key

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.batch_size
        bs = self.bucket_for(batch)
        key = self._cascade_key(batch, bs) or bs
        self.last_key = key
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
        self._fill_lora(key, batch)
        return self._replay(key, n)


class ExtendGraphs(_Bank):
    """EXTEND graphs keyed by (token bucket, sequence bucket); see the module docstring."""

    def __init__(self, forward_eager, attn_backend, req_to_token: torch.Tensor, pad_row: int, max_seqs: int,
                 head_dim: int, device: torch.device, max_tokens: int = DEFAULT_MAX_EXTEND_TOKENS,
                 logits_out: torch.Tensor | None = None, emulate: bool = False, num_heads: int = 1,
                 num_sms: int = 0, num_kv_heads: int | None = None):
        """num_heads, num_kv_heads, num_sms: size the split-KV of each bucket (num_sms 0: no splits)."""
        super().__init__(forward_eager, attn_backend, req_to_token, pad_row, device, logits_out, emulate)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.num_sms = num_sms
        self.keys = extend_buckets(max_tokens, max_seqs)
        self.token_buckets = sorted({t for t, _ in self.keys})
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.max_seqs = max(s for _, s in self.keys)
        t, b = self.max_tokens, self.max_seqs
        # Block maps: the largest a key needs (B + T / block height).
        self.max_blocks = max(self.num_blocks(key) for key in self.keys)
        i64 = {"dtype": torch.int64, "device": device}
        i32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.out_cache_loc = torch.zeros(t, **i64)
        self.req_pool_indices = torch.full((b,), pad_row, **i64)
        self.seq_lens = torch.zeros(b, **i32)
        self.prefix_lens = torch.zeros(b, **i32)
        self.extend_lens = torch.zeros(b, **i32)
        self.extend_start_loc = torch.zeros(b, **i32)
        self.logits_indices = torch.zeros(max(self.logit_rows(key) for key in self.keys), **i64)
        self.block_seq = torch.full((self.max_blocks,), -1, **i32)
        self.block_mb = torch.zeros(self.max_blocks, **i32)

    @staticmethod
    def logit_rows(key: tuple[int, int]) -> int:
        """Logits rows a key's graph computes: one per sequence (a prefill chunk's last token)."""
        return key[1]

    def block_m(self, key: tuple[int, int]) -> int:
        return extend_block_m(key[0], key[1], self.head_dim)

    def num_blocks(self, key: tuple[int, int]) -> int:
        t, b = key
        return b + -(-t // self.block_m(key))

    def num_splits(self, key: tuple[int, int]) -> int:
        from prefixrt.kernels.extend_attention import pack_heads_by_default

        if self.num_sms <= 0:
            return 1
        packed = pack_heads_by_default(self.num_heads // self.num_kv_heads, True, self.block_m(key))
        programs = self.num_kv_heads if packed else self.num_heads  # a query block's programs (one per head)
        return extend_splits(self.num_blocks(key), programs, self.num_sms)

    def _static_batch(self, key: tuple[int, int]) -> ForwardBatch:
        t, b = key
        nb = self.num_blocks(key)
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:t], positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t], req_pool_indices=self.req_pool_indices[:b],
            seq_lens=self.seq_lens[:b], prefix_lens=self.prefix_lens[:b], extend_lens=self.extend_lens[:b],
            extend_start_loc=self.extend_start_loc[:b], req_to_token=self.req_to_token,
            logits_indices=self.logits_indices[: self.logit_rows(key)], seq_lens_cpu=[t] * b, prefix_lens_cpu=[0] * b,
            extend_lens_cpu=[t] + [0] * (b - 1),
            extend_plan=ExtendPlan(self.block_seq[:nb], self.block_mb[:nb], self.block_m(key), self.num_splits(key)),
            lora=self._lora_static(t, b),
        )

    def capture(self, pool=None, warm_only: bool = False) -> None:  # noqa: D102
        super().capture(sorted(self.keys, reverse=True), pool, warm_only)

    def _warm_keys(self, keys: list) -> list:
        # The extend kernel compiles once per (block height, splits); the largest key sizes the buffers.
        seen, out = set(), []
        for key in keys:
            variant = (self.block_m(key), self.num_splits(key))
            if not out or variant not in seen:
                seen.add(variant)
                out.append(key)
        return out

    def bucket_for(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The key whose graph runs this batch, or None (eager): EXTEND only, at most max_tokens tokens,
        no more logits rows than sequences, no prefix groups."""
        if batch.mode is not ForwardMode.EXTEND or batch.prefix_groups is not None:
            return None
        n_tok, n_seq, n_logits = batch.num_tokens, batch.batch_size, int(batch.logits_indices.shape[0])
        key = extend_key_for(self.keys, n_tok, n_seq)
        if key is None or n_logits > self.logit_rows(key) or key not in self.graphs:
            return None
        return key

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.bucket_for(batch) is not None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        from prefixrt.kernels.extend_attention import block_map

        key = self.bucket_for(batch)
        t, b = key
        n_tok, n_seq, n_logits = batch.num_tokens, batch.batch_size, int(batch.logits_indices.shape[0])
        seqs, mbs = block_map(batch.extend_lens_cpu, self.block_m(key), self.num_blocks(key))
        nb = len(seqs)
        host = torch.tensor([seqs, mbs], dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.block_seq[:nb].copy_(host[0], non_blocking=True)
        self.block_mb[:nb].copy_(host[1], non_blocking=True)
        self.input_ids[:n_tok].copy_(batch.input_ids)
        self.positions[:n_tok].copy_(batch.positions)
        self.out_cache_loc[:n_tok].copy_(batch.out_cache_loc)
        if t > n_tok:  # padded tokens: K/V into slot 0 (stale ids/positions are valid values, never read)
            self.out_cache_loc[n_tok:t].zero_()
        self.req_pool_indices[:n_seq].copy_(batch.req_pool_indices)
        self.seq_lens[:n_seq].copy_(batch.seq_lens)
        self.prefix_lens[:n_seq].copy_(batch.prefix_lens)
        self.extend_lens[:n_seq].copy_(batch.extend_lens)
        self.extend_start_loc[:n_seq].copy_(batch.extend_start_loc)
        self.logits_indices[:n_logits].copy_(batch.logits_indices)
        rows = self.logit_rows(key)
        if rows > n_logits:  # rows past the wanted logits read token 0 (in range for every bucket)
            self.logits_indices[n_logits:rows].zero_()
        self._fill_lora(key, batch)
        return self._replay(key, n_logits)


class VerifyGraphs(ExtendGraphs):
    """EXTEND graphs whose logits cover every token row: speculative decoding's verify forwards (a row's last
    token and its drafts, logits at each; engine/loop/speculate.py), which ExtendGraphs does not take (one logits
    row per sequence). Same buckets up to max_tokens; a batch runs here when it has more logits rows than
    sequences."""

    @staticmethod
    def logit_rows(key: tuple[int, int]) -> int:
        return key[0]
