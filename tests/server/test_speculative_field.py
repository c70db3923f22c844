"""The per-request speculative opt-out through the OpenAI routes (`extra_body={"speculative": False}`)."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import build_engine

PROMPT = [1] + list(range(40, 60)) * 3  # repetitive: the n-gram drafter has something to propose


@pytest.fixture(scope="module")
def spec_client(tiny_checkpoints, tiny_tokenizer):
    from starlette.testclient import TestClient

    from prefixrt.server.app import create_app

    eng = build_engine(tiny_checkpoints, tiny_tokenizer, "llama", speculative="ngram")
    http = TestClient(create_app(eng))
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="test", http_client=http, max_retries=0)
    yield eng, client
    client.close()
    eng.shutdown()


def test_a_request_opts_out_of_speculation(spec_client):
    eng, client = spec_client
    greedy = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    off = client.completions.create(**greedy, extra_body={"speculative": False})
    assert eng.stats().spec_verify_rows_total == 0
    on = client.completions.create(**greedy)
    assert eng.stats().spec_verify_rows_total > 0
    assert on.choices[0].text == off.choices[0].text  # speculation never changes a greedy answer
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi " * 20}],
                                          max_tokens=4, temperature=0, extra_body={"speculative": False})
    assert chat.choices[0].message.content is not None


def test_a_speculative_field_that_is_not_a_boolean_is_a_400(spec_client):
    _, client = spec_client
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body={"speculative": "sometimes"})
    assert e.value.status_code == 400
