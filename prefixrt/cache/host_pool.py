"""HostKVPool: the host tier's K/V tensors and their page allocator. Knows nothing about requests or the tree.

Same layout as KVPool (k_buffers[l][s]: [num_kv_heads, head_dim]) so a copy between the tiers is one index
copy per layer. On CUDA the tensors are pinned (page-locked), so host<->device copies are asynchronous DMA;
on the CPU they are a second set of ordinary tensors. Host page 0 is never handed out (PageAllocator's rule),
which keeps slot numbers comparable with the device pool's.
"""

from __future__ import annotations

import torch

from prefixrt.cache.allocator import PageAllocator


class HostKVPool:
    def __init__(self, num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 page_size: int, pin: bool):
        num_slots = (num_tokens // page_size + 1) * page_size  # + the reserved page 0
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.pinned = pin
        shape = (num_slots, num_kv_heads, head_dim)

        def make():  # pinned: allocated page-locked directly (no pageable copy); every slot is written before read
            return torch.empty(shape, dtype=dtype, pin_memory=True) if pin else torch.zeros(shape, dtype=dtype)

        self.k_buffers = [make() for _ in range(num_layers)]
        self.v_buffers = [make() for _ in range(num_layers)]
        self.allocator = PageAllocator(num_slots, page_size)
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def total_tokens(self) -> int:
        return self.allocator.total_tokens

    @property
    def free_tokens(self) -> int:
        return self.allocator.free_tokens

    def poison(self, slots: list[int]) -> None:
        """Debug aid: NaN into freed host slots, so a load of a stale host copy shows up in the output."""
        if not slots or not self.dtype.is_floating_point:
            return
        idx = torch.tensor(slots, dtype=torch.int64)
        for kb, vb in zip(self.k_buffers, self.v_buffers):
            kb[idx] = float("nan")
            vb[idx] = float("nan")
