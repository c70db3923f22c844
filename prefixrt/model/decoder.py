"""The decoder-only skeleton the model families share (Llama-family, Gemma-3).

A family keeps what makes it different (its config switches, norms, layer body, embedding scale, logit
post-processing) and takes from here: the dimensions every config carries and their transformers spelling,
the fused q/k/v attention block, the embed/layers/norm stack and the causal-LM shell that runs the layers.
Module and attribute names follow transformers' checkpoints, so weight loading stays generic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.base import CausalLM
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.layers import Linear, MergedLinear, RMSNorm, rope_and_attend
from prefixrt.model.lora import with_lora


@dataclass(frozen=True)
class DecoderDims:
    """The dimensions every decoder config starts with; families add their own fields after these (the two
    keyword-only ones stay last)."""

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
    tie_word_embeddings: bool = field(default=False, kw_only=True)
    eos_token_ids: tuple[int, ...] = field(default=(), kw_only=True)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


def dims_from_hf(hf_config, act_field: str, default_act: str) -> dict:
    """DecoderDims' fields from a transformers config (4.x or 5.x spelling), as keyword arguments.
    act_field: where the family keeps its MLP activation (`hidden_act`, `hidden_activation`)."""
    num_heads = hf_config.num_attention_heads
    return dict(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=getattr(hf_config, act_field, None) or default_act,
        max_position_embeddings=hf_config.max_position_embeddings,
    )


class DecoderAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, RoPE, attention over the pool, output projection."""

    def __init__(
        self, dims: DecoderDims, layer_id: int, *, scaling: float, sliding_window: int | None,
        qkv_bias: bool, o_bias: bool, qk_norm: Callable[[int, float], RMSNorm] | None,
    ):  # fmt: skip
        super().__init__()
        h, kvh, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.qkv_proj = MergedLinear(
            dims.hidden_size, [h * d, kvh * d, kvh * d], ["q_proj", "k_proj", "v_proj"], bias=qkv_bias
        )
        self.o_proj = Linear(h * d, dims.hidden_size, bias=o_bias)
        self.q_norm = qk_norm(d, dims.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(d, dims.rms_norm_eps) if qk_norm else None
        self.layer = AttentionLayer(layer_id, h, kvh, d, scaling, sliding_window)
        self.fused = False  # set by layers.use_fused_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:  # x: [T, hidden] -> [T, hidden]
        qkv = with_lora(self.qkv_proj, x, batch.lora)  # [T, (h + 2 kvh) * d]
        out = rope_and_attend(attn, self.layer, qkv, cos, sin, batch, self.q_norm, self.k_norm, self.fused)
        return with_lora(self.o_proj, out, batch.lora)


class DecoderStack(nn.Module):
    """transformers' `model.`: embed_tokens, layers, the final norm."""

    def __init__(self, dims: DecoderDims, layers: Sequence[nn.Module], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(CausalLM):
    """A CausalLM over a DecoderStack whose layers are called as layer(x, residual, cos, sin, batch, attn)
    and return (their output, the residual stream before it); the sums are formed by the next pre-norm."""

    def __init__(self, config: DecoderDims, model: DecoderStack):
        super().__init__(
            vocab_size=config.vocab_size,
            max_context=config.max_position_embeddings,
            eos_token_ids=config.eos_token_ids,
            tie_word_embeddings=config.tie_word_embeddings,
        )
        self.config = config
        self.model = model
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention_layers = [layer.self_attn.layer for layer in model.layers]
        self.tie_weights()

    def run_layers(
        self, x: torch.Tensor, rope_of_layer: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """x: the embeddings [T, hidden]; rope_of_layer[i]: layer i's (cos, sin) [T, head_dim].
        Returns the final-normed hidden states of the rows batch.logits_indices [L, hidden]."""
        residual = None
        ready = batch.kv_ready
        for i, layer in enumerate(self.model.layers):
            if ready is not None:
                ready.wait(i)  # layer i's K/V loads (host tier) are done before its attention reads the pool
            cos, sin = rope_of_layer[i]
            x, residual = layer(x, residual, cos, sin, batch, attn)
        idx = batch.logits_indices  # norm is per token, so select first
        x, _ = self.model.norm.add_norm(x[idx], residual[idx] if residual is not None else None)
        return x
