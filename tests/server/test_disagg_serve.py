"""`prefixrt serve --role decode` + `--role prefill` as two processes (the CLI, gloo over a TCP store on
127.0.0.1): a completion through the decode server equals the single engine's, and the prompt was computed by
the prefill server (its /stats count it)."""

from __future__ import annotations

import httpx

from tests.helpers.serve import ServeProcess, assert_clean, free_port


def test_prefill_and_decode_servers_serve_the_single_engine_output(model_dirs, tmp_path, make_engine):
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]
    want = make_engine("llama").generate(prompt, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", str(model_dirs("llama")), "--served-model-name", "x", "--device", "cpu", "--kv-cache-tokens", "2048", "--debug",
              "--log-level", "warning", "--disagg-addr", addr]
    decode = ServeProcess([*common, "--role", "decode"], tmp_path / "decode.log", wait_healthy=False)
    prefill = ServeProcess([*common, "--role", "prefill", "--disagg-rank", "1"], tmp_path / "prefill.log",
                           wait_healthy=False)
    with decode, prefill:
        decode.wait_ready()
        prefill.wait_ready()
        body = {"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(decode.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1  # all fetched
        assert prefill.stats()["prompt_tokens_total"] == len(prompt) - 1  # ... computed over there
        assert_clean(decode.wait_idle())
        assert_clean(prefill.wait_idle())
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()
        for log in (decode.log(), prefill.log()):
            assert "Traceback" not in log and "scheduler loop error" not in log, log
