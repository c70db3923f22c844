"""SGLang's own clients against `prefixrt serve`, their request loops ported in our words (SGLang is not a test
dependency: its wheel's declared dependencies are its CUDA stack). Each test sends what the SGLang client sends and
reads the answer the way it reads it:

- `python -m sglang.bench_serving --backend sglang` (sglang/benchmark/serving.py `async_request_sglang_generate`):
  readiness on /v1/models, the tokenizer from /model_info's path, streamed /generate with `text` (or `input_ids` with
  --tokenize-prompt) and its payload fields, each SSE line's `meta_info.completion_tokens` for the output length and
  the inter-token latencies, `meta_info.prompt_tokens` for the prompt length, /server_info's `internal_states`,
  /flush_cache with a timeout parameter;
- benchmark/hicache/bench_multiturn.py (the version beside sglang 0.5.23, whose requests come from
  sglang/test/kits/cache_hit_kit.py): with `--api-format sglang`, clients whose token history grows by each
  streamed answer's cumulative `output_ids` and a new question's ids, sent as `input_ids`, the first event's
  `meta_info` read for `prompt_tokens` and `cached_tokens`; with `--api-format openai`, streamed chat whose
  `model` is /get_model_info's `model_path`, usage (with `prompt_tokens_details.cached_tokens`) read from the
  final chunk; /flush_cache between request rates;
- the frontend language's `RuntimeEndpoint` (sglang/lang/backend/runtime_endpoint.py): /get_model_info's
  `model_path`, `cache_prefix` and `commit_lazy_operations` (max_new_tokens 0), `generate` (sampling params from
  `SglSamplingParams.to_srt_kwargs`, None for unset, a dtype's regex), `generate_stream` (`data:` lines, the text
  past what was read), and `select`: a batch of `text` + choice with max_new_tokens 0, return_logprob,
  return_text_in_logprobs, logprob_start_len = prompt length - 2, and the unconditional scores over `input_ids`.

The real scripts (sglang 0.5.23) were also run against `prefixrt serve`: commands and numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import requests

aiohttp = pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def url(server):
    return server.url


def _random_prompt(tokenizer, rng: random.Random, length: int) -> str:
    """A random prompt as bench_serving's random dataset makes one: random token ids decoded to text (here without
    the NUL byte, which prefixrt refuses in text)."""
    ids = []
    while len(ids) < length:
        t = rng.randrange(3, len(tokenizer))
        if "\x00" not in tokenizer.decode([t]):
            ids.append(t)
    return tokenizer.decode(ids)


async def _bench_serving_request(session, api_url: str, prompt, output_len: int) -> dict:
    """bench_serving's async_request_sglang_generate: the payload it sends and how it reads the stream."""
    payload = {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    out = {"success": False, "ttft": 0.0, "itl": [], "output_len": output_len, "prompt_len": None, "text": ""}
    st = time.perf_counter()
    recent, last_len = st, 0
    async with session.post(url=api_url, json=payload) as response:
        assert response.status == 200, await response.text()
        async for chunk_bytes in response.content:
            chunk_bytes = chunk_bytes.strip()
            if not chunk_bytes:
                continue
            data_bytes = chunk_bytes[6:] if chunk_bytes.startswith(b"data: ") else chunk_bytes
            latency = time.perf_counter() - st
            if data_bytes == b"[DONE]":
                continue
            data = json.loads(data_bytes)
            reported = data.get("usage") or data.get("meta_info") or {}
            if reported.get("prompt_tokens"):
                out["prompt_len"] = reported["prompt_tokens"]
            if "text" in data and data["text"]:
                now = time.perf_counter()
                out["text"] = data["text"]
                out["output_len"] = data["meta_info"]["completion_tokens"]
                if out["ttft"] == 0.0:
                    out["ttft"] = now - st
                else:
                    new = out["output_len"] - last_len
                    if new == 0:
                        continue
                    out["itl"].extend([(now - recent) / new] * new)
                recent, last_len = now, out["output_len"]
    out["success"], out["latency"] = True, latency
    return out


@pytest.mark.parametrize("tokenize_prompt", [False, True])
def test_bench_serving_sglang_backend(url, tokenize_prompt):
    from transformers import AutoTokenizer

    models = requests.get(url + "/v1/models", timeout=30).json()["data"]
    assert models and models[0]["id"]
    info = requests.get(url + "/model_info", timeout=30).json()
    tokenizer = AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info.get("model_path"))
    rng = random.Random(0)
    lengths = [(rng.randint(12, 40), rng.randint(4, 16)) for _ in range(12)]
    prompts = [_random_prompt(tokenizer, rng, n) for n, _ in lengths]
    if tokenize_prompt:
        prompts = [tokenizer.encode(p) for p in prompts]

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_bench_serving_request(session, url + "/generate", p, o)
                                          for p, (_, o) in zip(prompts, lengths)))

    requests.post(url + "/flush_cache", params={"timeout": 60.0}, timeout=60).raise_for_status()
    outs = asyncio.run(run())
    assert all(o["success"] for o in outs)
    assert [o["output_len"] for o in outs] == [o for _, o in lengths]  # ignore_eos: exactly what was asked
    for p, o in zip(prompts, outs):
        assert o["prompt_len"] == len(p if tokenize_prompt else tokenizer.encode(p))
        assert o["ttft"] > 0 and len(o["itl"]) < o["output_len"]  # one latency per token after the first event's
    server_info = requests.get(url + "/server_info", timeout=30).json()
    assert server_info["internal_states"][0].get("avg_spec_accept_length", None) is None


