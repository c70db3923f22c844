"""Shared fixtures: tiny transformers checkpoints, a tiny byte-level tokenizer, and engines built on them.

Every engine made through `make_engine` is checked at teardown: idle, kv_free + kv_evictable == kv_total,
kv_locked == 0, and the internal accounting (free + cached + private == total) holds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "prefix caching reuses the key value cache of shared prompts; radix trees index token sequences. "
    "Question: what is the capital of France? Answer: Paris. {\"name\": \"value\", \"items\": [1, 2, 3]} "
) * 4


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE with 320 ids (matching the tiny checkpoints' vocab): <pad>=0, <bos>=1, <eos>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert len(fast) <= 320
    return fast


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) for every architecture, built once per session."""
    from model.checkpoints import save_tiny_checkpoint

    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{name}")
            cache[name] = (path, save_tiny_checkpoint(name, path))
        return cache[name]

    return get


def assert_idle_and_clean(engine) -> None:
    engine.wait_idle()
    s = engine.stats()
    assert s.requests_running == 0 and s.requests_waiting == 0
    assert s.kv_free + s.kv_evictable == s.kv_total, s
    assert s.kv_locked == 0, s
    engine.check_integrity()


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
