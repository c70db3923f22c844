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

from dataclasses import dataclass, field

import torch
from torch import nn

from prefixrt.model.attention.base import AttentionBackend
from prefixrt.model.base import eos_ids_from_hf
from prefixrt.model.decoder import DecoderAttention, DecoderDims, DecoderLM, DecoderStack, dims_from_hf
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.layers import GatedMLP, GemmaRMSNorm, RopeConfig, RotaryEmbedding, hf_rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config(DecoderDims):
    query_pre_attn_scalar: float
    layer_types: tuple[str, ...]  # SLIDING or FULL, per layer
    sliding_window: int
    local_rope: RopeConfig  # sliding layers
    global_rope: RopeConfig  # full-attention layers
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = field(default=True, kw_only=True)  # Gemma-3 ties lm_head to the embeddings

    def __post_init__(self):
        super().__post_init__()
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
        dims = dims_from_hf(hf_config, "hidden_activation", "gelu_pytorch_tanh")
        num_layers, head_dim, max_pos = dims["num_layers"], dims["head_dim"], dims["max_position_embeddings"]

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
            **dims,
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


class Gemma3Attention(DecoderAttention):
    def __init__(self, config: Gemma3Config, layer_id: int):
        super().__init__(
            config, layer_id, scaling=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window_of(layer_id), qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, qk_norm=GemmaRMSNorm,
        )
        self.is_sliding = config.layer_types[layer_id] == SLIDING


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
        return self.post_feedforward_layernorm(self.mlp(h, batch.lora)), residual


class Gemma3ForCausalLM(DecoderLM):
    def __init__(self, config: Gemma3Config):
        layers = [Gemma3DecoderLayer(config, i) for i in range(config.num_layers)]
        super().__init__(config, DecoderStack(config, layers, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)))
        self.local_rotary = RotaryEmbedding(config.local_rope)
        self.global_rotary = RotaryEmbedding(config.global_rope)

    def embed_scale(self) -> float:
        """sqrt(hidden_size) rounded to the weights' dtype, as transformers multiplies it in that dtype."""
        dtype = self.model.embed_tokens.weight.dtype
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=dtype))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        return self.model.embed_tokens(batch.input_ids) * self.embed_scale()

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(batch)  # [T, hidden]
        local = self.local_rotary(batch.positions)  # (cos, sin), [T, head_dim] each
        full = self.global_rotary(batch.positions)
        rope = [local if layer.self_attn.is_sliding else full for layer in self.model.layers]
        x = self.run_layers(x, rope, batch, attn)  # [L, hidden]
        logits = self.lm_head(x).float()  # [L, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
