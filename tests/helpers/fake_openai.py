"""Test doubles for OpenAI-compatible endpoints, plugged into the real `openai` client through an
httpx.MockTransport (the client builds and parses real HTTP requests and responses; no socket).

- ScriptedModel: a deterministic "model" that knows a record of `Key: value` lines. Given a prompt that
  ends with `Key:` it continues with ` value` and the following lines of the record; otherwise it writes
  the whole record. Tokens are whitespace-separated words. Used to make speculation hold or fail at will.
- FailingModel: every request fails with an HTTP error status.
"""

from __future__ import annotations

import json
import re

import httpx
import openai


def _words(text) -> int:
    if isinstance(text, list):  # content parts: count the text parts
        text = " ".join(p.get("text", "") for p in text)
    return len(text.split())


def _apply_stop(text: str, stop) -> tuple[str, bool]:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    hits = [text.find(s) for s in stops if s and text.find(s) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class ScriptedModel:
    def __init__(self, record: list[tuple[str, str]], accept_choices: bool = False):
        self.record = record
        self.accept_choices = accept_choices
        self.requests: list[dict] = []

    def continuation(self, prompt: str) -> str:
        m = re.search(r"(\w+):\s*$", prompt)
        keys = [k for k, _ in self.record]
        if m and m.group(1) in keys:
            i = keys.index(m.group(1))
            return f" {self.record[i][1]}\n" + "".join(f"{k}: {v}\n" for k, v in self.record[i + 1:])
        return "".join(f"{k}: {v}\n" for k, v in self.record)

    def complete(self, prompt: str, body: dict) -> tuple[str, str]:
        if body.get("choices") is not None:
            if not self.accept_choices:
                raise ValueError("unknown field: choices")
            return body["choices"][0], "stop"
        text = self.continuation(prompt)
        words = text.split(" ")
        limit = body.get("max_tokens") or 10**6
        finish = "stop"
        if _words(text) > limit:
            text, finish = " ".join(words[: limit + 1]), "length"
        text, stopped = _apply_stop(text, body.get("stop"))
        return text, "stop" if stopped else finish

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        chat = request.url.path.endswith("/chat/completions")
        if chat:
            msgs = body["messages"]
            prompt = msgs[-1]["content"] if body.get("continue_final_message") else ""
            prompt_words = sum(_words(m["content"]) for m in msgs)
        else:
            prompt = body["prompt"]
            prompt_words = _words(prompt)
        try:
            text, finish = self.complete(prompt, body)
        except ValueError as e:
            return _error(400, str(e))
        return _response(chat, body, text, finish, prompt_words, _words(text))


class FailingModel:
    def __init__(self, status: int = 503):
        self.status = status
        self.requests: list[dict] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        return _error(self.status, "service unavailable")


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "param": None, "code": None}})


def _response(chat, body, text, finish, prompt_tokens, completion_tokens, logprobs=None, cached=0):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": logprobs}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return httpx.Response(200, json={"id": "fake-1", "object": obj, "created": 0, "model": body["model"],
                                     "choices": [choice], "usage": usage})


def client_for(model) -> openai.OpenAI:
    """A real openai.OpenAI whose HTTP transport is `model.handler` (no retries: failures surface at once)."""
    return openai.OpenAI(base_url="http://fake.invalid/v1", api_key="test", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(model.handler)))
