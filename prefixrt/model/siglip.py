"""SigLIP vision encoder (transformers' SiglipVisionModel without the pooling head), as Gemma-3 uses it.

Pixels [N, C, H, W] -> patch embeddings (a strided conv) + learned position embeddings -> pre-LayerNorm
encoder layers with full (non-causal) attention -> post LayerNorm. Checkpoint names follow transformers
(`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`, `post_layernorm`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, hf_config) -> SiglipVisionConfig:
        if getattr(hf_config, "vision_use_head", False):
            raise NotImplementedError("a SigLIP vision tower with a pooling head is not supported")
        return cls(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_channels=getattr(hf_config, "num_channels", 3),
            image_size=hf_config.image_size,
            patch_size=hf_config.patch_size,
            layer_norm_eps=hf_config.layer_norm_eps,
            hidden_act=getattr(hf_config, "hidden_act", "gelu_pytorch_tanh"),
        )


def activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise NotImplementedError(f"vision activation {name!r} is not supported")


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, P, hidden]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, hidden]
        n, p, d = x.shape
        h = self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, p, h, d // h).transpose(1, 2)  # [N, h, P, d/h]

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = (q.float() @ k.float().transpose(-1, -2)) * (d // h) ** -0.5
        out = torch.softmax(scores, dim=-1) @ v.float()  # [N, h, P, d/h]
        return self.out_proj(out.to(x.dtype).transpose(1, 2).reshape(n, p, d))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))


class SiglipVisionModel(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, patches, hidden]
        size = self.config.image_size
        if tuple(pixels.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"pixel values of shape {tuple(pixels.shape)}; the vision tower takes "
                             f"[N, {self.config.num_channels}, {size}, {size}]")
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
