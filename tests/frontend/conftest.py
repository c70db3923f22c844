"""Frontend fixtures: a tiny llama with a 1024-token context (programs render longer prompts than the
shared 128-token checkpoints allow), checked for KV accounting at teardown like `make_engine`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.engines import assert_idle_and_clean


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import tiny_config

    cfg = tiny_config("llama")
    cfg.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("ckpt-llama-1k")
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture
def make_frontend_engine(long_checkpoint, tiny_tokenizer):
    """make_frontend_engine(**engine_kwargs) -> Engine on the 1k-context tiny llama (CPU, fp32)."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    engines = []

    def make(**kwargs):
        path, _ = long_checkpoint
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name="tiny-llama-1k", revision="test", extra_eos_token_ids=(), path=str(path))
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("debug", True)
        kwargs.setdefault("kv_cache_tokens", 8192)
        eng = Engine("tiny-llama-1k", _parts=(model, tiny_tokenizer, resolved), **kwargs)
        engines.append(eng)
        return eng

    yield make
    try:
        for eng in engines:
            assert_idle_and_clean(eng)
    finally:
        for eng in engines:
            eng.shutdown()
