"""Chat / completions requests -> (prompt, SamplingParams, tool plan), and engine outputs -> OpenAI objects.

Shared by the HTTP server and the in-process OpenAI shim (which runs the same app without sockets). The
request vocabulary itself (options, response_format, tools, messages) is lowered by prefixrt/lowering.py,
the one translation layer the adapters use too; this module applies it to the server's request models and
builds the response dicts. The routes turn an engine abort into an error (server/errors.py) before these run,
so finish_reason is always one of OpenAI's values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from prefixrt import lowering
from prefixrt.engine.process.messages import PackedIds
from prefixrt.errors import InvalidRequest
from prefixrt.outputs import Chunk, Completion
from prefixrt.params import CONSTRAINT_FIELDS, SamplingParams
from prefixrt.reasoning import ReasoningParser, ReasoningSplitter
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from prefixrt.server.sse import dumps, sse

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

# Request fields that carry over under their OpenAI names (lowering.sampling_options maps them).
_OPTIONS = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
            "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens", "regex",
            "grammar", "choices", "json_schema", "cache_salt", "priority", "speculative")


def constrained_decoding_available() -> bool:
    return importlib.util.find_spec("prefixrt.constrained.compiler") is not None


WARNING_HEADER = "x-prefixrt-warning"  # what the server read other than as written (schema type names)


def with_warnings(response, warnings: list[str]):
    """`response` with the request's warnings in its WARNING_HEADER ("; "-separated), when there are any."""
    if warnings:
        text = "; ".join(warnings).encode("ascii", "backslashreplace").decode("ascii")
        response.headers[WARNING_HEADER] = text
    return response


def _base_params(req: _Sampling, max_new_tokens: int | None, default_max: int,
                 warnings: list[str] | None = None, defaults: dict | None = None) -> dict[str, Any]:
    """SamplingParams fields of the request; `defaults` (the model's generation config, hub/generation.py) fill
    the sampling settings it leaves out."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    params = lowering.sampling_options({k: getattr(req, k) for k in _OPTIONS}, what="request", warnings=warnings)
    for name, value in (defaults or {}).items():
        params.setdefault(name, value)
    params["max_new_tokens"] = default_max if max_new_tokens is None else max_new_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    return params


def _finish_params(params: dict[str, Any]) -> SamplingParams:
    sp = SamplingParams(**params)
    kind = sp.constraint_kind
    if kind is not None and not constrained_decoding_available():
        raise InvalidRequest("constrained decoding (regex, json_schema, grammar, choices, response_format, "
                             "tool_choice) is not available in this build", param=kind)
    return sp


@dataclass
class ChatLowered:
    messages: list[dict]  # what the chat template renders
    params: SamplingParams
    tools: lowering.ToolPlan | None
    template_tools: list[dict] | None  # tools for apply_chat_template(tools=...), when it renders them
    warnings: list[str] = dataclasses.field(default_factory=list)  # for the response's WARNING_HEADER


def chat_params(req: ChatCompletionRequest, eng, defaults: dict | None = None) -> ChatLowered:
    """The messages, SamplingParams and tool plan for a chat request (InvalidRequest when bad); the route
    renders the messages with `eng.encode_chat` (tools given to the template when it renders them). `defaults`:
    sampling settings for those the request leaves out (the model's generation config)."""
    if req.functions is not None or req.function_call is not None:
        raise InvalidRequest("functions / function_call are deprecated; pass tools / tool_choice",
                             param="functions" if req.functions is not None else "function_call")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    lowering.check_output_limit(req.max_tokens, "max_tokens")
    lowering.check_output_limit(req.max_completion_tokens, "max_completion_tokens")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # No limit given: generate until EOS or the context is full (the engine stops at max_context).
    warnings: list[str] = []
    params = _base_params(req, limit, eng.max_context, warnings, defaults)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) if req.response_format else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    syntax = lowering.template_call_syntax(eng.tokenizer) if tools and req.tool_prompt else None
    choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    lowered = lowering.lower_chat([m.model_dump(exclude_none=True) for m in req.messages], tools=tools,
                                  tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
                                  response_format=rf, syntax=syntax, tool_prompt=req.tool_prompt)
    lowered.apply(params)
    return ChatLowered(lowered.messages, _finish_params(params), lowered.tools, lowered.template_tools,
                       warnings + lowered.warnings)


# Arguments of apply_chat_template that the server sets itself: not a request's to give.
_TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
                                "truncation", "max_length", "chat_template", "tokenizer_kwargs",
                                "return_assistant_tokens_mask"})


def template_kwargs(req: ChatCompletionRequest) -> dict | None:
    """The request's `chat_template_kwargs` (None when absent); InvalidRequest naming a reserved key."""
    kw = req.chat_template_kwargs
    if not kw:
        return None
    bad = sorted(k for k in kw if k in _TEMPLATE_RESERVED)
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)} (the server sets "
                             f"{'it' if len(bad) == 1 else 'them'})", param="chat_template_kwargs")
    return dict(kw)


