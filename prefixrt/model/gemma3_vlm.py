"""Gemma-3 with images (Gemma3ForConditionalGeneration): the Gemma-3 decoder, a SigLIP vision tower and the
multimodal projector, mirrored from transformers' modeling_gemma3.

An image becomes `mm_tokens_per_image` soft tokens: the tower's patch states are average-pooled to a square of
tokens, RMS-normed ((1 + weight), the vision eps) and projected to the text width; they replace the (scaled)
embeddings of the image placeholder tokens, unscaled. The prompt carries each image as
[boi] + [image token] * mm_tokens_per_image + [eoi]; the image tokens of one image attend to each other in both
directions (ForwardBatch.mm.spans), everything else stays causal (sliding layers also keep their window).
Unlike Gemma3ForCausalLM, the logits are not soft-capped (transformers' class does not apply it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.base import eos_ids_from_hf
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.gemma3 import Gemma3Config, Gemma3ForCausalLM
from prefixrt.model.layers import GemmaRMSNorm
from prefixrt.model.siglip import SiglipVisionConfig, SiglipVisionModel
from prefixrt.model.vision import VisionSpec, embed_with_images


@dataclass(frozen=True)
class Gemma3VLMConfig:
    text: Gemma3Config
    vision: SiglipVisionConfig
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    def __post_init__(self):
        side = int(round(self.mm_tokens_per_image**0.5))
        if side * side != self.mm_tokens_per_image or self.vision.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides "
                             f"the {self.vision.patches_per_side} patches per side")

    @classmethod
    def from_hf(cls, hf_config) -> Gemma3VLMConfig:
        text = Gemma3Config.from_hf(hf_config.text_config)
        if not text.eos_token_ids:  # multimodal configs keep it at the top level
            text = dataclasses.replace(text, eos_token_ids=eos_ids_from_hf(hf_config))
        # transformers' Gemma3ForConditionalGeneration never soft-caps its logits (its text config may ask to)
        text = dataclasses.replace(text, final_logit_softcapping=None)

        def token(name: str, legacy: str) -> int:
            value = getattr(hf_config, name, None)
            return int(value if value is not None else getattr(hf_config, legacy))

        return cls(
            text=text,
            vision=SiglipVisionConfig.from_hf(hf_config.vision_config),
            mm_tokens_per_image=int(hf_config.mm_tokens_per_image),
            image_token_id=token("image_token_id", "image_token_index"),
            boi_token_id=token("boi_token_id", "boi_token_index"),
            eoi_token_id=token("eoi_token_id", "eoi_token_index"),
        )


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Gemma3VLMConfig):
        super().__init__()
        vision_hidden = config.vision.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, config.text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, config.vision.layer_norm_eps)
        self.patches_per_side = config.vision.patches_per_side
        self.kernel = self.patches_per_side // int(round(config.mm_tokens_per_image**0.5))

    def forward(self, states: torch.Tensor) -> torch.Tensor:  # [N, patches, vh] -> [N, tokens, text hidden]
        n, _, vh = states.shape
        side = self.patches_per_side
        grid = states.transpose(1, 2).reshape(n, vh, side, side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(states)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Checkpoint names: the text model's (`model.`, `lm_head.`), `vision_tower.` and `multi_modal_projector.`
    (hub/loader.py maps transformers' multimodal spellings to these)."""

    def __init__(self, config: Gemma3VLMConfig):
        super().__init__(config.text)
        self.vlm_config = config
        self.vision_tower = SiglipVisionModel(config.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.vision = VisionSpec(
            image_token_id=config.image_token_id,
            tokens_per_image=config.mm_tokens_per_image,
            begin_token_id=config.boi_token_id,
            end_token_id=config.eoi_token_id,
            bidirectional=True,
        )
        self.vision_runs = 0  # images through the vision tower so far (one per image)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values [N, C, H, W] from the model's image processor -> soft tokens [N, tokens_per_image,
        hidden] in the model's dtype."""
        dtype = self.model.embed_tokens.weight.dtype
        with torch.inference_mode():
            states = self.vision_tower(pixels.to(self.model.embed_tokens.weight.device, dtype))
            out = self.multi_modal_projector(states)
        self.vision_runs += int(pixels.shape[0])
        return out

    def embed(self, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        # the placeholders' scaled embeddings are replaced by the (unscaled) image embeddings
        return embed_with_images(self.model.embed_tokens, batch, self.vlm_config.image_token_id, self.embed_scale())
