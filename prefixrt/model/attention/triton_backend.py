"""TritonAttentionBackend: the attention seam implemented with the Triton kernels in prefixrt.kernels.

prepare() plans once per forward from host-side lengths (no device sync): the extend grid height, the
number of KV splits for decode, and, when the batch carries prefix_groups worth sharing, a cascade plan.
forward() writes the layer's new K/V into the pool, then dispatches EXTEND -> extend_attention, DECODE ->
cascade_decode_attention (grouped batch, full-attention layer) or decode_attention.

CUDA graphs (model/cuda_graphs.py): decode graphs are captured per batch-size bucket; the split counts
depend only on the bucket (plan_decode_splits with the engine's max context), the per-sequence arrays are
copied into static tensors before replay, and the split workspace below is already static, so replay
launches the same grids on the same addresses. EXTEND graphs pass ForwardBatch.extend_plan, a block map in
static buffers: extend attention then runs on a grid fixed by the map's length. Cascade decode graphs pass
ForwardBatch.cascade_plan, a plan padded to a fixed tile count (padding tiles exit at once). The page size
is fixed at construction, so every captured graph launches the kernels with the same PAGE_SPAN.
"""

from __future__ import annotations

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.kernels.cascade_decode import cascade_decode_attention
from prefixrt.kernels.cascade_plan import CascadePlan, plan_cascade
from prefixrt.kernels.decode_attention import decode_attention, decode_workspace
from prefixrt.kernels.extend_attention import extend_attention, span_ends
from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.forward_batch import ForwardBatch, ForwardMode

# A split shorter than this many keys costs more in its merge than it saves in parallelism.
MIN_KEYS_PER_SPLIT = 128


