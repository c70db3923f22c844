"""KVPool: the paged K/V tensors themselves. Knows nothing about requests or the radix tree.

Slot s of layer l holds one token's K and V: k_buffers[l][s] has shape [num_kv_heads, head_dim]; k_buffers[l] is
k_all[l], a view of one [num_layers, num_slots, num_kv_heads, head_dim] tensor (v likewise).
Slot 0 is a padding slot: never handed out by the allocator, so padded batch entries (CUDA graphs) may
write to it harmlessly. Page p covers slots [p * page_size, (p + 1) * page_size).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Random-ish init rather than zeros would hide nothing; zeros are fine because every slot is
        # written before it is read (a freed slot can be poisoned with NaN in debug mode, see poison()).
        # One tensor per K and V over all layers (k_all[l] is layer l's buffer): a copy of some slots across every
        # layer (the host tier's, cache/transfer.py) is then one indexed op, not one per layer.
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_buffers = list(self.k_all.unbind(0))
        self.v_buffers = list(self.v_all.unbind(0))

    def close(self) -> None:
        """Free the K/V tensors (the pool is unusable afterwards)."""
        self.k_buffers, self.v_buffers = [], []
        self.k_all = self.v_all = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V. slots: [T] int64; k, v: [T, num_kv_heads, head_dim]."""
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def poison(self, slots: torch.Tensor) -> None:
        """Debug aid: fill freed slots with NaN so a read-after-free shows up in the output."""
        if slots.numel() == 0 or not self.dtype.is_floating_point:
            return
        self.k_all[:, slots] = float("nan")
        self.v_all[:, slots] = float("nan")
