"""Engine outputs -> OpenAI's response objects: chat.completion, text_completion, their stream chunks, usage,
logprobs; and the response header that carries a request's warnings.

The routes (openai_api.py, responses.py) turn an engine abort into an error (errors.py) before these run, so
finish_reason is always one of OpenAI's values. Tool calls and reasoning are read back by the request's
ToolPlan (lowering/tools.py) and Reasoning (lowering/reasoning.py).
"""

from __future__ import annotations

import contextlib
import json

from prefixrt.lowering.reasoning import Reasoning
from prefixrt.lowering.tools import ToolPlan
from prefixrt.outputs import Chunk, Completion
from prefixrt.server.sse import dumps, sse

WARNING_HEADER = "x-prefixrt-warning"  # what the server read other than as written (schema type names)


def with_warnings(response, warnings: list[str]):
    """`response` with the request's warnings in its WARNING_HEADER ("; "-separated), when there are any."""
    if warnings:
        text = "; ".join(warnings).encode("ascii", "backslashreplace").decode("ascii")
        response.headers[WARNING_HEADER] = text
    return response


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


def chat_message(text: str, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """The assistant message for a finished output; "tool_calls" when it is one or more tool calls."""
    calls = plan.parse(text) if plan is not None else None
    if calls:
        return {"role": "assistant", "content": None, "refusal": None,
                "tool_calls": [c.to_openai() for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, None


def chat_response(c: Completion, rid: str, model: str, created: int, plan: ToolPlan | None,
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
    """A completions prompt's echo text (`echo_text`) and per-token logprob entries, every prompt token's (the
    first token's logprob is None, as in OpenAI's echo), scored by the engine in one extend of the prompt's first
    token."""
    tok = eng.tokenizer
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=True)
        pieces = [tok.decode([t]) for t in ids]
        text = prompt if isinstance(prompt, str) else echo_text(tok, ids)
    if len(ids) < 2:
        return text, [{"token": p, "logprob": None, "top_logprobs": []} for p in pieces]
    _, _, (lps,) = eng.score_continuations(ids[:1], [ids[1:]])
    entries = [{"token": pieces[0], "logprob": None, "top_logprobs": []}]
    entries += [{"token": p, "logprob": lp, "top_logprobs": []} for p, lp in zip(pieces[1:], lps)]
    return text, entries


def prompt_text(eng, prompt) -> str:
    """A completions prompt's echo text: the text as given, token ids decoded by `echo_text`."""
    if isinstance(prompt, str):
        return prompt
    with getattr(eng, "tokenizer_lock", None) or contextlib.nullcontext():
        return echo_text(eng.tokenizer, list(prompt))


def echo_text(tokenizer, ids: list[int]) -> str:
    """The echoed text of a token-id prompt: the ids decoded without the special tokens the tokenizer adds to an
    encoded text (a leading BOS), so `encode(text)` echoes as `text`, as SGLang echoes it; other special tokens in
    the ids (chat-template markers, a prompt of pad ids) are decoded as their text, as vLLM echoes them. (SGLang
    drops every special token, vLLM none: the two agree on every prompt their suites send this way.)"""
    added = set(tokenizer.encode("", add_special_tokens=True))
    start, end = 0, len(ids)
    while start < end and ids[start] in added:
        start += 1
    while end > start and ids[end - 1] in added:
        end -= 1
    return tokenizer.decode(ids[start:end])


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
