"""ChatPrefixRT: a LangChain chat model over a prefixrt Provider.

Lowering, call by call:
- messages -> chat messages (system text merged first; tool calls and tool results written as text turns),
  rendered by the model's chat template inside the Provider;
- `with_structured_output(schema)` (default method "json_schema") -> `json_schema` constrained decoding, so the
  reply always parses; "json_mode" -> any JSON object; "function_calling" -> a forced tool call (below);
- `bind_tools(tools, tool_choice=...)` -> constrained decoding over a schema of the tools
  ({"name": ..., "arguments": {...}}, or {"response": "..."} when tool_choice is "auto"), returned as
  `AIMessage.tool_calls`;
- `batch` runs every input concurrently (not a thread pool's worth at a time), `abatch` gathers them; the engine
  prefills a prefix they share once and reuses it from the radix cache;
- `Completion.cached_tokens` -> `usage_metadata["input_token_details"]["cache_read"]`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams, generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.utils.utils import secret_from_env
from prefixrt.adapters.provider_handle import ProviderHandle
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from prefixrt.lowering.chat import lower_chat
from prefixrt.lowering.json_schema import strict_schema
from prefixrt.lowering.messages import normalize_messages
from prefixrt.lowering.options import sampling_options, with_request_id
from prefixrt.lowering.reasoning import ReasoningParser, ReasoningSplitter
from prefixrt.lowering.tools import ToolPlan, new_call_id
from prefixrt.multimodal.messages import IMAGE_MARKER, image_source, restore_images

_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
          "ai": "assistant"}


def _content_text(content: str | list, where: str, images: list | None = None) -> str:
    """images: where image blocks go (each leaves IMAGE_MARKER in the text); None: image blocks are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif images is not None and image_source(block) is not None:
            images.append(image_source(block))
            texts.append(IMAGE_MARKER)
        elif block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # tool calls travel in AIMessage.tool_calls; reasoning is not replayed
        else:
            raise ValueError(f"ChatPrefixRT reads text only; {where} has a {block.get('type')!r} content block")
    return "\n".join(t for t in texts if t)


def to_openai_messages(messages: Sequence[BaseMessage], images: list | None = None) -> list[dict]:
    """LangChain messages -> OpenAI chat messages (assistant `tool_calls`, `tool` results), system text merged
    into one leading message. images: a list that receives the image blocks of human messages (their text
    holds IMAGE_MARKER there; multimodal.messages.restore_images puts them back); None refuses images."""
    out = []
    for m in messages:
        text = _content_text(m.content, type(m).__name__, images if isinstance(m, HumanMessage) else None)
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": text})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": text})
        elif isinstance(m, AIMessage):
            message: dict = {"role": "assistant", "content": text}
            if m.tool_calls:
                message["tool_calls"] = [{"id": tc.get("id") or "", "type": "function", "function": {
                    "name": tc["name"], "arguments": json.dumps(tc["args"], ensure_ascii=False)}}
                    for tc in m.tool_calls]
            out.append(message)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id,
                        **({"name": m.name} if m.name else {})})
        elif isinstance(m, ChatMessage) and m.role in _ROLES:
            out.append({"role": _ROLES[m.role], "content": text})
        else:
            raise ValueError(f"ChatPrefixRT cannot send a {type(m).__name__}")
    return normalize_messages(out)


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> chat messages a chat template accepts (system/user/assistant only)."""
    return lower_chat(to_openai_messages(messages)).messages


def _tool_choice_name(tool_choice: Any, names: list[str]) -> str:
    """LangChain/OpenAI tool_choice spellings -> "auto" | "required" | "none" | a tool name."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required", True):
        return "required"
    if tool_choice == "none" or tool_choice is False:
        return "none"
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    raise ValueError(f"tool_choice {tool_choice!r} is not 'auto', 'any', 'required', 'none' or a bound tool name "
                     f"({', '.join(names)})")


def _finish_reason(engine_reason: str | None, fields: dict) -> str | None:
    """The reply's finish reason as OpenAI (and ChatOpenAI) report it: "tool_calls" when the message carries tool
    calls, else the engine's ("stop" / "length")."""
    return "tool_calls" if fields.get("tool_calls") else engine_reason


def _is_transient(e: Exception) -> bool:
    """Worth retrying: the connection to a server failed, not the request."""
    if isinstance(e, ConnectionError):
        return True
    try:
        import httpx
    except ImportError:
        return False
    return isinstance(e, httpx.TransportError)


