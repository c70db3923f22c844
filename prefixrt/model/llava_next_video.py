"""LLaVA-NeXT-Video (LlavaNextVideoForConditionalGeneration) with videos as frames, mirrored from transformers'
modeling_llava_next_video.

A video is a list of frames; each frame goes through the CLIP tower on its own (`vision_feature_layer`, class
token dropped), its patch grid is pooled by `spatial_pool_stride` (average or max, the checkpoint's
`spatial_pool_mode`) and projected to the text width, giving (patches_per_side // stride)^2 embeddings that
replace that many video placeholder tokens. A frame's tokens depend on that frame alone, so the engine treats
each frame as an image of its own: its own content key (equal frames of two videos share K/V and encoder output)
and its own block of placeholders, the frames' blocks adjacent. Attention stays causal. The checkpoint's
any-resolution image path (image_newline, image crops) is not used: images sent to this model are one-frame
videos.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from prefixrt.model.llava import LlavaConfig, LlavaForConditionalGeneration
from prefixrt.model.vision import VisionSpec


@dataclass(frozen=True)
class LlavaNextVideoConfig:
    llava: LlavaConfig  # its image_token_id is the video placeholder
    pool_mode: str  # "average" | "max"
    pool_stride: int

    @property
    def tokens_per_frame(self) -> int:
        return (self.llava.vision.patches_per_side // self.pool_stride) ** 2

    @classmethod
    def from_hf(cls, hf_config, text_architecture: str) -> LlavaNextVideoConfig:
        mode = getattr(hf_config, "spatial_pool_mode", "average")
        if mode not in ("average", "max"):
            raise NotImplementedError(f"LLaVA-NeXT-Video with spatial_pool_mode {mode!r} is not supported")
        if hf_config.vision_feature_select_strategy != "default":
            raise NotImplementedError("LLaVA-NeXT-Video needs vision_feature_select_strategy 'default'")
        llava = LlavaConfig.from_hf(hf_config, text_architecture)
        video_id = getattr(hf_config, "video_token_id", None)
        video_id = int(video_id if video_id is not None else hf_config.video_token_index)
        return cls(dataclasses.replace(llava, image_token_id=video_id), mode, int(hf_config.spatial_pool_stride))


class LlavaNextVideoForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA's checkpoint names (`model.`, `lm_head.`, `vision_tower.`, `multi_modal_projector.`); the
    checkpoint's image_newline is not loaded (hub/loader.py)."""

    def __init__(self, config: LlavaNextVideoConfig):
        super().__init__(config.llava)
        self.video_config = config
        pool = nn.AvgPool2d if config.pool_mode == "average" else nn.MaxPool2d
        self.pool = pool(kernel_size=config.pool_stride, stride=config.pool_stride)
        self.vision = VisionSpec(
            image_token_id=config.llava.image_token_id,
            tokens_per_image=config.tokens_per_frame,
            begin_token_id=None,
            end_token_id=None,
            bidirectional=False,
        )

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Frames [N, C, H, W] -> frame embeddings [N, tokens_per_frame, hidden] in the model's dtype."""
        weight = self.model.embed_tokens.weight
        with torch.inference_mode():
            states = self.vision_tower.hidden_state(pixels.to(weight.device, weight.dtype),
                                                    self.llava_config.feature_layer)[:, 1:]
            n, patches, dim = states.shape
            side = self.llava_config.vision.patches_per_side
            grid = states.view(n, side, side, dim).permute(0, 3, 1, 2)
            pooled = self.pool(grid).flatten(2).transpose(1, 2)  # [N, tokens_per_frame, dim]
            out = self.multi_modal_projector(pooled)
        self.vision_runs += int(pixels.shape[0])
        return out
