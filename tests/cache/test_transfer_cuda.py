"""The host tier's CUDA copy path (cache/transfer.py): page-first host runs by DMA through a staging buffer, one
scatter / gather per K/V over every layer of the pool. GPU only (the CPU copier is exercised everywhere else).

Random K/V in scattered pool slots goes to fragmented host slots and back into other pool slots, in several
staging chunks; the result must be bit-identical, and nothing outside the target slots may change.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backup_then_load_round_trips_bit_exact_across_chunks(dtype, monkeypatch):
    from prefixrt.cache import transfer as T
    from prefixrt.cache.host_pool import HostKVPool
    from prefixrt.cache.kv_pool import KVPool

    layers, kvh, d, n = 5, 2, 64, 700
    pool = KVPool(4096, layers, kvh, d, dtype, "cuda")
    host = HostKVPool(2048, layers, kvh, d, dtype, page_size=1, pin=True)
    monkeypatch.setattr(T, "STAGING_BYTES", 97 * host.bytes_per_token)  # several chunks, a ragged last one
    xfer = T.KVTransfer(pool, host)
    rng = random.Random(0)
    src = rng.sample(range(1, 2048), n)  # scattered pool slots
    dst = rng.sample(range(2048, 4096), n)
    hs = sorted(rng.sample(range(1, 2049), n))  # host slots in runs of assorted lengths
    pool.k_all.normal_()
    pool.v_all.normal_()
    before = (pool.k_all.clone(), pool.v_all.clone())
    xfer.backup(src, hs).wait()
    k_host, v_host = host.read(hs)
    src_t = torch.tensor(src, device="cuda")
    assert torch.equal(k_host, pool.k_all[:, src_t].cpu()) and torch.equal(v_host, pool.v_all[:, src_t].cpu())
    xfer.load(hs, dst).wait()
    dst_t = torch.tensor(dst, device="cuda")
    assert torch.equal(pool.k_all[:, dst_t], before[0][:, src_t])
    assert torch.equal(pool.v_all[:, dst_t], before[1][:, src_t])
    untouched = torch.ones(4096, dtype=torch.bool, device="cuda")
    untouched[dst_t] = False
    assert torch.equal(pool.k_all[:, untouched], before[0][:, untouched])
    xfer.close()


def test_pinned_host_tier_is_registered_at_its_exact_size():
    from prefixrt.cache.host_pool import HostKVPool

    host = HostKVPool(1000, 3, 2, 16, torch.bfloat16, page_size=16, pin=True)
    assert host.kv.numel() * host.kv.element_size() == host.num_slots * host.bytes_per_token
    assert host.kv.is_pinned()  # page-locked in place (cudaHostRegister)
    host.close()
    assert not host.kv.is_pinned()
