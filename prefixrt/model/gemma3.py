"""Gemma-3 text decoder (Gemma3ForCausalLM; the text half of Gemma3ForConditionalGeneration).

Differences from Llama, all mirrored from transformers' modeling_gemma3:
  - sliding-window ("sliding_attention") and global ("full_attention") layers per `layer_types`, each kind
    with its own RoPE (local base `rope_local_base_freq`, global `rope_theta` + optional scaling);
  - per-head q/k RMSNorm; scores scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5;
  - (1 + weight) RMSNorm, four per layer (input, post-attention, pre- and post-feedforward);
  - embeddings multiplied by sqrt(hidden_size) rounded to the model dtype; tied lm_head;
  - gelu_pytorch_tanh MLP; optional final logit soft-capping.
transformers ignores `attn_logit_softcapping` for Gemma-3 (its attention never passes it), so do we.
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
    GemmaRMSNorm,
    Linear,
    MergedLinear,
    RopeConfig,
    RotaryEmbedding,
    hf_rope_parameters,
    rope_and_attend,
)

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config:
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
    query_pre_attn_scalar: float
    layer_types: tuple[str, ...]  # SLIDING or FULL, per layer
    sliding_window: int
    local_rope: RopeConfig  # sliding layers
    global_rope: RopeConfig  # full-attention layers
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        bad = set(self.layer_types) - {SLIDING, FULL}
        if bad:
            raise ValueError(f"unknown Gemma-3 layer types {sorted(bad)}")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    def sliding_window_of(self, layer_id: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    @classmethod
    def from_hf(cls, hf_config) -> Gemma3Config:
        """From a gemma3_text config (or a gemma3 config's text_config), 4.x or 5.x spelling."""
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma-3 with use_bidirectional_attention is not supported")
        num_layers = hf_config.num_hidden_layers
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        max_pos = hf_config.max_position_embeddings

        layer_types = getattr(hf_config, "layer_types", None)
        if not layer_types:
            pattern = getattr(hf_config, "sliding_window_pattern", 6)
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]

        params = hf_rope_parameters(hf_config)
        if SLIDING in params or FULL in params:  # transformers 5.x: nested by layer type
            local_params, global_params = params.get(SLIDING), params.get(FULL)
        else:  # legacy: rope_theta (+ rope_scaling) is global; the local base has its own field
            global_params = params
            local_params = {"rope_theta": getattr(hf_config, "rope_local_base_freq", None) or 10000.0}

        def rope(p, default_theta: float) -> RopeConfig:
            return RopeConfig.from_parameters(
                p, head_dim=head_dim, default_theta=default_theta, max_position_embeddings=max_pos
            )

        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            hidden_act=getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh",
            max_position_embeddings=max_pos,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            layer_types=tuple(layer_types),
            sliding_window=int(hf_config.sliding_window),
            local_rope=rope(local_params, 10000.0),
            global_rope=rope(global_params, 1_000_000.0),
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            eos_token_ids=eos_ids_from_hf(hf_config),
        )


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int):
        super().__init__()
        h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.is_sliding = config.layer_types[layer_id] == SLIDING
        self.qkv_proj = MergedLinear(
            config.hidden_size, [h * d, kvh * d, kvh * d], ["q_proj", "k_proj", "v_proj"], bias=config.attention_bias
        )
        self.o_proj = Linear(h * d, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.layer = AttentionLayer(
            layer_id=layer_id,
            num_heads=h,
            num_kv_heads=kvh,
            head_dim=d,
            scaling=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window_of(layer_id),
        )
        self.fused = False  # set by layers.use_fused_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:  # x: [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (h + 2 kvh) * d]
        out = rope_and_attend(attn, self.layer, qkv, cos, sin, batch, self.q_norm, self.k_norm, self.fused)
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x: the previous block's (post-normed) output [T, hidden], the embeddings at layer 0 with residual
        None; residual: the stream before it. Returns (this layer's post-normed MLP output, the stream before
        it), like LlamaDecoderLayer: the sums are formed by the next pre-norm (fused on the Triton path)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, batch, attn))
        h, residual = self.pre_feedforward_layernorm.add_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: Gemma3Config):
        super().__init__(
            vocab_size=config.vocab_size,
            max_context=config.max_position_embeddings,
            eos_token_ids=config.eos_token_ids,
            tie_word_embeddings=config.tie_word_embeddings,
        )
        self.config = config
        self.model = Gemma3TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.local_rotary = RotaryEmbedding(config.local_rope)
        self.global_rotary = RotaryEmbedding(config.global_rope)
        self.attention_layers = [layer.self_attn.layer for layer in self.model.layers]
        self.tie_weights()

    def embed_scale(self) -> float:
        """sqrt(hidden_size) rounded to the weights' dtype, as transformers multiplies it in that dtype."""
        dtype = self.model.embed_tokens.weight.dtype
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=dtype))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        return self.model.embed_tokens(batch.input_ids) * self.embed_scale()

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(batch)  # [T, hidden]
        local_cos, local_sin = self.local_rotary(batch.positions)  # [T, head_dim] each
        global_cos, global_sin = self.global_rotary(batch.positions)
        residual = None
        ready = batch.kv_ready
        for i, layer in enumerate(self.model.layers):
            if ready is not None:
                ready.wait(i)  # layer i's K/V loads (host tier) are done before its attention reads the pool
            if layer.self_attn.is_sliding:
                x, residual = layer(x, residual, local_cos, local_sin, batch, attn)
            else:
                x, residual = layer(x, residual, global_cos, global_sin, batch, attn)
        idx = batch.logits_indices  # norm is per token, so select first
        x, _ = self.model.norm.add_norm(x[idx], residual[idx] if residual is not None else None)  # [L, hidden]
        logits = self.lm_head(x).float()  # [L, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
