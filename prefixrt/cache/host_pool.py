"""HostKVPool: the host tier's K/V tensor and its page allocator. Knows nothing about requests or the tree.

Page-first layout: one tensor kv[slot] = [num_layers, 2 (K, V), num_kv_heads, head_dim], so all of one token's
K/V (every layer) is contiguous and a run of consecutive host slots is one contiguous block: a copy between the
tiers is one DMA per run of slots, whatever the number of layers (the device pool is layer-first, see
cache/transfer.py for the scatter). On CUDA the tensor is page-locked in place (cudaHostRegister on a plain
allocation: torch's pinned allocator rounds every allocation up to a power of two, which turns an 80 GB tier
into 128 GB); on the CPU it is an ordinary tensor. Its size is checked against the machine's available memory
before anything is allocated (check_host_memory): a tier that does not fit is refused with one line naming
what is available, never left to the OOM killer. Host page 0 is never handed out (PageAllocator's rule), which
keeps slot numbers comparable with the device pool's.
"""

from __future__ import annotations

import os
import weakref

import torch

from prefixrt.cache.allocator import AllocatorSizes, PageAllocator
from prefixrt.cache.kv_pool import byte_view

GIB = 2**30


def available_host_bytes() -> tuple[int, int]:
    """(bytes this process may still allocate, the machine's total): MemAvailable from /proc/meminfo, capped by
    the cgroup's memory limit (containers) when one is set. Falls back to (total, total) where unknown."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = info.get("MemAvailable", total)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < total:
            avail = min(avail, int(limit) - usage)
        break
    return max(0, avail), total


def host_reserve_bytes(total: int) -> int:
    """Host memory a tier may not take: the rest of the process (weights while loading, the server) and the OS."""
    return max(4 * GIB, total // 10)


def check_host_memory(num_bytes: int, what: str, per_token: int) -> None:
    """Raise ValueError (one line) if num_bytes of host memory for `what` would not fit in what the machine has
    available, less host_reserve_bytes. per_token: bytes a token takes, to say how many would fit."""
    avail, total = available_host_bytes()
    usable = avail - host_reserve_bytes(total)
    if num_bytes > usable:
        fits = max(0, usable) // per_token
        raise ValueError(
            f"{what} needs {num_bytes / GIB:.1f} GiB of host memory but this machine has {avail / GIB:.1f} GiB "
            f"available of {total / GIB:.1f} GiB ({host_reserve_bytes(total) / GIB:.1f} GiB kept back): at most "
            f"{fits} tokens fit")


def _register(t: torch.Tensor) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of the {t.numel() * t.element_size() / GIB:.1f} GiB host KV tier failed "
                           f"(error {int(rc)})")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostKVPool(AllocatorSizes):
    def __init__(self, num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 page_size: int, pin: bool):
        num_slots = (num_tokens // page_size + 1) * page_size  # + the reserved page 0
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.pinned = pin
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        check_host_memory(num_slots * self.bytes_per_token, f"a host KV tier of {num_tokens} tokens",
                          self.bytes_per_token)
        shape = (num_slots, num_layers, 2, num_kv_heads, head_dim)
        # Every slot is written before it is read: no fill, so the OS maps pages as they are first used (pinning
        # maps them all at once).
        self.kv = torch.empty(shape, dtype=dtype)
        self._unpin = None
        if pin:
            _register(self.kv)
            # Unpinned before the memory goes, at close() or when the pool is collected, whichever comes first.
            self._unpin = weakref.finalize(self, _unregister, self.kv)
        self.allocator = PageAllocator(num_slots, page_size)

    def read(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of host slots, each [num_layers, len(slots), num_kv_heads, head_dim] (copies)."""
        block = self.kv.index_select(0, torch.tensor(slots, dtype=torch.int64))  # [n, layers, 2, kvh, d]
        return block[:, :, 0].transpose(0, 1).contiguous(), block[:, :, 1].transpose(0, 1).contiguous()

    def write(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V ([num_layers, len(slots), num_kv_heads, head_dim]) into host slots."""
        block = torch.stack((k, v), dim=2).transpose(0, 1).to(self.dtype)  # [n, layers, 2, kvh, d]
        byte_view(self.kv).index_copy_(0, torch.tensor(slots, dtype=torch.int64), byte_view(block))

    def poison(self, slots: list[int]) -> None:
        """Debug aid: NaN into freed host slots, so a load of a stale host copy shows up in the output."""
        if not slots or not self.dtype.is_floating_point:
            return
        self.kv[torch.tensor(slots, dtype=torch.int64)] = float("nan")

    def close(self) -> None:
        """Unpin (CUDA; idempotent); the memory goes with the tensor."""
        if self._unpin is not None:
            self._unpin()
