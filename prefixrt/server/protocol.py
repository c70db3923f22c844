"""Request bodies the server accepts: OpenAI chat/completions (plus prefixrt's extra fields) and the native API.

Only requests are modelled (they define the OpenAPI schema and the 400s for malformed bodies); responses are
plain dicts built in openai_format.py. Unknown fields are ignored, as vLLM and SGLang do, so clients that send
newer OpenAI fields keep working. Range checks live in SamplingParams (one place, one message per field).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model

from prefixrt.params import SamplingParams, option_names

# A token-id prompt: integers only. pydantic's lax int would take `true` as 1 and 2.0 as 2; the OpenAI API and
# the in-process engine refuse both, so the server does too (a 400 naming the prompt).
TokenIds = list[StrictInt]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields shared by chat and completions, as OpenAI names them."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    user: str | None = None


# SamplingParams' options a body carries under other names or in another shape: the output budget (OpenAI's
# max_tokens, ...), logprobs (a bool with top_logprobs on chat, a count on completions), json_object
# (response_format).
_NOT_IN_BODY = frozenset({"max_new_tokens", "logprobs", "json_object"})


def sampling_body(params_cls: type = SamplingParams, base: type[BaseModel] = _OpenAISampling) -> type[BaseModel]:
    """`base` plus prefixrt's, vLLM's and SGLang's extras: every other request option that params_cls declares
    (params.option_names), each None when not given. A field typed Any there (json_schema) is a JSON object here.
    A new SamplingParams field is a body field without a line here."""
    types = typing.get_type_hints(params_cls)
    extras = {}
    for option, name in option_names(params_cls).items():
        if option in base.model_fields or option in _NOT_IN_BODY:
            continue
        kind = dict[str, Any] if types[name] is Any else types[name]
        extras[option] = (kind | None, None)
    return create_model("_Sampling", __base__=base, **extras)


_Sampling = sampling_body()


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # {"mode": "explicit"}: keep the prompt up to here


class ToolCallFunction(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class RefusalPart(_Body):
    type: Literal["refusal"] = "refusal"
    refusal: str


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Body):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL
    prompt_cache_breakpoint: dict[str, Any] | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    tool_prompt: bool = True  # prefixrt extra: False when the messages already describe the tools
    function_call: Any = None  # OpenAI's deprecated forms: refused with a pointer to tools
    functions: Any = None
    # vLLM / SGLang extra: the final assistant message is a prefix to continue, not a finished turn
    continue_final_message: bool = False
    # vLLM / SGLang extra: variables for the chat template (e.g. {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's prompt caching (prefixrt/lowering/prompt_cache.py): the session key, kept prefixes and their lifetime
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    # Token ids before list[str]: pydantic's smart union tries the members in order and stops at the first that
    # validates strictly, and list[str] fails a token-id prompt one error per token (0.7 ms for 3,500 ids on
    # the event loop, against 0.04 ms this way). The validated value is the same list either way.
    prompt: str | TokenIds | list[TokenIds] | list[str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(_Body):
    """Native /generate in two dialects. prefixrt's: one prompt (text, token ids or chat messages) or a batch
    (`prompts`), and SamplingParams fields; it answers Completion JSON. SGLang's (server/sglang_api.py): `text` or
    `input_ids` (one prompt or a batch), sampling_params in SGLang's names (one dict, or one per prompt), and
    SGLang's per-prompt fields; it answers SGLang's output objects."""

    prompt: str | TokenIds | list[dict[str, Any]] | None = None
    prompts: list[str | TokenIds | list[dict[str, Any]]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    # SGLang's GenerateReqInput
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    lora_path: Any = None  # refused unless empty (adapters are named by `model` on the OpenAI routes)
    return_hidden_states: bool = False
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None


class CachePrefixRequest(_Body):
    prompt: str | TokenIds | list[dict[str, Any]]
    cache_salt: str | None = None
    lora: str | None = None  # a loaded LoRA adapter's name: the prefix cached under it


class AbortRequest(_Body):
    request_id: str
