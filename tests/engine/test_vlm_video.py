"""Video as frames on a tiny LLaVA-NeXT-Video checkpoint (save_pretrained, CPU, fp32): logits and greedy tokens
equal transformers' (pixel_values_videos), every frame keyed by its own content (frames two videos share are
cached: K/V and encoder output), a video file refused (no decoder is installed)."""

from __future__ import annotations

import pytest
import torch

from prefixrt.errors import InvalidRequest
from prefixrt.model.vision import SequenceImages, multimodal_batch
from tests.helpers.checkpoints import VLM_IMAGE_TOKEN
from tests.helpers.harness import PagedHarness
from tests.helpers.images import data_url, random_image

NAME = "llava_next_video"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def ask_video(question: str, frames) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": list(frames)}, {"type": "text", "text": question}]}]


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("num_frames", [1, 3])
def test_video_logits_match_transformers(vlm_checkpoints, make_vlm, num_frames):
    folder, hf = vlm_checkpoints(NAME)
    eng = make_vlm(NAME)
    ours, processor = eng._built.model, eng._built.image_processor
    frames = processor.process([random_image(s) for s in range(num_frames)])
    pixels = torch.stack([f.pixels for f in frames])
    per_frame = ours.vision.tokens_per_image
    tokens = [5, 6, 7] + [VLM_IMAGE_TOKEN] * (per_frame * num_frames) + [8, 9, 10, 11]
    embeds = list(ours.encode_images(pixels))
    mm = multimodal_batch(ours.vision, [SequenceImages(ours.vision.placeholder_runs(tokens), 0, len(tokens), embeds)],
                          "cpu")
    harness = PagedHarness(ours)
    got = harness.forward([(harness.new_row(), tokens)], mm=mm)[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens]), pixel_values_videos=pixels[None]).logits[0]
        other = hf(input_ids=torch.tensor([tokens]), pixel_values_videos=pixels.flip(0)[None] if num_frames > 1
                   else torch.stack([processor.process([random_image(99)])[0].pixels])[None]).logits[0]
    assert rel_err(got, ref) < 1e-4
    assert rel_err(other, ref) > 1e-3  # the frames (and their order) matter


def test_video_generate_matches_transformers(vlm_checkpoints, make_vlm):
    _, hf = vlm_checkpoints(NAME)
    eng = make_vlm(NAME)
    frames = [random_image(s) for s in (1, 2, 3)]
    messages = ask_video("What happens in the video?", frames)
    got = eng.generate(messages, GREEDY)
    ids = eng.image_prompt_ids(messages)
    per_frame = eng._built.model.vision.tokens_per_image
    first = ids.index(VLM_IMAGE_TOKEN)
    assert ids[first:first + 3 * per_frame] == [VLM_IMAGE_TOKEN] * (3 * per_frame)  # the frames, adjacent
    assert ids.count(VLM_IMAGE_TOKEN) == 3 * per_frame
    pixels = torch.stack([f.pixels for f in eng._built.image_processor.process(frames)])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values_videos=pixels[None], max_new_tokens=6,
                          do_sample=False, pad_token_id=0)
    assert got.token_ids == out[0, len(ids):].tolist()
    # OpenAI clients (no video part in the API): the frames as consecutive image_url parts are the same prompt
    as_images = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(f)}} for f in frames]
                  + [{"type": "text", "text": "What happens in the video?"}]}]
    assert eng.image_prompt_ids(as_images) == ids
    assert eng.generate(as_images, GREEDY).token_ids == got.token_ids


def test_frames_shared_by_two_videos_are_cached(make_vlm):
    """Videos [f1, f2, f3] then [f1, f2, f4]: the second reuses the K/V of the text before the video and of f1,
    f2, encodes f4 alone, and answers as an engine without reuse does."""
    eng = make_vlm(NAME)
    ref = make_vlm(NAME, radix_cache=False)
    f1, f2, f3, f4 = (random_image(s) for s in (11, 12, 13, 14))
    question = "What happens in the video?"
    eng.generate(ask_video(question, [f1, f2, f3]), GREEDY)
    model, encoder = eng._built.model, eng.core.encoder
    runs, encoded = model.vision_runs, encoder.encoded
    second = ask_video(question, [f1, f2, f4])
    got = eng.generate(second, GREEDY)
    ids = eng.image_prompt_ids(second)
    start, per_frame = ids.index(VLM_IMAGE_TOKEN), model.vision.tokens_per_image
    assert start + 2 * per_frame <= got.cached_tokens < start + 3 * per_frame  # f1 and f2, not f4
    assert model.vision_runs == runs + 1 and encoder.encoded == encoded + 1  # f4 only
    assert got.token_ids == ref.generate(second, GREEDY).token_ids
    # the same frames in another order share only the text before them
    reordered = ask_video(question, [f2, f1, f3])
    assert eng.generate(reordered, GREEDY).cached_tokens == start


def test_video_file_is_refused(make_vlm, tmp_path):
    eng = make_vlm(NAME)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 64)
    for bad in (str(clip), [], None):
        with pytest.raises(InvalidRequest, match="video"):
            eng.generate([{"role": "user", "content": [{"type": "video", "video": bad},
                                                       {"type": "text", "text": "What?"}]}], GREEDY)
    assert eng.generate(ask_video("What?", [random_image(1)]), GREEDY).token_ids  # the engine still serves
