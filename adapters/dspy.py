"""prefixrt.LM: a dspy.LM whose execution engine is a prefixrt Provider.

DSPy 3.4 splits an LM into the outer `dspy.LM` (response cache, retries, n fan-out, history, usage tracking,
callbacks) and an execution engine with `complete(Request) -> Response` and `stream(Request)`, plus an async
twin, passed as `dspy.LM(engine=..., async_engine=...)` (dspy/clients/engines/base.py). This module supplies that
engine pair over any `prefixrt.Provider`, and `LM`, the `dspy.LM` subclass that builds it:

- lm15 `Request` messages -> chat messages, rendered by the model's chat template in the Provider;
- `Config` (max_tokens, temperature, top_p, top_k, stop, seed, penalties, logprobs) -> SamplingParams;
  `Config.extensions` may carry prefixrt knobs (regex, choices, grammar, cache_salt, repetition_penalty, ...);
- `Config.response_format` (JSONAdapter's structured-output schema) -> `json_schema` constrained decoding, so
  every reply parses; the engine declares `supports_response_schema` for JSONAdapter to send it; the
  `json_object` it sends for signatures with an open mapping field becomes the schema of the fields its
  prompt names (adapters/dspy_formats.py `json_adapter_schema`);
- no response_format: the reply format ChatAdapter or XMLAdapter asked for in the prompt becomes a grammar
  (adapters/dspy_formats.py), so the default ChatAdapter parses on the first call and never falls back;
- `Request.tools` -> constrained decoding over a schema of the tools, returned as ToolCallParts;
- `Completion.cached_tokens` -> `Usage.cache_read_tokens`, which DSPy reports as
  `prompt_tokens_details.cached_tokens` to its usage tracker and history.

Concurrent calls (module.batch, dspy.Parallel, asyncio.gather over acall) reach the engine as concurrent
requests; the engine prefills a shared uncached prefix (DSPy's system prompt, demos) once and the others reuse it
from the radix cache, which shows up as cache_read_tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import dspy
import pydantic
from dspy.lm15 import (
    InvalidRequestError,
    Message,
    Request,
    Response,
    ServerError,
    StreamDeltaEvent,
    StreamEndEvent,
    StreamStartEvent,
    TextDelta,
    TextPart,
    ThinkingDelta,
    ThinkingPart,
    ToolCallDelta,
    ToolCallPart,
    UnsupportedFeatureError,
    Usage,
)
from prefixrt.adapters.dspy_formats import (
    cap_json_adapter_strings,
    json_adapter_schema,
    nested_skeletons,
    output_format_constraint,
)
from prefixrt.adapters.provider_handle import ProviderHandle

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.chat import lower_chat
from prefixrt.lowering.messages import normalize_messages
from prefixrt.lowering.options import sampling_options, with_request_id
from prefixrt.lowering.reasoning import ReasoningParser
from prefixrt.lowering.tools import ToolPlan, new_call_id
from prefixrt.multimodal.messages import IMAGE_MARKER, restore_images
from prefixrt.params import CONSTRAINT_FIELDS

_PROVIDER = "prefixrt"
_LM_CLASS_PATH = "prefixrt.adapters.dspy.LM"
_ENGINE_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                   "logprobs")


# ---------------------------------------------------------------------------------------------- lowering


def _image_of(part) -> str:
    """An lm15 ImagePart as an image source the engine takes (a data: URL, a URL or a local path)."""
    if part.data is not None:
        return f"data:{part.media_type};base64,{part.data}"
    if part.url is not None:
        return part.url
    if part.path is not None:
        return str(part.path)
    raise UnsupportedFeatureError("prefixrt: an image given by file_id cannot be read", provider=_PROVIDER)


def _parts_text(parts, where: str, images: list | None = None) -> str:
    """The text of message parts (tool calls and tool results are carried apart, by `_openai_messages`).
    images: where image parts go (each leaves IMAGE_MARKER in the text); None: image parts are refused."""
    texts = []
    for part in parts:
        kind = part.type
        if kind == "image" and images is not None:
            images.append(_image_of(part))
            texts.append(IMAGE_MARKER)
        elif kind == "text":
            texts.append(part.text)
        elif kind in ("tool_call", "tool_result", "thinking", "citation"):
            continue  # calls and results travel as OpenAI fields; replay state and annotations are not text
        elif kind == "data":
            texts.append(json.dumps(part.value, ensure_ascii=False))
        else:
            raise UnsupportedFeatureError(f"prefixrt models read text only; {where} has a {kind!r} part",
                                          provider=_PROVIDER)
    return "\n".join(t for t in texts if t)


def _openai_messages(request: Request, images: list | None = None) -> list[dict]:
    """lm15 Request messages -> OpenAI chat messages (assistant `tool_calls`, one `tool` message per result).
    images: a list that receives user messages' image parts (see _parts_text); None refuses them."""
    messages = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else _parts_text(request.system, "system")
        messages.append({"role": "system", "content": system})
    for m in request.messages:
        results = [p for p in m.parts if p.type == "tool_result"]
        for r in results:
            messages.append({"role": "tool", "tool_call_id": r.id, "content": _parts_text(r.content, "tool result"),
                             **({"name": r.name} if r.name else {})})
        text = _parts_text(m.parts, f"a {m.role} message", images if m.role == "user" else None)
        if results and not text:
            continue
        message = {"role": "system" if m.role == "developer" else "user" if m.role == "tool" else m.role,
                   "content": text}
        calls = [p for p in m.parts if p.type == "tool_call"]
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.input, ensure_ascii=False)}} for c in calls]
        messages.append(message)
    return normalize_messages(messages)


