"""Transformers oracle for the embedded Gemma-3-270M: the prompts and greedy continuations the engine is held to
(docs/design.md, invariant 1: fp32 on CPU, greedy, token-identical)."""

from __future__ import annotations

MAX_NEW_TOKENS = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In 1969, the first humans landed on",
    "def fibonacci(n):\n",
    # A chat prompt rendered with the registry's template. This is a base model: it mostly echoes the
    # question instead of answering, but the prompt exercises the turn tokens.
    [{"role": "user", "content": "Name three primary colors."}],
]


def load_reference(model_path: str):
    """(tokenizer, model): transformers' tokenizer and fp32 CPU model with eager attention, from the folder only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    return tokenizer, model


def greedy(tokenizer, model, prompts, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations (new token ids only) of a loaded reference (load_reference).

    A string prompt is encoded with the tokenizer's BOS; a message list is rendered with the chat template
    (which already starts with BOS). Generation stops early on a generation_config eos (<eos>,
    <end_of_turn>).
    """
    import torch

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


def greedy_reference(model_path: str, prompts, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations (new token ids only) from transformers, fp32 on CPU with eager attention (see greedy)."""
    return greedy(*load_reference(model_path), prompts, max_new_tokens)
