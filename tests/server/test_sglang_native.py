"""SGLang's native HTTP API on `prefixrt serve` (prefixrt/server/sglang_api.py), through `requests` as SGLang's own
clients call it: /generate with `text` or `input_ids`, single or batch, sampling_params in SGLang's names, streamed
as SGLang streams it (cumulative text, `data: [DONE]`), logprobs (return_logprob / logprob_start_len /
top_logprobs_num / return_text_in_logprobs), rid; /get_model_info, /get_server_info, /flush_cache,
/health_generate; prefixrt's own `prompt` spelling still answering Completion JSON. Outputs are checked against the
in-process engine on the same weights."""

from __future__ import annotations

import json

import pytest
import requests

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def url(server):
    return server.url


def _post(url, body, **kw):
    r = requests.post(url + "/generate", json=body, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, body) -> list:
    """The SSE events of a streamed /generate, read as SGLang's RuntimeEndpoint reads them; the last is [DONE]."""
    events = []
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=False):
            line = line.decode("utf-8")
            if line.startswith("data:"):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[5:].strip()))
    return events


def test_model_info_names_the_folder_a_tokenizer_loads_from(url, model_dirs):
    from transformers import AutoTokenizer

    for route in ("/get_model_info", "/model_info"):
        info = requests.get(url + route, timeout=30).json()
        assert info["model_path"] == str(model_dirs("llama")) and info["is_generation"] is True
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert len(tok.encode(TEXT)) == _post(url, {"text": TEXT, "sampling_params": {"max_new_tokens": 0}})[
        "meta_info"]["prompt_tokens"]


def test_text_and_input_ids_generate_what_the_engine_generates(url, engine):
    ref = engine.generate(TEXT, GREEDY)
    out = _post(url, {"text": TEXT, "sampling_params": GREEDY})
    assert out["text"] == ref.text and out["output_ids"] == ref.token_ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == ref.prompt_tokens and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert 0 <= meta["cached_tokens"] < meta["prompt_tokens"] and meta["e2e_latency"] > 0 and meta["id"]
    ids = engine.tokenizer.encode(TEXT)
    by_ids = _post(url, {"input_ids": ids, "sampling_params": GREEDY})
    assert by_ids["output_ids"] == ref.token_ids
    assert by_ids["meta_info"]["cached_tokens"] == len(ids) - 1  # the same prompt again: all but its last token