def request_messages(request: Request) -> list[dict]:
    """lm15 Request -> chat messages (system/user/assistant) for the Provider's chat template."""
    return lower_chat(_openai_messages(request)).messages


def _openai_tools(request: Request) -> tuple[list[dict], Any]:
    """lm15 tools and tool choice -> OpenAI's `tools` and `tool_choice`."""
    if not request.tools:
        return [], None
    if any(t.type != "function" for t in request.tools):
        raise UnsupportedFeatureError("prefixrt: only function tools are supported", provider=_PROVIDER)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": dict(t.parameters)}} for t in request.tools]
    tc = request.config.tool_choice
    if tc is None or tc.mode == "auto":
        return tools, "auto"
    if tc.mode == "none":
        return tools, "none"
    if len(tc.allowed) == 1:
        return tools, {"type": "function", "function": {"name": tc.allowed[0]}}
    return tools, "required"


def lower_request(request: Request, reasoning: bool = False, tokenizer: Any = None
                  ) -> tuple[list[dict], dict, ToolPlan | None]:
    """Request -> (chat messages, SamplingParams dict, the tool plan when tools constrain the reply).

    tokenizer: the model's, where the provider has it (in-process): DSPy's reply formats then count their own text
    in its tokens (else in bytes, which leaves the values less of max_tokens). reasoning: the LM has a reasoning
    parser. A request's reasoning config (DSPy's `reasoning_effort`) is then
    accepted (the model thinks as its template says; the effort is not a knob it has), and DSPy's own reply
    formats are not imposed by decoding, which would hold the reply from its first token and leave no room to
    think (an explicit response_format or tool plan still is).

    The chat request itself (messages, tools, tool choice, response format) is lowered by
    prefixrt/lowering/chat.py lower_chat, as `prefixrt serve` lowers it; what is DSPy's own is the reply format its
    adapters ask for in the prompt (adapters/dspy_formats.py), which becomes the constraint when nothing else
    is one."""
    cfg = request.config
    options: dict[str, Any] = {name: getattr(cfg, name) for name in _ENGINE_OPTIONS}
    options["stop"] = list(cfg.stop) or None
    extensions = dict(cfg.extensions or {})
    parallel = extensions.pop("parallel_tool_calls", None)
    if parallel is None and cfg.tool_choice is not None:
        parallel = cfg.tool_choice.parallel
    if "top_logprobs" in extensions:
        options["logprobs"] = extensions.pop("top_logprobs")
    for key in ("max_completion_tokens",):
        extensions.pop(key, None)
    if (cfg.reasoning is not None and not reasoning) or cfg.cache is not None or cfg.probabilities is not None:
        raise UnsupportedFeatureError("prefixrt: reasoning, provider prompt-cache config and probabilities are not "
                                      "supported (prefix caching is automatic)", provider=_PROVIDER)
    try:
        params = with_request_id(sampling_options({**options, **extensions}, what="dspy request"))
        tools, choice = _openai_tools(request)
        # One tool call per reply unless asked: a small model allowed "one or more" may write calls until
        # max_tokens.
        images: list = []
        lowered = lower_chat(_openai_messages(request, images), tools=tools, tool_choice=choice,
                             parallel_tool_calls=bool(parallel), response_format=cfg.response_format)
        messages = lowered.messages
        if lowered.tools is None and lowered.constraint.get("json_object") and not reasoning:
            # JSONAdapter sends json_object for signatures with an open mapping field; its prompt names the
            # reply's fields, so the reply is held to them (any JSON object lets a small model write keys of its
            # own, and the reply does not parse).
            schema = json_adapter_schema(messages, params.get("max_new_tokens"))
            if schema is not None:
                lowered.constraint = {"json_schema": schema}
        elif lowered.tools is None and isinstance(lowered.constraint.get("json_schema"), dict) and not reasoning:
            # JSONAdapter's own schema: its free strings capped as above, so the object closes within the budget
            # (a small model otherwise writes its first string until max_tokens, and the reply does not parse).
            lowered.constraint = {"json_schema": cap_json_adapter_strings(
                lowered.constraint["json_schema"], messages, params.get("max_new_tokens"))}
        lowered.apply(params)
        if not reasoning and not any(params.get(k) not in (None, False) for k in CONSTRAINT_FIELDS):
            # ChatAdapter / XMLAdapter: their reply format, from the prompt, so the reply parses first time.
            params.update(output_format_constraint(messages, params.get("max_new_tokens"),
                                                   nested_schemas=caller_nested_schemas(messages),
                                                   count_tokens=_token_count(tokenizer)))
        if images:  # image parts back in place for the engine (dspy.Image fields)
            messages = restore_images(messages, images)
    except InvalidRequest as e:
        raise InvalidRequestError(str(e), provider=_PROVIDER) from e
    return messages, params, lowered.tools