class ChatPrefixRT(BaseChatModel):
    """LangChain chat model on prefixrt.

    `ChatPrefixRT(model="gemma-3-270m")` loads the model in-process on first use (one engine per model per
    process); `ChatPrefixRT(engine=eng)` uses an Engine or any Provider; `ChatPrefixRT(base_url=...)` talks to
    a `prefixrt serve` server. Greedy decoding (temperature 0) by default: small local models do best that way.
    """

    model_name: str | None = Field(default=None, alias="model")
    """Registry name or local folder to load; with base_url, the server's model (asked for when omitted)."""
    engine: Any = Field(default=None, exclude=True)
    """An existing prefixrt Engine / RemoteEngine / Provider to run on."""
    base_url: str | None = None
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PREFIXRT_API_KEY", default=None))
    """Key for a `prefixrt serve` started with one (default: $PREFIXRT_API_KEY)."""
    engine_kwargs: dict = Field(default_factory=dict)
    """Engine(...) keyword arguments used when this model loads `model` in-process."""
    temperature: float | None = 0.0
    max_tokens: int | None = 256
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = None
    """Seconds per call; the request is aborted in the engine when it runs out."""
    max_retries: int = 2
    """Retries of calls whose connection to a server failed (remote providers only)."""
    streaming: bool = False
    """invoke() runs through the streaming path (callbacks see tokens as they arrive)."""
    cache_salt: str | None = None
    """Requests with different salts never share cached KV."""
    reasoning_parser: str | None = None
    """A reasoning model's form ("qwen3", "deepseek-r1"; prefixrt/lowering/reasoning.py): its thinking then goes in the
    AIMessage's additional_kwargs["reasoning_content"] (streamed as chunks), apart from the content."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())

    _handle: ProviderHandle = PrivateAttr()

    @model_validator(mode="after")
    def _build_handle(self) -> ChatPrefixRT:
        if self.reasoning_parser is not None:
            ReasoningParser(self.reasoning_parser)  # ValueError naming the choices
        if self.engine is not None:  # model= may name one of the engine's LoRA adapters
            self._handle = ProviderHandle(provider=self.engine, model=self.model_name)
            if self.model_name is None:
                self.model_name = getattr(self.engine, "model_name", None)
        else:
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self._handle = ProviderHandle(model=self.model_name, base_url=self.base_url, api_key=key,
                                          engine_kwargs=self.engine_kwargs)
        return self

    # ------------------------------------------------------------------ identity
    @property
    def _llm_type(self) -> str:
        return "prefixrt-chat"

    @property
    def provider(self):
        """The prefixrt Provider (built on first use)."""
        return self._handle.get()

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": self.base_url, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="prefixrt", ls_model_name=kwargs.get("model") or self._name(),
                                 ls_model_type="chat")
        if self.temperature is not None:
            params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if self.max_tokens is not None:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _name(self) -> str:
        return self.model_name or self._handle.model_name

    # ------------------------------------------------------------------ lowering
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict
                 ) -> tuple[list[dict], dict, ToolPlan | None]:
        kwargs = dict(kwargs)
        kwargs.pop("ls_structured_output_format", None)  # tracing metadata bound by with_structured_output
        model = kwargs.pop("model", None)
        if model is not None and model != self._name():
            raise ValueError(f"this ChatPrefixRT serves {self._name()!r}; make another for {model!r}")
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        parallel_tool_calls = kwargs.pop("parallel_tool_calls", None)
        response_format = kwargs.pop("response_format", None)
        options = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "seed": self.seed, "repetition_penalty": self.repetition_penalty,
                   "cache_salt": self.cache_salt, "stop": stop if stop is not None else self.stop}
        options.update(kwargs)
        params = with_request_id(sampling_options(options, what="ChatPrefixRT"))
        if (lora := self._handle.lora()) is not None:  # model= names a LoRA adapter of the engine / server
            params["lora"] = lora
        choice = None
        if tools:
            choice = _tool_choice_name(tool_choice, [t["function"]["name"] for t in tools])
            if choice not in ("auto", "required", "none"):
                choice = {"type": "function", "function": {"name": choice}}
        # One call per reply unless bound with parallel_tool_calls=True: a small model allowed "one or more"
        # calls may keep writing calls until max_tokens. The schema goes in the prompt too: LangChain's
        # structured output sends no instructions of its own.
        images: list = []
        lowered = lower_chat(to_openai_messages(messages, images), tools=tools, tool_choice=choice,
                             parallel_tool_calls=bool(parallel_tool_calls), response_format=response_format,
                             schema_note=True)
        lowered.apply(params)
        chat, plan = lowered.messages, lowered.tools
        if images:  # image parts back in place (the engine renders them; a text-only model refuses them)
            chat = restore_images(chat, images)
        return chat, params, plan

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageMetadata:
        return UsageMetadata(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens,
                             input_token_details={"cache_read": cached_tokens})

    def _metadata(self, finish_reason: str | None, request_id: str) -> dict:
        return {"model_name": self._name(), "model_provider": "prefixrt", "finish_reason": finish_reason,
                "request_id": request_id}

    def _reply_fields(self, text: str, finish_reason: str | None, plan: ToolPlan | None) -> dict:
        """Message fields (content, tool calls) for the whole reply text. Under a tool plan the reply is
        plain text or well-formed calls; one that began a call and was cut short is an invalid tool call."""
        if plan is None:
            return {"content": text}
        calls = plan.parse(text)
        if calls:
            return {"content": "", "tool_calls": [
                {"name": c.name, "args": c.arguments, "id": new_call_id(), "type": "tool_call"} for c in calls]}
        if plan.forced or (text.strip() and plan.may_be_call(text)):
            return {"content": "", "invalid_tool_calls": [
                {"name": None, "args": text, "id": new_call_id(), "type": "invalid_tool_call",
                 "error": f"the tool-call reply is incomplete (finish_reason {finish_reason}); raise max_tokens"}]}
        return {"content": text}

    @staticmethod
    def _check(completion_or_chunk, timed_out: bool) -> None:
        if completion_or_chunk.finish_reason == "abort":
            if timed_out:
                raise TimeoutError("ChatPrefixRT: the call exceeded its timeout and was aborted")
            raise RuntimeError(f"ChatPrefixRT: the request was aborted: {getattr(completion_or_chunk, 'error', None)}")

    def _retrying(self, fn):
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except Exception as e:
                if attempt == self.max_retries or not _is_transient(e):
                    raise

    async def _aretrying(self, fn):
        for attempt in range(self.max_retries + 1):
            try:
                return await fn()
            except Exception as e:
                if attempt == self.max_retries or not _is_transient(e):
                    raise

    def _abort_timer(self, request_id: str) -> tuple[threading.Timer | None, dict]:
        state = {"fired": False}
        if self.timeout is None:
            return None, state
        provider = self.provider

        def fire():
            state["fired"] = True
            provider.abort(request_id)

        timer = threading.Timer(self.timeout, fire)
        timer.daemon = True
        timer.start()
        return timer, state

    # ------------------------------------------------------------------ LangChain hooks
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        chat, params, specs = self._prepare(messages, stop, kwargs)

        def call():
            timer, state = self._abort_timer(params["request_id"])
            try:
                completion = self.provider.generate(chat, params)
            finally:
                if timer is not None:
                    timer.cancel()
            self._check(completion, state["fired"])
            return completion

        completion = self._retrying(call)
        return self._result(completion, specs)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        chat, params, specs = self._prepare(messages, stop, kwargs)

        async def call():
            try:
                completion = await asyncio.wait_for(self.provider.agenerate(chat, params), self.timeout)
            except asyncio.TimeoutError as e:
                raise TimeoutError("ChatPrefixRT: the call exceeded its timeout and was aborted") from e
            self._check(completion, False)
            return completion

        return self._result(await self._aretrying(call), specs)

    def _splitter(self) -> ReasoningSplitter | None:
        """A splitter of the reply's thinking from its answer, with a reasoning parser (the engine renders the
        prompt, so a template that opens the block in the prompt needs "deepseek-r1")."""
        return ReasoningParser(self.reasoning_parser).splitter() if self.reasoning_parser is not None else None

    @staticmethod
    def _pieces(split: ReasoningSplitter | None, c, specs: ToolPlan | None) -> tuple[str, list[ChatGenerationChunk]]:
        """(the answer's text in prefixrt chunk `c`, the chunks to yield for it: its thinking, then its text
        unless a tool plan holds the text back)."""
        thought, text = "", c.text
        if split is not None:
            thought, text = split.feed(c.text)
            if c.finish_reason is not None:
                more_thought, more_text = split.finish()
                thought, text = thought + more_thought, text + more_text
        out = []
        if thought:
            out.append(ChatGenerationChunk(message=AIMessageChunk(content="",
                                                                  additional_kwargs={"reasoning_content": thought})))
        if specs is None and text:
            out.append(ChatGenerationChunk(message=AIMessageChunk(content=text)))
        return text, out

    def _result(self, completion, specs: ToolPlan | None) -> ChatResult:
        thought, text = None, completion.text
        if self.reasoning_parser is not None:
            thought, text = ReasoningParser(self.reasoning_parser).split(text)
        fields = self._reply_fields(text, completion.finish_reason, specs)
        if thought is not None:
            fields["additional_kwargs"] = {"reasoning_content": thought}
        finish_reason = _finish_reason(completion.finish_reason, fields)
        message = AIMessage(
            **fields,
            usage_metadata=self._usage(completion.prompt_tokens, completion.completion_tokens,
                                       completion.cached_tokens),
            response_metadata=self._metadata(finish_reason, completion.request_id),
        )
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": finish_reason})])

    def _final_chunk(self, text: str, last, specs: ToolPlan | None, request_id: str) -> ChatGenerationChunk:
        """The closing chunk: usage, metadata, and (with tools) the parsed tool call."""
        fields: dict[str, Any] = {"content": ""}
        finish_reason = last.finish_reason
        if specs is not None:
            reply = self._reply_fields(text, last.finish_reason, specs)
            finish_reason = _finish_reason(last.finish_reason, reply)
            fields = {"content": reply.get("content", "")}
            if reply.get("tool_calls"):
                fields["tool_call_chunks"] = [
                    {"name": tc["name"], "args": json.dumps(tc["args"]), "id": tc["id"], "index": k,
                     "type": "tool_call_chunk"} for k, tc in enumerate(reply["tool_calls"])]
            if reply.get("invalid_tool_calls"):
                fields["tool_call_chunks"] = [
                    {"name": None, "args": text, "id": new_call_id(), "index": 0, "type": "tool_call_chunk"}]
        message = AIMessageChunk(
            **fields, usage_metadata=self._usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens),
            response_metadata=self._metadata(finish_reason, request_id), chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish_reason})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        chat, params, specs = self._prepare(messages, stop, kwargs)
        rid = params["request_id"]
        chunks = self._retrying(lambda: self.provider.stream(chat, params))
        timer, state = self._abort_timer(rid)
        texts, last, split = [], None, self._splitter()
        try:
            for c in chunks:
                last = c
                self._check(c, state["fired"])
                text, gens = self._pieces(split, c, specs)
                texts.append(text)
                for gen in gens:
                    if run_manager and gen.message.content:
                        run_manager.on_llm_new_token(text, chunk=gen)
                    yield gen
        finally:
            if timer is not None:
                timer.cancel()
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        if last is None:
            raise RuntimeError("ChatPrefixRT: the stream ended without output")
        yield self._final_chunk("".join(texts), last, specs, rid)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        chat, params, specs = self._prepare(messages, stop, kwargs)
        rid = params["request_id"]
        chunks = self.provider.astream(chat, params)
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        texts, last, split = [], None, self._splitter()
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    c = await asyncio.wait_for(chunks.__anext__(), remaining)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError as e:
                    raise TimeoutError("ChatPrefixRT: the call exceeded its timeout and was aborted") from e
                last = c
                self._check(c, False)
                text, gens = self._pieces(split, c, specs)
                texts.append(text)
                for gen in gens:
                    if run_manager and gen.message.content:
                        await run_manager.on_llm_new_token(text, chunk=gen)
                    yield gen
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        if last is None:
            raise RuntimeError("ChatPrefixRT: the stream ended without output")
        yield self._final_chunk("".join(texts), last, specs, rid)

    # ------------------------------------------------------------------ batching (prefix sharing)
    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[BaseMessage]:
        """Run all inputs at once (the default caps threads at the executor's worker count), so requests that
        share a prompt prefix reach the engine together and the prefix is prefilled once."""
        if isinstance(config, list):
            config = [{**c, "max_concurrency": c.get("max_concurrency") or len(inputs)} for c in config]
        else:
            config = {**(config or {})}
            config.setdefault("max_concurrency", len(inputs) or None)
        return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; replies are constrained to a call of one of them (tool_choice "any"/"required"/a name)
        or to a call or a text answer ("auto", the default). Calls come back as AIMessage.tool_calls."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        return super().bind(tools=formatted, tool_choice=_tool_choice_name(tool_choice, names), **kwargs)

    def with_structured_output(self, schema: dict | type | None = None, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any
                               ) -> Runnable[LanguageModelInput, dict | Any]:
        """A runnable whose output is `schema` (a pydantic class -> an instance; a dict/TypedDict -> a dict).

        method: "json_schema" (constrained decoding to the schema), "function_calling" (a forced call of a tool
        whose arguments are the schema), "json_mode" (JSON; constrained to `schema` when one is given, else to
        any JSON object). Objects in the schema are closed (no keys beyond the declared ones). strict is
        accepted for compatibility: output is always schema-exact. Other keyword arguments are call options for
        the structured call (`max_tokens=`, `temperature=`, ...), as with `bind`.
        """
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **kwargs,
                                  ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                               "schema": tool})
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_model
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method == "json_schema":
            if schema is None:
                raise ValueError("method='json_schema' needs a schema")
            json_schema = convert_to_json_schema(schema)
            llm = self.bind(response_format={"type": "json_schema", "schema": strict_schema(json_schema)}, **kwargs,
                            ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                         "schema": json_schema})
            parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        elif method == "json_mode":
            # With a schema, decoding follows it (a reply that is JSON but not the schema is of no use to the
            # parser); without one, any JSON object.
            response_format = ({"type": "json_schema", "schema": strict_schema(convert_to_json_schema(schema))}
                               if schema is not None else {"type": "json_object"})
            llm = self.bind(response_format=response_format, **kwargs,
                            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}")
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")


__all__ = ["ChatPrefixRT", "to_chat_messages"]
