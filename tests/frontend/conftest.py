"""Frontend fixtures: a tiny llama with a 1024-token context (programs render longer prompts than the
shared 128-token checkpoints allow), checked for KV accounting at teardown like `make_engine`."""

from __future__ import annotations

import pytest

from tests.helpers.engines import check_and_shut_down, tiny_llama_1k


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
    engines = []

    def make(**kwargs):
        eng = tiny_llama_1k(long_checkpoint, tiny_tokenizer, **kwargs)
        engines.append(eng)
        return eng

    yield make
    check_and_shut_down(*engines)