def _token_count(tokenizer: Any):
    """A text's token count under `tokenizer` (no special tokens), or None without one."""
    if tokenizer is None:
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def caller_nested_schemas(messages: list[dict]) -> dict[str, dict]:
    """The JSON schemas of the nested fields XMLAdapter asks for (lists, dicts, pydantic models), from the
    signature of the Predict making this call (DSPy's `settings.caller_modules`, innermost last), for each field
    whose nested-XML skeleton in the prompt is the one DSPy writes for that field's type (so a signature other
    than the prompt's is never used). The prompt alone gives no leaf types (`<score>...</score>`): with them an
    int leaf is held to an int. Empty when there is no such caller."""
    users = [m for m in messages if m.get("role") == "user"]
    skeletons = nested_skeletons(users[-1].get("content") or "") if users else {}
    caller = (dspy.settings.caller_modules or [None])[-1]
    fields = getattr(getattr(caller, "signature", None), "output_fields", None)
    to_skeleton = getattr(dspy.XMLAdapter, "_xml_schema", None)
    if not skeletons or not fields or to_skeleton is None:
        return {}
    out = {}
    for name, skeleton in skeletons.items():
        field = fields.get(name)
        if field is None:
            continue
        try:
            same = to_skeleton(name, field.annotation) == skeleton
            schema = pydantic.TypeAdapter(field.annotation).json_schema()
        except (TypeError, ValueError, pydantic.PydanticUserError):  # a type without a JSON schema
            continue
        if same:
            out[name] = schema
    return out


def _translate(e: Exception) -> Exception:
    if isinstance(e, InvalidRequest):
        return InvalidRequestError(str(e), provider=_PROVIDER)
    if isinstance(e, ImportError):
        return UnsupportedFeatureError(f"prefixrt: a component this request needs is not installed: {e}",
                                       provider=_PROVIDER)
    return ServerError(f"{type(e).__name__}: {e}", provider=_PROVIDER)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(input_tokens=prompt_tokens, output_tokens=completion_tokens, cache_read_tokens=cached_tokens)


def _finish(reason: str | None, error: str | None) -> str:
    if reason == "abort":
        raise ServerError(f"request aborted: {error or 'aborted'}", provider=_PROVIDER)
    return "length" if reason == "length" else "stop"


