"""Engine.generate with images on the tiny VLMs (Gemma-3, LLaVA): greedy equal to transformers generate (Gemma-3: every
generated token's logprobs too, on inputs where its bidirectional image attention matters; the repetition penalty as
transformers applies it), image tokens in the radix key by content (a second question about an image reuses its K/V
and skips the vision tower; other images never share, even when their hashes collide), cache on vs off identical, bad
images refused."""

from __future__ import annotations

import base64

import pytest
import torch

from prefixrt.errors import InvalidRequest
from prefixrt.multimodal.messages import IMAGE_MARKER
from prefixrt.multimodal.processor import ImageKey
from tests.helpers.checkpoints import VLM_IMAGE_TOKEN, VLM_NAMES
from tests.helpers.images import ask, data_url, png_bytes, random_image

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def reference_ids(eng, messages) -> list[int]:
    """The prompt the engine builds, built here from the template: text pieces around each image block."""
    tokenizer, block = eng.tokenizer, eng._built.model.vision.image_block()
    plain = []
    for m in messages:
        text = "".join(IMAGE_MARKER if p["type"] != "text" else p["text"] for p in m["content"])
        plain.append({"role": m["role"], "content": text})
    rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    pieces = rendered.split(IMAGE_MARKER)
    for i, piece in enumerate(pieces):
        ids.extend(tokenizer.encode(piece, add_special_tokens=False) if piece else [])
        if i < len(pieces) - 1:
            ids.extend(block)
    return ids


def block_bounds(eng, messages) -> tuple[int, int]:
    """Where the first image's block (boi token, placeholders, eoi token) starts and ends in the prompt."""
    ids = reference_ids(eng, messages)
    start = ids.index(eng._built.model.vision.image_block()[0])
    return start, start + len(eng._built.model.vision.image_block())


@pytest.mark.parametrize("name,backend", [(n, "torch") for n in VLM_NAMES] + [(n, "triton") for n in VLM_NAMES])
def test_generate_matches_transformers(make_vlm, vlm_checkpoints, name, backend):
    _, hf = vlm_checkpoints(name)
    eng = make_vlm(name, attention_backend=backend)
    images = [random_image(11), random_image(12, size=(20, 50))]
    messages = ask("Question: what is the capital?", *images)
    got = eng.generate(messages, GREEDY)

    ids = reference_ids(eng, messages)
    block = eng._built.model.vision.image_block()
    assert sum(t in block for t in ids) == 2 * len(block)  # no text token collides with the image tokens
    pixels = eng._built.image_processor.hf(images=images, return_tensors="pt")["pixel_values"]
    x = torch.tensor([ids])
    extra = {"token_type_ids": (x == VLM_IMAGE_TOKEN).long()} if name == "gemma3_vlm" else {}
    with torch.no_grad():
        out = hf.generate(input_ids=x, pixel_values=pixels, max_new_tokens=6, do_sample=False, pad_token_id=0,
                          **extra)
    assert got.token_ids == out[0, len(ids):].tolist()
    assert got.prompt_tokens == len(ids)


def _hf_logprobs(hf, ids: list[int], pixels, bidirectional: bool = True) -> torch.Tensor:
    """transformers' log-probabilities [len(ids), vocab] over `ids` (fp32, one forward); bidirectional=False: the
    image tokens attend causally (no token_type_ids), the mask a model without image spans would use."""
    x = torch.tensor([ids])
    extra = {"token_type_ids": (x == VLM_IMAGE_TOKEN).long()} if bidirectional else {}
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=x, pixel_values=pixels, **extra).logits[0].float(), dim=-1)


