"""The KV memory an engine runs on, built from its CacheSettings (config/engine_config.py): the pool's size for the
device, the pool, and KVManager over the allocator, the request table and the prefix cache (with its host and
disk tiers when configured).

engine/builder.py calls these in order: `pool_slots` (the ranks of a tensor-parallel engine agree on the
smallest), `KVPool(...)`, then `make_kv_manager`. parallel/tp_worker.py sizes the other ranks' pools with
`pool_slots` too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.block import BlockCache
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.no_reuse import NoReuseCache
from prefixrt.cache.radix import RadixCache
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.config.engine_config import CacheSettings

CPU_DEFAULT_KV_TOKENS = 16384  # the pool of a CPU engine without kv_cache_tokens
ACTIVATION_RESERVE_BYTES = 2 << 30  # GPU memory kept out of the KV pool for activations and graphs


def pool_slots(settings: CacheSettings, bytes_per_token: int, device: torch.device) -> int:
    """KV pool slots (a multiple of the page size, the padding page included) for this device: kv_cache_tokens,
    else what mem_fraction of the GPU leaves, else the CPU default. A kv_cache_tokens the GPU cannot hold is a
    ValueError that names what fits (not a CUDA out-of-memory error halfway through the build)."""
    if settings.kv_cache_tokens is not None:
        num_slots = settings.kv_cache_tokens + settings.page_size  # + the reserved padding page
        if device.type == "cuda":
            check_pool_fits(num_slots, bytes_per_token, torch.cuda.mem_get_info(device)[0], settings.page_size)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        spare = total * settings.mem_fraction - (total - free) - ACTIVATION_RESERVE_BYTES
        num_slots = max(int(spare // bytes_per_token), 4 * settings.page_size)
    else:
        num_slots = CPU_DEFAULT_KV_TOKENS + settings.page_size
    return num_slots // settings.page_size * settings.page_size


def check_pool_fits(num_slots: int, bytes_per_token: int, free_bytes: int, page_size: int) -> None:
    """ValueError when a pool of num_slots needs more than the GPU's free memory less the activations' reserve."""
    room = free_bytes - ACTIVATION_RESERVE_BYTES
    if num_slots * bytes_per_token > room:
        fits = max(int(room // bytes_per_token) // page_size * page_size - page_size, 0)
        raise ValueError(
            f"kv_cache_tokens={num_slots - page_size} needs {num_slots * bytes_per_token / 2**30:.1f} GiB of KV; "
            f"the GPU has {free_bytes / 2**30:.1f} GiB free after the weights, {ACTIVATION_RESERVE_BYTES / 2**30:.0f} "
            f"GiB of it kept for activations: at most kv_cache_tokens={fits} fits (or leave it unset: mem_fraction "
            f"sizes the pool)")


def make_kv_manager(settings: CacheSettings, pool: KVPool, table: ReqToTokenTable, say,
                    kv_identity: Callable[[], str]) -> KVManager:
    """KVManager over `pool` and `table`: the page allocator and the prefix cache the settings ask for (none, the
    hash-block table, the radix tree, or the radix tree over a host tier and a disk tier). kv_identity: what disk
    files must have been computed with to be reused (called only with a disk tier)."""
    allocator = PageAllocator(pool.num_slots, settings.page_size)
    if settings.radix_cache and settings.host_kv_cache_tokens:
        cache = make_tiered_cache(settings, pool, allocator, say, kv_identity)
    elif not settings.radix_cache:
        cache = NoReuseCache(allocator)
    elif settings.prefix_cache == "block":
        cache = BlockCache(allocator)
    else:
        cache = RadixCache(allocator)
        cache.supports_insert_below = settings.radix_insert_below  # False: the reference path (an ablation)
    if settings.max_cached_fraction_per_salt is not None and isinstance(cache, RadixCache):
        cache.set_salt_quota(int(settings.max_cached_fraction_per_salt * allocator.total_tokens))
    if settings.debug and type(cache) in (RadixCache, BlockCache):  # (the tiered cache frees through KVManager)
        cache.on_evict = lambda slots: pool.poison(torch.tensor(slots, device=pool.device))
    return KVManager(pool, allocator, table, cache, debug=settings.debug,
                     max_pinned_fraction=settings.max_pinned_fraction,
                     max_pinned_fraction_per_salt=settings.max_pinned_fraction_per_salt)


def make_tiered_cache(settings: CacheSettings, pool: KVPool, allocator: PageAllocator, say,
                      kv_identity: Callable[[], str]):
    """The radix tree over the pool and a host tier of host_kv_cache_tokens tokens (pinned on CUDA); with
    kv_disk_dir, a disk tier below it."""
    from prefixrt.cache.host_pool import HostKVPool
    from prefixrt.cache.tiered_radix import TieredRadixCache
    from prefixrt.cache.transfer import KVTransfer

    host = HostKVPool(settings.host_kv_cache_tokens, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype,
                      settings.page_size, pin=pool.device.type == "cuda")
    say(f"host KV tier: {host.total_tokens} tokens ({host.total_tokens * host.bytes_per_token / 2**30:.2f} GiB"
        f"{', pinned' if host.pinned else ''}), {settings.host_kv_write_policy}")
    transfer = KVTransfer(pool, host, delay_s=settings.host_kv_debug_delay_s, debug=settings.debug)
    if settings.kv_disk_dir is not None:
        from prefixrt.cache.disk_radix import DiskTieredRadixCache
        from prefixrt.cache.disk_store import DiskKVStore

        disk = DiskKVStore(settings.kv_disk_dir, kv_identity(), int(settings.kv_disk_max_gb * 2**30),
                           pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, settings.page_size)
        say(f"disk KV tier: {settings.kv_disk_dir} (cap {settings.kv_disk_max_gb:g} GiB), {disk.cached_tokens} tokens "
            f"in {disk.num_files} files found")
        return DiskTieredRadixCache(allocator, host, transfer, policy=settings.host_kv_write_policy,
                                    write_threshold=settings.host_kv_write_threshold, debug=settings.debug, disk=disk)
    return TieredRadixCache(allocator, host, transfer, policy=settings.host_kv_write_policy,
                            write_threshold=settings.host_kv_write_threshold, debug=settings.debug)
