"""Llama-family decoder: Llama (incl. Llama-3.1 rope scaling), Mistral, Qwen2, Qwen3.

The four differ only in switches captured by LlamaConfig: q/k/v (and o) biases, per-head q/k RMSNorm
(Qwen3), and sliding-window layers (Mistral; Qwen2/3 with use_sliding_window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.base import CausalLM, eos_ids_from_hf
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.layers import (
    GatedMLP,
    Linear,
    MergedLinear,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    hf_rope_parameters,
    rope_and_attend,
)

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.rope.head_dim != self.head_dim:
            raise ValueError("rope head_dim must equal head_dim")

    @classmethod
    def from_hf(cls, hf_config, architecture: str) -> LlamaConfig:
        """From a transformers config of one of LLAMA_ARCHITECTURES (4.x or 5.x spelling)."""
        if architecture not in LLAMA_ARCHITECTURES:
            raise ValueError(f"{architecture} is not a Llama-family architecture")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_layers = hf_config.num_hidden_layers
        max_pos = hf_config.max_position_embeddings
        rope = RopeConfig.from_parameters(
            hf_rope_parameters(hf_config), head_dim=head_dim, default_theta=10000.0, max_position_embeddings=max_pos
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
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            max_position_embeddings=max_pos,
            rope=rope,
            sliding_windows=windows,
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids_from_hf(hf_config),
        )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int):
        super().__init__()
        h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [h * d, kvh * d, kvh * d], ["q_proj", "k_proj", "v_proj"], bias=config.qkv_bias
        )
        self.o_proj = Linear(h * d, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.layer = AttentionLayer(
            layer_id=layer_id,
            num_heads=h,
            num_kv_heads=kvh,
            head_dim=d,
            scaling=d**-0.5,
            sliding_window=config.sliding_windows[layer_id],
        )
        self.fused = False  # set by layers.use_fused_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:  # x: [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (h + 2 kvh) * d]
        out = rope_and_attend(attn, self.layer, qkv, cos, sin, batch, self.q_norm, self.k_norm, self.fused)
        return self.o_proj(out)


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
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaConfig):
        super().__init__(
            vocab_size=config.vocab_size,
            max_context=config.max_position_embeddings,
            eos_token_ids=config.eos_token_ids,
            tie_word_embeddings=config.tie_word_embeddings,
        )
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope)
        self.attention_layers = [layer.self_attn.layer for layer in self.model.layers]
        self.tie_weights()

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        return self.model.embed_tokens(batch.input_ids)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(batch)  # [T, hidden]
        cos, sin = self.rotary(batch.positions)  # [T, head_dim] each
        residual = None
        ready = batch.kv_ready
        for i, layer in enumerate(self.model.layers):
            if ready is not None:
                ready.wait(i)  # layer i's K/V loads (host tier) are done before its attention reads the pool
            x, residual = layer(x, residual, cos, sin, batch, attn)
        idx = batch.logits_indices  # norm is per token, so select first
        x, _ = self.model.norm.add_norm(x[idx], residual[idx] if residual is not None else None)  # [L, hidden]
        return self.lm_head(x).float()  # [L, vocab]