def _assert_logprobs_match(got, want: torch.Tensor, prompt_len: int, atol: float = 1e-4) -> None:
    """Every generated token of `got` (with top-20 logprobs) against `want` = _hf_logprobs over prompt + output:
    the same token chosen, the same 20 ids in order, each logprob within atol."""
    assert len(got.logprobs) == len(got.token_ids) > 0
    for step, entry in enumerate(got.logprobs):
        row = want[prompt_len - 1 + step]
        top = torch.topk(row, 20)
        assert entry["token_id"] == got.token_ids[step] == int(row.argmax())
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist(), step
        got_lp = torch.tensor([t["logprob"] for t in entry["top_logprobs"]])
        assert torch.allclose(got_lp, top.values, atol=atol, rtol=0), (step, (got_lp - top.values).abs().max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cache", [False, True], ids=["cache_off", "cache_on"])
def test_gemma3_logprobs_match_transformers_where_image_attention_matters(make_vlm, vlm_checkpoints, backend, cache):
    """Gemma-3's image blocks attend both ways: every generated token's top-20 logprobs equal transformers' within
    1e-4 (fp32), on the torch and the Triton backends, with the cache off and on. Cache on: a first question about
    the same images leaves their K/V in the tree and the second question's prefill (in chunks of 4) reads them
    from there. The inputs are ones where the image attention matters: transformers with causal image tokens
    moves some logprob by more than 0.01 (guarded below), so an engine that drops the image spans fails."""
    _, hf = vlm_checkpoints("gemma3_vlm")
    kwargs = {"chunked_prefill_tokens": 4} if cache else {"radix_cache": False}
    eng = make_vlm(attention_backend=backend, **kwargs)
    images = [random_image(91), random_image(92, size=(24, 36))]
    params = {**GREEDY, "logprobs": 20}
    if cache:
        eng.generate(ask("What is the capital?", *images), params)
    messages = ask("Where?", *images)
    got = eng.generate(messages, params)
    ids = reference_ids(eng, messages)
    if cache:
        _, end = block_bounds(eng, messages)
        assert got.cached_tokens >= end  # (the first image block and more came from the tree)
    pixels = eng._built.image_processor.hf(images=images, return_tensors="pt")["pixel_values"]
    full = ids + got.token_ids
    want = _hf_logprobs(hf, full, pixels)
    _assert_logprobs_match(got, want, len(ids))
    causal = _hf_logprobs(hf, full, pixels, bidirectional=False)
    assert (causal[len(ids) - 1:] - want[len(ids) - 1:]).abs().max() > 0.01  # the spans matter on these inputs


def test_every_image_source_gives_the_same_answer(make_vlm, tmp_path):
    eng = make_vlm()
    image = random_image(21)
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(image))
    question = "What is in the picture?"
    want = eng.generate(ask(question, image), GREEDY).token_ids
    for source in (png_bytes(image), str(path), f"file://{path}", data_url(image)):
        assert eng.generate(ask(question, source), GREEDY).token_ids == want
    openai_style = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": question}]}]
    assert eng.generate(openai_style, GREEDY).token_ids == want
    langchain_style = [{"role": "user", "content": [
        {"type": "image", "source_type": "base64", "mime_type": "image/png",
         "data": base64.b64encode(png_bytes(image)).decode()},
        {"type": "text", "text": question}]}]
    assert eng.generate(langchain_style, GREEDY).token_ids == want


@pytest.mark.parametrize("name", VLM_NAMES)
def test_second_question_reuses_the_image(make_vlm, name):
    eng = make_vlm(name)
    model, encoder = eng._built.model, eng.core.encoder
    image = random_image(31)
    first = eng.generate(ask("What is the capital?", image), GREEDY)
    runs = model.vision_runs
    assert runs == 1 and encoder.encoded == 1
    second = eng.generate(ask("Question: where is the fox?", image), GREEDY)
    _, end = block_bounds(eng, ask("Question: where is the fox?", image))
    assert second.cached_tokens >= end  # the text before the image and the whole image block
    assert model.vision_runs == runs  # the vision tower ran zero times for the second question
    assert encoder.encoded == 1
    # and the answer is what a fresh engine with no cache computes
    fresh = make_vlm(name, radix_cache=False)
    assert fresh.generate(ask("Question: where is the fox?", image), GREEDY).token_ids == second.token_ids
    assert first.cached_tokens == 0


