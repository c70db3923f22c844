"""LoRA in the network: each target projection's adapter slots (LoraWeights), a forward's plan (LoraBatch), and the
update `with_lora` adds to a projection's output.

The engine gives the model a fixed number of adapter slots; every target linear holds all of them in two tensors
(A [slots, num_shards * R, in], B [slots, out, R], ranks zero-padded to R = the engine's max rank, plus a float32
scale per slot and shard), allocated once, so their addresses never change and CUDA graphs read whatever the slots
hold when replayed. Which adapter is in which slot is the engine's business (prefixrt/lora/); the model sees only
slot numbers through the forward's LoraBatch. A fused linear (q/k/v, gate/up) has one shard per projection of
the checkpoint: an adapter's q_proj, k_proj and v_proj A/B land in the shards of qkv_proj.

The update is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` for each row under a slot, the base model's rows left
as they are: the Triton kernels (kernels/lora.py) on the fused path, the torch reference (kernels/lora_reference.py)
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrt.config.engine_config import LORA_TARGET_MODULES
from prefixrt.kernels.lora_plan import EXPAND_BLOCK_N, LoraPlanLists, block_m_for, expand_tiles, plan_lists
from prefixrt.kernels.lora_reference import lora_apply as lora_apply_reference

# PEFT target module names (transformers' checkpoint names) this runtime serves, and the fused linear each lands in
TARGET_MODULES = LORA_TARGET_MODULES
FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


@dataclass
class LoraPlan:
    """A forward's LoRA plan on the device (kernels/lora_plan.py): which token rows run under which slot."""

    sorted_tokens: torch.Tensor  # [T] int32
    block_slot: torch.Tensor  # [NB] int32, -1 = padding
    block_start: torch.Tensor  # [NB] int32
    block_end: torch.Tensor  # [NB] int32
    block_m: int

    @classmethod
    def from_lists(cls, lists: LoraPlanLists, device) -> LoraPlan:
        """The plan's four lists in one host->device copy."""
        host = torch.tensor(lists.sorted_tokens + lists.block_slot + lists.block_start + lists.block_end,
                            dtype=torch.int32)
        dev = torch.device(device)
        if dev.type == "cuda":
            host = host.pin_memory()
        packed = host.to(dev, non_blocking=True)
        nt, nb = len(lists.sorted_tokens), lists.num_blocks
        tokens, slot, start, end = torch.split(packed, [nt, nb, nb, nb])
        return cls(tokens, slot, start, end, lists.block_m)

    @classmethod
    def static(cls, num_tokens: int, num_blocks: int, block_m: int, device) -> LoraPlan:
        """An all-padding plan of fixed sizes (a CUDA graph's static buffers, filled by fill())."""
        zeros = torch.zeros(num_tokens + 3 * num_blocks, dtype=torch.int32, device=device)
        tokens, slot, start, end = torch.split(zeros, [num_tokens, num_blocks, num_blocks, num_blocks])
        slot.fill_(-1)
        return cls(tokens, slot, start, end, block_m)

    def fill(self, row_slots: list[int] | None, row_lens: list[int]) -> None:
        """Write the plan of these rows into this static plan's tensors (one host->device copy); None: every block
        padding (no row under an adapter). ValueError if it needs more blocks than the plan has."""
        nb = self.block_slot.shape[0]
        if row_slots is None:
            lists = LoraPlanLists([], [-1] * nb, [0] * nb, [0] * nb, self.block_m)
        else:
            lists = plan_lists(row_slots, row_lens, self.block_m, num_blocks=nb)
        host = torch.tensor(lists.block_slot + lists.block_start + lists.block_end + lists.sorted_tokens,
                            dtype=torch.int32)
        if self.block_slot.is_cuda:
            host = host.pin_memory()
        self.block_slot.copy_(host[:nb], non_blocking=True)
        self.block_start.copy_(host[nb:2 * nb], non_blocking=True)
        self.block_end.copy_(host[2 * nb:3 * nb], non_blocking=True)
        nt = len(lists.sorted_tokens)
        self.sorted_tokens[:nt].copy_(host[3 * nb:], non_blocking=True)


