"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector and a Llama-family text
model (Llama, Mistral, Qwen2, Qwen3), mirrored from transformers' modeling_llava.

An image is one hidden state of the tower (`vision_feature_layer`), without its class token under the
"default" select strategy, projected by linear -> activation -> linear to the text width; those embeddings
replace the prompt's image placeholder tokens (`image_token_id`, one per patch). Attention stays causal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.base import eos_ids_from_hf
from prefixrt.model.clip import ClipVisionModel
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.llama import LlamaConfig, LlamaForCausalLM
from prefixrt.model.siglip import SiglipVisionConfig, activation
from prefixrt.model.vision import VisionSpec, embed_with_images


@dataclass(frozen=True)
class LlavaConfig:
    text: LlamaConfig
    vision: SiglipVisionConfig
    image_token_id: int
    feature_layer: int
    select_strategy: str  # "default" (drop the class token) | "full"
    projector_act: str
    projector_bias: bool

    def __post_init__(self):
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {self.select_strategy!r}")

    @property
    def tokens_per_image(self) -> int:
        return self.vision.patches_per_side**2 + (1 if self.select_strategy == "full" else 0)

    @classmethod
    def from_hf(cls, hf_config, text_architecture: str) -> LlavaConfig:
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):
            raise NotImplementedError("LLaVA with several vision feature layers is not supported")
        text = LlamaConfig.from_hf(hf_config.text_config, text_architecture)
        if not text.eos_token_ids:
            text = dataclasses.replace(text, eos_token_ids=eos_ids_from_hf(hf_config))
        vision_hf = hf_config.vision_config
        if getattr(vision_hf, "model_type", "clip_vision_model") != "clip_vision_model":
            raise NotImplementedError(f"LLaVA with a {vision_hf.model_type} vision tower is not supported")
        image_id = getattr(hf_config, "image_token_id", None)
        return cls(
            text=text,
            vision=SiglipVisionConfig.from_hf(vision_hf),
            image_token_id=int(image_id if image_id is not None else hf_config.image_token_index),
            feature_layer=int(layer),
            select_strategy=hf_config.vision_feature_select_strategy,
            projector_act=hf_config.projector_hidden_act,
            projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
        )


class LlavaProjector(nn.Module):
    def __init__(self, config: LlavaConfig):
        super().__init__()
        hidden = config.text.hidden_size
        self.linear_1 = nn.Linear(config.vision.hidden_size, hidden, bias=config.projector_bias)
        self.act = activation(config.projector_act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=config.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """Checkpoint names: the text model's (`model.`, `lm_head.`), `vision_tower.` and `multi_modal_projector.`
    (hub/loader.py maps transformers' multimodal spellings to these)."""

    def __init__(self, config: LlavaConfig):
        super().__init__(config.text)
        self.llava_config = config
        self.vision_tower = ClipVisionModel(config.vision)
        self.multi_modal_projector = LlavaProjector(config)
        self.vision = VisionSpec(
            image_token_id=config.image_token_id,
            tokens_per_image=config.tokens_per_image,
            begin_token_id=None,
            end_token_id=None,
            bidirectional=False,
        )
        self.vision_runs = 0  # images through the vision tower so far

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values [N, C, H, W] -> image embeddings [N, tokens_per_image, hidden] in the model's dtype."""
        weight = self.model.embed_tokens.weight
        with torch.inference_mode():
            states = self.vision_tower.hidden_state(pixels.to(weight.device, weight.dtype),
                                                    self.llava_config.feature_layer)
            if self.llava_config.select_strategy == "default":
                states = states[:, 1:]
            out = self.multi_modal_projector(states)
        self.vision_runs += int(pixels.shape[0])
        return out

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        return embed_with_images(self.model.embed_tokens, batch, self.llava_config.image_token_id)
