"""LoRA adapters through the clients, by model name and nothing else: the openai client (over HTTP to `prefixrt serve
--lora-modules`, and the in-process shim), the anthropic client on the Messages API, `/v1/models`, the load / unload
routes, DSPy (`prefixrt.LM(model=<adapter>)`), LangChain (`ChatPrefixRT(model=<adapter>)`) and the frontend
language (`ProviderBackend(engine, model=<adapter>)`, `OpenAIBackend(<adapter>)`)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.helpers.engines import check_and_shut_down
from tests.helpers.serve import ServeProcess, assert_clean
from tests.lora.conftest import TARGET_SETS, hf_greedy

pytest.importorskip("peft")

BASE = "tiny-llama"
NEW = 8
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def adapters(peft_adapters):
    return {"a": peft_adapters("llama", "cli-a", TARGET_SETS["all"], rank=8, seed=31),
            "b": peft_adapters("llama", "cli-b", TARGET_SETS["attn"], rank=16, seed=32)}


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tiny_tokenizer, adapters):
    from tests.server.conftest import build_engine

    eng = build_engine(tiny_checkpoints, tiny_tokenizer, "llama", enable_lora=True,
                       lora_adapters={n: str(f) for n, (f, _) in adapters.items()})
    yield eng
    check_and_shut_down(eng)


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tiny_tokenizer, adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("served") / BASE
    shutil.copytree(tiny_checkpoints("llama")[0], folder)
    tiny_tokenizer.save_pretrained(folder)
    args = ["--model", str(folder), "--served-model-name", BASE, "--device", "cpu", "--kv-cache-tokens", "8192",
            "--debug", "--log-level", "warning", "--lora-modules", *[f"{n}={f}" for n, (f, _) in adapters.items()],
            "--max-loras", "2"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live
        assert_clean(live.wait_idle())
        assert live.stop() == 0, live.log()
        assert "Traceback" not in live.log(), live.log()


def _want(engine, lora, messages=MESSAGES, n=NEW):
    return engine.generate(messages, {"max_new_tokens": n, "temperature": 0, "lora": lora}).text


def test_models_lists_adapters_with_the_base_as_parent(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a", "b"}
    assert cards["a"].model_extra["parent"] == BASE and cards["b"].model_extra["parent"] == BASE
    assert "parent" not in (cards[BASE].model_extra or {})
    assert client.models.retrieve("a").id == "a"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("c")


@pytest.mark.parametrize("via", ["http", "shim"])
def test_the_openai_client_reaches_an_adapter_by_model_name(via, server, engine, adapters):
    import openai

    from prefixrt.openai import OpenAI

    client = (openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) if via == "http"
              else OpenAI(engine=engine))
    prompt = [7, 17, 99, 4, 250, 13, 61, 200, 31, 5, 77]  # (no BOS: nothing in common with the chat prompts)
    extra = {"ignore_eos": True, "min_tokens": NEW}
    got = {}
    for lora in ("a", "b", BASE):
        r = client.completions.create(model=lora, prompt=prompt, max_tokens=NEW, temperature=0, extra_body=extra)
        got[lora] = r
        assert r.model == lora
    tok = engine.tokenizer
    for lora in ("a", "b"):  # the adapter's own tokens: transformers + peft
        assert got[lora].choices[0].text == tok.decode(hf_greedy(adapters[lora][1], prompt, NEW))
    assert len({r.choices[0].text for r in got.values()}) == 3
    # the same prompt under another adapter or the base reuses nothing; under the same adapter, all but one token
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in got.values())
    again = client.completions.create(model="a", prompt=prompt, max_tokens=NEW, temperature=0, extra_body=extra)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    chat = client.chat.completions.create(model="b", messages=MESSAGES, max_tokens=NEW, temperature=0)
    assert chat.choices[0].message.content == _want(engine, "b") and chat.model == "b"
    if via == "http":  # (the in-process shim serves any model name)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    # the flush keeps the next run of this test (the other client) from hitting what this one cached
    (httpx.post(server.url + "/flush_cache") if via == "http" else engine.flush_cache())


def test_the_messages_api_reaches_an_adapter(server, engine):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    msg = client.messages.create(model="a", max_tokens=NEW, messages=MESSAGES, extra_body={"temperature": 0})
    assert msg.model == "a"
    assert msg.content[0].text == _want(engine, "a")
    base = client.messages.create(model=BASE, max_tokens=NEW, messages=MESSAGES, extra_body={"temperature": 0})
    assert base.content[0].text == _want(engine, None) != msg.content[0].text


def test_the_responses_api_reaches_an_adapter(server, engine):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="a", input=MESSAGES, max_output_tokens=NEW, temperature=0)
    assert r.model == "a" and r.output_text == _want(engine, "a")
    base = client.responses.create(model=BASE, input=MESSAGES, max_output_tokens=NEW, temperature=0)
    assert base.output_text == _want(engine, None) != r.output_text


def test_load_and_unload_routes(server, engine, adapters):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    folder = str(adapters["a"][0])
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folder})
    assert r.status_code == 200, r.text
    assert "c" in {m.id for m in client.models.list().data}
    out = client.chat.completions.create(model="c", messages=MESSAGES, max_tokens=NEW, temperature=0)
    assert out.choices[0].message.content == _want(engine, "a")  # the same files as a
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folder})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c", messages=MESSAGES, max_tokens=2)
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 404


def test_dspy_lm_reaches_an_adapter_by_model_name(server, engine):
    import prefixrt

    want = _want(engine, "a")
    for lm in (prefixrt.LM(model="a", engine=engine, max_tokens=NEW, cache=False),
               prefixrt.LM(model="a", base_url=server.url, max_tokens=NEW, cache=False)):
        assert lm(MESSAGES[0]["content"])[0] == want  # one user message
        assert lm.model.startswith("prefixrt/a@")  # DSPy's cache key tells adapters apart
    base = prefixrt.LM(engine=engine, max_tokens=NEW, cache=False)
    assert base(MESSAGES[0]["content"])[0] == _want(engine, None) != want
    with pytest.raises(ValueError, match="nor one of its LoRA adapters"):
        prefixrt.LM(model="nope", engine=engine, max_tokens=NEW, cache=False)


def test_langchain_reaches_an_adapter_by_model_name(server, engine):
    from prefixrt.adapters.langchain import ChatPrefixRT

    want = _want(engine, "b")
    for chat in (ChatPrefixRT(model="b", engine=engine, max_tokens=NEW, temperature=0),
                 ChatPrefixRT(model="b", base_url=server.url, max_tokens=NEW, temperature=0)):
        assert chat.invoke(MESSAGES[0]["content"]).content == want
    base = ChatPrefixRT(engine=engine, max_tokens=NEW, temperature=0)
    assert base.invoke(MESSAGES[0]["content"]).content == _want(engine, None) != want


def test_frontend_programs_run_under_an_adapter(server, engine):
    import openai

    import prefixrt
    from prefixrt.frontend.backend import ProviderBackend

    @prefixrt.function
    def complete(s, text):
        s += prefixrt.user(text)
        s += prefixrt.assistant(prefixrt.gen("out", max_tokens=NEW, temperature=0))

    want = _want(engine, "a")
    state = complete.run(text=MESSAGES[0]["content"], backend=ProviderBackend(engine, model="a"))
    assert state["out"] == want
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    state = complete.run(text=MESSAGES[0]["content"], backend=prefixrt.OpenAIBackend("a", client=client))
    assert state["out"] == want
    with pytest.raises(ValueError):
        ProviderBackend(engine, model="nope")


def test_metrics_per_adapter(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="b", messages=MESSAGES, max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if line.startswith("prefixrt_lora")}
    assert lines['prefixrt_lora_requests_total{adapter="b"}'] >= 2
    assert lines['prefixrt_lora_hit_tokens_total{adapter="b"}'] > 0
    assert 0 < lines['prefixrt_lora_cache_hit_rate{adapter="b"}'] < 1
    assert lines['prefixrt_lora_loads_total{adapter="b"}'] >= 1
    assert lines["prefixrt_lora_slots"] == 2 and 1 <= lines["prefixrt_lora_resident_adapters"] <= 2
    assert lines["prefixrt_lora_slot_loads_total"] >= 2 and lines["prefixrt_lora_slot_load_seconds_total"] > 0
    assert 0 < lines["prefixrt_lora_slot_load_busy_seconds_total"] <= lines["prefixrt_lora_slot_load_seconds_total"]
