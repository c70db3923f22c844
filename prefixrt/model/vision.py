"""What a vision-language model tells the engine about images, and how a forward's image inputs are laid out.

A prompt holds each image as a block of placeholder tokens (VisionSpec.image_block); the model's encoder turns
the image into one embedding per placeholder. `multimodal_batch` maps the placeholders that a forward computes
to rows of its flat token list and, for models whose image tokens attend both ways, lists the image blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrt.model.forward_batch import MultimodalBatch


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a model's images: how a prompt holds one, and how its tokens attend."""

    image_token_id: int  # the placeholder each image token carries in the prompt
    tokens_per_image: int
    begin_token_id: int | None  # the token before an image's placeholders (None: none)
    end_token_id: int | None  # the token after them
    bidirectional: bool  # an image's tokens attend to each other in both directions

    def image_block(self) -> list[int]:
        """The token ids one image occupies in a prompt."""
        head = [self.begin_token_id] if self.begin_token_id is not None else []
        tail = [self.end_token_id] if self.end_token_id is not None else []
        return head + [self.image_token_id] * self.tokens_per_image + tail

    def placeholder_runs(self, tokens) -> list[tuple[int, int]]:
        """[start, end) of each image's placeholder run in a token list (one run per image, in order)."""
        runs, i, n, size = [], 0, len(tokens), self.tokens_per_image
        while i < n:
            if tokens[i] == self.image_token_id:
                j = i
                while j < n and tokens[j] == self.image_token_id:
                    j += 1
                if (j - i) % size:
                    raise ValueError(f"a run of {j - i} image tokens is not a whole number of {size}-token images")
                runs.extend((s, s + size) for s in range(i, j, size))
                i = j
            else:
                i += 1
        return runs


def embed_with_images(embed_tokens, batch, image_token_id: int, scale: float | None = None) -> torch.Tensor:
    """Token embeddings of a forward ([T, hidden], times `scale` if given) with each image token's row replaced
    by its encoder output (batch.mm). An out-of-vocabulary placeholder id is embedded as token 0 first."""
    ids = batch.input_ids
    if image_token_id >= embed_tokens.num_embeddings:
        ids = torch.where(ids == image_token_id, torch.zeros_like(ids), ids)
    x = embed_tokens(ids)
    if scale is not None:
        x = x * scale
    mm = batch.mm
    if mm is not None and mm.token_index.numel():
        x = x.index_copy(0, mm.token_index, mm.embeds.to(x.dtype))
    return x


@dataclass(frozen=True)
class SequenceImages:
    """One sequence of a forward: the placeholder run [start, end) of each of its images (VisionSpec.
    placeholder_runs of its tokens), the tokens already cached (prefix_len), how many it computes now, and the
    encoder output [tokens, hidden] of each image, in prompt order (None for an image whose placeholders this
    forward does not compute)."""

    blocks: list[tuple[int, int]]
    prefix_len: int
    extend_len: int
    embeds: list[torch.Tensor | None]


def multimodal_batch(spec: VisionSpec, seqs: list[SequenceImages], device) -> MultimodalBatch | None:
    """The MultimodalBatch of a forward over `seqs` (in batch order), or None when none of its new tokens is
    an image token. Raises ValueError when an image block a forward needs is split (its end not computed)."""
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    spans: list[list[tuple[int, int]]] = []
    offset = 0
    for seq in seqs:
        lo, hi = seq.prefix_len, seq.prefix_len + seq.extend_len
        if len(seq.blocks) != len(seq.embeds):
            raise ValueError(f"{len(seq.blocks)} image blocks, {len(seq.embeds)} images")
        mine: list[tuple[int, int]] = []
        for (start, end), emb in zip(seq.blocks, seq.embeds):
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            if emb is None:
                raise ValueError(f"image at positions [{start}, {end}) is computed but has no encoder output")
            rows.extend(range(offset + a - lo, offset + b - lo))
            parts.append(emb[a - start : b - start])
            if spec.bidirectional:
                if end > hi:
                    raise ValueError(f"image block [{start}, {end}) is split by a forward ending at {hi}")
                mine.append((start, end))
        spans.append(mine)
        offset += seq.extend_len
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.int64).to(device)
    return MultimodalBatch(token_index=index, embeds=torch.cat(parts).to(device), spans=spans)
