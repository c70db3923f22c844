"""Token-id prompts through `prefixrt serve` (engine in its own process): the ids cross to the engine process
packed (engine/process/messages.py pack_token_ids), their range is read off the packed buffer, and the body is decoded by
server/body.py's loads_json. Every bad prompt is still a 400 with an OpenAI error object naming the prompt, and
good prompts of every size generate what the in-process engine generates."""

from __future__ import annotations

import httpx
import pytest

GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("prompt, message", [
    ([2**40], "outside the vocabulary"),  # beyond int32: cannot be packed, still the vocabulary error
    ([-(2**31) - 5], "outside the vocabulary"),
    ([5, -1, 7], "token id -1 is outside the vocabulary"),
    ([5, 320], "token id 320 is outside the vocabulary"),
    ([], "prompt"),
    ([1, 2.5], "prompt"),
    ([1, "x"], "prompt"),
    ([1, True], "prompt"),  # a boolean is no token id (pydantic's lax int would read it as 1)
    ([1, 2.0], "prompt"),
    (list(range(1, 300)) * 40, "tokens"),  # longer than the context
])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_bad_token_id_prompts_are_400s(server, path, prompt, message):
    body = {"prompt": prompt, "sampling_params": GREEDY} if path == "/generate" else \
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": 3}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and message in err["message"], err
    assert err["param"] is None or err["param"].startswith("prompt"), err


def test_token_id_prompts_generate_what_the_engine_generates(server, engine):
    prompts = [[1], [7, 8, 9], [k % 300 + 3 for k in range(100)]]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for ids in prompts:
            r = http.post("/generate", json={"prompt": ids, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["prompt_tokens"] == len(ids)
            assert got["token_ids"] == engine.generate(ids, GREEDY).token_ids
