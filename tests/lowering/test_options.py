"""Options are lowered once (prefixrt/lowering/options.py): a new sampling option is one SamplingParams field plus
its use (the sampler), and every door takes it from that declaration: lowering's option table, the server's
request bodies; the output budget keeps one name, max_new_tokens, from the OpenAI names to the engine, checked
once and fitted to the context once."""

from __future__ import annotations

import dataclasses

import pytest

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.chat import lower_chat_request
from prefixrt.lowering.completion import lower_completion_request
from prefixrt.lowering.options import OPTION_NAMES, OUTPUT_BUDGET_NAMES, lower_options, sampling_options
from prefixrt.params import SamplingParams, option_names
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_body


@dataclasses.dataclass
class TopASamplingParams(SamplingParams):
    """SamplingParams with one more option: the declaration is all the doors need."""

    top_a: float = 0.0


def test_a_new_sampling_option_is_one_declaration():
    assert "top_a" not in OPTION_NAMES and option_names(TopASamplingParams)["top_a"] == "top_a"
    options = lower_options({"top_a": 0.25, "max_tokens": 7}, what="t", params_cls=TopASamplingParams)
    sp = options.sampling_params()
    assert isinstance(sp, TopASamplingParams) and sp.top_a == 0.25 and sp.max_new_tokens == 7
    body = sampling_body(TopASamplingParams)  # the server's request body, with its extras read off the class
    assert body.model_validate({"top_a": 0.5}).top_a == 0.5
    assert body.model_validate({}).top_a is None  # not given: the engine's default
    with pytest.raises(InvalidRequest, match="no sampling option 'top_a'"):  # the plain class has no such option
        lower_options({"top_a": 0.25}, what="t")


def test_every_option_reaches_the_server_bodies():
    """Every SamplingParams option is a field of the chat and completions bodies, unless OpenAI carries it under
    another name (the output budget) or shape (logprobs, json_object through response_format)."""
    for body in (ChatCompletionRequest, CompletionRequest):
        missing = {o for o in option_names() if o not in body.model_fields} - set(OUTPUT_BUDGET_NAMES)
        assert missing <= {"logprobs", "json_object"}, (body.__name__, missing)
    assert "min_tokens" in OPTION_NAMES and "request_id" not in OPTION_NAMES and "detokenize" not in OPTION_NAMES


def test_the_output_budget_has_one_name():
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"):
        options = lower_options({name: 9}, what="t")
        assert options.params["max_new_tokens"] == 9
        assert options.max_new_tokens_param == name
    assert sampling_options({"max_tokens": 5, "max_completion_tokens": 5}, what="t") == {"max_new_tokens": 5}
    with pytest.raises(InvalidRequest, match="give max_tokens or max_completion_tokens, not both") as e:
        lower_options({"max_completion_tokens": 5, "max_tokens": 6}, what="t")
    assert e.value.param == "max_tokens"
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # OpenAI's rule: at least 1
        with pytest.raises(InvalidRequest, match=f"{name} must be at least 1") as e:
            lower_options({name: 0}, what="t")
        assert e.value.param == name
    assert lower_options({"max_new_tokens": 0}, what="t").params["max_new_tokens"] == 0  # the engine's own name


def test_max_new_tokens_fits_the_context_once():
    explicit = lower_options({"max_completion_tokens": 50}, what="t", default_max_new_tokens=100)
    assert explicit.fit_to_context(prompt_tokens=40, max_context=100).max_new_tokens == 50
    with pytest.raises(InvalidRequest, match="max_completion_tokens is 50, .* at most 10 new tokens fit") as e:
        explicit.fit_to_context(prompt_tokens=90, max_context=100)
    assert e.value.param == "max_completion_tokens"
    default = lower_options({}, what="t", default_max_new_tokens=100)  # no budget given: cut to what fits
    assert default.fit_to_context(prompt_tokens=90, max_context=100, request_id="r").max_new_tokens == 10


def test_requests_lower_through_the_same_options():
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                 "min_tokens": 1, "top_k": 5, "logprobs": True, "top_logprobs": 2})
    lowered = lower_chat_request(chat.model_dump(exclude_none=True, by_alias=True), tokenizer=None, max_context=64)
    sp = lowered.options.fit_to_context(prompt_tokens=4, max_context=64)
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.top_k, sp.logprobs) == (3, 1, 5, 2)
    body = CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 4})
    fields = {k: getattr(body, k) for k in type(body).model_fields if k != "prompt"}
    prompts, options = lower_completion_request(fields, body.prompt)
    assert prompts == [[1, 2, 3]] and options.sampling_params().max_new_tokens == 4
    assert lower_completion_request({}, "hi")[1].params["max_new_tokens"] == 16  # OpenAI's completions default