def _reply_parts(text: str, tools: ToolPlan | None) -> tuple[list, bool]:
    """(message parts, whether they are tool calls) for a reply generated under `tools` (or none)."""
    if tools is None:
        return [TextPart(text)], False
    calls = tools.parse(text)
    if calls:
        return [ToolCallPart(id=new_call_id(), name=c.name, input=c.arguments) for c in calls], True
    if tools.forced:
        raise ServerError(f"the tool-call reply is incomplete: {text[:200]!r}; raise max_tokens", provider=_PROVIDER)
    return [TextPart(text)], False


def build_response(request: Request, completion, tools: ToolPlan | None,
                   parser: ReasoningParser | None = None) -> Response:
    """A prefixrt Completion -> an lm15 Response (tool calls parsed when a tool plan constrained it; with a
    reasoning parser, the thinking as a ThinkingPart first, which DSPy reports as reasoning_content)."""
    finish = _finish(completion.finish_reason, getattr(completion, "error", None))
    thought, text = parser.split(completion.text) if parser is not None else (None, completion.text)
    parts, called = _reply_parts(text, tools if finish == "stop" else None)
    if thought is not None:
        parts = [ThinkingPart(thought), *parts]
    if called:
        finish = "tool_call"
    return Response(
        id=completion.request_id, model=request.model, message=Message.assistant(parts), finish_reason=finish,
        usage=_usage(completion.prompt_tokens, completion.completion_tokens, completion.cached_tokens),
    )


class _StreamState:
    """Turns prefixrt Chunks into lm15 stream events (text deltas; a tool call arrives whole at the end)."""

    def __init__(self, request: Request, tools: ToolPlan | None, parser: ReasoningParser | None = None):
        self.request, self.tools = request, tools
        self.text: list[str] = []
        self.last = None
        self.split = parser.splitter() if parser is not None else None

    def start(self, request_id: str) -> StreamStartEvent:
        return StreamStartEvent(id=request_id, model=self.request.model)

    def push(self, chunk) -> list:
        self.last = chunk
        events, text = [], chunk.text
        if self.split is not None:  # the thinking streams as thinking deltas (part 0), the answer after it
            thought, text = self.split.feed(text)
            if chunk.finish_reason is not None:
                more_thought, more_text = self.split.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                events.append(StreamDeltaEvent(delta=ThinkingDelta(text=thought, part_index=0)))
        if not text:
            return events
        self.text.append(text)
        if self.tools is not None:
            return events  # tool calls are JSON: emitted parsed, once complete
        first = 1 if self.split is not None and self.split.saw_reasoning else 0
        return events + [StreamDeltaEvent(delta=TextDelta(text=text, part_index=first))]

    def end(self) -> list:
        c = self.last
        if c is None:
            raise ServerError("the stream ended without output", provider=_PROVIDER)
        finish = _finish(c.finish_reason, None)
        events = []
        if self.tools is not None:
            text = "".join(self.text)
            parts, called = _reply_parts(text, self.tools if finish == "stop" else None)
            for k, part in enumerate(parts):
                if called:
                    events.append(StreamDeltaEvent(delta=ToolCallDelta(
                        input=json.dumps(part.input), part_index=k, id=part.id, name=part.name)))
                elif text:
                    events.append(StreamDeltaEvent(delta=TextDelta(text=text, part_index=0)))
            if called:
                finish = "tool_call"
        events.append(StreamEndEvent(finish_reason=finish,
                                     usage=_usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)))
        return events


# ---------------------------------------------------------------------------------------------- engines


