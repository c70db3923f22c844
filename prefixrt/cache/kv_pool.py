"""KVPool: the paged K/V tensors themselves. Knows nothing about requests or the radix tree.

Slot s of layer l holds one token's K and V: k_buffers[l][s] has shape [num_kv_heads, head_dim]; k_buffers[l] is
k_all[l], a view of one [num_layers, num_slots, num_kv_heads, head_dim] tensor (v likewise).
Slot 0 is a padding slot: never handed out by the allocator, so padded batch entries (CUDA graphs) may
write to it harmlessly. Page p covers slots [p * page_size, (p + 1) * page_size).

`dtype` is the storage dtype. An FP8 pool (torch.float8_e4m3fn, `kv_cache_dtype="fp8_e4m3"`) stores K / k_scale and
V / v_scale rounded to e4m3, with one float32 scale per layer and kv head (`k_scales`, `v_scales` [num_layers,
num_kv_heads]): K ~= k_all[l] * k_scales[l][None, :, None]. The scales are constants of the pool, set once before any
K/V is written (`set_scales`: from the checkpoint, or calibrated at start-up, model/kv_calibration.py) and never
changed afterwards, so the same K/V always becomes the same bytes: a slot's bytes are the whole of its state, and
copies to other tiers (host, disk, another engine) move those bytes as they are, in `dtype`, and need no per-slot
scale. Readers dequantize (`read`; the Triton kernels take the per-layer scales, `kv_scales`).
"""

from __future__ import annotations

import hashlib

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value; larger values saturate
# kv_cache_dtype names (EngineConfig) -> storage dtype; "auto" stores K/V in the model's dtype
KV_CACHE_DTYPES = {"fp8_e4m3": FP8_KV_DTYPE}


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
        # FP8: per-layer, per-kv-head scales (1.0 until set_scales; see the module docstring), None otherwise.
        self.quantized = dtype == FP8_KV_DTYPE
        scales_shape = (num_layers, num_kv_heads)
        self.k_scales = torch.ones(scales_shape, dtype=torch.float32, device=self.device) if self.quantized else None
        self.v_scales = torch.ones(scales_shape, dtype=torch.float32, device=self.device) if self.quantized else None
        self.scales_source: str | None = None  # "checkpoint" | "calibrated" once set

    def set_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor, source: str) -> None:
        """Set an FP8 pool's scales ([num_layers, num_kv_heads] each, positive, finite), in place (kernels and CUDA
        graphs keep reading the same tensors). Call once, before any K/V is written: K/V stored under other scales
        would be read wrongly. Raises ValueError for a float pool or bad scales."""
        if not self.quantized:
            raise ValueError(f"a {self.dtype} KV pool has no scales")
        for name, t in (("k", k_scales), ("v", v_scales)):
            t = torch.as_tensor(t, dtype=torch.float32)
            if t.shape != self.k_scales.shape or not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name} scales must be positive and finite, shape {tuple(self.k_scales.shape)}; "
                                 f"got {tuple(t.shape)}")
            (self.k_scales if name == "k" else self.v_scales).copy_(t)
        self.scales_source = source

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of one layer ([num_kv_heads] float32 views), or (None, None) for a float pool."""
        if not self.quantized:
            return None, None
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def scales_digest(self) -> str:
        """A short digest of the scales ('' for a float pool): K/V bytes mean the same only under the same scales."""
        if not self.quantized:
            return ""
        data = torch.cat((self.k_scales, self.v_scales)).cpu().numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:16]

    def close(self) -> None:
        """Free the K/V tensors (the pool is unusable afterwards)."""
        self.k_buffers, self.v_buffers = [], []
        self.k_all = self.v_all = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V (quantized with the layer's scales in an FP8 pool). slots: [T] int64; k, v: [T, num_kv_heads,
        head_dim]."""
        if self.quantized:
            k = _quantize(k, self.k_scales[layer_id])
            v = _quantize(v, self.v_scales[layer_id])
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the given slots as float32 [n, num_kv_heads, head_dim], dequantized in an FP8 pool."""
        k = self.k_buffers[layer_id][slots].float()
        v = self.v_buffers[layer_id][slots].float()
        if self.quantized:
            k = k * self.k_scales[layer_id][None, :, None]
            v = v * self.v_scales[layer_id][None, :, None]
        return k, v

    def poison(self, slots: torch.Tensor) -> None:
        """Debug aid: fill freed slots with NaN so a read-after-free shows up in the output."""
        if slots.numel() == 0 or not self.dtype.is_floating_point:
            return
        self.k_all[:, slots] = float("nan")
        self.v_all[:, slots] = float("nan")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as uint8 (the same storage), other tensors as they are: copies by index (index_copy_) are not
    implemented for float8 types, and a copy between tiers moves the bytes unchanged anyway."""
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, KVH, D] -> e4m3 of x / scale (scale [KVH]), saturating; kernels/fp8_reference.quantize_kv is the same."""
    return (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