@pytest.mark.parametrize("name,chunk,backend", [("gemma3_vlm", 8192, "torch"), ("gemma3_vlm", 3, "torch"),
                                                ("llava", 8192, "torch"), ("llava", 5, "torch"),
                                                ("gemma3_vlm", 3, "triton")])
def test_cache_on_and_off_identical(make_vlm, name, chunk, backend):
    """Small chunks: prefill chunks shorter than an image block (Gemma-3: 6 tokens, never split; LLaVA: causal,
    split anywhere). Triton: the cached engine on the Triton kernels, the reference on the torch backend."""
    on = make_vlm(name, chunked_prefill_tokens=chunk, attention_backend=backend)
    off = make_vlm(name, radix_cache=False)
    a, b = random_image(41), random_image(42)
    prompts = [ask("What is the capital?", a), ask("Where is the fox?", a), ask("What is the capital?", b),
               ask("Where is the fox?", a, b), ask("Where is the fox?", b, a), ask("What is it?", b)]
    for p in prompts:
        got = on.generate(p, GREEDY)
        assert got.error is None and got.finish_reason == "length"
        assert got.token_ids == off.generate(p, GREEDY).token_ids
    assert off.core.encoder.hits == 0 and len(off.core.encoder) == 0
    assert on.core.encoder.hits > 0


def test_triton_backend_equals_torch_backend(make_vlm):
    """Gemma-3 images on the Triton kernels (the extend kernel's bidirectional blocks): per-token logprobs of
    the cached, chunked Triton engine within 1e-4 of the torch backend with no reuse, for every prompt."""
    params = {**GREEDY, "logprobs": 3}
    tri = make_vlm(chunked_prefill_tokens=4, attention_backend="triton")
    ref = make_vlm(radix_cache=False, attention_backend="torch")
    a, b = random_image(81), random_image(82, size=(30, 30))
    for p in [ask("What is the capital?", a), ask("Where is the fox?", a, b), ask("What is it?", b, a)]:
        got, want = tri.generate(p, params), ref.generate(p, params)
        assert got.token_ids == want.token_ids
        for g, w in zip(got.logprobs, want.logprobs):
            assert [t["token_id"] for t in g["top_logprobs"]] == [t["token_id"] for t in w["top_logprobs"]]
            assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(g["top_logprobs"], w["top_logprobs"])) < 1e-4
    assert tri.stats().cached_tokens_total > 0


def _shared_after(eng, first, second):
    eng.generate(first, GREEDY)
    return eng.generate(second, GREEDY)


@pytest.mark.parametrize("name,collide", [("gemma3_vlm", False), ("gemma3_vlm", True), ("llava", True)])
def test_different_images_of_one_size_never_share(make_vlm, monkeypatch, name, collide):
    """Two images of the same size: the second request reuses only the text before its image. With every
    ImageKey hashing alike (a forced collision, as a truncated hash would give) the keys still differ."""
    if collide:
        monkeypatch.setattr(ImageKey, "__hash__", lambda self: 7)
    eng = make_vlm(name)
    a, b = random_image(51), random_image(52)
    assert a.size == b.size
    question = "What is the capital?"
    got = _shared_after(eng, ask(question, a), ask(question, b))
    start, _ = block_bounds(eng, ask(question, b))
    before_image = start + (eng._built.model.vision.begin_token_id is not None)  # the text and a boi token
    assert got.cached_tokens == before_image  # no image token
    fresh = make_vlm(name, radix_cache=False)
    assert fresh.generate(ask(question, b), GREEDY).token_ids == got.token_ids


