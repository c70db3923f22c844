"""Tensor parallelism: the rank group, the parallel layers, and `shard_model`, the transform that splits a model.

The model files (llama.py, gemma3.py) know nothing about tensor parallelism. `shard_model(model, tp)` runs on the
meta-device model before its weights exist and swaps modules for their parallel versions, by role:

    qkv_proj      ColumnParallelLinear: this rank's query heads and its KV heads (q, k, v sliced by head)
    o_proj        RowParallelLinear:    input columns of this rank's query heads; all-reduce, then the bias
    gate_up_proj  ColumnParallelLinear: this rank's slice of the intermediate dimension, gate and up alike
    down_proj     RowParallelLinear:    the same slice of its input columns; all-reduce, then the bias
    embed_tokens  VocabParallelEmbedding: rows [start, start + vocab_per_rank); other ids give 0; all-reduce
    lm_head       ParallelLMHead:       the same rows; logits all-gathered (every rank gets [L, vocab])

and replaces each attention module's AttentionLayer by one with the local head counts, so the attention backend
and the KV pool of a rank see only its heads. KV heads: with num_kv_heads >= tp_size each rank holds
num_kv_heads / tp_size of them; with fewer KV heads than ranks each rank holds one, replicated on
tp_size / num_kv_heads ranks (the one its query heads use). Norms, rotary tables and everything else are
replicated. A linear the transform has no rule for raises, so a new architecture cannot be split wrongly.

Each parallel module says which part of a checkpoint tensor it holds (`load_part`); CausalLM.load_weights
slices every tensor with it, so a rank reads only its shard into memory.

With tp_size == 1 nothing here runs: the model keeps its plain modules (no extra op, copy or collective).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixrt.model.attention.base import AttentionLayer
from prefixrt.model.layers import GatedMLP, Linear, MergedLinear, _kernels


@dataclass
class TPGroup:
    """One rank's view of the tensor-parallel group. `group`: device collectives of the forward (NCCL on CUDA,
    gloo on the CPU); `control`: host messages from rank 0 (always gloo; the same group on the CPU).
    Collectives are called by every rank in the same order (the model's forward is the same code on all)."""

    rank: int
    size: int
    group: object = None  # torch.distributed ProcessGroup (None: the default group)
    control: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, m] per rank -> [size * n, m], rank 0's rows first."""
        import torch.distributed as dist

        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out


