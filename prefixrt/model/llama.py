"""Llama-family decoder: Llama (incl. Llama-3.1 rope scaling), Mistral, Qwen2, Qwen3.

The four differ only in switches captured by LlamaConfig: q/k/v (and o) biases, per-head q/k RMSNorm
(Qwen3), and sliding-window layers (Mistral; Qwen2/3 with use_sliding_window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.attention.base import AttentionBackend
from prefixrt.model.base import eos_ids_from_hf
from prefixrt.model.decoder import DecoderAttention, DecoderDims, DecoderLM, DecoderStack, dims_from_hf
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.layers import GatedMLP, RMSNorm, RopeConfig, RotaryEmbedding, hf_rope_parameters

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class LlamaConfig(DecoderDims):
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE

    def __post_init__(self):
        super().__post_init__()
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.rope.head_dim != self.head_dim:
            raise ValueError("rope head_dim must equal head_dim")

    @classmethod
    def from_hf(cls, hf_config, architecture: str) -> LlamaConfig:
        """From a transformers config of one of LLAMA_ARCHITECTURES (4.x or 5.x spelling)."""
        if architecture not in LLAMA_ARCHITECTURES:
            raise ValueError(f"{architecture} is not a Llama-family architecture")
        dims = dims_from_hf(hf_config, "hidden_act", "silu")
        num_layers = dims["num_layers"]
        rope = RopeConfig.from_parameters(
            hf_rope_parameters(hf_config), head_dim=dims["head_dim"], default_theta=10000.0,
            max_position_embeddings=dims["max_position_embeddings"],
        )

        window = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "use_sliding_window", True) is False:
            window = None  # Qwen2/3 carry a window size they do not use
        layer_types = getattr(hf_config, "layer_types", None)
        if window is None:
            windows: tuple[int | None, ...] = (None,) * num_layers
        elif layer_types and architecture != "MistralForCausalLM":  # transformers' Mistral windows every layer
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * num_layers

        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            **dims,
            rope=rope,
            sliding_windows=windows,
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids_from_hf(hf_config),
        )


class LlamaAttention(DecoderAttention):
    def __init__(self, config: LlamaConfig, layer_id: int):
        super().__init__(
            config, layer_id, scaling=config.head_dim**-0.5, sliding_window=config.sliding_windows[layer_id],
            qkv_bias=config.qkv_bias, o_bias=config.o_bias, qk_norm=RMSNorm if config.qk_norm else None,
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x: the previous block's output [T, hidden] (the embeddings at layer 0, with residual None);
        residual: the stream before it. Returns (this layer's MLP output, the stream before it); the
        layer's result is their sum, which the next norm forms (fused with the norm on the Triton path)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos, sin, batch, attn)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h, batch.lora), residual


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config: LlamaConfig):
        layers = [LlamaDecoderLayer(config, i) for i in range(config.num_layers)]
        super().__init__(config, DecoderStack(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps)))
        self.rotary = RotaryEmbedding(config.rope)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        return self.model.embed_tokens(batch.input_ids)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(batch)  # [T, hidden]
        rope = self.rotary(batch.positions)  # (cos, sin), [T, head_dim] each
        x = self.run_layers(x, [rope] * len(self.model.layers), batch, attn)  # [L, hidden]
        return self.lm_head(x).float()  # [L, vocab]
