"""A tiny Llama GGUF written from a tiny transformers model and the tiny byte-level tokenizer, as llama.cpp's
converter writes one (q/k rows permuted to its rotary layout, GPT-2-style BPE vocabulary): the input that
prefixrt/hub/gguf_import.py converts, small enough for a unit test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (pairs of rotary halves interleaved per head); transformers' GGUF loader undoes it."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_llama_gguf(path: Path, hf_model, tokenizer, quantize_q8_0: bool = True) -> Path:
    """Write `hf_model` (a tiny transformers LlamaForCausalLM, untied) and `tokenizer` (a byte-level BPE fast
    tokenizer) to the GGUF file `path`. quantize_q8_0: store the 2-D weights as Q8_0 blocks (so the conversion
    dequantizes, as a real checkpoint's does), else float32. Returns `path`."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * cfg.vocab_size
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t["id"] for t in spec["added_tokens"]}
    for index in range(len(vocab), cfg.vocab_size):  # ids the checkpoint has but the tokenizer never makes
        tokens[index] = f"<unused{index}>"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials or i >= len(vocab) else gguf.TokenType.NORMAL
                            for i in range(cfg.vocab_size)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for layer in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in per_layer.items():
            names[f"model.layers.{layer}.{hf_name}.weight"] = f"blk.{layer}.{gguf_name}.weight"
    for hf_name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if hf_name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if quantize_q8_0 and data.ndim == 2:
            blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(names[hf_name], blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(names[hf_name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
