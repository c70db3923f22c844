"""LoRA adapters written by peft itself over the tiny checkpoints, and the peft model each one is (the oracle)."""

from __future__ import annotations

import pytest
import torch

TARGET_SETS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qv": ("q_proj", "v_proj"),
}


def write_peft_adapter(checkpoint, out, targets, rank: int = 8, alpha: float = 16, seed: int = 0, **lora_kwargs):
    """A LoRA adapter of random weights saved by peft's save_pretrained (adapter_config.json +
    adapter_model.safetensors) over the transformers checkpoint folder; returns the peft model (eval, fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        **lora_kwargs)
    model = get_peft_model(base, config)
    with torch.no_grad():  # peft's random B is small: make each adapter move the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(str(out))
    return model.eval()


@pytest.fixture(scope="session")
def peft_adapters(tiny_checkpoints, tmp_path_factory):
    """(arch, key, targets, rank, seed, extra kwargs as a tuple of pairs) -> (adapter folder, peft model), cached."""
    cache = {}

    def get(arch: str, key: str, targets=TARGET_SETS["all"], rank: int = 8, seed: int = 0, **kwargs):
        ident = (arch, key, tuple(targets), rank, seed, repr(sorted(kwargs.items())))
        if ident not in cache:
            folder = tmp_path_factory.mktemp(f"lora-{arch}-{key}")
            cache[ident] = (folder, write_peft_adapter(tiny_checkpoints(arch)[0], folder, targets, rank, seed=seed,
                                                       **kwargs))
        return cache[ident]

    return get


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
