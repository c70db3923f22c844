"""Helpers for engine tests: the tiny byte-level tokenizer and the idle-and-clean check run at every teardown."""

from __future__ import annotations

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "prefix caching reuses the key value cache of shared prompts; radix trees index token sequences. "
    "Question: what is the capital of France? Answer: Paris. {\"name\": \"value\", \"items\": [1, 2, 3]} "
) * 4


def make_tiny_tokenizer():
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


def assert_idle_and_clean(engine) -> None:
    engine.wait_idle()
    s = engine.stats()
    assert s.requests_running == 0 and s.requests_waiting == 0
    assert s.kv_free + s.kv_evictable + s.kv_pinned == s.kv_total, s  # (kv_pinned: kept prefixes, pool alone)
    assert s.kv_locked == 0, s
    assert s.cache_audit_mismatches_total == 0, s  # cache_audit_rate > 0: recomputed K/V equals the cache
    assert s.kv_host_free + s.kv_host_cached == s.kv_host_total, s  # the host tier's idle invariant
    engine.check_integrity()


def check_and_shut_down(*engines, skip_stopped: bool = False) -> None:
    """The end of an engine fixture: each engine idle and clean (assert_idle_and_clean), then every one shut down,
    even when a check fails. skip_stopped: an engine a test already shut down (a restart test checks it itself)."""
    try:
        for eng in engines:
            if not (skip_stopped and eng._stopped):
                assert_idle_and_clean(eng)
    finally:
        for eng in engines:
            eng.shutdown()


def tiny_llama_1k(long_checkpoint, tokenizer, **options):
    """An Engine on the frontend tests' tiny llama with a 1024-token context (tests/frontend/conftest.py's
    long_checkpoint), CPU, fp32, debug checks on; options override the defaults."""
    from types import SimpleNamespace

    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    path, _ = long_checkpoint
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name="tiny-llama-1k", revision="test", extra_eos_token_ids=(), path=str(path))
    options = {"device": "cpu", "debug": True, "kv_cache_tokens": 8192, **options}
    return Engine("tiny-llama-1k", _parts=(model, tokenizer, resolved), **options)