async def _sse_events(response):
    """The JSON events of a 200 SSE response, as bench_multiturn reads them (`data: ` lines, `[DONE]` skipped)."""
    assert response.status == 200, await response.text()
    async for chunk_bytes in response.content:
        chunk = chunk_bytes.strip().decode("utf-8").removeprefix("data: ")
        if chunk and chunk != "[DONE]":
            yield json.loads(chunk)


async def _multiturn_sglang_request(session, url: str, history: list[int], output_len: int) -> dict:
    """bench_multiturn's `--api-format sglang` request (sglang/test/kits/cache_hit_kit.py): the history as
    `input_ids`, streamed; `output_ids` is cumulative (the last event holds the whole answer), the first event's
    meta_info gives `prompt_tokens` and `cached_tokens`."""
    payload = {"input_ids": history,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
               "stream": True, "stream_options": {"include_usage": True}, "lora_path": "",
               "return_logprob": False, "logprob_start_len": -1}
    out = {"output_ids": [], "prompt_len": 0, "cached_tokens": 0, "ttft": 0.0}
    st = time.perf_counter()
    async with session.post(url=url + "/generate", json=payload) as response:
        async for data in _sse_events(response):
            if data.get("output_ids"):
                out["output_ids"] = data["output_ids"]
                if out["ttft"] == 0.0:
                    out["ttft"] = time.perf_counter() - st
                    meta = data.get("meta_info") or {}
                    out["prompt_len"], out["cached_tokens"] = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
    return out


