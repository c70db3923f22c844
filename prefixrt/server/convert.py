"""Request -> (prompt, SamplingParams) and Completion/Chunk -> OpenAI response objects (plain dicts).

Shared by the HTTP server and the in-process OpenAI shim (which runs the same app without sockets).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.outputs import Chunk, Completion
from prefixrt.params import CONSTRAINT_FIELDS, SamplingParams
from prefixrt.server import structured
from prefixrt.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

# Request field -> SamplingParams field, for the fields that carry over unchanged.
_PASSTHROUGH = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens", "regex",
                "grammar", "choices", "json_schema", "cache_salt", "priority")


def _base_params(req: _Sampling, max_new_tokens: int | None, default_max: int) -> dict[str, Any]:
    params = {k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}
    params["max_new_tokens"] = default_max if max_new_tokens is None else max_new_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    return params


def _finish_params(params: dict[str, Any]) -> SamplingParams:
    sp = SamplingParams(**params)
    kind = sp.constraint_kind
    if kind is not None and not structured.constrained_decoding_available():
        raise InvalidRequest("constrained decoding (regex, json_schema, grammar, choices, response_format, "
                             "forced tool_choice) is not available in this build", param=kind)
    return sp


def chat_params(req: ChatCompletionRequest, max_context: int
                ) -> tuple[list[dict], SamplingParams, structured.ToolMode]:
    """The engine messages, SamplingParams and tool mode for a chat request (InvalidRequest when bad)."""
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # No limit given: generate until EOS or the context is full (the engine stops at max_context).
    params = _base_params(req, limit, max_context)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    messages = structured.to_engine_messages(req)
    mode = structured.apply(req, messages, params)
    return messages, _finish_params(params), mode


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


def completion_params(req: CompletionRequest) -> tuple[list, SamplingParams]:
    """The prompts (one or a batch) and SamplingParams for a completions request."""
    if req.echo:
        raise InvalidRequest("echo is not supported", param="echo")
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    params = _base_params(req, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    p = req.prompt
    if isinstance(p, str):
        prompts: list = [p]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = list(p)
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
    if entries is None:
        return None
    offsets, at = [], text_start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
        "text_offset": offsets,
    }


def chat_message(text: str, mode: structured.ToolMode) -> tuple[dict, str | None]:
    """The assistant message for a finished output; the finish_reason override when it is a tool call."""
    calls = structured.parse_tool_calls(text, mode)
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, None


def chat_response(c: Completion, rid: str, model: str, created: int, mode: structured.ToolMode) -> dict:
    choices = []
    for i, s in enumerate(samples(c)):
        message, reason = chat_message(s.text, mode)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(s.logprobs),
                        "finish_reason": reason or s.finish_reason})
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
        "usage": usage(c.prompt_tokens, sum(s.completion_tokens for s in samples(c)), c.cached_tokens),
    }


def completion_response(cs: list[Completion], rid: str, model: str, created: int) -> dict:
    choices = []
    for c in cs:
        for s in samples(c):
            choices.append({"index": len(choices), "text": s.text, "logprobs": completion_logprobs(s.logprobs),
                            "finish_reason": s.finish_reason})
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
        "usage": usage(sum(c.prompt_tokens for c in cs),
                       sum(s.completion_tokens for c in cs for s in samples(c)),
                       sum(c.cached_tokens for c in cs)),
    }


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


def usage_chunk(rid: str, model: str, created: int, obj: str, u: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}


def completion_from_dict(d: dict) -> Completion:
    """Inverse of Completion.to_dict (used by RemoteEngine)."""
    d = dict(d)
    outs = [completion_from_dict(o) for o in d.pop("outputs", []) or []]
    c = Completion(**d)
    c.outputs = outs if outs else [c]
    return c
