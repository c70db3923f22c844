"""OpenAI image_url parts on /v1/chat/completions through the real `openai` client, in-process (the shim runs the
server's own app) and over a socket to `prefixrt serve`: data: URLs and local files answer as Engine.generate
does; remote URLs and undecodable images are 400s; a text-only model refuses images with a 400."""

from __future__ import annotations

import openai
import pytest

from prefixrt.openai import OpenAI
from tests.helpers.images import ask, data_url, png_bytes, random_image

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def chat(client, url: str, question: str, stream: bool = False):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          stream=stream)


def test_image_url_parts_answer_like_the_engine(make_vlm, tmp_path):
    eng = make_vlm()
    image = random_image(61)
    want = eng.generate(ask("What is the capital?", image), {**GREEDY, "detokenize": True}).text
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes(image))
    with OpenAI(engine=eng) as client:
        for url in (data_url(image), f"file://{path}", str(path)):
            got = chat(client, url, "What is the capital?")
            assert got.choices[0].message.content == want
        again = chat(client, data_url(image), "What is the capital?")
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the image's K/V came from the cache
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, data_url(image),
                                                                           "What is the capital?", stream=True)
                           if c.choices)
        assert streamed == want


def test_bad_image_urls_are_400(make_vlm):
    eng = make_vlm()
    with OpenAI(engine=eng) as client:
        with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
            chat(client, "https://example.com/cat.png", "What?")
        with pytest.raises(openai.BadRequestError, match="cannot decode image"):
            chat(client, "data:image/png;base64,aGVsbG8=", "What?")


def test_text_model_refuses_image_parts(engine):
    with OpenAI(engine=engine) as client, pytest.raises(openai.BadRequestError, match="images"):
        chat(client, data_url(random_image(1)), "What?")


def test_image_url_parts_through_the_engine_process(vlm_checkpoints, tiny_tokenizer, tmp_path):
    """The server's default engine lives in its own process (ProcessEngine): images cross the pipe as chat
    messages and are prepared there; answers equal the in-process engine's."""
    import shutil

    from prefixrt.engine.process.client import ProcessEngine

    folder = tmp_path / "vlm"
    shutil.copytree(vlm_checkpoints("gemma3_vlm")[0], folder)
    tiny_tokenizer.save_pretrained(str(folder))
    image = random_image(71)
    eng = ProcessEngine(str(folder), device="cpu", kv_cache_tokens=1024, attention_backend="torch")
    try:
        want = eng.generate(ask("What is the capital?", image), {**GREEDY, "detokenize": True})
        with OpenAI(engine=eng) as client:
            got = chat(client, data_url(image), "What is the capital?")
            assert got.choices[0].message.content == want.text
            assert got.usage.prompt_tokens_details.cached_tokens > 0
            with pytest.raises(openai.BadRequestError, match="cannot decode image"):
                chat(client, "data:image/png;base64,aGVsbG8=", "What?")
    finally:
        eng.shutdown()


def test_image_over_a_socket_to_prefixrt_serve(make_vlm, vlm_checkpoints, tiny_tokenizer, tmp_path):
    """`prefixrt serve` on the tiny Gemma-3 VLM (its default engine process), the openai client over HTTP: a data:
    URL and a local file answer with the in-process engine's text, whole and streamed; a second question about
    the image reuses exactly the cached tokens the in-process engine reuses; an image whose request body is over
    the server's parser-process threshold (server/body.py OFFLOAD_BYTES: decoded in another process, only under
    `prefixrt serve`) answers too; a bad image is a 400."""
    import shutil

    from prefixrt.server.body import OFFLOAD_BYTES
    from tests.server.conftest import ServeProcess

    folder = tmp_path / "vlm"
    shutil.copytree(vlm_checkpoints("gemma3_vlm")[0], folder)
    tiny_tokenizer.save_pretrained(str(folder))
    image = random_image(75)
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes(image))
    eng = make_vlm(attention_backend="torch", kv_cache_tokens=1024)
    first = eng.generate(ask("What is the capital?", image), {**GREEDY, "detokenize": True})
    second = eng.generate(ask("Where is the fox?", image), {**GREEDY, "detokenize": True})
    assert second.cached_tokens > 0 and first.text and second.text
    large = random_image(76, size=(400, 300))
    assert len(data_url(large)) > OFFLOAD_BYTES
    third = eng.generate(ask("What is it?", large), {**GREEDY, "detokenize": True})

    args = ["--model", str(folder), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-tokens", "1024", "--attention-backend", "torch", "--log-level", "warning"]
    with ServeProcess(args, tmp_path / "serve.log") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        got = chat(client, data_url(image), "What is the capital?")
        assert got.choices[0].message.content == first.text
        assert got.usage.prompt_tokens == first.prompt_tokens and got.usage.prompt_tokens_details.cached_tokens == 0
        again = chat(client, f"file://{path}", "Where is the fox?")
        assert again.choices[0].message.content == second.text
        assert again.usage.prompt_tokens_details.cached_tokens == second.cached_tokens
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, data_url(image),
                                                                           "What is the capital?", stream=True)
                           if c.choices)
        assert streamed == first.text
        assert chat(client, data_url(large), "What is it?").choices[0].message.content == third.text
        with pytest.raises(openai.BadRequestError, match="cannot decode image"):
            chat(client, "data:image/png;base64,aGVsbG8=", "What?")
        assert live.stop() == 0, live.log()
