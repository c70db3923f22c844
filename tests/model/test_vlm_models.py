"""Vision-language models against transformers (fp32, CPU): Gemma3ForConditionalGeneration and
LlavaForConditionalGeneration, each a tiny random checkpoint written by save_pretrained, images through the
saved image processor, 1-3 images per prompt."""

from __future__ import annotations

import pytest
import torch

from prefixrt.hub.loader import load_model
from prefixrt.model.vision import SequenceImages, multimodal_batch
from prefixrt.multimodal.processor import ImageProcessor
from tests.helpers.checkpoints import VLM_IMAGE_TOKEN, VLM_NAMES, save_tiny_vlm_checkpoint
from tests.helpers.harness import PagedHarness
from tests.helpers.images import random_image

RTOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=VLM_NAMES)
def vlm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, hf_processor = save_tiny_vlm_checkpoint(path, request.param)
    ours = load_model(str(path), dtype=torch.float32, device="cpu")
    return hf, hf_processor, ours, ImageProcessor.from_folder(path)


def build_prompt(model, pieces) -> list[int]:
    """pieces: token lists and the string "IMG" for an image block."""
    out: list[int] = []
    for piece in pieces:
        out.extend(model.vision.image_block() if piece == "IMG" else piece)
    return out


def mm_of(model, tokens, prefix_len, n, embeds):
    blocks = model.vision.placeholder_runs(tokens)
    return multimodal_batch(model.vision, [SequenceImages(blocks, prefix_len, n, embeds)], "cpu")


def hf_inputs(hf, tokens, pixels) -> dict:
    ids = torch.tensor([tokens])
    extra = {"token_type_ids": (ids == VLM_IMAGE_TOKEN).long()} if hf.config.model_type == "gemma3" else {}
    return {"input_ids": ids, "pixel_values": pixels, **extra}


def hf_forward(hf, tokens, pixels):
    with torch.no_grad():
        return hf(**hf_inputs(hf, tokens, pixels)).logits[0]


PROMPTS = [
    ([text(3, 1), "IMG", text(5, 2)], [0]),
    ([text(2, 3), "IMG", text(1, 4), "IMG", text(4, 5)], [1, 2]),
    ([text(1, 6), "IMG", "IMG", text(3, 7), "IMG", text(2, 8)], [3, 4, 0]),
]


def test_processor_matches_transformers(vlm):
    _, hf_processor, _, processor = vlm
    images = [random_image(s) for s in range(3)]
    ours = torch.stack([p.pixels for p in processor.process(images)])
    ref = hf_processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(ours, ref.float())


BACKENDS = ["torch", "triton"]  # triton: the extend kernel's span_end for Gemma-3's bidirectional image blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_prefill_logits_match_transformers(vlm, case, backend):
    hf, _, ours, processor = vlm
    pieces, image_seeds = PROMPTS[case]
    images = processor.process([random_image(s) for s in image_seeds])
    pixels = torch.stack([p.pixels for p in images])
    tokens = build_prompt(ours, pieces)
    embeds = list(ours.encode_images(pixels))
    harness = PagedHarness(ours, backend=backend)
    mm = mm_of(ours, tokens, 0, len(tokens), embeds)
    got = harness.forward([(harness.new_row(), tokens)], mm=mm)[0]
    ref = hf_forward(hf, tokens, pixels)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < RTOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_images_change_the_logits(vlm, backend):
    """Guards the test above: other pixels, or causal image tokens, give other logits."""
    hf, _, ours, processor = vlm
    tokens = build_prompt(ours, PROMPTS[1][0])
    images = processor.process([random_image(1), random_image(2)])
    pixels = torch.stack([p.pixels for p in images])
    ref = hf_forward(hf, tokens, pixels)
    other = hf_forward(hf, tokens, torch.stack([processor.process([random_image(9)])[0].pixels, pixels[1]]))
    assert rel_err(other, ref) > 1e-3
    embeds = list(ours.encode_images(pixels))
    if ours.vision.bidirectional:
        mm = mm_of(ours, tokens, 0, len(tokens), embeds)
        mm.spans = [[]]  # causal image tokens
        harness = PagedHarness(ours, backend=backend)
        got = harness.forward([(harness.new_row(), tokens)], mm=mm)[0]
        assert rel_err(got, ref) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_prefix_then_extend_and_decode(vlm, backend):
    """A prompt's image prefix computed by one row and reused by another (the KV a radix hit shares), the rest
    extended with a second image, then greedy decode: equal to transformers generate."""
    hf, _, ours, processor = vlm
    images = processor.process([random_image(5), random_image(6)])
    pixels = torch.stack([p.pixels for p in images])
    embeds = list(ours.encode_images(pixels))
    tokens = build_prompt(ours, [text(2, 10), "IMG", text(3, 11), "IMG", text(2, 12)])
    first_len = 2 + len(ours.vision.image_block()) + 3  # text, first image block, text
    harness = PagedHarness(ours, backend=backend)
    row_a = harness.new_row()
    mm = mm_of(ours, tokens[:first_len], 0, first_len, embeds[:1])
    harness.forward([(row_a, tokens[:first_len])], mm=mm)
    row_b = harness.new_row(share_prefix_of=row_a, prefix_len=first_len)
    rest = tokens[first_len:]
    mm = mm_of(ours, tokens, first_len, len(rest), [None, embeds[1]])
    logits = harness.forward([(row_b, rest)], mm=mm)[0]
    ref = hf_forward(hf, tokens, pixels)
    assert rel_err(logits, ref[first_len:]) < RTOL

    max_new = 6
    out = [int(logits[-1].argmax())]
    for _ in range(max_new - 1):
        out.append(int(harness.forward([(row_b, [out[-1]])])[0][-1].argmax()))
    with torch.no_grad():
        gen = hf.generate(**hf_inputs(hf, tokens, pixels), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    assert out == gen[0, len(tokens):].tolist()


def test_split_image_block_is_refused(vlm):
    _, _, ours, _ = vlm
    if not ours.vision.bidirectional:
        pytest.skip("causal image tokens: a forward may end inside an image")
    tokens = build_prompt(ours, [text(2, 1), "IMG"])
    emb = torch.zeros(ours.vision.tokens_per_image, 64)
    with pytest.raises(ValueError, match="split"):
        mm_of(ours, tokens, 0, 5, [emb])
