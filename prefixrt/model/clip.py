"""CLIP vision encoder (transformers' CLIPVisionModel), as LLaVA uses it: a hidden state of one encoder layer.

Pixels -> patch embeddings (a strided conv, no bias) with a class token prepended + learned position
embeddings -> pre-LayerNorm ("pre_layrnorm", transformers' spelling) -> encoder layers as SigLIP's (siglip.py)
-> the hidden state after `num_layers + feature_layer + 1` layers for a negative feature_layer. post_layernorm
is loaded but not applied (LLaVA reads a hidden state, not the pooled output).
"""

from __future__ import annotations

import torch
from torch import nn

from prefixrt.model.siglip import SiglipEncoder, SiglipVisionConfig


class ClipEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2 + 1, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, 1 + P, hidden]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class ClipVisionModel(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_state(self, pixels: torch.Tensor, layer: int) -> torch.Tensor:
        """transformers' hidden_states[layer] ([N, 1 + patches, hidden]): 0 is the embeddings after
        pre_layrnorm, i the output of encoder layer i; negative counts from the end (-1: the last layer)."""
        size = self.config.image_size
        if tuple(pixels.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"pixel values of shape {tuple(pixels.shape)}; the vision tower takes "
                             f"[N, {self.config.num_channels}, {size}, {size}]")
        count = layer if layer >= 0 else len(self.encoder.layers) + 1 + layer
        if not 0 <= count <= len(self.encoder.layers):
            raise ValueError(f"vision feature layer {layer} of a {len(self.encoder.layers)}-layer tower")
        x = self.pre_layrnorm(self.embeddings(pixels))
        for block in self.encoder.layers[:count]:
            x = block(x)
        return x