def test_forced_collision_is_exercised(make_vlm, monkeypatch):
    """Guards the test above: equal-hash keys that compared equal (a key compared by hash alone) would share
    the image's K/V."""
    monkeypatch.setattr(ImageKey, "__hash__", lambda self: 7)
    monkeypatch.setattr(ImageKey, "__eq__", lambda self, other: isinstance(other, ImageKey))
    eng = make_vlm()
    a, b = random_image(51), random_image(52)
    got = _shared_after(eng, ask("What is the capital?", a), ask("What is the capital?", b))
    start, _ = block_bounds(eng, ask("What is the capital?", b))
    assert got.cached_tokens > start + 1


@pytest.mark.parametrize("name", VLM_NAMES)
def test_repetition_penalty_with_images_equals_transformers(make_vlm, vlm_checkpoints, name):
    """The penalty reads the prompt, image positions as the image token the model saw (as transformers'
    RepetitionPenaltyLogitsProcessor reads input_ids): greedy tokens under repetition_penalty=2 equal
    transformers generate with the same penalty, and differ from the run without it (the penalty acted)."""
    _, hf = vlm_checkpoints(name)
    eng = make_vlm(name)
    images = [random_image(3)]
    messages = ask("Question: what is the capital?", *images)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}  # (transformers: eos_token_id=None)
    got = eng.generate(messages, {**params, "repetition_penalty": 2.0})
    plain = eng.generate(messages, params)
    assert got.error is None and plain.error is None

    ids = reference_ids(eng, messages)
    pixels = eng._built.image_processor.hf(images=images, return_tensors="pt")["pixel_values"]
    x = torch.tensor([ids])
    extra = {"token_type_ids": (x == VLM_IMAGE_TOKEN).long()} if name == "gemma3_vlm" else {}

    def hf_greedy(**penalty):
        with torch.no_grad():
            out = hf.generate(input_ids=x, pixel_values=pixels, max_new_tokens=12, do_sample=False,
                              pad_token_id=0, eos_token_id=None, **extra, **penalty)
        return out[0, len(ids):].tolist()

    want, want_plain = hf_greedy(repetition_penalty=2.0), hf_greedy()
    assert want != want_plain  # on these inputs the penalty changes the greedy tokens
    assert got.token_ids == want
    assert plain.token_ids == want_plain


def test_bad_images_are_refused(make_vlm, tmp_path):
    eng = make_vlm()
    cases = [
        b"not an image at all",
        "https://example.com/cat.png",
        "data:image/png;base64,@@@@",
        str(tmp_path / "missing.png"),
        png_bytes(random_image(1))[:40],  # truncated PNG
    ]
    for source in cases:
        with pytest.raises(InvalidRequest):
            eng.generate(ask("What?", source), GREEDY)
    with pytest.raises(InvalidRequest, match="limit"):
        eng.generate(ask("What?", *[random_image(i) for i in range(17)]), GREEDY)
    with pytest.raises(InvalidRequest, match="remote"):
        eng.generate([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                                   {"type": "text", "text": "hi"}]}], GREEDY)
    assert eng.generate(ask("What?", random_image(2)), GREEDY).token_ids  # the engine still serves


def test_text_model_refuses_images(make_engine):
    eng = make_engine("llama")
    with pytest.raises(InvalidRequest, match="takes no images"):
        eng.generate(ask("What?", random_image(1)), GREEDY)


def test_bidirectional_images_need_a_backend_that_honours_them(make_vlm, monkeypatch):
    """Gemma-3's image blocks attend both ways: a backend without that is refused up front, not mid-forward."""
    from prefixrt.model.attention.torch_backend import TorchAttentionBackend

    eng = make_vlm()
    monkeypatch.setattr(TorchAttentionBackend, "bidirectional_spans", False)
    with pytest.raises(InvalidRequest, match="bidirectional image blocks"):
        eng.generate(ask("What?", random_image(1)), GREEDY)
    llava = make_vlm("llava")  # causal image tokens: any backend
    assert llava.generate(ask("What?", random_image(1)), GREEDY).token_ids
