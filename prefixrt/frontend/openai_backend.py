"""OpenAIBackend: run programs on a black-box OpenAI-compatible endpoint (chat or completions API).

With `speculative_tokens=N`, several gens in a row (`"Name:" + gen("name", stop="\\n") + "\\nJob:" + gen(...)`)
are answered by one call of up to N tokens that ignores the intermediate stops, split afterwards against
the template's literal text (speculative.py); the unmatched remainder is run as ordinary calls.

Chat endpoints cannot continue a partial assistant message in the OpenAI API itself; a gen that follows
literal text inside assistant(...) is sent with `continue_final_message=True, add_generation_prompt=False`
in the request body (the convention of vLLM and SGLang servers). Speculation avoids that for the gens it
resolves.
"""

from __future__ import annotations

import difflib
import threading
from typing import Any

from prefixrt.frontend.backend import (
    BackendError,
    Context,
    GenResult,
    ProgramBackend,
    SamplingArgs,
    SelectResult,
)
from prefixrt.frontend.chat_format import PlainFormat, TemplateFormat
from prefixrt.frontend.ir import Expr, Gen
from prefixrt.frontend.speculative import match_template, speculation_window

TOP_LOGPROBS = 20


class OpenAIBackend(ProgramBackend):
    """`OpenAIBackend(model, client=openai.OpenAI(...), speculative_tokens=N, chat=True)`.

    client: an `openai.OpenAI` (built from base_url/api_key when omitted). chat: use /chat/completions
    (True) or /completions with the program rendered as text (False). tokenizer: optional HF tokenizer of the
    served model, used to render completion prompts with its chat template and to check gens' max_tokens
    on speculated values. Counters (cumulative, thread-safe): num_api_calls, prompt_tokens,
    completion_tokens, cached_tokens; reset with reset_counters().
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
        self._lock = threading.Lock()
        self.reset_counters()

    def reset_counters(self) -> None:
        with self._lock:
            self.num_api_calls = 0
            self.prompt_tokens = 0
            self.completion_tokens = 0
            self.cached_tokens = 0

    # ------------------------------------------------------------------ one API call
    def _request(self, ctx: Context, max_tokens: int, temperature: float, top_p: float = 1.0,
                 stop: list[str] | None = None, extra_body: dict | None = None, logprobs: bool = False,
                 response_format: dict | None = None, continue_partial: bool = True):
        """Call the endpoint for a continuation of ctx. Returns (text, finish_reason, usage, top_logprobs)
        where top_logprobs is {token: logprob} of the first generated token, or None."""
        body: dict[str, Any] = dict(extra_body or {})
        kw: dict[str, Any] = dict(model=self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        if stop:
            kw["stop"] = stop
        try:
            if self.chat:
                if ctx.open_role != "assistant":
                    raise BackendError("on a chat endpoint, gen/select must be inside assistant(...)")
                messages = ctx.messages()
                if ctx.partial and continue_partial:
                    messages.append({"role": "assistant", "content": ctx.partial})
                    body.update(continue_final_message=True, add_generation_prompt=False)
                if logprobs:
                    kw.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
                if response_format is not None:
                    kw["response_format"] = response_format
                resp = self.client.chat.completions.create(messages=messages, extra_body=body or None, **kw)
                choice = resp.choices[0]
                text = choice.message.content or ""
                top = None
                if logprobs and choice.logprobs is not None and choice.logprobs.content:
                    top = {t.token: t.logprob for t in choice.logprobs.content[0].top_logprobs}
            else:
                if logprobs:
                    kw["logprobs"] = TOP_LOGPROBS
                resp = self.client.completions.create(prompt=self.render(ctx), extra_body=body or None, **kw)
                choice = resp.choices[0]
                text = choice.text or ""
                top = None
                if logprobs and choice.logprobs is not None and choice.logprobs.top_logprobs:
                    top = dict(choice.logprobs.top_logprobs[0])
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"{'chat' if self.chat else 'completions'} request failed: "
                               f"{type(e).__name__}: {e}") from e
        usage = resp.usage
        with self._lock:
            self.num_api_calls += 1
            if usage is not None:
                self.prompt_tokens += usage.prompt_tokens or 0
                self.completion_tokens += usage.completion_tokens or 0
                details = getattr(usage, "prompt_tokens_details", None)
                self.cached_tokens += (getattr(details, "cached_tokens", 0) or 0) if details else 0
        return text, choice.finish_reason, usage, top

    @staticmethod
    def _usage(res: GenResult, usage) -> GenResult:
        if usage is not None:
            res.prompt_tokens = usage.prompt_tokens or 0
            details = getattr(usage, "prompt_tokens_details", None)
            res.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
        return res

    # ------------------------------------------------------------------ ProgramBackend
    def generate(self, ctx: Context, args: SamplingArgs) -> GenResult:
        body = dict(args.extra)
        response_format = None
        if args.regex is not None:
            body["regex"] = args.regex
        if args.choices is not None:
            body["choices"] = args.choices
        if args.json_schema is not None:
            schema = args.json_schema
            if hasattr(schema, "model_json_schema"):
                schema = schema.model_json_schema()
            if self.chat:
                response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            else:  # the completions API has no response_format: the `json_schema` extra field (prefixrt serve)
                body["json_schema"] = schema
        text, finish, usage, _ = self._request(ctx, args.max_tokens, args.temperature, args.top_p, args.stop, body,
                                               response_format=response_format)
        return self._usage(GenResult(text, finish_reason=finish), usage)

    def speculate(self, ctx: Context, items: list[Expr], defaults: dict) -> list[GenResult] | None:
        window = speculation_window(items)
        gens = [x for x in window if isinstance(x, Gen)]
        if not gens:
            return None
        if self.chat:
            if ctx.open_role != "assistant" or (len(gens) < 2 and not ctx.partial):
                return None
        elif len(gens) < 2:
            return None
        first = SamplingArgs.resolve(gens[0], defaults)
        text, finish, usage, _ = self._request(ctx, self.speculative_tokens, first.temperature, first.top_p,
                                               extra_body=dict(first.extra), continue_partial=False)
        if self.chat:  # the reply is the whole assistant message: it must begin with the literal text so far
            if not text.startswith(ctx.partial):
                return []
            text = text[len(ctx.partial):]
        resolved = [self._resolve_max_tokens(g, defaults) for g in window]
        values = match_template(text, resolved, ended=finish == "stop", count_tokens=self._count_tokens)
        results = [GenResult(v, finish_reason="stop") for v in values]
        if results:
            self._usage(results[0], usage)
        return results

    @staticmethod
    def _resolve_max_tokens(item: Expr, defaults: dict) -> Expr:
        if isinstance(item, Gen) and item.max_tokens is None:
            return Gen(item.name, defaults.get("max_new_tokens", 128), item.stop, item.temperature, item.top_p)
        return item

    def _count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return 0  # unknown: max_tokens of speculated gens is not checked without a tokenizer
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def select(self, ctx: Context, choices: list[str]) -> SelectResult:
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
