"""EngineAPI: the caller-side half of an engine (the public methods of docs/api.md that run in the caller's
thread), shared by Engine (scheduler loop on a thread) and ProcessEngine (scheduler loop in a child process).

It tokenizes and validates prompts in the caller's thread (a bad request raises InvalidRequest there and
never reaches the loop), and turns the StepOutputs the loop streams back into Completion and Chunk objects
(detokenizing on the caller's side). Subclasses say how a request reaches the loop (`_submit`), how a
`choices` request is scored (`_select`) and how a request is aborted (`abort`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Iterator

from prefixrt.engine.detokenizer import IncrementalDetokenizer
from prefixrt.engine.process.messages import PackedIds, token_id_range
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.errors import InvalidRequest
from prefixrt.hub.chat_templates import render_chat_template
from prefixrt.lowering.text_checks import check_json_value, check_text
from prefixrt.multimodal.messages import has_images
from prefixrt.outputs import Chunk, Completion, coalesce_chunks
from prefixrt.params import SamplingParams


class EngineAPI:
    """Set by subclasses before use: _tokenizer, _tok_lock, model_name, vocab_size, max_context,
    kv_total_tokens (the KV pool size: a longer prompt can never run).

    Optionally `_encoder` and `_encode_lock`: a private copy of the tokenizer that prompts are encoded (and chat
    templates rendered) with, so that encoding a long prompt (a 5 MB one takes seconds) never holds the lock
    that detokenization waits for. Without one, encoding shares `_tokenizer` and `_tok_lock`.

    The async entry points (agenerate, astream_open, aencode) tokenize, validate and submit in a worker thread
    (`_workers`), never on the caller's event loop."""

    _tokenizer = None
    _encoder = None
    _encode_lock = None
    _worker_pool: concurrent.futures.ThreadPoolExecutor | None = None
    _worker_pool_lock = threading.Lock()
    model_name: str
    vocab_size: int
    max_context: int
    kv_total_tokens: int

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def tokenizer_lock(self):
        """The lock every use of `tokenizer` holds (HF fast tokenizers are not thread-safe): share it when
        calling the tokenizer from outside the engine."""
        return self._tok_lock

    # ------------------------------------------------------------------ subclass hooks
    def _submit(self, prompt, params, loop: asyncio.AbstractEventLoop | None = None, **req_fields
                ) -> tuple[str, RequestStream, list[int], SamplingParams]:
        """Validate and enqueue one prompt; returns (request id, its output stream, prompt ids, params).
        Raises InvalidRequest before anything is scheduled."""
        raise NotImplementedError

    def _select(self, prompt, p: SamplingParams) -> Completion:
        """A `choices` request: score every choice and return the best as a Completion."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ worker threads
    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads async callers submit on (created on first use, shut down by _stop_workers)."""
        with self._worker_pool_lock:
            if self._worker_pool is None:
                self._worker_pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="prefixrt-submit")
            return self._worker_pool

    def _stop_workers(self) -> None:
        with self._worker_pool_lock:
            pool, self._worker_pool = self._worker_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, fn, *args):
        """fn(*args) in a worker thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._workers(), fn, *args)

    async def _asubmit(self, prompt, p: SamplingParams, loop: asyncio.AbstractEventLoop):
        """_submit in a worker thread. If the caller is cancelled while it runs, the request is aborted as
        soon as it is in (so a client that left never leaves a request running)."""
        fut = loop.run_in_executor(self._workers(), self._submit, prompt, p, loop)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def abort_when_in(f) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.abort(f.result()[0])

            fut.add_done_callback(abort_when_in)
            raise

    # ------------------------------------------------------------------ tokenization and validation
    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """text -> token ids. Long texts go straight to the Rust tokenizer (`encode_batch` releases the GIL; the
        Python wrapper's per-token bookkeeping holds it for seconds on a 5 MB prompt, stalling every other
        thread, the HTTP event loop included), and a text whose token count already exceeds the model's limits
        is refused before its ids are turned into a Python list."""
        tok, lock = (self._encoder, self._encode_lock) if self._encoder is not None else (self._tokenizer,
                                                                                           self._tok_lock)
        with lock:
            backend = self._rust_backend(tok) if len(text) > _FAST_ENCODE_CHARS else None
            if backend is None:
                return tok.encode(text, add_special_tokens=add_special_tokens)
            # A head of the text that alone is far over the limit settles it without encoding the rest (a
            # 5 MB prompt would cost seconds and millions of objects). Tokenization is local (normalizers and
            # pre-tokenizers work on characters and words, merges on neighbours), so the rest can change the
            # head's count by a token or two at its cut, never by _HEAD_SLACK_TOKENS.
            limit = min(self.max_context, self.kv_total_tokens)
            head_chars = _HEAD_CHARS_PER_TOKEN * (limit + _HEAD_SLACK_TOKENS)
            if len(text) > head_chars:
                n = len(backend.encode_batch([text[:head_chars]], add_special_tokens=add_special_tokens)[0])
                if n >= limit + _HEAD_SLACK_TOKENS:
                    self._check_length(n, at_least=True)
            enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            self._check_length(len(enc))
            return enc.ids

    def _rust_backend(self, tok):
        """_probe_rust_backend(tok), probed once per tokenizer of this engine (the caller holds its lock)."""
        cache = self.__dict__.setdefault("_rust_backends", {})  # id(tok) -> backend; the engine keeps tok alive
        if id(tok) not in cache:
            cache[id(tok)] = _probe_rust_backend(tok)
        return cache[id(tok)]

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids (text encoded, chat messages rendered with the chat template), validated
        against the vocabulary, the context and the KV pool. Raises InvalidRequest."""
        ids = self._tokenize(prompt)
        self._validate_ids(ids, SamplingParams())
        return ids

    async def aencode(self, prompt) -> list[int]:
        """encode() in a worker thread (token ids inline: see _inline)."""
        if _inline(prompt):
            return self.encode(prompt)
        return await self._offload(self.encode, prompt)

    def image_prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt ids of chat messages holding images (each image as the model's placeholder block).
        Raises InvalidRequest; an engine that takes no images refuses them."""
        raise InvalidRequest(f"model {self.model_name!r} takes no images here", param="messages")

    def _tokenize(self, prompt) -> list[int]:
        if has_images(prompt):  # Engine.prepare takes them; scoring (choices) and other engines do not
            raise InvalidRequest("images are accepted in generate / stream chat requests of an in-process "
                                 "engine only", param="messages")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("prompt is empty", param="prompt")
            check_text(prompt, "prompt")
            return self._encode_text(prompt, True)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.chat_prompt_ids(list(prompt))
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            if type(prompt) is PackedIds:  # ints by construction, packed already
                return prompt
            if not _INT_ONLY.issuperset(map(type, prompt)):  # (bool, an int subclass, is no token id)
                raise InvalidRequest("a token-id prompt must be a list of integers", param="prompt")
            return list(prompt)
        raise InvalidRequest(f"prompt must be str, list[int] or chat messages, not {type(prompt).__name__}",
                             param="prompt")

    def chat_prompt_ids(self, messages: list[dict], continue_final_message: bool = False,
                        tools: list[dict] | None = None, template_kwargs: dict | None = None,
                        text_out: list | None = None) -> list[int]:
        """Token ids of the model's chat template applied to messages, with the generation prompt (or, with
        continue_final_message, the final assistant message left open). The one place the engine renders
        chat; raises InvalidRequest for malformed messages, a model without a template or a template that
        refuses them. template_kwargs: extra variables for the template (a request's `chat_template_kwargs`,
        e.g. {"enable_thinking": False}). text_out: a list that receives the rendered text instead (the ids
        returned are then [])."""
        for m in messages:
            if "role" not in m or "content" not in m:
                raise InvalidRequest("each chat message needs 'role' and 'content'", param="messages")
        check_json_value(messages, "messages")  # every string valid Unicode without NUL; bounded nesting
        tok, lock = (self._encoder, self._encode_lock) if self._encoder is not None else (self._tokenizer,
                                                                                           self._tok_lock)
        if not getattr(tok, "chat_template", None):
            raise InvalidRequest(f"model {self.model_name!r} has no chat template; send a text prompt",
                                 param="messages")
        if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
            raise InvalidRequest("continue_final_message needs a final assistant message", param="messages")
        try:
            with lock:
                text = render_chat_template(tok, messages, continue_final_message=continue_final_message,
                                            tools=tools, template_kwargs=template_kwargs)
            if text_out is not None:  # the caller splits the text itself (image markers)
                text_out.append(text)
                return []
            return self._encode_text(text, False)
        except InvalidRequest:
            raise
        except Exception as e:
            raise InvalidRequest(f"cannot render chat messages: {e}", param="messages") from e

    def encode_continuation(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation whose final assistant message is left open for the model to continue
        (`continue_final_message`, as vLLM and SGLang accept it), validated against the model's limits.
        Raises InvalidRequest."""
        ids = self.chat_prompt_ids(messages, continue_final_message=True)
        self._validate_ids(ids, SamplingParams())
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of chat messages (tools passed to the template when given; the final assistant message
        left open with continue_final_message; template_kwargs as chat_prompt_ids takes them), validated
        against the model's limits. Raises InvalidRequest."""
        ids = self.chat_prompt_ids(messages, continue_final_message=continue_final_message, tools=tools,
                                   template_kwargs=template_kwargs)
        self._validate_ids(ids, SamplingParams())
        return ids

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text the chat template makes of messages (with the generation prompt)."""
        ids = self.chat_prompt_ids(messages)
        with self._tok_lock:
            return self._tokenizer.decode(ids)

    def _validate_ids(self, ids: list[int], params: SamplingParams, id_range: tuple[int, int] | None = None
                      ) -> None:
        """Raise InvalidRequest unless ids is a non-empty prompt within the vocabulary and the limits (and
        params.logit_bias within the vocabulary). id_range: (min(ids), max(ids)) when the caller has them."""
        if not ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        lowest, highest = id_range if id_range is not None else token_id_range(ids)
        if lowest < 0 or highest >= self.vocab_size:
            bad = [t for t in ids if t < 0 or t >= self.vocab_size]
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 param="prompt")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            ids = ", ".join(str(t) for t in bad)
            raise InvalidRequest(f"logit_bias token id{'s' if len(bad) > 1 else ''} {ids} outside the vocabulary "
                                 f"[0, {self.vocab_size})", param="logit_bias")
        self._check_length(len(ids))

    def _check_length(self, num_tokens: int, at_least: bool = False) -> None:
        has = f"more than {num_tokens - _HEAD_SLACK_TOKENS}" if at_least else str(num_tokens)
        if num_tokens >= self.max_context:
            raise InvalidRequest(f"prompt has {has} tokens; the model's context is {self.max_context}",
                                 param="prompt")
        if num_tokens + 1 > self.kv_total_tokens:
            raise InvalidRequest(f"prompt has {has} tokens; the KV pool holds {self.kv_total_tokens}",
                                 param="prompt")

    # ------------------------------------------------------------------ outputs
    def _decode(self, ids: list[int], skip_special: bool) -> str:
        with self._tok_lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _assemble(self, rid: str, ids: list[int], p: SamplingParams, events: list[list[StepOutput]]) -> Completion:
        outs = []
        for i, evs in enumerate(events):
            toks = [t for e in evs for t in e.token_ids]
            last = evs[-1]
            if last.final_text is not None:
                text = last.final_text
            elif not p.detokenize:
                text = ""
            else:
                text_ids = toks[:-1] if isinstance(last.matched_stop, int) and toks else toks
                text = self._decode(text_ids, p.skip_special_tokens)
            lps = [lp for e in evs for lp in (e.logprobs or [])] if p.logprobs is not None else None
            outs.append(Completion(
                request_id=rid if p.n == 1 else f"{rid}-{i}", text=text, token_ids=toks,
                finish_reason=last.finish_reason, matched_stop=last.matched_stop, prompt_tokens=len(ids),
                cached_tokens=last.cached_tokens, completion_tokens=len(toks), logprobs=lps,
                choice_scores=last.choice_scores, error=last.error, timing=timing_dict(last.timing),
                keep_report=next((e.keep_report for e in evs if e.keep_report is not None), None),
            ))
        first = outs[0]
        first.request_id = rid
        first.outputs = outs if p.n > 1 else [first]
        return first

    def _wait(self, rid, stream: RequestStream, ids, p) -> Completion:
        events: list[list[StepOutput]] = [[] for _ in range(p.n)]
        done = 0
        try:
            while done < p.n:
                ev = stream.get()
                events[ev.index].append(ev)
                done += ev.finished
        except BaseException:
            self.abort(rid)
            raise
        return self._assemble(rid, ids, p, events)

    async def _await(self, rid, stream: RequestStream, ids, p) -> Completion:
        events: list[list[StepOutput]] = [[] for _ in range(p.n)]
        done = 0
        try:
            while done < p.n:
                ev = await stream.aget()
                events[ev.index].append(ev)
                done += ev.finished
        except BaseException:  # cancelled: the caller went away
            self.abort(rid)
            raise
        return self._assemble(rid, ids, p, events)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt, params: SamplingParams | dict | None = None):
        """One prompt -> Completion; a list of prompts -> list[Completion] (submitted together)."""
        p = SamplingParams.coerce(params)
        if p.choices is not None:
            if _is_batch(prompt):
                return [self._select(q, p) for q in prompt]
            return self._select(prompt, p)
        if _is_batch(prompt):
            subs = [self._submit(q, p) for q in prompt]
            return [self._wait(*s) for s in subs]
        return self._wait(*self._submit(prompt, p))

    async def agenerate(self, prompt, params: SamplingParams | dict | None = None):
        p = SamplingParams.coerce(params)
        if p.choices is not None:
            return await asyncio.to_thread(self.generate, prompt, p)
        loop = asyncio.get_running_loop()
        if _is_batch(prompt):
            subs = await asyncio.gather(*(self._asubmit(q, p, loop) for q in prompt), return_exceptions=True)
            failed = [s for s in subs if isinstance(s, BaseException)]
            if failed:  # one bad prompt fails the batch: nothing of it keeps running
                for s in subs:
                    if not isinstance(s, BaseException):
                        self.abort(s[0])
                raise failed[0]
            return list(await asyncio.gather(*(self._await(*s) for s in subs)))
        return await self._await(*await self._asubmit(prompt, p, loop))

    def stream(self, prompt, params: SamplingParams | dict | None = None) -> Iterator[Chunk]:
        """Submit now (errors raise here), then iterate Chunks. Closing the iterator early aborts."""
        p = SamplingParams.coerce(params)
        if p.choices is not None:
            return iter([_completion_chunk(self._select(prompt, p))])
        rid, stream, ids, p = self._submit(prompt, p)
        return self._iter_chunks(rid, stream, ids, p)

    def _iter_chunks(self, rid, stream, ids, p) -> Iterator[Chunk]:
        state = _ChunkState(self, ids, p)
        finished = False
        try:
            while state.done < p.n:
                ev = stream.get()
                yield state.chunk(rid, ev)
            finished = True
        finally:
            if not finished:
                self.abort(rid)

    def astream(self, prompt, params: SamplingParams | dict | None = None) -> AsyncIterator[Chunk]:
        p = SamplingParams.coerce(params)
        if p.choices is not None:
            return _aiter_one(asyncio.to_thread(lambda: _completion_chunk(self._select(prompt, p))))
        loop = asyncio.get_running_loop()
        rid, stream, ids, p = self._submit(prompt, p, loop)
        return self._aiter_chunks(rid, stream, ids, p)

    async def astream_open(self, prompt, params: SamplingParams | dict | None = None, *,
                           coalesce: bool = False) -> AsyncIterator[Chunk]:
        """astream with the submission (tokenization, validation, grammar compilation) done in a worker thread:
        `chunks = await eng.astream_open(prompt, params)` raises InvalidRequest there, before anything is
        streamed; then `async for ch in chunks`. Closing the iterator early aborts.

        coalesce: when the caller falls behind (several steps' outputs are waiting when it asks for the next
        chunk), the waiting chunks of each sample come as one (outputs.coalesce_chunks): the server uses it so
        that a stream it cannot keep up with costs one SSE event per sample, not one per token."""
        p = SamplingParams.coerce(params)
        if p.choices is not None:
            return _aiter_one(asyncio.to_thread(lambda: _completion_chunk(self._select(prompt, p))))
        loop = asyncio.get_running_loop()
        if _inline(prompt) and p.constraint_kind is None:
            rid, stream, ids, p = self._submit(prompt, p, loop)
        else:
            rid, stream, ids, p = await self._asubmit(prompt, p, loop)
        return self._aiter_chunks(rid, stream, ids, p, coalesce)

    async def _aiter_chunks(self, rid, stream, ids, p, coalesce: bool = False) -> AsyncIterator[Chunk]:
        state = _ChunkState(self, ids, p)
        finished = False
        try:
            while state.done < p.n:
                if not coalesce:
                    yield state.chunk(rid, await stream.aget())
                    continue
                # Each event is detokenized on its own (the text is exactly that of one chunk per event), then
                # the chunks of a sample are joined.
                for ch in coalesce_chunks([state.chunk(rid, ev) for ev in await stream.aget_ready()]):
                    yield ch
            finished = True
        finally:
            if not finished:
                self.abort(rid)


class _ChunkState:
    """Turns StepOutputs into Chunks for one streaming request (per-sample incremental detokenization)."""

    def __init__(self, engine: EngineAPI, ids: list[int], p: SamplingParams):
        self.engine, self.ids, self.p = engine, ids, p
        self.detoks = [IncrementalDetokenizer(engine.tokenizer, p.skip_special_tokens, engine._tok_lock)
                       for _ in range(p.n)]
        self.tokens: list[list[int]] = [[] for _ in range(p.n)]
        self.counts = [0] * p.n
        self.done = 0

    def chunk(self, rid: str, ev: StepOutput) -> Chunk:
        i = ev.index
        self.tokens[i].extend(ev.token_ids)
        self.counts[i] += len(ev.token_ids)
        if ev.text is not None:
            text = ev.text
        elif not self.p.detokenize:
            text = ""
        else:
            toks = self.tokens[i]
            text_ids = toks[:-1] if ev.finished and isinstance(ev.matched_stop, int) and toks else toks
            text = self.detoks[i].step(text_ids)
            if ev.finished:
                text += self.detoks[i].flush(text_ids)
        self.done += ev.finished
        return Chunk(
            request_id=rid, text=text, token_ids=list(ev.token_ids), finish_reason=ev.finish_reason, index=i,
            logprobs=ev.logprobs, prompt_tokens=len(self.ids), cached_tokens=ev.cached_tokens,
            completion_tokens=self.counts[i], matched_stop=ev.matched_stop, error=ev.error,
            timing=timing_dict(ev.timing), keep_report=ev.keep_report,
        )


def timing_dict(timing: tuple | None) -> dict | None:
    """A StepOutput's (queue, prefill, decode) seconds as Completion.timing."""
    if timing is None:
        return None
    return dict(zip(("queue_s", "prefill_s", "decode_s"), timing))