def test_batches_and_n_in_sglangs_order(url, engine):
    texts = [TEXT, "A stitch in time"]
    refs = [engine.generate(t, GREEDY) for t in texts]
    outs = _post(url, {"text": texts, "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [r.token_ids for r in refs]
    ids = [engine.tokenizer.encode(t) for t in texts]
    per_prompt = [dict(GREEDY, max_new_tokens=3), dict(GREEDY, max_new_tokens=5)]
    outs = _post(url, {"input_ids": ids, "sampling_params": per_prompt, "rid": ["a", "b"]})
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    # n samples per prompt: all prompts' first samples, then all second samples (SGLang's expansion order)
    outs = _post(url, {"text": texts, "sampling_params": {**GREEDY, "n": 2}})
    assert len(outs) == 4 and [o["output_ids"] for o in outs] == [r.token_ids for r in refs] * 2
    single_n = _post(url, {"text": TEXT, "sampling_params": {**GREEDY, "n": 2}})
    assert isinstance(single_n, list) and len(single_n) == 2


def test_sglang_sampling_names(url, engine):
    seeded = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7, "ignore_eos": True}
    a, b = (_post(url, {"text": TEXT, "sampling_params": seeded}) for _ in range(2))
    ref = engine.generate(TEXT, {"temperature": 1.0, "max_new_tokens": 8, "seed": 7, "ignore_eos": True})
    assert a["output_ids"] == b["output_ids"] == ref.token_ids
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    out = _post(url, {"text": TEXT, "sampling_params": {"max_new_tokens": 16, "json_schema": json.dumps(schema),
                                                         "temperature": 1.0, "top_k": -1,
                                                         "spaces_between_special_tokens": True, "stop": [],
                                                         "stop_token_ids": [], "regex": None, "stop_regex": None}})
    assert set(json.loads(out["text"])) == {"n"}
    stop_at = engine.generate(TEXT, GREEDY).text[2:4]
    stopped = _post(url, {"text": TEXT, "sampling_params": {**GREEDY, "max_new_tokens": 32, "stop": stop_at}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    for bad in ({"stop_regex": "a+"}, {"no_stop_trim": True}, {"structural_tag": "{}"}, {"frobnicate": 1}):
        r = requests.post(url + "/generate", json={"text": TEXT, "sampling_params": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params.{next(iter(bad))}", r.text
    r = requests.post(url + "/generate", json={"text": TEXT, "lora_path": "adapter"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_logprobs(url, engine):
    ids = engine.tokenizer.encode(TEXT)
    out = _post(url, {"text": TEXT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
                      "return_text_in_logprobs": True})
    meta = out["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids and inputs[0][0] is None and all(lp < 0 for lp, _, _ in inputs[1:])
    assert [s for _, _, s in inputs] == [engine.tokenizer.decode([t]) for t in ids]
    _, _, (ref,) = engine.score_continuations(ids[:1], [ids[1:]])
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(ref, abs=1e-4)
    ref_out = engine.generate(ids, {**GREEDY, "logprobs": 0})
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref_out.token_ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(
        [e["logprob"] for e in ref_out.logprobs], abs=1e-4)
    later = _post(url, {"text": TEXT, "sampling_params": GREEDY, "return_logprob": True,
                        "logprob_start_len": len(ids) - 2})["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in later] == ids[-2:] and later[0][2] is None  # no text unless asked
    assert [lp for lp, _, _ in later] == pytest.approx(ref[-2:], abs=1e-4)
    top = _post(url, {"text": TEXT, "sampling_params": GREEDY, "return_logprob": True,
                      "top_logprobs_num": 3})["meta_info"]
    assert top["input_token_logprobs"] == [] and len(top["output_top_logprobs"]) == 6
    assert all(len(alts) == 3 and alts[0][0] >= alts[-1][0] for alts in top["output_top_logprobs"])
    r = requests.post(url + "/generate", json={"text": TEXT, "return_logprob": True, "logprob_start_len": 0,
                                               "top_logprobs_num": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"


def test_stream_is_cumulative_and_ends_with_done(url, engine):
    whole = _post(url, {"text": TEXT, "sampling_params": GREEDY, "return_logprob": True})
    events = _stream(url, {"text": TEXT, "sampling_params": GREEDY, "return_logprob": True})
    assert events[-1] == "[DONE]"
    data = events[:-1]
    assert len(data) > 1
    for prev, cur in zip(data, data[1:]):
        assert cur["text"].startswith(prev["text"]) and cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
        assert cur["meta_info"]["completion_tokens"] >= prev["meta_info"]["completion_tokens"]
    assert all(e["meta_info"]["finish_reason"] is None for e in data[:-1])
    last = data[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6} and last["meta_info"]["e2e_latency"] > 0
    assert len(last["meta_info"]["output_token_logprobs"]) == 6
    # a batch streams each output's events with its index
    batch = _stream(url, {"text": [TEXT, "A stitch"], "sampling_params": {**GREEDY, "n": 2}})[:-1]
    finals = {e["index"]: e for e in batch if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3] and finals[0]["output_ids"] == whole["output_ids"]


def test_prefixrt_prompt_spelling_still_answers_completion_json(url, engine):
    out = _post(url, {"prompt": TEXT, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
    assert out["token_ids"] == engine.generate(TEXT, {**GREEDY, "max_new_tokens": 4}).token_ids
    assert out["finish_reason"] == "length" and "request_id" in out
    r = requests.post(url + "/generate", json={"prompt": TEXT, "text": TEXT}, timeout=30)
    assert r.status_code == 400


def test_admin_and_health_routes(url):
    for method in ("get", "post"):
        assert getattr(requests, method)(url + "/flush_cache", timeout=30).status_code == 200
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert info["internal_states"][0]["requests_total"] >= 0 and info["max_total_num_tokens"] > 0
    assert requests.get(url + "/server_info", timeout=30).status_code == 200
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200
