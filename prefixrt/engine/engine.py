"""Engine: the in-process front of prefixrt (API.md). Thread-safe and asyncio-friendly.

Callers' threads tokenize, validate and compile grammars (so a bad request fails in the caller and the loop
never sees it), then hand requests to the scheduler loop through an inbox. The loop runs EngineCore.step()
on its own thread and streams StepOutputs back through one RequestStream per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prefixrt.config import EngineConfig
from prefixrt.engine.detokenizer import IncrementalDetokenizer
from prefixrt.engine.request import Req
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.outputs import Chunk, Completion, EngineStats
from prefixrt.params import SamplingParams

log = logging.getLogger("prefixrt")


class Engine:
    """See API.md. `Engine(model="gemma-3-270m", ...)`; use as a context manager or call shutdown()."""

    def __init__(self, model: str = "gemma-3-270m", **kwargs: Any):
        progress = kwargs.pop("progress", None)
        parts = kwargs.pop("_parts", None)  # (model, tokenizer, resolved): tests inject a ready model
        self.config = EngineConfig(model=model if isinstance(model, str) else "custom", **kwargs)
        from prefixrt.engine import builder

        if parts is None:
            built = builder.build(self.config, progress)
        else:
            dev = builder.resolve_device(self.config.device)
            built = builder.assemble(self.config, *parts, dev, builder.resolve_dtype(self.config.dtype, dev))
        self._built = built
        self.core = built.core
        self._tokenizer = built.tokenizer
        self._tok_lock = built.tokenizer_lock
        self.device = built.device
        self.model_name = built.resolved.name
        self.model_revision = built.resolved.revision
        self.vocab_size = built.model.vocab_size
        self.max_context = self.core.max_context
        self._grammar = None
        self._grammar_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="prefixrt-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public properties
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def page_size(self) -> int:
        return self.config.page_size

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        import os

        if os.environ.get("PREFIXRT_PROFILE_LOOP"):  # debugging aid: cProfile the scheduler thread
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            try:
                self._run_loop()
            finally:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ["PREFIXRT_PROFILE_LOOP"]))
        else:
            self._run_loop()

    def _run_loop(self) -> None:
        core = self.core
        while True:
            try:
                block = not core.scheduler.has_work
                while True:
                    try:
                        msg = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    block = False
                    if msg is None:
                        self._drain_on_exit()
                        return
                    self._handle(msg)
                if core.scheduler.has_work:
                    core.step()
            except Exception:  # never let the loop die silently
                log.exception("scheduler loop error")
                time.sleep(0.01)

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            self.core.add(msg[1])
        elif kind == "abort":
            self.core.abort(msg[1])
        elif kind == "call":
            fn, fut = msg[1], msg[2]
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _drain_on_exit(self) -> None:
        for rid in list(self.core.requests):
            self.core.abort(rid)

    def _call(self, fn, timeout: float | None = 60.0):
        """Run fn on the loop thread (between steps) and return its result."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout=timeout)

    # ------------------------------------------------------------------ submission
    def _tokenize(self, prompt) -> list[int]:
        tok = self._tokenizer
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("prompt is empty", param="prompt")
            with self._tok_lock:
                return tok.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._render_chat(list(prompt))
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequest("a token-id prompt must be a list of integers", param="prompt")
            return list(prompt)
        raise InvalidRequest(f"prompt must be str, list[int] or chat messages, not {type(prompt).__name__}",
                             param="prompt")

    def _render_chat(self, messages: list[dict]) -> list[int]:
        for m in messages:
            if "role" not in m or "content" not in m:
                raise InvalidRequest("each chat message needs 'role' and 'content'", param="messages")
        tok = self._tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidRequest(f"model {self.model_name!r} has no chat template; send a text prompt",
                                 param="messages")
        try:
            with self._tok_lock:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                return tok.encode(text, add_special_tokens=False)
        except InvalidRequest:
            raise
        except Exception as e:
            raise InvalidRequest(f"cannot render chat messages: {e}", param="messages") from e

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text the chat template makes of messages (with the generation prompt)."""
        ids = self._render_chat(messages)
        with self._tok_lock:
            return self._tokenizer.decode(ids)

    def _validate_ids(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 param="prompt")
        if len(ids) >= self.max_context:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}",
                                 param="prompt")
        if len(ids) + 1 > self.core.kv.total_tokens:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the KV pool holds {self.core.kv.total_tokens}",
                                 param="prompt")

    def grammar_compiler(self):
        """The engine's GrammarCompiler (built on first use: the backend's vocab tables take ~1 s)."""
        with self._grammar_lock:
            if self._grammar is None:
                import os

                from prefixrt.constrained import GrammarCompiler, make_backend

                opts = {"mask_threads": max(2, min(8, os.cpu_count() or 2))} \
                    if self.config.grammar_backend == "llguidance" else {}
                backend = make_backend(self.config.grammar_backend, self._tokenizer, self.vocab_size,
                                       sorted(self.core.eos_token_ids), **opts)
                self._grammar = GrammarCompiler(backend, timeout_s=self.config.grammar_timeout_s)
                self.core.grammar_backend = backend
            return self._grammar

    def _compile(self, p: SamplingParams):
        kind = p.constraint_kind
        spec = getattr(p, kind)
        if kind == "json_schema" and spec == "json_object":
            kind, spec = "json_object", None
        return self.grammar_compiler().compile(kind, spec)

    def _submit(self, prompt, params, loop: asyncio.AbstractEventLoop | None = None, **req_fields):
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        p = SamplingParams.coerce(params)
        ids = self._tokenize(prompt)
        self._validate_ids(ids, p)
        compiled = None
        if p.constraint_kind not in (None, "choices"):
            compiled = self._compile(p)
        rid = p.request_id or f"req-{uuid.uuid4().hex[:12]}"
        stream = RequestStream(loop)
        reqs = []
        for i in range(p.n):
            r = Req(rid=rid, prompt_ids=ids, params=p, sink=stream, index=i, namespace=p.cache_salt, **req_fields)
            if compiled is not None:
                r.matcher = self.grammar_compiler().backend.matcher(compiled)
                if p.jump_forward:  # step-0 forced tokens join the prefill
                    forced = r.matcher.forced_tokens()[: max(0, p.max_new_tokens - 1)]
                    forced = forced[: max(0, self.max_context - 1 - len(ids))]
                    if forced:
                        r.matcher.accept_tokens(forced)
                        r.append_output(forced)
                        r.num_forced_tokens += len(forced)
                        r.pending_emit = list(forced)
            reqs.append(r)
        self._inbox.put(("add", reqs))
        return rid, stream, ids, p

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
                choice_scores=last.choice_scores, error=last.error,
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
            subs = [self._submit(q, p, loop) for q in prompt]
            return list(await asyncio.gather(*(self._await(*s) for s in subs)))
        return await self._await(*self._submit(prompt, p, loop))

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

    async def _aiter_chunks(self, rid, stream, ids, p) -> AsyncIterator[Chunk]:
        state = _ChunkState(self, ids, p)
        finished = False
        try:
            while state.done < p.n:
                ev = await stream.aget()
                yield state.chunk(rid, ev)
            finished = True
        finally:
            if not finished:
                self.abort(rid)

    # ------------------------------------------------------------------ select
    def score_continuations(self, prompt, continuations: list[list[int]], cache_salt: str | None = None
                            ) -> tuple[list[int], int, list[list[float]]]:
        """Log p(continuation tokens | prompt) for each continuation, token by token. The prompt is prefilled
        once (cache_prefix) and every continuation is an extend of it, submitted together.
        Returns (prompt ids, prompt tokens reused from the cache, per-continuation token logprobs)."""
        ids = self._tokenize(prompt)
        base = SamplingParams(max_new_tokens=0, cache_salt=cache_salt)
        self._validate_ids(ids, base)
        hit = self._call(lambda: self.core.kv.cache.match_prefix(ids, cache_salt, max_len=len(ids) - 1).length)
        if self.config.radix_cache:
            self.cache_prefix(ids, cache_salt)
        subs = [self._submit(ids + cont, base, input_logprobs_from=len(ids)) for cont in continuations]
        scores = []
        for _, stream, _, _ in subs:
            while True:
                ev = stream.get()
                if ev.finished:
                    break
            if ev.finish_reason != "length" or ev.error:
                raise RuntimeError(f"scoring request failed: {ev.error or ev.finish_reason}")
            scores.append(list(ev.input_logprobs or []))
        return ids, hit, scores

    def _select(self, prompt, p: SamplingParams) -> Completion:
        from prefixrt.constrained.choices import score_choices

        with self._tok_lock:
            cont = [self._tokenizer.encode(c, add_special_tokens=False) for c in p.choices]
        if any(not c for c in cont):
            raise InvalidRequest("a choice tokenizes to nothing", param="choices")
        ids, hit, lps = self.score_continuations(prompt, cont, p.cache_salt)
        uncond = None
        method = p.choices_method
        if method == "unconditional_normalized":
            bos = getattr(self._tokenizer, "bos_token_id", None)
            start = [bos] if bos is not None else cont[0][:1]
            uncond = self.score_continuations(start, cont, p.cache_salt)[2]
        scores = score_choices(lps, normalization=method, unconditional_logprobs=uncond)
        best = max(range(len(scores)), key=lambda i: scores[i])
        rid = p.request_id or f"req-{uuid.uuid4().hex[:12]}"
        c = Completion(
            request_id=rid, text=p.choices[best], token_ids=cont[best], finish_reason="stop",
            prompt_tokens=len(ids), cached_tokens=hit, completion_tokens=len(cont[best]),
            choice_scores=dict(zip(p.choices, scores)), choice_logprobs=lps,
            logprobs=[{"token_id": t, "token": self._decode([t], False), "logprob": lp, "top_logprobs": []}
                      for t, lp in zip(cont[best], lps[best])] if p.logprobs is not None else None,
        )
        c.outputs = [c]
        return c

    def cache_prefix(self, prompt, cache_salt: str | None = None) -> int:
        """Prefill prompt into the radix cache without generating. Returns how many of its tokens are cached."""
        params = SamplingParams(max_new_tokens=0, cache_salt=cache_salt)
        rid, stream, ids, p = self._submit(prompt, params)
        self._wait(rid, stream, ids, p)
        return self._call(lambda: self.core.kv.cache.match_prefix(ids, cache_salt).length)

    def abort(self, request_id: str) -> None:
        if not self._stopped:
            self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        if self._stopped or not self._thread.is_alive():
            return self.core.snapshot_stats()
        return self._call(self.core.snapshot_stats)

    def flush_cache(self) -> None:
        self._call(self.core.kv.flush)

    def check_integrity(self) -> None:
        """Debug: verify KV accounting now (on the loop thread)."""
        self._call(self.core.kv.check_integrity)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is waiting or running."""
        deadline = time.monotonic() + timeout
        while self._call(lambda: self.core.scheduler.has_work):
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not become idle")
            time.sleep(0.01)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self._stopped = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            if not self._stopped:
                self._inbox.put(None)
        except Exception:
            pass


class _ChunkState:
    """Turns StepOutputs into Chunks for one streaming request (per-sample incremental detokenization)."""

    def __init__(self, engine: Engine, ids: list[int], p: SamplingParams):
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
            completion_tokens=self.counts[i], matched_stop=ev.matched_stop,
        )


def _completion_chunk(c: Completion) -> Chunk:
    return Chunk(request_id=c.request_id, text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                 logprobs=c.logprobs, prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
                 completion_tokens=c.completion_tokens)


async def _aiter_one(awaitable):
    yield await awaitable


def _is_batch(prompt) -> bool:
    """A list of prompts (str, token lists or message lists), as opposed to one token-id or chat prompt."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, str) or (isinstance(first, (list, tuple)) and not isinstance(first, dict))