def _completion_chunk(c: Completion) -> Chunk:
    return Chunk(request_id=c.request_id, text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                 logprobs=c.logprobs, prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
                 completion_tokens=c.completion_tokens, error=c.error, timing=c.timing, keep_report=c.keep_report)


def _inline(prompt) -> bool:
    """Whether a prompt is submitted on the caller's event loop rather than in a worker thread: token ids, whose
    checks are C-speed scans (a 3,500-id prompt: ~0.1 ms). A worker-thread hop costs more than that once many
    requests arrive together: each hop's return waits behind every other request's work on the loop, and the
    workers contend with the loop for the GIL, so the first request reached the engine only after the last had
    been parsed. Text and chat prompts (tokenization) and constrained requests (a grammar compiles; a process
    engine waits for the child's verdict) keep the worker thread. A process engine's pipe write never blocks the
    loop (engine/process/pipe_writer.py: a non-blocking send, the rest on its writer thread)."""
    return isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int


async def _aiter_one(awaitable):
    yield await awaitable


_INT_ONLY = frozenset({int})  # a token-id prompt's element types (a C-speed scan, not a Python step per id)
_FAST_ENCODE_CHARS = 100_000  # texts longer than this skip the Python tokenizer wrapper (see _encode_text)
_HEAD_CHARS_PER_TOKEN = 16  # a long text's head is this many characters per token of the limit (+ slack)
_HEAD_SLACK_TOKENS = 64
_PROBE = " The quick  brown fox\n\njumps: {\"a\": [1, 2]} éü 🎉 <|im_start|>user\nhi<|im_end|> <bos></s>"


def _probe_rust_backend(tok):
    """tok's `tokenizers.Tokenizer` when encoding through it gives exactly tok.encode's ids (checked on a probe
    text, with and without special tokens), else None (a tokenizer that post-processes in Python)."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    try:
        same = all(backend.encode_batch([_PROBE], add_special_tokens=sp)[0].ids
                   == tok.encode(_PROBE, add_special_tokens=sp) for sp in (True, False))
    except Exception:
        return None
    return backend if same else None


def _is_batch(prompt) -> bool:
    """A list of prompts (str, token lists or message lists), as opposed to one token-id or chat prompt."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, str) or (isinstance(first, (list, tuple)) and not isinstance(first, dict))