def thinking_enabled(kwargs: dict | None) -> bool:
    """False when the request switches thinking off (`enable_thinking: false`, or `thinking: false` as some
    templates name it)."""
    kw = kwargs or {}
    return kw.get("enable_thinking", True) is not False and kw.get("thinking", True) is not False


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning parser and the end of its rendered prompt (which may open the reasoning block)."""

    parser: ReasoningParser
    prompt_tail: str = ""

    def splitter(self) -> ReasoningSplitter:
        return self.parser.splitter(self.prompt_tail)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.parser.split(text, self.prompt_tail)


def request_reasoning(parser: ReasoningParser | None, kwargs: dict | None, eng, ids: list[int]
                      ) -> Reasoning | None:
    """The Reasoning of a chat request under the server's parser (None without one, or when the request
    switches thinking off). Reads the prompt's last tokens as text; call it off the event loop."""
    if parser is None or not thinking_enabled(kwargs):
        return None
    tok = getattr(eng, "tokenizer", None)
    if tok is None:
        return Reasoning(parser)
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        tail = tok.decode(ids[-8:])
    return Reasoning(parser, tail)


def requested_max_tokens(req: ChatCompletionRequest) -> int | None:
    """The chat request's explicit output limit (max_completion_tokens, else max_tokens), or None."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def fit_max_tokens(params: SamplingParams, requested: int | None, prompt_tokens: int, max_context: int,
                   limit_param: str = "max_tokens") -> SamplingParams:
    """The params with max_new_tokens fitted to the context, as vLLM does: an explicit limit that does not fit
    after the prompt is a 400; a default one is cut to what fits."""
    room = max_context - prompt_tokens
    if requested is not None:
        if requested > room:
            raise InvalidRequest(f"{limit_param} is {requested}, but the model's context is {max_context} tokens "
                                 f"and the prompt has {prompt_tokens}: at most {room} new tokens fit",
                                 param=limit_param)
        return params
    if params.max_new_tokens <= room:
        return params
    return dataclasses.replace(params, max_new_tokens=room)


def completion_params(req: CompletionRequest, warnings: list[str] | None = None, defaults: dict | None = None
                      ) -> tuple[list, SamplingParams]:
    """The prompts (one or a batch) and SamplingParams for a completions request (what was read other than as
    written appended to `warnings`; `defaults` as for chat_params)."""
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    lowering.check_output_limit(req.max_tokens, "max_tokens")
    params = _base_params(req, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, warnings, defaults)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    p = req.prompt
    if isinstance(p, str):
        prompts: list = [p]
    elif p and isinstance(p[0], int):
        prompts = [PackedIds.of(p)]  # StrictInt lists: packed once, not scanned again (messages.PackedIds)
    else:
        prompts = [x if isinstance(x, str) else PackedIds.of(x) for x in p]
    if not prompts:
        raise InvalidRequest("prompt is empty", param="prompt")
    return prompts, _finish_params(params)


def constraint_of(params: dict) -> str | None:
    return next((k for k in CONSTRAINT_FIELDS if params.get(k) not in (None, False)), None)


# ---------------------------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def samples(c: Completion) -> list[Completion]:
    return c.outputs if c.outputs else [c]


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None

    def one(e):
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs", [])]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict] | None, text_start: int = 0) -> dict | None:
    """OpenAI's legacy logprobs object. top_logprobs always holds the sampled token beside the top-k
    alternatives (so `logprobs: 0` still reports the sampled token, as vLLM does); prompt entries echoed
    with a None logprob (the first prompt token) have a None top_logprobs entry."""
    if entries is None:
        return None
    offsets, at = [], text_start
    tops: list[dict | None] = []
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
        if e["logprob"] is None:
            tops.append(None)
            continue
        top = {t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
        top.setdefault(e["token"], e["logprob"])
        tops.append(top)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def chat_message(text: str, plan: lowering.ToolPlan | None) -> tuple[dict, str | None]:
    """The assistant message for a finished output; "tool_calls" when it is one or more tool calls."""
    calls = plan.parse(text) if plan is not None else None
    if calls:
        return {"role": "assistant", "content": None, "refusal": None,
                "tool_calls": [c.to_openai() for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, None


def chat_response(c: Completion, rid: str, model: str, created: int, plan: lowering.ToolPlan | None,
                  reasoning: Reasoning | None = None) -> dict:
    """With `reasoning`, each sample's thinking goes in the message's `reasoning_content`, its answer in
    `content` (or tool calls)."""
    choices = []
    for i, s in enumerate(samples(c)):
        thought, text = reasoning.split(s.text) if reasoning is not None else (None, s.text)
        message, reason = chat_message(text, plan)
        if reasoning is not None:
            message["reasoning_content"] = thought
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(s.logprobs),
                        "finish_reason": reason or s.finish_reason})
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
        "usage": usage(c.prompt_tokens, sum(s.completion_tokens for s in samples(c)), c.cached_tokens),
    }


def completion_response(cs: list[Completion], rid: str, model: str, created: int,
                        echo: list[tuple[str, list[dict] | None]] | None = None) -> dict:
    """echo: per prompt, (its text, its logprob entries or None), put before each of its samples."""
    choices = []
    for k, c in enumerate(cs):
        for s in samples(c):
            head, head_lps = echo[k] if echo else ("", None)
            lps = None
            if s.logprobs is not None:
                lps = completion_logprobs((head_lps or []) + s.logprobs)
            choices.append({"index": len(choices), "text": head + s.text, "logprobs": lps,
                            "finish_reason": s.finish_reason})
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
        "usage": usage(sum(c.prompt_tokens for c in cs),
                       sum(s.completion_tokens for c in cs for s in samples(c)),
                       sum(c.cached_tokens for c in cs)),
    }


def prompt_entries(eng, prompt) -> tuple[str, list[dict]]:
    """A completions prompt's text and per-token logprob entries (the first token's logprob is None, as in
    OpenAI's echo), scored by the engine in one extend of the prompt's first token."""
    tok = eng.tokenizer
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=True)
        pieces = [tok.decode([t]) for t in ids]
    text = prompt if isinstance(prompt, str) else "".join(pieces)
    if len(ids) < 2:
        return text, [{"token": p, "logprob": None, "top_logprobs": []} for p in pieces]
    _, _, (lps,) = eng.score_continuations(ids[:1], [ids[1:]])
    entries = [{"token": pieces[0], "logprob": None, "top_logprobs": []}]
    entries += [{"token": p, "logprob": lp, "top_logprobs": []} for p, lp in zip(pieces[1:], lps)]
    return text, entries


def prompt_text(eng, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        return eng.tokenizer.decode(list(prompt))


class StreamUsage:
    """Accumulates usage over a stream of Chunks (several prompts, n samples each)."""

    def __init__(self):
        self.prompt: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt_tokens, cached_tokens)
        self.completion: dict[tuple[int, int], int] = {}  # (prompt index, sample) -> completion tokens

    def add(self, prompt_index: int, ch: Chunk) -> None:
        self.prompt[prompt_index] = (ch.prompt_tokens, ch.cached_tokens)
        self.completion[(prompt_index, ch.index)] = ch.completion_tokens

    def to_dict(self) -> dict:
        return usage(sum(p for p, _ in self.prompt.values()), sum(self.completion.values()),
                     sum(c for _, c in self.prompt.values()))


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


class TextEvents:
    """The SSE events of one streamed chat or completions response, for the common chunk: new text only (no
    logprobs, no tool calls). `event(index, text, finish_reason)` returns exactly the string that
    `sse(completion_chunk(...))` (obj "text_completion") or `sse(chat_chunk(..., {"content": text}, ...))` (obj
    "chat.completion.chunk") returns, byte for byte, but encodes only the text: the head (id, object, created,
    model) is encoded once per response. Where a fast event could differ (text or model that only the ASCII
    fallback of `dumps` can encode) it builds the event the general way."""

    def __init__(self, rid: str, model: str, created: int, obj: str):
        if obj not in ("text_completion", "chat.completion.chunk"):
            raise ValueError(f"no text events for {obj!r}")
        self.rid, self.model, self.created, self.obj = rid, model, created, obj
        head_obj = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
        head = dumps(head_obj)
        # Only when the head is what plain json.dumps makes of it (no ASCII fallback): then so is the event.
        self._fast = head == json.dumps(head_obj, ensure_ascii=False, allow_nan=False) and head.endswith("[]}")
        self._open = "data: " + head[:-2] + '{"index": '
        self._key = ', "text": ' if obj == "text_completion" else ', "delta": {"content": '
        self._close = ', "logprobs": null, "finish_reason": ' if obj == "text_completion" \
            else '}, "logprobs": null, "finish_reason": '

    def event(self, index: int, text: str, finish_reason: str | None = None) -> str:
        if self._fast:
            t = json.dumps(text, ensure_ascii=False)
            if t.isascii() or _utf8_encodable(t):
                reason = "null" if finish_reason is None else json.dumps(finish_reason, ensure_ascii=False)
                return f"{self._open}{index}{self._key}{t}{self._close}{reason}}}]}}\n\n"
        if self.obj == "text_completion":
            return sse(completion_chunk(self.rid, self.model, self.created, index, text, finish_reason))
        return sse(chat_chunk(self.rid, self.model, self.created, index, {"content": text}, finish_reason))


def _utf8_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate
        return False


def usage_chunk(rid: str, model: str, created: int, obj: str, u: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}


def completion_from_dict(d: dict) -> Completion:
    """Inverse of Completion.to_dict (used by RemoteEngine)."""
    d = dict(d)
    outs = [completion_from_dict(o) for o in d.pop("outputs", []) or []]
    c = Completion(**d)
    c.outputs = outs if outs else [c]
    return c
