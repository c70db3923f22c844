"""ForwardBatch: everything one model forward needs, passed explicitly (never through globals).

The scheduler builds it from its requests; the model and the attention backend read it. Kernels see only
the flat index arrays below. All tensors live on the model's device unless the name ends in `_cpu`.

Token layout: the new tokens of every sequence are concatenated, sequence after sequence:
    input_ids[extend_start_loc[i] : extend_start_loc[i] + extend_lens[i]] are sequence i's new tokens,
at positions prefix_lens[i] .. seq_lens[i]-1. Their K/V is written to pool slots `out_cache_loc`.
The K/V of sequence i's token at position p lives in pool slot req_to_token[req_pool_indices[i], p].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch

from prefixrt.cache.host_lists import int64_tensor

if TYPE_CHECKING:
    from prefixrt.model.lora import LoraBatch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # any number of new tokens per sequence (prefill, chunked prefill, jump-forward)
    DECODE = "decode"  # exactly one new token per sequence


@dataclass(frozen=True)
class ExtendPlan:
    """A fixed-size block map for extend attention (see kernels.extend_attention.block_map)."""

    block_seq: torch.Tensor  # [num_blocks] int32, sequence of each query block; -1 = padding
    block_mb: torch.Tensor  # [num_blocks] int32, index of the block within its sequence's new tokens
    block_m: int  # query-block height the map was built for
    num_splits: int = 1  # key ranges per query block, merged by log-sum-exp (split-KV)


@dataclass
class MultimodalBatch:
    """Encoder outputs to place in a forward, and the image blocks whose tokens attend each other.

    embeds[j] replaces the token embedding of flat row token_index[j]. spans[i]: sequence i's image blocks as
    absolute positions [start, end) that reach its new tokens, for models whose image tokens attend the whole
    of their own block (Gemma-3): a block must end within seq_lens[i] (its keys are all in the pool after
    this forward)."""

    token_index: torch.Tensor  # [N] int64, rows of the flat token list that are image tokens
    embeds: torch.Tensor  # [N, hidden], in the model's dtype
    spans: list[list[tuple[int, int]]] = field(default_factory=list)  # per sequence; [] = causal only

    @property
    def has_spans(self) -> bool:
        return any(self.spans)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, pool slot that receives each new token's K/V
    req_pool_indices: torch.Tensor  # [B] int64, row of each sequence in req_to_token
    seq_lens: torch.Tensor  # [B] int32, tokens with K/V after this forward (prefix + new)
    prefix_lens: torch.Tensor  # [B] int32, tokens whose K/V was already in the pool
    extend_lens: torch.Tensor  # [B] int32, new tokens per sequence (all 1 in DECODE)
    extend_start_loc: torch.Tensor  # [B] int32, offset of each sequence's first new token in [T]
    req_to_token: torch.Tensor  # [R, max_context] int32, pool slot of every (request row, position)
    logits_indices: torch.Tensor  # [L] int64, rows of [T] whose logits the caller wants
    # Host copies of the per-sequence lengths: backends use them to plan without a device sync.
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Optional shared-prefix groups for cascade decode: list of (prefix_len, [sequence indices]) whose first
    # prefix_len slots are identical. Backends that do not use it ignore it.
    prefix_groups: list[tuple[int, list[int]]] | None = None
    # Optional fixed launch plan for EXTEND attention (CUDA graphs): which (sequence, query block) each
    # program of a fixed-size grid handles. None = the backend sizes the grid from extend_lens_cpu.
    extend_plan: ExtendPlan | None = None
    # Optional cascade plan already on the device (decode CUDA graphs: static, padded to a fixed tile
    # count); None = the backend plans from prefix_groups itself.
    cascade_plan: object | None = None
    # Optional: K/V loads into the pool still in flight (cache/transfer.py LoadWaiter). The model calls
    # kv_ready.wait(i) before layer i reads the pool; a graph replay calls kv_ready.wait_all() first.
    kv_ready: object | None = None
    # Optional: image embeddings to place at image tokens, and bidirectional image blocks (MultimodalBatch).
    # Only eager forwards take it: CUDA graphs decline such a batch.
    mm: MultimodalBatch | None = None
    # Optional: which token rows run under which LoRA adapter slot (model/lora.py LoraBatch); None = the base model.
    lora: LoraBatch | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        *,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_tokens: list[list[int]],
        out_cache_loc: list[int] | torch.Tensor,
        req_to_token: torch.Tensor,
        logits_indices: list[int],
        device: torch.device | str,
        prefix_groups: list[tuple[int, list[int]]] | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists (one entry per sequence). The only host→device copies of a step."""
        extend_lens = [len(t) for t in extend_tokens]
        B = len(extend_lens)
        flat_ids = list(chain.from_iterable(extend_tokens))
        if len(flat_ids) == B:  # decode: one token per sequence
            mode = ForwardMode.DECODE
            positions = list(prefix_lens)
            seq_lens = [p + 1 for p in prefix_lens]
            starts = list(range(B))
        else:
            mode = ForwardMode.EXTEND
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
            starts, acc = [], 0
            for e in extend_lens:
                starts.append(acc)
                acc += e
            positions = [p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
        dev = torch.device(device)
        # One host->device copy for all index arrays (a copy per array costs ~10 us of launch each).
        T = len(flat_ids)
        has_loc = isinstance(out_cache_loc, torch.Tensor)
        parts = [flat_ids, positions, [] if has_loc else out_cache_loc, req_pool_indices, seq_lens,
                 prefix_lens, extend_lens, starts, logits_indices]
        packed = int64_tensor(*parts)
        if dev.type == "cuda":
            packed = packed.pin_memory().to(dev, non_blocking=True)
        sizes = [len(part) for part in parts]
        (ids_t, pos_t, loc_t, rows_t, seq_t, pre_t, ext_t, start_t, logit_t) = torch.split(packed, sizes)
        if has_loc:
            loc_t = out_cache_loc.to(dev, torch.int64)
        assert ids_t.shape[0] == T and rows_t.shape[0] == B
        return cls(
            mode=mode,
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=loc_t,
            req_pool_indices=rows_t,
            seq_lens=seq_t.to(torch.int32),
            prefix_lens=pre_t.to(torch.int32),
            extend_lens=ext_t.to(torch.int32),
            extend_start_loc=start_t.to(torch.int32),
            req_to_token=req_to_token,
            logits_indices=logit_t,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
            prefix_groups=prefix_groups,
        )
