"""OpenAIBackend: run programs on a black-box OpenAI-compatible endpoint (chat or completions API).

With `speculative_tokens=N` (or a program's `num_api_spec_tokens=N`), several gens in a row, in one statement
or across statements (`"Name:" + gen("name", stop="\\n")`, then `"\\nJob:" + gen(...)`), are answered by one
call of up to N tokens that ignores the intermediate stops; the state keeps the continuation and each later
literal and gen consumes it (speculative.py). What it cannot answer is run as ordinary calls.

Chat endpoints cannot continue a partial assistant message in the OpenAI API itself; a gen that follows
literal text inside assistant(...) is sent with `continue_final_message=True, add_generation_prompt=False`
in the request body (the convention of vLLM and SGLang servers). Speculation avoids that for the gens it
resolves.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.frontend.backend import (
    BackendError,
    Context,
    GenResult,
    ProgramBackend,
    SamplingArgs,
    SelectResult,
    SpecText,
    TokenUsage,
)
from prefixrt.frontend.chat_format import Message, PlainFormat, TemplateFormat, message_dict
from prefixrt.lowering.json_schema import to_json_schema

TOP_LOGPROBS = 20


class OpenAIBackend(ProgramBackend):
    """`OpenAIBackend(model, client=openai.OpenAI(...), speculative_tokens=N, chat=True)`.

    client: an `openai.OpenAI` (built from base_url/api_key when omitted). chat: use /chat/completions
    (True) or /completions with the program rendered as text (False). tokenizer: optional HF tokenizer of the
    served model, used to render completion prompts with its chat template and to check gens' max_tokens
    on speculated values. speculative_tokens: the API speculation budget of programs that set none
    (`@function(num_api_spec_tokens=N)` overrides it). `token_usage` counts calls and tokens (as the
    endpoint reports them); `num_api_calls`, `prompt_tokens`, `completion_tokens`, `cached_tokens` read it.
    """

    def __init__(self, model: str, client=None, speculative_tokens: int = 0, chat: bool = True,
                 base_url: str | None = None, api_key: str | None = None, tokenizer=None,
                 select_logprobs: bool = True):
        if client is None:
            import openai

            client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY")
        if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
            raise ValueError("speculative_tokens must be an integer >= 0")
        self.model = model
        self.client = client
        self.speculative_tokens = speculative_tokens
        self.chat = chat
        self.tokenizer = tokenizer
        self.select_logprobs = select_logprobs
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            self.chat_format = TemplateFormat(tokenizer, threading.Lock())
        else:
            self.chat_format = PlainFormat()
        self.token_usage = TokenUsage()
        self.count_tokens = self._count_tokens if tokenizer is not None else None

    def reset_counters(self) -> None:
        self.token_usage.reset()

    num_api_calls = property(lambda self: self.token_usage.num_calls)
    prompt_tokens = property(lambda self: self.token_usage.prompt_tokens)
    completion_tokens = property(lambda self: self.token_usage.completion_tokens)
    cached_tokens = property(lambda self: self.token_usage.cached_tokens)

    # ------------------------------------------------------------------ requests
    def _messages(self, ctx: Context, continue_partial: bool) -> list[dict]:
        messages = [message_dict(p) for p in ctx.pieces if isinstance(p, Message)]
        if ctx.partial and continue_partial:
            messages.append({"role": "assistant", "content": ctx.partial})
        return messages

    def _prepare(self, ctx: Context, max_tokens: int, temperature: float, top_p: float = 1.0,
                 stop: list[str] | None = None, extra_body: dict | None = None, logprobs: bool = False,
                 response_format: dict | None = None, continue_partial: bool = True) -> tuple[Callable, dict]:
        """(the client's create method, its keyword arguments) for a continuation of ctx."""
        body: dict[str, Any] = dict(extra_body or {})
        kw: dict[str, Any] = dict(model=self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        if stop:
            kw["stop"] = stop
        if self.chat:
            if ctx.open_role != "assistant":
                raise BackendError("on a chat endpoint, gen/select must be inside assistant(...)")
            kw["messages"] = self._messages(ctx, continue_partial)
            if ctx.partial and continue_partial:
                body.update(continue_final_message=True, add_generation_prompt=False)
            if logprobs:
                kw.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
            if response_format is not None:
                kw["response_format"] = response_format
            create = self.client.chat.completions.create
        else:
            if logprobs:
                kw["logprobs"] = TOP_LOGPROBS
            kw["prompt"] = self.render(ctx)
            create = self.client.completions.create
        kw["extra_body"] = body or None
        return create, kw

    def _count(self, usage) -> None:
        if usage is None:
            self.token_usage.add()
            return
        details = getattr(usage, "prompt_tokens_details", None)
        self.token_usage.add(usage.prompt_tokens or 0, usage.completion_tokens or 0,
                             (getattr(details, "cached_tokens", 0) or 0) if details else 0)

    def _failed(self, e: Exception) -> BackendError:
        return BackendError(f"{'chat' if self.chat else 'completions'} request failed: {type(e).__name__}: {e}")

    def _request(self, ctx: Context, max_tokens: int, temperature: float, top_p: float = 1.0,
                 stop: list[str] | None = None, extra_body: dict | None = None, logprobs: bool = False,
                 response_format: dict | None = None, continue_partial: bool = True):
        """Call the endpoint for a continuation of ctx. Returns (text, finish_reason, usage, top_logprobs)
        where top_logprobs is {token: logprob} of the first generated token, or None."""
        create, kw = self._prepare(ctx, max_tokens, temperature, top_p, stop, extra_body, logprobs, response_format,
                                   continue_partial)
        try:
            resp = create(**kw)
            choice = resp.choices[0]
            top = None
            if self.chat:
                text = choice.message.content or ""
                if logprobs and choice.logprobs is not None and choice.logprobs.content:
                    top = {t.token: t.logprob for t in choice.logprobs.content[0].top_logprobs}
            else:
                text = choice.text or ""
                if logprobs and choice.logprobs is not None and choice.logprobs.top_logprobs:
                    top = dict(choice.logprobs.top_logprobs[0])
        except Exception as e:
            raise self._failed(e) from e
        self._count(resp.usage)
        return text, choice.finish_reason, resp.usage, top

    @staticmethod
    def _usage(res: GenResult, usage) -> GenResult:
        if usage is not None:
            res.prompt_tokens = usage.prompt_tokens or 0
            res.completion_tokens = usage.completion_tokens or 0
            details = getattr(usage, "prompt_tokens_details", None)
            res.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
        return res

    # ------------------------------------------------------------------ ProgramBackend
    def _gen_body(self, args: SamplingArgs) -> tuple[dict, dict | None]:
        body = dict(args.extra)
        response_format = None
        if args.min_tokens:
            body["min_tokens"] = args.min_tokens
        if args.regex is not None:
            body["regex"] = args.regex
        if args.choices is not None:
            body["choices"] = args.choices
        if args.json_schema is not None:
            schema = to_json_schema(args.json_schema)
            if self.chat:
                response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            else:  # the completions API has no response_format: the `json_schema` extra field (prefixrt serve)
                body["json_schema"] = schema
        return body, response_format

    def generate(self, ctx: Context, args: SamplingArgs) -> GenResult:
        body, response_format = self._gen_body(args)
        text, finish, usage, _ = self._request(ctx, args.max_tokens, args.temperature, args.top_p, args.stop, body,
                                               response_format=response_format)
        return self._usage(GenResult(text, finish_reason=finish), usage)

    def generate_stream(self, ctx: Context, args: SamplingArgs, on_text: Callable[[str], None]) -> GenResult:
        body, response_format = self._gen_body(args)
        create, kw = self._prepare(ctx, args.max_tokens, args.temperature, args.top_p, args.stop, body,
                                   response_format=response_format)
        parts, finish, usage = [], None, None
        try:
            for event in create(stream=True, stream_options={"include_usage": True}, **kw):
                if getattr(event, "usage", None) is not None:
                    usage = event.usage
                for choice in event.choices or []:
                    delta = (choice.delta.content if self.chat else choice.text) or ""
                    if delta:
                        parts.append(delta)
                        on_text(delta)
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
        except Exception as e:
            raise self._failed(e) from e
        self._count(usage)
        return self._usage(GenResult("".join(parts), finish_reason=finish), usage)

    def speculate(self, ctx: Context, max_tokens: int, args: SamplingArgs) -> SpecText | None:
        if self.chat and ctx.open_role != "assistant":
            return None
        text, finish, usage, _ = self._request(ctx, max_tokens, args.temperature, args.top_p,
                                               extra_body=dict(args.extra), continue_partial=False)
        res = self._usage(GenResult(text, finish_reason=finish), usage)
        if self.chat:  # the reply is the whole assistant message: it must begin with the literal text so far
            if not text.startswith(ctx.partial):
                return SpecText(None, False, res, whole_block=True)
            return SpecText(text[len(ctx.partial):], finish == "stop", res, whole_block=True)
        return SpecText(text, finish == "stop", res)

    def check_media(self, kind: str) -> None:
        if not self.chat:
            raise InvalidRequest(f"{kind}() inputs need a chat endpoint: the completions API takes text only "
                                 f"(OpenAIBackend(..., chat=True))", param=kind)

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def select(self, ctx: Context, choices: list[str], method: str | None = None) -> SelectResult:
        candidates = list(choices)
        scores: dict[str, float] = {}
        if self.select_logprobs:
            try:
                _, _, usage, top = self._request(ctx, 1, 0.0, logprobs=True)
            except BackendError:
                top = None
            if top:
                for c in choices:
                    lps = [lp for tok, lp in top.items() if tok and c.startswith(tok)]
                    scores[c] = max(lps) if lps else float("-inf")
                best = max(scores.values())
                if best > float("-inf"):
                    candidates = [c for c in choices if scores[c] == best]
                    if len(candidates) == 1:
                        return SelectResult(candidates[0], scores, "logprobs", *self._tokens(usage))
        # Constrained choices (`choices` in the body, as prefixrt serve accepts), then nearest plain answer.
        longest = max(len(c) for c in candidates)
        try:
            text, _, usage, _ = self._request(ctx, max(16, longest), 0.0, extra_body={"choices": candidates})
            if text in candidates:
                return SelectResult(text, scores or {c: float(c == text) for c in choices}, "constrained",
                                    *self._tokens(usage))
        except BackendError:
            pass
        text, _, usage, _ = self._request(ctx, max(16, longest), 0.0)
        choice = nearest_choice(text, candidates)
        return SelectResult(choice, scores or {c: float(c == choice) for c in choices}, "nearest",
                            *self._tokens(usage))

    @staticmethod
    def _tokens(usage) -> tuple[int, int]:
        if usage is None:
            return 0, 0
        details = getattr(usage, "prompt_tokens_details", None)
        return usage.prompt_tokens or 0, (getattr(details, "cached_tokens", 0) or 0) if details else 0


def nearest_choice(text: str, choices: list[str]) -> str:
    """The choice that `text` starts with (longest first), else the most similar one."""
    stripped = text.strip()
    starts = [c for c in choices if stripped.startswith(c.strip())]
    if starts:
        return max(starts, key=len)
    return max(choices, key=lambda c: difflib.SequenceMatcher(None, stripped[: 4 * len(c)], c).ratio())