# --------------------------------------------------------------------------------------------- partition


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head per rank: ceil(vocab / size) (the last rank's tail is zero padding)."""
    return -(-vocab_size // size)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def first_kv_head(num_kv_heads: int, size: int, rank: int) -> int:
    """The first KV head this rank holds (replicated KV heads: the one its query heads read)."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)


def check_divisible(name: str, num_heads: int, num_kv_heads: int, intermediate: int | None, size: int) -> None:
    if num_heads % size:
        raise ValueError(f"{name}: {num_heads} attention heads cannot be split over tp_size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"{name}: {num_kv_heads} KV heads cannot be split over (or replicated on) tp_size {size}")
    if intermediate is not None and intermediate % size:
        raise ValueError(f"{name}: intermediate size {intermediate} cannot be split over tp_size {size}")


def _rows(tensor: torch.Tensor, start: int, size: int, dim: int = 0) -> torch.Tensor:
    return tensor.narrow(dim, start, size)


# ------------------------------------------------------------------------------------------------ layers


class ColumnParallelLinear(MergedLinear):
    """A MergedLinear holding, for each shard, this rank's rows of the checkpoint tensor. `parts[name]` =
    (first row, rows) of the shard's checkpoint tensor [out, in] this rank holds; the local shard sizes are the
    row counts. The output stays split (each rank has its columns): no collective."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int]], bias: bool):
        super().__init__(in_features, [n for _, n in parts.values()], list(parts), bias=bias)
        self.parts = dict(parts)

    def load_part(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        start, size = self.parts[shard]
        return _rows(tensor, start, size)


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W_local^T) + bias: W_local is this rank's input columns [start, start + in)
    of the checkpoint's [out, in_total]; the bias (whole, replicated) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, column_start: int):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.column_start = column_start

    def load_part(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        if kind == "bias":
            return tensor
        return _rows(tensor, self.column_start, self.in_features, dim=1)

    def _finish(self, partial: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self.gemv_plan.get(x.shape[0]) if x.dim() == 2 else None
        if config is not None:
            return self._finish(_kernels().gemv(x, self.weight, None, config))
        return self._finish(F.linear(x, self.weight))

    def forward_gated(self, gate_up: torch.Tensor, config, act: str) -> torch.Tensor:
        return self._finish(_kernels().gemv(gate_up, self.weight, None, config, act_input=act))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + rows) of the vocabulary; ids outside give zeros, and the all-reduce over the
    ranks puts each id's row together (exactly: one rank contributes it, the others add zeros)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.rows = vocab_per_rank(vocab_size, tp.size)
        self.start = tp.rank * self.rows
        self.vocab_size = vocab_size
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def load_part(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        return _vocab_rows(tensor, self.start, self.rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] -> [T, dim]
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """The LM head over this rank's vocabulary rows (the embedding's, when tied); forward returns the whole
    logits [L, vocab] on every rank (all-gathered, padding columns dropped)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        rows = vocab_per_rank(vocab_size, tp.size)
        super().__init__(dim, rows, bias=False)
        self.start = tp.rank * rows
        self.vocab_size = vocab_size
        self.tp = tp

    def load_part(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        return _vocab_rows(tensor, self.start, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [L, dim] -> [L, vocab]
        local = super().forward(x)  # [L, rows]
        gathered = self.tp.all_gather_rows(local.t())  # [size * rows, L]: rank r's vocabulary rows r*rows...
        return gathered[: self.vocab_size].t()


def _vocab_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a [vocab, dim] tensor, zero-padded past the vocabulary's end."""
    end = min(start + rows, tensor.shape[0])
    part = tensor[start:end]
    if part.shape[0] == rows:
        return part
    pad = torch.zeros((rows - part.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([part, pad])


# --------------------------------------------------------------------------------------------- transform


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Split a freshly built model (on the meta device, no weights yet) for rank tp.rank of tp.size; see the module
    docstring. Mutates and returns the model; raises ValueError when a dimension does not split and
    NotImplementedError for a linear without a rule. With tp.size == 1 it returns the model unchanged."""
    if tp.size == 1:
        return model
    size, rank = tp.size, tp.rank
    replaced: set[int] = set()
    for name, module in list(model.named_modules()):
        layer = getattr(module, "layer", None)
        if isinstance(layer, AttentionLayer) and hasattr(module, "qkv_proj"):
            h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
            check_divisible(name, h, kvh, None, size)
            h_local, kvh_local = h // size, kv_heads_per_rank(kvh, size)
            kv_start = first_kv_head(kvh, size, rank) * d
            old = module.qkv_proj
            module.qkv_proj = ColumnParallelLinear(old.in_features, {
                "q_proj": (rank * h_local * d, h_local * d),
                "k_proj": (kv_start, kvh_local * d),
                "v_proj": (kv_start, kvh_local * d),
            }, bias=old.bias is not None)
            o = module.o_proj
            module.o_proj = RowParallelLinear(h_local * d, o.out_features, o.bias is not None, tp, rank * h_local * d)
            module.layer = dataclasses.replace(layer, num_heads=h_local, num_kv_heads=kvh_local)
            replaced.update((id(module.qkv_proj), id(module.o_proj)))
        elif isinstance(module, GatedMLP):
            inter = module.intermediate_size
            check_divisible(name, size, size, inter, size)
            local = inter // size
            old = module.gate_up_proj
            module.gate_up_proj = ColumnParallelLinear(old.in_features, {
                "gate_proj": (rank * local, local), "up_proj": (rank * local, local),
            }, bias=old.bias is not None)
            down = module.down_proj
            module.down_proj = RowParallelLinear(local, down.out_features, down.bias is not None, tp, rank * local)
            module.intermediate_size = local
            replaced.update((id(module.gate_up_proj), id(module.down_proj)))
    inner = model.model
    vocab, dim = inner.embed_tokens.weight.shape
    inner.embed_tokens = VocabParallelEmbedding(vocab, dim, tp)
    model.lm_head = ParallelLMHead(vocab, dim, tp)
    replaced.update((id(inner.embed_tokens), id(model.lm_head)))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module) not in replaced:
            raise NotImplementedError(f"tensor parallelism has no rule for {name} ({type(module).__name__})")
    layers = [m.layer for m in model.modules() if isinstance(getattr(m, "layer", None), AttentionLayer)]
    model.attention_layers = sorted(layers, key=lambda a: a.layer_id)
    model.tp = tp
    model.tie_weights()
    return model
