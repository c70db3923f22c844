"""AdapterRegistry: the LoRA adapters an engine serves, by name, each checked against the model and packed on the
host in the layout of a GPU slot (PackedAdapter), so a load is three copies per projection.

Names are looked up from callers' threads (Engine.prepare) and changed on the loop thread (load / unload): a lock
guards the table. Nothing here touches the GPU slots (slots.py does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from prefixrt.lora.peft_format import LoraAdapter
from prefixrt.model.lora import FUSED_INTO, LoraWeights

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@+")


@dataclass
class PackedAdapter:
    """An adapter's host copy laid out as one slot of every projection it may touch: per (layer, fused linear),
    (A [num_shards * R, in], B [out, R], scale [num_shards]); projections it does not target hold zeros. (The
    adapter's own per-module tensors are not kept: this is its one host copy.)"""

    name: str
    digest: str  # its identity in cache keys (peft_format.py)
    rank: int
    path: str | None
    parts: list[tuple[LoraWeights, torch.Tensor, torch.Tensor, torch.Tensor]]

    def copy_into(self, slot: int) -> None:
        """Write this adapter into `slot` of every projection (on the current stream / thread; non-blocking from
        pinned memory on CUDA)."""
        for weights, a, b, scale in self.parts:
            weights.a[slot].copy_(a, non_blocking=True)
            weights.b[slot].copy_(b, non_blocking=True)
            weights.scale[slot].copy_(scale, non_blocking=True)


def target_dims(linears: dict[tuple[int, str], LoraWeights]) -> dict[str, tuple[int, int]]:
    """target module -> (in, out) features of the model's slotted projections (what an adapter for it must have)."""
    out = {}
    for weights in linears.values():
        for shard, size in zip(weights.shard_names, weights.shard_sizes):
            out[shard] = (weights.a.shape[2], size)
    return out


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or not set(name) <= NAME_CHARS:
        raise ValueError(f"a LoRA adapter name must be 1-256 characters of letters, digits and -_.:/@+, got {name!r}")
    return name


def pack(adapter: LoraAdapter, linears: dict[tuple[int, str], LoraWeights], rank: int, pin: bool) -> PackedAdapter:
    """Check the adapter against the model's slotted projections and lay it out as a slot (ValueError naming what
    does not fit: a layer the model lacks, a target the engine has no slots for, a shape, a rank above `rank`)."""
    where = f"LoRA adapter {adapter.name!r}"
    if adapter.rank > rank:
        raise ValueError(f"{where} has rank {adapter.rank}, above the engine's max_lora_rank {rank}")
    by_linear: dict[tuple[int, str], dict[str, object]] = {}
    num_layers = 1 + max(layer for layer, _ in linears)
    for (layer, target), m in adapter.modules.items():
        fused = FUSED_INTO[target]
        if layer >= num_layers:
            raise ValueError(f"{where} targets layer {layer}; the model has {num_layers}")
        if (layer, fused) not in linears:
            raise ValueError(f"{where} targets {target}, which is not among the engine's LoRA target modules")
        by_linear.setdefault((layer, fused), {})[target] = m
    parts = []
    for key, weights in sorted(linears.items()):
        mods = by_linear.get(key, {})
        in_features = weights.a.shape[2]
        a = torch.zeros(len(weights.shard_sizes) * rank, in_features, dtype=weights.a.dtype)
        b = torch.zeros(sum(weights.shard_sizes), rank, dtype=weights.b.dtype)
        scale = torch.zeros(len(weights.shard_sizes), dtype=torch.float32)
        for i, (shard, size) in enumerate(zip(weights.shard_names, weights.shard_sizes)):
            m = mods.get(shard)
            if m is None:
                continue
            if m.a.shape[1] != in_features or m.b.shape[0] != size:
                raise ValueError(f"{where}: layer {key[0]} {shard} has lora_A {tuple(m.a.shape)} and lora_B "
                                 f"{tuple(m.b.shape)}; the model's projection is [{size}, {in_features}]")
            off = weights.shard_offset(i)
            a[i * rank:i * rank + m.rank] = m.a
            b[off:off + size, :m.rank] = m.b
            scale[i] = m.scale
        if pin:
            a, b, scale = a.pin_memory(), b.pin_memory(), scale.pin_memory()
        parts.append((weights, a, b, scale))
    return PackedAdapter(adapter.name, adapter.digest, adapter.rank, adapter.path, parts)


class AdapterRegistry:
    """name -> PackedAdapter, thread-safe. Several names may hold the same files (one digest): they share a slot and
    K/V."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_name: dict[str, PackedAdapter] = {}

    def get(self, name: str) -> PackedAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def add(self, packed: PackedAdapter) -> None:
        with self._lock:
            if packed.name in self._by_name:
                raise ValueError(f"a LoRA adapter named {packed.name!r} is already loaded (unload it first)")
            self._by_name[packed.name] = packed

    def remove(self, name: str) -> PackedAdapter:
        with self._lock:
            return self._by_name.pop(name)

    def shares_digest(self, digest: str) -> bool:
        with self._lock:
            return any(p.digest == digest for p in self._by_name.values())
