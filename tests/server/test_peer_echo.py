"""echo on /v1/completions as the peer servers' own suites check it, ported in our words through the real `openai`
client against `prefixrt serve` (the session's tiny llama, whose tokenizer adds a BOS to an encoded text):

- SGLang's test/srt/openai_server/basic/test_openai_server.py `test_completion` and `test_completion_stream`: every
  combination of echo, logprobs (None / 5), one prompt or a list of two, n (1 / 2) and a text or token-id prompt
  (`tokenizer.encode(prompt)`, its BOS included): the echoed text starts with the prompt's text, logprobs have the
  shapes the suite reads, usage counts the prompt tokens, every choice index streams a first chunk;
- vLLM's tests/entrypoints/openai/test_completion.py `test_echo_logprob_completion`, with its prompts (a text and
  `[0, 0, 0, 0, 0]`, here the pad id: special tokens that the tokenizer does not add are echoed as their text).
"""

from __future__ import annotations

import itertools
import re

import openai
import pytest

from tests.server.conftest import SERVED_NAME

PROMPT = "The capital of France is"
COMBOS = list(itertools.product([False, True], [None, 5], [True, False], [1, 2], [False, True]))


@pytest.fixture(scope="module")
def oai(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    yield c
    c.close()


def _prompt(tokenizer, use_list_input: bool, token_input: bool):
    prompt_input = tokenizer.encode(PROMPT) if token_input else PROMPT
    num_prompt_tokens = len(tokenizer.encode(PROMPT))
    if use_list_input:
        return [prompt_input, prompt_input], 2, 2 * num_prompt_tokens
    return prompt_input, 1, num_prompt_tokens


def test_token_prompt_starts_with_the_tokenizers_bos(tiny_tokenizer):
    """The token-id case below is the one that failed: encode() puts a BOS before the prompt's tokens."""
    ids = tiny_tokenizer.encode(PROMPT)
    assert ids[0] == tiny_tokenizer.bos_token_id and tiny_tokenizer.decode(ids).startswith("<bos>")


@pytest.mark.parametrize("echo,logprobs,use_list_input,n,token_input", COMBOS)
def test_sglang_completion(oai, tiny_tokenizer, echo, logprobs, use_list_input, n, token_input):
    prompt_arg, num_choices, num_prompt_tokens = _prompt(tiny_tokenizer, use_list_input, token_input)
    response = oai.completions.create(model=SERVED_NAME, prompt=prompt_arg, temperature=0, max_tokens=32, echo=echo,
                                      logprobs=logprobs, n=n)
    assert len(response.choices) == num_choices * n
    if echo:
        for choice in response.choices:
            assert choice.text.startswith(PROMPT), choice.text
    if logprobs:
        lp = response.choices[0].logprobs
        assert lp and isinstance(lp.tokens[0], str)
        assert isinstance(lp.top_logprobs[1], dict) and len(lp.top_logprobs[1]) > 0
        if not echo:
            assert lp.token_logprobs[0]
    assert response.id and response.created
    assert response.usage.prompt_tokens == num_prompt_tokens
    assert response.usage.completion_tokens > 0 and response.usage.total_tokens > 0


@pytest.mark.parametrize("echo,logprobs,use_list_input,n,token_input", COMBOS)
def test_sglang_completion_stream(oai, tiny_tokenizer, echo, logprobs, use_list_input, n, token_input):
    prompt_arg, num_choices, _ = _prompt(tiny_tokenizer, use_list_input, token_input)
    stream = oai.completions.create(model=SERVED_NAME, prompt=prompt_arg, temperature=0, max_tokens=32, echo=echo,
                                    logprobs=logprobs, stream=True, stream_options={"include_usage": True}, n=n)
    is_first: dict[int, bool] = {}
    usage_seen = False
    for response in stream:
        if response.usage is not None:
            u = response.usage
            assert u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens > 0
            usage_seen = True
            continue
        choice = response.choices[0]
        first = is_first.get(choice.index, True)
        if logprobs:
            assert choice.logprobs and isinstance(choice.logprobs.tokens[0], str)
            if not (first and echo):
                assert isinstance(choice.logprobs.top_logprobs[0], dict) and len(choice.logprobs.top_logprobs[0]) > 0
        if first:
            if echo:
                assert choice.text.startswith(PROMPT), choice.text
            is_first[choice.index] = False
        assert response.id and response.created
    assert usage_seen
    assert all(not is_first.get(i, True) for i in range(num_choices * n)), is_first


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_vllm_echo_logprob_completion(oai, tiny_tokenizer, logprobs_arg):
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                            logprobs=logprobs_arg)
        prompt_text = tiny_tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert re.search(r"^" + re.escape(prompt_text), completion.choices[0].text)
        lp = completion.choices[0].logprobs
        assert lp is not None
        assert len(lp.text_offset) > 5
        assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1
        assert len(lp.tokens) > 5