class PrefixRTEngine:
    """DSPy's synchronous engine interface (`complete`, `stream`, `close`) over a prefixrt Provider.

    Capability hints are read by DSPy's adapters: JSONAdapter sends its output schema as `response_format`
    because `supports_response_schema` is True, and prefixrt enforces it by constrained decoding.
    """

    supports_response_schema = True
    supports_function_calling = False  # DSPy adapters keep text-based tool use; explicit Request.tools work
    supports_reasoning = False
    supported_params = frozenset({"temperature", "max_tokens", "top_p", "top_k", "stop", "seed", "response_format",
                                  "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "n"})

    def __init__(self, handle: ProviderHandle, reasoning_parser: str | None = None):
        self.handle = handle
        self.reasoning_parser = reasoning_parser
        self.parser = ReasoningParser(reasoning_parser) if reasoning_parser is not None else None
        self.supports_reasoning = self.parser is not None  # DSPy then leaves a dspy.Reasoning field to us

    @property
    def provider(self):
        return self.handle.get()

    def complete(self, request: Request) -> Response:
        completion, _, tools = self._call(request, "generate")
        return build_response(request, completion, tools, self.parser)

    def stream(self, request: Request) -> Iterator:
        chunks, params, tools = self._call(request, "stream")
        return self._events(request, tools, params["request_id"], chunks)

    def _lower(self, request: Request) -> tuple[list[dict], dict, ToolPlan | None]:
        """lower_request, under the LoRA adapter the LM's model names (if it names one of the provider's)."""
        messages, params, tools = lower_request(request, self.parser is not None,
                                                getattr(self.provider, "tokenizer", None))
        lora = self.handle.lora()
        if lora is not None:
            params["lora"] = lora
        return messages, params, tools

    def _call(self, request: Request, method: str):
        """Lowers the request and calls the provider's `method` ("generate" or "stream") on it, its errors
        translated. -> (the provider's result, the sampling params, the tool plan)"""
        messages, params, tools = self._lower(request)
        try:
            result = getattr(self.provider, method)(messages, params)
        except Exception as e:
            raise _translate(e) from e
        return result, params, tools

    def _events(self, request, tools, request_id, chunks) -> Iterator:
        state = _StreamState(request, tools, self.parser)
        yield state.start(request_id)
        try:
            for chunk in chunks:
                yield from state.push(chunk)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # aborts the request when the consumer stopped early
        yield from state.end()

    def close(self) -> None:
        """Borrowed engines are not shut down here: other LMs may share them."""

    # DSPy saves a custom engine by its class path and this state (LM.dump_state has its own, simpler form).
    def dump_state(self) -> dict:
        state = _handle_state(self.handle)
        if self.reasoning_parser is not None:
            state["reasoning_parser"] = self.reasoning_parser
        return state

    @classmethod
    def load_state(cls, state: dict) -> PrefixRTEngine:
        return cls(_handle_from_state(state), state.get("reasoning_parser"))

    def __deepcopy__(self, memo):
        return self


class AsyncPrefixRTEngine(PrefixRTEngine):
    """DSPy's async engine interface: `await complete(request)`, `async for event in stream(request)`."""

    async def complete(self, request: Request) -> Response:  # type: ignore[override]
        messages, params, tools = self._lower(request)
        try:
            completion = await self.provider.agenerate(messages, params)
        except Exception as e:
            raise _translate(e) from e
        return build_response(request, completion, tools, self.parser)

    async def stream(self, request: Request) -> AsyncIterator:  # type: ignore[override]
        messages, params, tools = self._lower(request)
        try:
            chunks = self.provider.astream(messages, params)
        except Exception as e:
            raise _translate(e) from e
        state = _StreamState(request, tools, self.parser)
        yield state.start(params["request_id"])
        try:
            async for chunk in chunks:
                for event in state.push(chunk):
                    yield event
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        for event in state.end():
            yield event

    async def aclose(self) -> None:
        """Borrowed engines are not shut down here."""


def _handle_state(handle: ProviderHandle) -> dict:
    state: dict[str, Any] = {"model": handle.model_name}
    if handle.base_url is not None:
        state["base_url"] = handle.base_url
    if handle.engine_kwargs:
        state["engine_kwargs"] = handle.engine_kwargs
    return state


def _handle_from_state(state: dict) -> ProviderHandle:
    return ProviderHandle(model=state.get("model"), base_url=state.get("base_url"),
                          engine_kwargs=state.get("engine_kwargs"))


# ---------------------------------------------------------------------------------------------- the LM


class LM(dspy.LM):
    """A `dspy.LM` that runs on prefixrt.

    `LM("gemma-3-270m")` loads the model in-process on first use (one engine per model per process, shared by
    every LM and LangChain model naming it); `LM(engine=eng)` uses an existing Engine or any Provider;
    `LM(base_url="http://127.0.0.1:30000")` talks to a `prefixrt serve` server through `prefixrt.RemoteEngine`.

    The DSPy model string is `prefixrt/<name>@<revision>`: DSPy keys its response cache by that string, so
    different weights never share cached answers. Defaults suit a small local model: temperature 0 (greedy)
    and max_tokens 512. Other keyword arguments are default request options (as for `dspy.LM`), including
    prefixrt's own (regex, choices, grammar, cache_salt, repetition_penalty, top_k, min_p).
    `reasoning_parser` ("qwen3", "deepseek-r1"; prefixrt/lowering/reasoning.py): a reasoning model's thinking is returned
    apart from its reply, as DSPy's `reasoning_content`, and fills a `dspy.Reasoning` output field.
    """

    def __init__(self, model: str | None = None, *, engine: Any = None, base_url: str | None = None,
                 api_key: str | None = None, engine_kwargs: dict | None = None, temperature: float | None = 0.0,
                 max_tokens: int | None = 512, cache: bool = True, num_retries: int = 3, callbacks=None,
                 model_type: str = "chat", reasoning_parser: str | None = None, **kwargs):
        if model_type != "chat":
            raise ValueError("prefixrt.LM supports model_type='chat' only")
        if isinstance(engine, PrefixRTEngine):  # DSPy's load_state / copy hand the engine object back
            handle = engine.handle
            reasoning_parser = reasoning_parser or engine.reasoning_parser
        else:
            if isinstance(model, str) and model.startswith(f"{_PROVIDER}/"):
                model = model[len(_PROVIDER) + 1:].split("@", 1)[0]  # a DSPy model string from a saved state
            handle = ProviderHandle(model=model, provider=engine, base_url=base_url, api_key=api_key,
                                    engine_kwargs=engine_kwargs)
        kwargs.pop("async_engine", None)
        self.handle = handle
        self.reasoning_parser = reasoning_parser
        super().__init__(
            model=f"{_PROVIDER}/{handle.model_id()}", model_type="chat", temperature=temperature,
            max_tokens=max_tokens, cache=cache, callbacks=callbacks, num_retries=num_retries,
            engine=PrefixRTEngine(handle, reasoning_parser),
            async_engine=AsyncPrefixRTEngine(handle, reasoning_parser), **kwargs,
        )

    @property
    def runtime(self):
        """The prefixrt Provider behind this LM (built on first use). (`provider` is dspy.LM's training provider.)"""
        return self.handle.get()

    def copy(self, **kwargs):
        if "engine" in kwargs and not isinstance(kwargs["engine"], PrefixRTEngine):
            handle = ProviderHandle(provider=kwargs.pop("engine"))
            kwargs["engine"], kwargs["async_engine"] = PrefixRTEngine(handle, self.reasoning_parser), \
                AsyncPrefixRTEngine(handle, self.reasoning_parser)
        copied = super().copy(**kwargs)
        copied.handle = copied.engine.handle
        return copied

    def dump_state(self) -> dict[str, Any]:
        """What rebuilds this LM: model name and revision, server address, default request options.

        An LM over a passed-in engine saves that engine's model name; loading rebuilds it from the registry
        (or pass engine= to load_state to attach a live one). API keys are never saved.
        """
        from dspy.clients.base_lm import LM_CLASS_STATE_KEY

        state = {
            LM_CLASS_STATE_KEY: _LM_CLASS_PATH,
            **_handle_state(self.handle),
            "revision": self.model.split("@", 1)[1] if "@" in self.model else None,
            "cache": self.cache,
            "num_retries": self.num_retries,
            **({"reasoning_parser": self.reasoning_parser} if self.reasoning_parser else {}),
        }
        state.update({k: v for k, v in self.kwargs.items() if k != "api_key"})
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False, engine: Any = None) -> LM:
        """Rebuild from `dump_state`. Warns when the model's revision differs from the saved one."""
        import warnings

        from dspy.clients.base_lm import LM_CLASS_STATE_KEY

        state = {k: v for k, v in state.items() if k != LM_CLASS_STATE_KEY}
        revision = state.pop("revision", None)
        if engine is not None:
            state.pop("model", None)
            state.pop("base_url", None)
            state.pop("engine_kwargs", None)
            lm = cls(engine=engine, **state)
        else:
            lm = cls(**state)
        if revision is not None and not lm.model.endswith(f"@{revision}"):
            warnings.warn(f"prefixrt.LM: saved for revision {revision!r}, loaded {lm.model!r}", stacklevel=2)
        return lm
