"""Backends: where a program's gen/select/fork-hint calls go.

`ProgramBackend` is the small interface the interpreter needs. `ProviderBackend` runs programs on any
`prefixrt.Provider` (Engine, RemoteEngine) with prefix hints; `OpenAIBackend` (openai_backend.py) runs them on a
black-box OpenAI-compatible endpoint with API speculative execution.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.frontend.chat_format import (
    ChatFormat,
    Message,
    Piece,
    PlainFormat,
    TemplateFormat,
    message_dict,
)
from prefixrt.frontend.ir import GEN_SAMPLING, REGEX_FLOAT, REGEX_STR, Gen
from prefixrt.frontend.select import ChoiceScores, teacher_forced_scores
from prefixrt.frontend.token_prefix import TokenPrefix, after_generation, continued_prompt
from prefixrt.lowering.choice_scoring import best_choice

log = logging.getLogger("prefixrt.frontend")


@dataclass
class Context:
    """A snapshot of a state at the point of a backend call (the backend renders it as it needs)."""

    pieces: list[Piece]
    open_role: str | None = None
    partial: str = ""  # content of the open role block so far
    partial_media: list = field(default_factory=list)  # (offset in partial, ir.Media) of the open block
    token_prefix: TokenPrefix | None = None  # the ids the state's text begins with (token_prefix.py)

    def messages(self) -> list[dict]:
        """Completed chat messages (the open block is not included)."""
        return [p.to_dict() for p in self.pieces if isinstance(p, Message)]


@dataclass
class SamplingArgs:
    """A gen's sampling parameters after the run's defaults were applied. `extra`: GEN_SAMPLING fields."""

    max_tokens: int | None
    temperature: float
    top_p: float = 1.0
    stop: list[str] | None = None
    regex: str | None = None
    json_schema: Any = None
    choices: list[str] | None = None
    extra: dict = field(default_factory=dict)
    min_tokens: int | None = None

    @property
    def constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.choices is not None

    @classmethod
    def resolve(cls, g: Gen, defaults: dict) -> SamplingArgs:
        max_tokens = g.max_tokens if g.max_tokens is not None else defaults.get("max_new_tokens", 128)
        stop = g.stop if g.stop is not None else defaults.get("stop")
        regex = bounded_regex(g.regex, max_tokens)
        extra = {k: defaults[k] for k in GEN_SAMPLING if defaults.get(k) is not None}
        extra.update(g.extra)
        return cls(
            max_tokens=max_tokens,
            temperature=g.temperature if g.temperature is not None else defaults.get("temperature", 1.0),
            top_p=g.top_p if g.top_p is not None else defaults.get("top_p", 1.0),
            stop=[stop] if isinstance(stop, str) else (list(stop) if stop else None),
            regex=regex, json_schema=g.json_schema, choices=g.choices, extra=extra, min_tokens=g.min_tokens,
        )


def bounded_regex(regex: str | None, max_tokens: int) -> str | None:
    """REGEX_STR and REGEX_FLOAT made to always complete within max_tokens (every token adds at least one
    character): a string of at most max_tokens - 2 characters inside its quotes; a float whose integer and
    fraction parts leave room for the digit after its point. Other regexes are returned unchanged."""
    if regex == REGEX_STR:
        return REGEX_STR[:-2] + "{0,%d}" % max(0, max_tokens - 2) + '"'  # noqa: UP031
    if regex == REGEX_FLOAT and max_tokens >= 4:
        k = max(1, (max_tokens - 3) // 2)
        return r"-?[0-9]{1,%d}(\.[0-9]{1,%d})?[ \n]?" % (k, k)  # noqa: UP031
    return regex


@dataclass
class GenResult:
    text: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    completion_tokens: int = 0
    token_prefix: TokenPrefix | None = None  # the prompt's text + `text`, with their exact ids (None: not known)


@dataclass
class SelectResult:
    choice: str
    scores: dict[str, float]
    method: str  # how the scores were obtained ("engine", "logprobs", "constrained", "nearest", ...)
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class SpecText:
    """The answer of a speculative call: `text` continues the context (None: the reply does not, e.g. a chat
    reply that does not begin with the assistant block's literal text), `ended` it stopped by itself.
    whole_block: the call answers the whole role block (a chat reply), so a second guess in the same block
    would get the same reply."""

    text: str | None
    ended: bool
    result: GenResult
    whole_block: bool = False


class TokenUsage:
    """Tokens and calls a backend has spent (cumulative, thread-safe); `reset()` starts over."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.num_calls = 0
            self.prompt_tokens = 0
            self.completion_tokens = 0
            self.cached_tokens = 0

    def add(self, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0, calls: int = 1):
        with self._lock:
            self.num_calls += calls
            self.prompt_tokens += prompt_tokens or 0
            self.completion_tokens += completion_tokens or 0
            self.cached_tokens += cached_tokens or 0

    def __repr__(self) -> str:
        return (f"TokenUsage(calls={self.num_calls}, prompt={self.prompt_tokens}, "
                f"completion={self.completion_tokens}, cached={self.cached_tokens})")


class BackendError(RuntimeError):
    """The backend failed or refused a call (the message says which call and why)."""


class ProgramBackend(ABC):
    """Where a program runs: what the interpreter calls for gen/select/fork hints (not an attention or
    grammar backend; those are AttentionBackend and GrammarBackend). Implementations must be thread-safe:
    every state's stream calls them. `token_usage` counts every call the backend makes to its model."""

    chat_format: ChatFormat = PlainFormat()
    speculative_tokens: int = 0
    # False: a program's model calls are issued one at a time (its forks' branches wait for each other): the
    # "no frontend parallelism" ablation. Programs of a run_batch still run side by side.
    parallel: bool = True
    token_usage: TokenUsage

    def render(self, ctx: Context) -> str:
        return self.chat_format.render(ctx.pieces, ctx.open_role, ctx.partial)

    @abstractmethod
    def generate(self, ctx: Context, args: SamplingArgs) -> GenResult:
        """Generate a continuation of ctx. Raises BackendError on failure."""

    @abstractmethod
    def select(self, ctx: Context, choices: list[str], method: str | None = None) -> SelectResult:
        """Pick the best continuation of ctx among choices. method: a choices_method, None for the backend's."""

    def generate_stream(self, ctx: Context, args: SamplingArgs, on_text: Callable[[str], None]) -> GenResult:
        """generate(), calling on_text(delta) with each new piece of text as it is produced; the deltas add up
        to the result's text. Default: one delta, the whole text."""
        res = self.generate(ctx, args)
        on_text(res.text)
        return res

    def generate_many(self, calls: list[tuple[Context, SamplingArgs]]) -> list[GenResult]:
        """Independent gens submitted together (compiled programs). Default: concurrent generate() calls."""
        if len(calls) == 1:
            return [self.generate(*calls[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda c: self.generate(*c), calls))

    def check_media(self, kind: str) -> None:
        """Raise InvalidRequest unless the model takes `kind` ("image" | "video") inputs."""
        raise InvalidRequest(f"{type(self).__name__} does not take {kind} inputs")

    def cache_prefix(self, ctx: Context) -> int:
        """Prefix hint: make ctx's prompt cached before several requests extend it. Returns cached tokens."""
        return 0

    def submit_prefix_hint(self, ctx: Context) -> Callable[[], int]:
        """Send ctx's prompt to the cache so that calls made after this returns find it there; returns a
        function that waits for the hint and gives the cached token count. Default: the blocking call."""
        n = self.cache_prefix(ctx)
        return lambda: n

    def speculate(self, ctx: Context, max_tokens: int, args: SamplingArgs) -> SpecText | None:
        """API speculative execution: one call for up to max_tokens tokens continuing ctx, without stop strings,
        sampled as `args`. None: declined, no call made (the default: only API backends speculate)."""
        return None


# ---------------------------------------------------------------------- ProviderBackend
def _in_process(provider) -> bool:
    """An in-process Engine: requests are queued in the order they are made (a fork's prefix hint first)."""
    try:
        from prefixrt.engine.engine import Engine
    except ImportError:
        return False
    return isinstance(provider, Engine)


class ProviderBackend(ProgramBackend):
    """Runs programs on a prefixrt Provider (Engine in-process, RemoteEngine over HTTP).

    Prompts are sent as token ids when a tokenizer is known (the provider's own, or `tokenizer=`), so prefix
    lengths are exact and prefix hints line up with later requests. Without one (a RemoteEngine), a context
    made of whole chat messages is sent as messages, which the provider renders with the model's own chat
    template (the same prompt an Engine gets); other contexts are sent as plain text.

    With token ids, a program's next prompt continues the exact ids of its last prompt and generation where its
    text continues them (token_prefix.py), so the cache reuses what the model wrote even where the text would
    encode to other ids. `token_continuity=False` encodes every prompt's whole text instead, as a provider that
    takes text does: to compare with one.

    `prefix_hints=False` turns off fork/batch `cache_prefix` calls (the ablation). `parallel=False` issues each
    program's calls one at a time, forks included (ProgramBackend.parallel: the other ablation). `select_method`: "auto"
    (the engine's `choices` scoring when the provider reports `choice_scores`, else scoring each choice from
    the provider's top-k token logprobs), "engine" or "logprobs". `normalization`: the choice score, as the
    engine's `choices_method` ("token_length_normalized", "sum", or — engine scoring only —
    "unconditional_normalized"). `model`: one of the provider's LoRA adapters, by name: every call (prefix hints
    included) runs under it; None: the base model.
    """

    def __init__(self, provider, prefix_hints: bool = True, select_method: str = "auto",
                 normalization: str = "token_length_normalized", tokenizer=None, parallel: bool = True,
                 token_continuity: bool = True, model: str | None = None):
        if select_method not in ("auto", "engine", "logprobs"):
            raise ValueError("select_method must be 'auto', 'engine' or 'logprobs'")
        if normalization not in ("token_length_normalized", "sum", "unconditional_normalized"):
            raise ValueError("normalization must be 'token_length_normalized', 'sum' or 'unconditional_normalized'")
        if normalization == "unconditional_normalized" and select_method == "logprobs":
            raise ValueError("unconditional_normalized needs the engine's choice scoring (select_method 'auto' "
                             "or 'engine')")
        self.provider = provider
        self.lora = None
        if model is not None and model != getattr(provider, "model_name", None):
            adapters = getattr(provider, "lora_adapters", None)
            if adapters is None or model not in adapters():
                raise ValueError(f"model={model!r} is neither the provider's model nor one of its LoRA adapters")
            self.lora = model
        self._lora_kw = {"lora": self.lora} if self.lora is not None else {}
        self.prefix_hints = prefix_hints
        self.parallel = parallel
        self.token_continuity = token_continuity
        self.select_method = select_method
        self.normalization = normalization
        own = getattr(provider, "tokenizer", None)
        self.tokenizer = own if own is not None else tokenizer
        # One lock per tokenizer: an engine's own tokenizer is used under the engine's lock.
        self._tok_lock = getattr(provider, "tokenizer_lock", None) if own is not None else None
        self._tok_lock = self._tok_lock or threading.Lock()
        self._engine_choices_ok: bool | None = None  # learnt on first select in "auto"
        self._in_process = _in_process(provider)
        self.token_usage = TokenUsage()
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            self.chat_format = TemplateFormat(self.tokenizer, self._tok_lock)
        else:
            self.chat_format = PlainFormat()

    @property
    def model_name(self) -> str:
        return self.lora or self.provider.model_name

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids; BOS is added unless the rendered text already starts with it."""
        tok = self.tokenizer
        bos = tok.bos_token or ""
        with self._tok_lock:
            return tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    @staticmethod
    def _as_messages(ctx: Context) -> list[dict] | None:
        """ctx as chat messages for the provider to render, when it is exactly that: whole messages, then
        either nothing or an empty assistant turn (the generation prompt)."""
        if not ctx.pieces or not all(isinstance(p, Message) for p in ctx.pieces):
            return None
        if ctx.open_role is None or (ctx.open_role == "assistant" and not ctx.partial):
            return ctx.messages()
        return None

    def prompt(self, ctx: Context):
        """ctx's prompt as the provider takes it: token ids when a tokenizer is known (continuing
        ctx.token_prefix's ids where that is exact), else chat messages or text."""
        return self._prompt(ctx)[0]

    def _prompt(self, ctx: Context) -> tuple[list[int] | list[dict] | str, str | None]:
        """(prompt, its rendered text when the prompt is token ids, else None)."""
        if ctx.partial_media or any(isinstance(p, Message) and p.media for p in ctx.pieces):
            return self._image_messages(ctx), None
        if self.tokenizer is None:
            messages = self._as_messages(ctx)
            if messages is not None:
                return messages, None
        text = self.render(ctx)
        if not text:
            raise BackendError("the prompt is empty: append some text before gen/select")
        if self.tokenizer is None:
            return text, None
        return self._ids(text, ctx.token_prefix if self.token_continuity else None), text

    def _ids(self, text: str, prefix: TokenPrefix | None) -> list[int]:
        """Prompt text -> token ids: prefix's exact ids and the rest of text encoded alone when text continues
        prefix and that spells it exactly (token_prefix.py), else encode(text)."""
        if prefix is not None:
            with self._tok_lock:
                ids = continued_prompt(self.tokenizer, prefix, text)
            if ids is not None:
                return ids
            log.debug("prompt encoded whole: its text does not continue the last generation's exactly")
        return self.encode(text)

    def _token_prefix(self, prompt, text: str | None, token_ids: list[int], out_text: str, matched_stop,
                      params) -> TokenPrefix | None:
        """The state's text after a gen (text + out_text) with its exact ids: prompt + the generated ids that
        spell out_text. None when the prompt was not token ids or no generated ids spell out_text."""
        if text is None or not self.token_continuity:
            return None
        with self._tok_lock:
            return after_generation(self.tokenizer, prompt, text, token_ids, out_text, matched_stop,
                                    params.skip_special_tokens)

    def _params(self, args: SamplingArgs, **over):
        from prefixrt.params import SamplingParams

        kw = dict(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, stop=args.stop,
                  regex=args.regex, json_schema=args.json_schema, choices=args.choices)
        if args.choices is not None:
            kw["choices_method"] = self.normalization
        if args.min_tokens:
            kw["min_new_tokens"] = args.min_tokens
        kw.update(self._lora_kw)
        kw.update(args.extra)
        kw.update(over)
        return SamplingParams(**kw)

    def _generate_or_raise(self, prompt, params):
        """provider.generate, with failures and aborted completions raised as BackendError."""
        try:
            out = self.provider.generate(prompt, params)
        except Exception as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e
        for c in out if isinstance(out, list) else [out]:
            if c.finish_reason == "abort":
                raise BackendError(f"request {c.request_id} was aborted: {c.error or 'no reason given'}")
            self.token_usage.add(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        return out

    # ------------------------------------------------------------------ ProgramBackend
    def generate(self, ctx: Context, args: SamplingArgs) -> GenResult:
        (prompt, text), params = self._prompt(ctx), self._params(args)
        c = self._generate_or_raise(prompt, params)
        return self._gen_result(c, prompt, text, params)

    def _gen_result(self, c, prompt, text: str | None, params) -> GenResult:
        """GenResult of completion c of prompt (rendered from text; None: the prompt was not token ids)."""
        prefix = self._token_prefix(prompt, text, c.token_ids, c.text, c.matched_stop, params)
        return GenResult(c.text, c.prompt_tokens, c.cached_tokens, c.finish_reason, c.completion_tokens, prefix)

    def generate_stream(self, ctx: Context, args: SamplingArgs, on_text: Callable[[str], None]) -> GenResult:
        (prompt, prompt_text), params = self._prompt(ctx), self._params(args)
        text, token_ids, last = [], [], None
        try:
            for chunk in self.provider.stream(prompt, params):
                last = chunk
                if chunk.finish_reason == "abort":
                    raise BackendError(f"request {chunk.request_id} was aborted")
                token_ids.extend(chunk.token_ids)
                if chunk.text:
                    text.append(chunk.text)
                    on_text(chunk.text)
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e
        if last is None:
            raise BackendError("the stream ended without output")
        self.token_usage.add(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        out_text = "".join(text)
        prefix = self._token_prefix(prompt, prompt_text, token_ids, out_text, last.matched_stop, params)
        return GenResult(out_text, last.prompt_tokens, last.cached_tokens, last.finish_reason,
                         last.completion_tokens, prefix)

    def generate_many(self, calls: list[tuple[Context, SamplingArgs]]) -> list[GenResult]:
        """One provider call per group of gens with the same sampling parameters (the engine schedules the
        group's prompts together)."""
        groups: dict[str, list[int]] = {}
        params = [self._params(args) for _, args in calls]
        for i, p in enumerate(params):
            groups.setdefault(repr(p), []).append(i)
        out: list[GenResult | None] = [None] * len(calls)
        for idx in groups.values():
            built = [self._prompt(calls[i][0]) for i in idx]
            prompts = [prompt for prompt, _ in built]
            res = self._generate_or_raise(prompts if len(prompts) > 1 else prompts[0], params[idx[0]])
            for i, (prompt, text), c in zip(idx, built, res if isinstance(res, list) else [res]):
                out[i] = self._gen_result(c, prompt, text, params[i])
        return out

    def check_media(self, kind: str) -> None:
        if kind == "image" and getattr(self.provider, "takes_images", False):
            return
        if kind == "video" and getattr(self.provider, "takes_images", False):
            raise InvalidRequest("video(path) needs a video decoder and none is installed: sample the frames and "
                                 "send them as images, or to the engine as a {'type': 'video', 'video': [frames]} "
                                 "part", param=kind)
        raise InvalidRequest(f"model {self.model_name!r} is a text-only model: {kind}() inputs need a multimodal "
                             f"model (one with an image processor)", param=kind)

    def _image_messages(self, ctx: Context) -> list[dict]:
        """ctx as chat messages with image parts (the engine renders them with the model's template and image
        blocks). Images need whole messages before the gen: an open block holding one cannot be continued."""
        if ctx.partial_media or not ctx.pieces or not all(isinstance(p, Message) for p in ctx.pieces) or not (
                ctx.open_role is None or (ctx.open_role == "assistant" and not ctx.partial)):
            raise BackendError("a prompt with images must be whole chat messages followed by the gen "
                               "(e.g. user(image(path) + question), then assistant(gen(...)))")
        return [message_dict(m) for m in ctx.pieces]  # image parts as data: URLs of the files

    def cache_prefix(self, ctx: Context) -> int:
        if not self.prefix_hints:
            return 0
        prompt = self.prompt(ctx)
        try:
            return self.provider.cache_prefix(prompt, **self._lora_kw)
        except Exception as e:
            raise BackendError(f"cache_prefix failed: {type(e).__name__}: {e}") from e

    def submit_prefix_hint(self, ctx: Context) -> Callable[[], int]:
        """On an in-process engine the hint is queued at once (a prefill-only request) and the returned function
        waits for it to finish (a fork calls it before its branches start). Over a network the hint's round trip
        completes before this returns."""
        if not self.prefix_hints:
            return lambda: 0
        if not self._in_process:
            return super().submit_prefix_hint(ctx)
        from prefixrt.params import SamplingParams

        prompt = self.prompt(ctx)
        try:
            chunks = self.provider.stream(prompt, SamplingParams(max_new_tokens=0, **self._lora_kw))
        except Exception as e:
            raise BackendError(f"cache_prefix failed: {type(e).__name__}: {e}") from e

        def wait() -> int:
            last = None
            for chunk in chunks:
                last = chunk
            return last.prompt_tokens if last is not None and last.finish_reason != "abort" else 0

        return wait

    def cache_prefix_prompt(self, prompt) -> int:
        """Prefix hint for an already built prompt (token ids or text), e.g. a batch's common prefix."""
        if not self.prefix_hints or not prompt:
            return 0
        try:
            return self.provider.cache_prefix(prompt, **self._lora_kw)
        except Exception as e:
            raise BackendError(f"cache_prefix failed: {type(e).__name__}: {e}") from e

    def select(self, ctx: Context, choices: list[str], method: str | None = None) -> SelectResult:
        prompt = self.prompt(ctx)
        normalization = method or self.normalization
        if self.select_method in ("auto", "engine") and self._engine_choices_ok is not False:
            res = self._select_by_engine(prompt, choices, normalization)
            if res is not None:
                return res
            if self.select_method == "engine":
                raise BackendError("the provider does not report choice scores for `choices` requests")
        if normalization == "unconditional_normalized":
            raise BackendError("unconditional_normalized needs the provider's choice scoring")
        if self.tokenizer is None:
            raise BackendError("select needs either the engine's choice scores or a tokenizer to score choices")
        text = self.render(ctx)
        prefix = ctx.token_prefix if self.token_continuity else None
        choice_ids = [self._choice_ids(text, prompt, c, prefix) for c in choices]
        try:
            scores = teacher_forced_scores(self.provider, prompt, choice_ids, normalization,
                                   prefix_hint=self.prefix_hints)
        except Exception as e:
            raise BackendError(f"select failed: {type(e).__name__}: {e}") from e
        return self._result(choices, scores, "logprobs")

    # ------------------------------------------------------------------ select scoring sources
    def _select_by_engine(self, prompt, choices: list[str], normalization: str) -> SelectResult | None:
        """The provider's `choices` request: every choice scored from its token logprobs after the prompt
        (prefilled once), the best returned with each choice's score. None if the provider cannot."""
        from prefixrt.errors import InvalidRequest

        try:
            c = self.provider.generate(prompt, self._params(
                SamplingArgs(max_tokens=1, temperature=0.0, choices=choices), choices_method=normalization))
        except (ImportError, NotImplementedError, InvalidRequest) as e:
            if self.select_method == "engine":
                raise BackendError(f"select failed: {type(e).__name__}: {e}") from e
            self._engine_choices_ok = False
            return None
        except Exception as e:
            raise BackendError(f"select failed: {type(e).__name__}: {e}") from e
        if c.finish_reason == "abort":
            raise BackendError(f"select request {c.request_id} was aborted: {c.error or 'no reason given'}")
        if not c.choice_scores:
            self._engine_choices_ok = False
            return None
        self._engine_choices_ok = True
        self.token_usage.add(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        scores = ChoiceScores([c.choice_scores[ch] for ch in choices], approximate=False,
                              token_logprobs=c.choice_logprobs)
        return self._result(choices, scores, "engine", c.prompt_tokens, c.cached_tokens)

    def _choice_ids(self, text: str, prompt: list[int], choice: str, prefix: TokenPrefix | None) -> list[int]:
        """The tokens choice adds after prompt: from a joint tokenization (made as the prompt's was) when it
        extends the prompt's."""
        joint = self._ids(text + choice, prefix)
        if joint[: len(prompt)] == prompt and len(joint) > len(prompt):
            return joint[len(prompt):]
        with self._tok_lock:
            return self.tokenizer.encode(choice, add_special_tokens=False)

    @staticmethod
    def _result(choices, scores: ChoiceScores, method: str, prompt_tokens: int = 0, cached: int = 0):
        best = best_choice(scores.scores)
        if scores.approximate:
            method += "~"  # some token was outside the reported top logprobs: its logprob is a bound
        return SelectResult(choices[best], dict(zip(choices, scores.scores)), method,
                            prompt_tokens or scores.prompt_tokens, cached or scores.cached_tokens)


# ---------------------------------------------------------------------- the default backend
_default_backend: ProgramBackend | None = None


def set_default_backend(backend) -> None:
    """The backend used when run()/run_batch() get none (a ProgramBackend or any Provider)."""
    global _default_backend
    _default_backend = as_backend(backend) if backend is not None else None


def as_backend(backend) -> ProgramBackend:
    """A ProgramBackend as is; a Provider (anything with generate and cache_prefix) wrapped in ProviderBackend."""
    if backend is None:
        if _default_backend is None:
            raise ValueError("no backend: pass backend=<Engine | RemoteEngine | OpenAIBackend> or call "
                             "prefixrt.set_default_backend")
        return _default_backend
    if isinstance(backend, ProgramBackend):
        return backend
    if callable(getattr(backend, "generate", None)) and callable(getattr(backend, "cache_prefix", None)):
        cached = getattr(backend, "_prefixrt_frontend_backend", None)
        if cached is None:  # one ProviderBackend per provider: its token usage adds up across runs
            cached = ProviderBackend(backend)
            try:
                backend._prefixrt_frontend_backend = cached
            except AttributeError:
                pass
        return cached
    raise TypeError(f"backend must be a Provider or a frontend ProgramBackend, not {type(backend).__name__}")


Backend = ProgramBackend  # the earlier name, kept for code written against prefixrt.frontend.Backend
