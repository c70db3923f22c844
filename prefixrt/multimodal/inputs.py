"""A request's images as the loop sees them, and the encoder-output cache.

The prompt a request carries (Req.prompt_ids) is its radix key: text positions hold token ids (ints), and the
j-th placeholder of an image holds `(ImageKey, j)`. A tuple never equals an int, and two image positions are
equal only when their full sha256 digests and offsets are equal, so equal images share K/V and different ones
never do, whatever a hash table does with their hashes. The model still sees `image_token_id` there
(`model_ids`); the encoder outputs come from EncoderCache, keyed by the same ImageKeys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixrt.multimodal.processor import ImageKey, ProcessedImage

DEFAULT_ENCODER_CACHE_IMAGES = 256


@dataclass
class ReqImages:
    """The images of one request: each one's placeholder run [start, end) in the prompt, key and pixels (kept
    for as long as the request lives: a retracted or evicted prefix may need the encoder again)."""

    image_token_id: int
    blocks: list[tuple[int, int]]
    images: list[ProcessedImage]
    bidirectional: bool  # an image's tokens attend to each other both ways: a prefill chunk never splits one

    def chunk_end(self, start: int, n: int) -> int:
        """How many of the n tokens from `start` a prefill chunk may take without splitting an image block
        (bidirectional models): the chunk ends before a block it would cut, or, when a block starts at or
        before `start`, at that block's end (which may exceed n)."""
        if not self.bidirectional:
            return n
        end = start + n
        for a, b in self.blocks:
            if a < end < b:
                return a - start if a > start else b - start
        return n


def keyed_prompt(ids: list[int], blocks: list[tuple[int, int]], images: list[ProcessedImage]) -> list:
    """The radix key of a prompt: ids with each image's placeholders replaced by (its key, offset)."""
    if len(blocks) != len(images):
        raise ValueError(f"{len(blocks)} image blocks for {len(images)} images")
    out: list = list(ids)
    for (a, b), image in zip(blocks, images):
        out[a:b] = [(image.key, j) for j in range(b - a)]
    return out


def model_ids(tokens: list, image_token_id: int) -> list[int]:
    """The ids the model embeds for a slice of a keyed prompt."""
    return [t if t.__class__ is int else image_token_id for t in tokens]


class EncoderCache:
    """Encoder outputs by ImageKey, least recently used out first (capacity in images; 0 = keep nothing).
    Counts hits, and images encoded."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], capacity: int = DEFAULT_ENCODER_CACHE_IMAGES):
        self.encode = encode  # pixels [N, C, H, W] -> [N, tokens, hidden]
        self.capacity = capacity
        self._entries: OrderedDict[ImageKey, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.encoded = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """The encoder output of each image, encoding the missing ones in one batch (equal images once)."""
        out: dict[ImageKey, torch.Tensor] = {}
        missing: dict[ImageKey, ProcessedImage] = {}
        for image in images:
            hit = self._entries.get(image.key)
            if hit is not None:
                self._entries.move_to_end(image.key)
                out[image.key] = hit
                self.hits += 1
            elif image.key not in missing:
                missing[image.key] = image
        if missing:
            embeds = self.encode(torch.stack([m.pixels for m in missing.values()]))
            self.encoded += len(missing)
            for key, emb in zip(missing, embeds):
                out[key] = emb
                if self.capacity > 0:
                    self._entries[key] = emb
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return [out[image.key] for image in images]

    def clear(self) -> None:
        self._entries.clear()