@dataclass
class LoraBatch:
    """Which LoRA slot each sequence of a forward runs under (ForwardBatch.lora); the device plan is built from it on
    first use (a CUDA graph replay writes its own static plan instead, so an eager plan is never built for it).

    kernels: run the Triton kernels (the fused path on CUDA; the CPU interpreter in tests), else the torch reference.
    num_sms: the device's SM count, for the shrink's K split (0: no split)."""

    row_slots: list[int]  # per sequence: its slot, -1 = the base model
    row_lens: list[int]  # per sequence: the token rows it feeds (ForwardBatch.extend_lens_cpu)
    device: torch.device
    kernels: bool = False
    num_sms: int = 0
    plan: LoraPlan | None = None

    def device_plan(self) -> LoraPlan:
        if self.plan is None:
            lists = plan_lists(self.row_slots, self.row_lens, block_m_for(sum(self.row_lens), len(self.row_lens)))
            self.plan = LoraPlan.from_lists(lists, self.device)
        return self.plan


class LoraWeights:
    """The adapter slots of one target projection (see the module docstring). Owned by its Linear (`linear.lora`);
    written only by the engine's adapter loads (prefixrt/lora/), read by every forward with a LoraBatch."""

    def __init__(self, in_features: int, shard_names: list[str], shard_sizes: list[int], num_slots: int, rank: int,
                 dtype: torch.dtype, device):  # fmt: skip
        self.shard_names = list(shard_names)
        self.shard_sizes = list(shard_sizes)
        self.rank = rank
        n = sum(shard_sizes)
        self.a = torch.zeros(num_slots, len(shard_sizes) * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, n, rank, dtype=dtype, device=device)
        self.scale = torch.zeros(num_slots, len(shard_sizes), dtype=torch.float32, device=device)
        self.tiles = torch.tensor(expand_tiles(self.shard_sizes, EXPAND_BLOCK_N), dtype=torch.int32, device=device)

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + self.scale.nbytes

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])

    def apply(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """y (the base projection's output for x, [T, out]) with each slot row's update added; y itself, in place."""
        p = lora.device_plan()
        if lora.kernels:
            from prefixrt.kernels import lora as lora_kernels

            split = lora_kernels.shrink_split(p.block_slot.shape[0], x.shape[1], lora.num_sms, 64)
            return lora_kernels.lora_apply(x, y, self.a, self.b, self.scale, self.tiles, p.sorted_tokens,
                                           p.block_slot, p.block_start, p.block_end, p.block_m, split)
        return lora_apply_reference(x, y, self.a, self.b, self.scale, self.shard_sizes, p.sorted_tokens,
                                    p.block_slot, p.block_start, p.block_end)


def with_lora(linear, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
    """linear(x), plus the LoRA update of the rows under a slot when the forward has a plan and the linear slots."""
    y = linear(x)
    weights = getattr(linear, "lora", None)
    if lora is not None and weights is not None:
        y = weights.apply(x, y, lora)
    return y


def lora_linears(model) -> dict[tuple[int, str], object]:
    """(layer index, fused linear name) -> the Linear, for every projection LoRA can target in a decoder model
    (model.model.layers[i].self_attn.qkv_proj / o_proj, .mlp.gate_up_proj / down_proj)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers LoRA adapters can target")
    out = {}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        out[(i, "qkv_proj")] = attn.qkv_proj
        out[(i, "o_proj")] = attn.o_proj
        out[(i, "gate_up_proj")] = mlp.gate_up_proj
        out[(i, "down_proj")] = mlp.down_proj
    return out


def attach_lora_slots(model, num_slots: int, rank: int, dtype: torch.dtype, targets: tuple[str, ...] = TARGET_MODULES
                      ) -> dict[tuple[int, str], LoraWeights]:
    """Give every linear that one of `targets` lands in its adapter slots (zeros: every slot is the base model until
    written), in `dtype` (the activations': FP8 linears keep float adapters). Returns (layer, fused name) -> LoraWeights. Mutates the linears' `lora` attribute only; call before
    capturing CUDA graphs (their plans read the slots)."""
    fused = {FUSED_INTO[t] for t in targets}
    out = {}
    for (i, name), linear in lora_linears(model).items():
        if name not in fused:
            continue
        names = list(getattr(linear, "shard_names", [name]))
        sizes = list(getattr(linear, "shard_sizes", [linear.out_features]))
        linear.lora = LoraWeights(linear.in_features, names, sizes, num_slots, rank, dtype, linear.weight.device)
        out[(i, name)] = linear.lora
    return out
