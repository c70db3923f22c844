"""cache/kv_setup.py's pool sizing: an explicit kv_cache_tokens the GPU cannot hold is refused with what fits."""

from __future__ import annotations

import pytest
import torch

from prefixrt.cache.kv_setup import ACTIVATION_RESERVE_BYTES, check_pool_fits, pool_slots
from prefixrt.config.engine_config import CacheSettings

GIB = 2**30


def test_a_pool_that_fits_passes_and_one_that_does_not_names_what_fits():
    per_token = 128 * 1024  # Llama-3-8B's bf16 K/V per token
    free = 30 * GIB
    room_tokens = (free - ACTIVATION_RESERVE_BYTES) // per_token
    check_pool_fits(room_tokens, per_token, free, page_size=16)  # exactly the room: fits
    with pytest.raises(ValueError) as e:
        check_pool_fits(548_275 + 16, per_token, free, page_size=16)
    msg = str(e.value)
    assert "kv_cache_tokens=548275 needs 66.9 GiB" in msg and "30.0 GiB free" in msg
    fits = int(msg.split("at most kv_cache_tokens=")[1].split(" ")[0])
    assert fits % 16 == 0 and (fits + 16) * per_token <= free - ACTIVATION_RESERVE_BYTES
    assert (fits + 32) * per_token > free - ACTIVATION_RESERVE_BYTES - 16 * per_token  # the largest that fits


def test_the_cpu_pool_takes_kv_cache_tokens_as_given():
    settings = CacheSettings(kv_cache_tokens=1 << 24, page_size=16)  # no free-memory check on the CPU
    assert pool_slots(settings, 128 * 1024, torch.device("cpu")) == (1 << 24) + 16
