"""Shared fixtures: tiny transformers checkpoints, a tiny byte-level tokenizer, and engines built on them.

Every engine made through `make_engine` is checked at teardown: idle, kv_free + kv_evictable == kv_total,
kv_locked == 0, and the internal accounting (free + cached + private == total) holds.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.helpers.engines import assert_idle_and_clean, make_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE with 320 ids (matching the tiny checkpoints' vocab): <pad>=0, <bos>=1, <eos>=2."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) for every architecture, built once per session."""
    from tests.helpers.checkpoints import save_tiny_checkpoint

    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{name}")
            cache[name] = (path, save_tiny_checkpoint(name, path))
        return cache[name]

    return get


@pytest.fixture
def make_engine(tiny_checkpoints, tiny_tokenizer):
    """make_engine(arch="llama", **engine_kwargs) -> Engine on a tiny checkpoint (CPU, fp32)."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    engines = []

    def make(arch: str = "llama", **kwargs):
        path, _ = tiny_checkpoints(arch)
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name=f"tiny-{arch}", revision="test", extra_eos_token_ids=(), path=str(path))
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("debug", True)
        kwargs.setdefault("kv_cache_tokens", 4096)
        if os.environ.get("PREFIXRT_TEST_CACHE_AUDIT"):  # e.g. 1.0: audit cache hits in every engine test
            kwargs.setdefault("cache_audit_rate", float(os.environ["PREFIXRT_TEST_CACHE_AUDIT"]))
        eng = Engine(f"tiny-{arch}", _parts=(model, tiny_tokenizer, resolved), **kwargs)
        engines.append(eng)
        return eng

    yield make
    try:
        for eng in engines:
            assert_idle_and_clean(eng)
    finally:
        for eng in engines:
            eng.shutdown()