def plan_decode_splits(num_work_items: int, max_keys: int, num_sms: int, max_splits: int,
                       programs_per_sm: int = 2) -> int:
    """Splits per work item (sequence x kv head, or cascade tile x kv head) so that about programs_per_sm
    programs run per SM, without splits shorter than MIN_KEYS_PER_SPLIT keys."""
    wanted = -(-programs_per_sm * num_sms // max(num_work_items, 1))
    useful = -(-max(max_keys, 1) // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, max_splits))


class TritonAttentionBackend(AttentionBackend):
    bidirectional_spans = True  # honours ForwardBatch.mm.spans in EXTEND (the extend kernel's span_end)

    def __init__(
        self,
        pool: KVPool,
        max_batch_size: int = 256,
        max_kv_splits: int = 16,
        num_sms: int | None = None,
        use_cascade: bool = True,
        cascade_min_prefix_len: int = 256,
        cascade_min_group_size: int = 2,
        cascade_queries_per_tile: int = 16,
        contiguous_extend_kv: bool = False,
        page_size: int = 1,
    ):
        """pool: the KV pool this backend reads and writes. max_batch_size and max_kv_splits size the
        static decode workspace. use_cascade: honour ForwardBatch.prefix_groups when a group has at least
        cascade_min_group_size sequences sharing at least cascade_min_prefix_len tokens.
        contiguous_extend_kv: in EXTEND, read the new tokens' K/V from the forward's k/v tensors instead
        of back from the pool. page_size: the allocator's (pages of page_size contiguous, aligned slots);
        above 1 the kernels read the request table once per page run (see kernels/decode_attention.py)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_kv_splits = max_kv_splits
        if num_sms is None:
            on_gpu = pool.device.type == "cuda"
            num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count if on_gpu else 8
        self.num_sms = num_sms
        self.use_cascade = use_cascade
        self.cascade_min_prefix_len = cascade_min_prefix_len
        self.cascade_min_group_size = cascade_min_group_size
        self.cascade_queries_per_tile = cascade_queries_per_tile
        self.contiguous_extend_kv = contiguous_extend_kv
        # Static split workspace per (num_heads, head_dim): mid_o [max_batch, H, 2*max_splits, D] and
        # mid_lse [max_batch, H, 2*max_splits] fp32 (cascade uses prefix + suffix splits).
        self._workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Per-forward plan, set by prepare().
        self._batch: ForwardBatch | None = None
        self._max_extend_len = 0
        self._span_end: torch.Tensor | None = None  # [T] int32: EXTEND with bidirectional image blocks
        self._num_kv_splits = 1
        self.cascade_plan: CascadePlan | None = None
        self._num_prefix_splits = 0
        self._num_suffix_splits = 0

    def close(self) -> None:
        self._workspaces.clear()
        self._batch = self.cascade_plan = None

    def workspace(self, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static split workspace for layers of this shape (allocated on first use; call it before
        CUDA graph capture so capture sees no allocation)."""
        key = (num_heads, head_dim)
        if key not in self._workspaces:
            self._workspaces[key] = decode_workspace(
                self.max_batch_size, num_heads, head_dim, 2 * self.max_kv_splits, self.pool.device
            )
        return self._workspaces[key]

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan this forward from the batch's host lengths; mutates only the backend's per-forward plan.
        Raises ValueError for a decode batch above max_batch_size or inconsistent prefix_groups."""
        spans = batch.mm is not None and batch.mm.has_spans
        if spans and batch.mode is not ForwardMode.EXTEND:
            raise ValueError("bidirectional image blocks in a decode batch")
        self._batch = batch
        self.cascade_plan = None
        self._span_end = None
        num_kv_heads = self.pool.num_kv_heads
        if batch.mode is ForwardMode.EXTEND:
            self._max_extend_len = max(batch.extend_lens_cpu, default=0)
            if spans:
                ends = span_ends(batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.mm.spans)
                self._span_end = torch.tensor(ends, dtype=torch.int32).to(self.pool.device)
            return
        if batch.batch_size > self.max_batch_size:
            raise ValueError(f"decode batch of {batch.batch_size} exceeds max_batch_size {self.max_batch_size}")
        max_seq_len = max(batch.seq_lens_cpu, default=0)
        self._num_kv_splits = plan_decode_splits(
            batch.batch_size * num_kv_heads, max_seq_len, self.num_sms, self.max_kv_splits
        )
        if batch.cascade_plan is not None:  # static, padded (CUDA graphs): split counts fixed by its shape
            self._use_plan(batch.cascade_plan, num_kv_heads)
            return
        if not (self.use_cascade and batch.prefix_groups):
            return
        plan = plan_cascade(
            batch.prefix_groups,
            batch.seq_lens_cpu,
            self.pool.device,
            queries_per_tile=self.cascade_queries_per_tile,
            min_prefix_len=self.cascade_min_prefix_len,
            min_group_size=self.cascade_min_group_size,
        )
        if plan is None:
            return
        self._use_plan(plan, num_kv_heads)

    def _use_plan(self, plan: CascadePlan, num_kv_heads: int) -> None:
        batch = self._batch
        self.cascade_plan = plan
        tiles = plan.split_tiles or plan.num_tiles
        self._num_prefix_splits = plan_decode_splits(
            tiles * num_kv_heads, plan.max_prefix_len, self.num_sms, self.max_kv_splits
        )
        # The suffix stage runs beside the prefix stage and its short loops are latency-bound: twice the
        # programs (measured on an H200, RAG shape: 49.0 -> 45.9 us a layer for the whole cascade).
        self._num_suffix_splits = plan_decode_splits(
            batch.batch_size * num_kv_heads, plan.max_suffix_len, self.num_sms, self.max_kv_splits,
            programs_per_sm=4,
        )

    @staticmethod
    def _extend_map_args(batch: ForwardBatch) -> dict:
        plan = batch.extend_plan
        if plan is None:
            return {}
        return {"block_seq": plan.block_seq, "block_mb": plan.block_mb, "block_m": plan.block_m,
                "num_splits": plan.num_splits}

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:  # shapes as in AttentionBackend.forward
        """Write k, v into the pool at batch.out_cache_loc, then attend (see AttentionBackend.forward)."""
        if batch is not self._batch:
            raise RuntimeError("TritonAttentionBackend.forward called without prepare() for this batch")
        num_tokens, num_heads, head_dim = q.shape[0], layer.num_heads, layer.head_dim
        q = q.view(num_tokens, num_heads, head_dim)  # q: [T, H, D]
        if k is not None:  # None: already stored by the caller (fused RoPE + K/V store)
            k = k.view(num_tokens, layer.num_kv_heads, head_dim)  # k: [T, KVH, D]
            v = v.view(num_tokens, layer.num_kv_heads, head_dim)
            self.pool.write(layer.layer_id, batch.out_cache_loc, k, v)
        k_buffer = self.pool.k_buffers[layer.layer_id]  # [num_slots, KVH, D]
        v_buffer = self.pool.v_buffers[layer.layer_id]
        if q.dtype != k_buffer.dtype and not self.pool.quantized:
            raise ValueError(f"query dtype {q.dtype} differs from the KV pool's {k_buffer.dtype}")
        k_scale, v_scale = self.pool.kv_scales(layer.layer_id)  # [KVH] each for an FP8 pool, else None
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        o = torch.empty_like(q)  # o: [T, H, D]
        common = (k_buffer, v_buffer, batch.req_to_token, batch.req_pool_indices)
        if batch.mode is ForwardMode.EXTEND:
            plan = batch.extend_plan
            # (an FP8 pool is read from the pool only: the new tokens must be seen as quantized, as later reads see them)
            contiguous = (self.contiguous_extend_kv and k is not None and (plan is None or plan.num_splits == 1)
                          and not self.pool.quantized)
            extend_attention(
                q, o, *common, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc,
                self._max_extend_len, layer.scaling, layer.sliding_window, layer.logit_softcap,
                k_extend=k.to(k_buffer.dtype) if contiguous else None,
                v_extend=v.to(v_buffer.dtype) if contiguous else None,
                **self._extend_map_args(batch), page_size=self.page_size, **scales, span_end=self._span_end,
            )  # fmt: skip
        elif self.cascade_plan is not None and layer.sliding_window is None:
            mid_o, mid_lse = self.workspace(num_heads, head_dim)
            cascade_decode_attention(
                q, o, *common, batch.seq_lens, layer.scaling, self.cascade_plan, layer.logit_softcap,
                num_prefix_splits=self._num_prefix_splits, num_suffix_splits=self._num_suffix_splits,
                mid_o=mid_o, mid_lse=mid_lse, page_size=self.page_size, **scales,
            )  # fmt: skip
        else:
            mid_o, mid_lse = self.workspace(num_heads, head_dim)
            decode_attention(
                q, o, *common, batch.seq_lens, layer.scaling, layer.sliding_window, layer.logit_softcap,
                num_kv_splits=self._num_kv_splits, mid_o=mid_o, mid_lse=mid_lse, page_size=self.page_size, **scales,
            )  # fmt: skip
        return o.view(num_tokens, num_heads * head_dim)
