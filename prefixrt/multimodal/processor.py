"""The model's transformers image processor (read from its folder's preprocessor_config.json, offline), and
the image records a request carries: pixel values with their content key (ImageKey, a record of request.py:
the cache's tiers store it with the K/V)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixrt.multimodal.images import ImageLimits, image_hash, load_images
from prefixrt.request import ImageKey


@dataclass(frozen=True)
class ProcessedImage:
    key: ImageKey
    pixels: torch.Tensor  # [C, H, W] float32, as the model's processor makes them


class ImageProcessor:
    """Wraps a transformers image processor: PIL images -> pixel values, and their content keys."""

    def __init__(self, hf_processor, limits: ImageLimits = ImageLimits()):
        self.hf = hf_processor
        self.limits = limits
        # Every setting that changes the pixels the model sees is in this string, so it is in every key.
        settings = hf_processor.to_dict() if hasattr(hf_processor, "to_dict") else {}
        self.settings = type(hf_processor).__name__ + json.dumps(settings, sort_keys=True, default=str)

    @classmethod
    def from_folder(cls, path: str | Path, limits: ImageLimits = ImageLimits()) -> ImageProcessor:
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(str(path), local_files_only=True), limits)

    def process(self, sources, param: str = "images") -> list[ProcessedImage]:
        """Decode (see images.load_image) and process images; raises InvalidRequest for bad ones."""
        images = load_images(sources, self.limits, param)
        if not images:
            return []
        keys = [ImageKey(image_hash(image, self.settings)) for image in images]
        pixels = self.hf(images=images, return_tensors="pt")["pixel_values"]  # [N, C, H, W]
        if pixels.shape[0] != len(images):
            raise ValueError(f"the image processor made {pixels.shape[0]} crops of {len(images)} images; "
                             "one crop per image is supported (no pan-and-scan)")
        return [ProcessedImage(k, p.float()) for k, p in zip(keys, pixels)]