async def _multiturn_openai_request(session, url: str, model: str, messages: list[dict], output_len: int) -> dict:
    """bench_multiturn's `--api-format openai` request: streamed chat whose `model` is /get_model_info's
    `model_path`; the answer from the content deltas, the counts from the final chunk's usage."""
    payload = {"model": model, "messages": messages, "max_tokens": output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    out = {"text": "", "prompt_len": 0, "cached_tokens": 0, "completion_tokens": 0}
    async with session.post(url=url + "/v1/chat/completions", json=payload) as response:
        async for data in _sse_events(response):
            if data.get("choices"):
                out["text"] += data["choices"][0].get("delta", {}).get("content") or ""
            if data.get("usage"):
                usage = data["usage"]
                out["prompt_len"], out["completion_tokens"] = usage["prompt_tokens"], usage["completion_tokens"]
                out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return out


def test_bench_multiturn_sglang_format(url):
    """Clients whose token history grows by each answer's `output_ids` and a new question's ids: each round's
    prompt is exactly the history, and all of the previous round's prompt comes from the cache."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(requests.get(url + "/get_model_info", timeout=30).json()["model_path"])
    rng = random.Random(1)
    num_clients, num_rounds, output_len = 3, 3, 6
    histories = {i: tokenizer.encode(_random_prompt(tokenizer, rng, 16)) for i in range(num_clients)}
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()

    async def client(i, session):
        rounds = []
        for _ in range(num_rounds):
            out = await _multiturn_sglang_request(session, url, histories[i], output_len)
            assert out["prompt_len"] == len(histories[i]) and len(out["output_ids"]) == output_len
            rounds.append((len(histories[i]), out["cached_tokens"]))
            histories[i] = histories[i] + out["output_ids"] + tokenizer.encode(_random_prompt(tokenizer, rng, 8))
        return rounds

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(client(i, session) for i in range(num_clients)))

    for rounds in asyncio.run(run()):
        for (prev_len, _), (prompt_len, cached) in zip(rounds, rounds[1:]):
            assert prev_len <= cached < prompt_len


def test_bench_multiturn_openai_format(url):
    """`--api-format openai`: `model` is the folder /get_model_info reports (the server here is started with
    another --served-model-name, so only that folder names the model), and the second turn's usage reports the
    first turn's prompt as cached."""
    model_path = requests.get(url + "/get_model_info", timeout=30).json()["model_path"]
    assert model_path not in [m["id"] for m in requests.get(url + "/v1/models", timeout=30).json()["data"]]
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()

    async def run():
        async with aiohttp.ClientSession() as session:
            messages = [{"role": "user", "content": "Name three rivers of Europe and say where each one flows."}]
            first = await _multiturn_openai_request(session, url, model_path, messages, 6)
            messages += [{"role": "assistant", "content": first["text"]},
                         {"role": "user", "content": "Which of them is the longest?"}]
            return first, await _multiturn_openai_request(session, url, model_path, messages, 6)

    first, second = asyncio.run(run())
    assert first["completion_tokens"] > 0 and first["prompt_len"] > 0 and second["prompt_len"] > first["prompt_len"]
    assert second["cached_tokens"] >= first["prompt_len"] - 1
    unknown = requests.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model_path + "-other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def _srt_kwargs(**given) -> dict:
    """SglSamplingParams.to_srt_kwargs with the frontend's defaults (None where unset)."""
    base = {"max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": (), "stop_token_ids": (),
            "stop_regex": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
            "json_schema": None}
    return {**base, **given}


def _post(url, body):
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_runtime_endpoint_calls(url, engine):
    info = requests.get(url + "/get_model_info", timeout=30).json()
    assert info["model_path"]
    text = "Question: what is the capital of France?\nAnswer:"
    _post(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})  # cache_prefix / commit_lazy_operations
    # generate: a dtype=int gen becomes REGEX_INT with stop [" ", "\n"]
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
              **_srt_kwargs(max_new_tokens=8, temperature=0.0, regex=r"[-+]?[0-9]+[ \n]*", stop=[" ", "\n"])}
    obj = _post(url, {"text": text, "sampling_params": params})
    assert obj["text"].strip().lstrip("+-").isdigit() and obj["meta_info"]["prompt_tokens"] > 0
    # generate_stream: each `data:` line's text past what was read so far
    plain = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
             **_srt_kwargs(max_new_tokens=8, temperature=0.0, ignore_eos=True)}
    pieces, pos = [], 0
    with requests.post(url + "/generate", json={"text": text, "sampling_params": plain, "stream": True},
                       stream=True, timeout=120) as res:
        assert res.status_code == 200
        for chunk in res.iter_lines(decode_unicode=False):
            chunk = chunk.decode("utf-8")
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                data = json.loads(chunk[5:].strip("\n"))
                pieces.append(data["text"][pos:])
                pos += len(pieces[-1])
    assert "".join(pieces) == _post(url, {"text": text, "sampling_params": plain})["text"]
    # select: the choices scored by prompt logprobs, as RuntimeEndpoint.select computes them
    choices = [" Paris", " London", " Rome"]
    prompt_len = _post(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    obj = _post(url, {"text": [text + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                      "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start})
    assert len(obj) == len(choices)
    input_lps = [r["meta_info"]["input_token_logprobs"] for r in obj]
    assert all(r["meta_info"]["output_token_logprobs"] == [] for r in obj)
    ids = engine.tokenizer.encode(text)
    for c, lps in zip(choices, input_lps):
        full = engine.tokenizer.encode(text + c)
        assert [t for _, t, _ in lps] == full[start:] and all(isinstance(s, str) for _, _, s in lps)
        _, _, (ref,) = engine.score_continuations(full[:start], [full[start:]])
        assert [lp for lp, _, _ in lps] == pytest.approx(ref, abs=1e-4)
    assert all(lps[0][1] == ids[start] for lps in input_lps)  # the token-healing check reads lps[0]'s text
    normalized = [sum(x[0] for x in lps if x[0]) / len([x for x in lps if x[0]]) for lps in input_lps]
    assert len(normalized) == 3
    uncond = _post(url, {"input_ids": [[t for _, t, _ in lps] for lps in input_lps],
                         "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in uncond] == [0, 0, 0]  # start -1: none (SGLang's)
