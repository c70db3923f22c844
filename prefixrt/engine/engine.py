"""Engine: prefixrt in-process (docs/api.md). Thread-safe and asyncio-friendly.

Callers' threads tokenize, validate and compile grammars (so a bad request fails in the caller and the loop
never sees it), then hand requests to the scheduler loop through an inbox. The loop runs EngineCore.step()
on its own thread and streams StepOutputs back through one RequestStream per request. The caller-side half
(tokenization, validation, Completion/Chunk assembly) is EngineAPI (api.py), shared with ProcessEngine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from prefixrt.config.engine_config import EngineConfig
from prefixrt.constrained.budget import budget_matcher
from prefixrt.default_models import BASE_MODEL
from prefixrt.engine.api import EngineAPI
from prefixrt.engine.loop.busy_gc import BusyGC
from prefixrt.engine.loop.postprocess import jump_forward
from prefixrt.engine.probes import EngineProbes
from prefixrt.engine.process.messages import packed_id_range, unpack_token_ids
from prefixrt.engine.progress import ProgressWatch
from prefixrt.engine.stream import RequestStream
from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.lowering.choice_scoring import best_choice, score_choices
from prefixrt.multimodal.inputs import ReqImages, keyed_prompt
from prefixrt.multimodal.messages import IMAGE_MARKER, has_images, split_images
from prefixrt.outputs import Completion, EngineStats
from prefixrt.params import SamplingParams
from prefixrt.request import Req

log = logging.getLogger("prefixrt")


@dataclass
class PreparedRequest:
    """A validated request ready for the loop (Engine.prepare -> Engine.enqueue): its id, prompt ids, coerced
    params and one Req per sample (constraint matchers attached, step-0 forced tokens already output)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    reqs: list[Req]


class Engine(EngineAPI):
    """See docs/api.md. `Engine(model="gemma-3-270m", ...)`; use as a context manager or call shutdown()."""

    def __init__(self, model: str = BASE_MODEL, **kwargs: Any):
        progress = kwargs.pop("progress", None)
        parts = kwargs.pop("_parts", None)  # (model, tokenizer, resolved): tests inject a ready model
        # Where the loop's outputs go (LoopHooks.deliver): RequestStreams, or the engine process's pipe.
        deliver = kwargs.pop("_deliver", None) or RequestStream.push_many
        self.config = EngineConfig(model=model if isinstance(model, str) else "custom", **kwargs)
        from prefixrt.engine import builder

        if parts is None:
            built = builder.build(self.config, progress, deliver)
        elif self.config.tp_size > 1:
            raise ValueError("tp_size > 1 loads each rank's shard itself: pass a model name or folder, not a model")
        else:
            dev = builder.resolve_device(self.config.device)
            built = builder.assemble(self.config, *parts, dev, builder.resolve_dtype(self.config.dtype, dev),
                                     deliver=deliver)
        self._built = built
        self.core = built.core
        self.progress = ProgressWatch()  # health(): is the loop stepping while it has work
        self.probes = EngineProbes(self)  # what benchmarks observe and switch (engine/probes.py, docs/api.md "Probes")
        self._tokenizer = built.tokenizer
        self._tok_lock = built.tokenizer_lock
        self.device = built.device
        self.model_name = built.resolved.name
        self.model_revision = built.resolved.revision
        path = getattr(built.resolved, "path", None)
        self.model_path = str(path) if path is not None else None  # the local folder the model was loaded from
        self.vocab_size = built.model.vocab_size
        self.max_context = self.core.max_context
        self.kv_total_tokens = self.core.kv.total_tokens
        self._grammar = self.core.hooks.grammar
        # Text, stop strings and logprob strings leave the loop on the detokenizer's thread.
        self.core.detokenizer.start()
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = False
        self._ids = itertools.count()
        if builder.grammar_warm_up(self.config, self.device):
            # The first constrained request should not build the vocabulary tables: started during the build
            # (engine/builder.py), waited for here; `spent` is the wait.
            spent = self.warm_grammar()
            self._built.startup["total_s"] = self._built.startup.get("total_s", 0.0) + spent
            (progress or log.info)(f"grammar backend ready ({spent:.1f}s after the rest of start-up)")
        if self.device.type == "cuda":
            # Everything built so far (model, graphs, tokenizer) lives as long as the engine: keep it out of the
            # cyclic collector, whose full passes over it would otherwise stall the loop thread at random steps.
            gc.collect()
            gc.freeze()
            from prefixrt.engine.compile_cache import COMPILES
            COMPILES.mark_serving()  # kernel builds from here on are counted as serving's (should be none)
        self._thread = threading.Thread(target=self._loop, name="prefixrt-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public properties
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
        collector = BusyGC(enabled=self.device.type == "cuda")  # no collector pauses inside busy stretches
        while True:
            try:
                block = not core.has_work
                if block:
                    collector.idle()
                while True:
                    try:
                        msg = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    block = False
                    if msg is None:
                        self._drain_on_exit()
                        collector.idle()
                        return
                    self._handle(msg)
                if core.has_work:
                    collector.busy()
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
        self.core.drain()

    def _run_on_loop(self, fn, timeout: float | None = 60.0):
        """Run fn on the loop thread (between steps) and return its result."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout=timeout)

    # ------------------------------------------------------------------ submission
    def grammar_compiler(self):
        """The engine's GrammarCompiler (built on first use: the backend's vocab tables take ~1 s)."""
        return self._grammar.compiler()

    def warm_grammar(self) -> float:
        """Build the grammar backend and its vocabulary tables now, which the first constrained request would
        otherwise wait for (several seconds for a 128k-token vocabulary). Start-up does this where
        EngineConfig.grammar_warm_up says so (default: on CUDA). Returns the seconds spent, also in the start-up
        report as `grammar_warm_s`; a failure is logged, and the first constrained request meets it again."""
        t = time.perf_counter()
        try:
            self._grammar.warm(self.device)
        except Exception:
            log.warning("grammar backend warm-up failed", exc_info=True)
        spent = time.perf_counter() - t
        self._built.startup["grammar_warm_s"] = spent
        return spent

    def _compile(self, p: SamplingParams):
        kind = p.constraint_kind
        spec = None if kind == "json_object" else getattr(p, kind)
        return self.grammar_compiler().compile(kind, spec)

    def _submit(self, prompt, params, loop: asyncio.AbstractEventLoop | None = None, **req_fields):
        """See EngineAPI._submit: prepare, then enqueue with a new RequestStream on `loop` as the sink."""
        prepared = self.prepare(prompt, params, **req_fields)
        stream = RequestStream(loop)
        self.enqueue(prepared, stream)
        return prepared.request_id, stream, prepared.prompt_ids, prepared.params

    def prepare(self, prompt, params, **req_fields) -> PreparedRequest:
        """Everything before scheduling, in the caller's thread: coerce and validate params, tokenize and
        check the prompt, compile the constraint (with step-0 forced tokens already output), build one Req
        per sample. Raises InvalidRequest (or EngineDeadError); nothing reaches the loop. `req_fields` are
        extra Req fields (input_logprobs_from for choice scoring)."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        p = SamplingParams.coerce(params)
        if has_images(prompt):
            ids, images = self._tokenize_with_images(prompt)
            self._validate_ids(ids, p)
            if p.constraint_kind == "choices":
                raise InvalidRequest("choices with images are not supported", param="choices")
            key = keyed_prompt(ids, images.blocks, images.images)
            return self._prepare_ids(ids, p, {**req_fields, "images": images}, key=key)
        ids = self._tokenize(prompt)
        self._validate_ids(ids, p)
        return self._prepare_ids(ids, p, req_fields)

    @property
    def takes_images(self) -> bool:
        """Whether chat messages may hold images (a vision-language model with its image processor)."""
        return getattr(self._built.model, "vision", None) is not None and self._built.image_processor is not None

    def image_prompt_ids(self, messages: list[dict]) -> list[int]:
        ids = self._tokenize_with_images(messages)[0]
        self._check_length(len(ids))
        return ids

    def _tokenize_with_images(self, messages) -> tuple[list[int], ReqImages]:
        """Chat messages holding images -> (prompt ids with each image's placeholder block, the images). The
        template renders each image as a marker; the text between markers is encoded piece by piece and the
        model's image block (VisionSpec.image_block) goes where each marker was. Raises InvalidRequest."""
        spec = getattr(self._built.model, "vision", None)
        if spec is None:
            raise InvalidRequest(f"model {self.model_name!r} takes no images", param="messages")
        processor = self._built.image_processor
        if processor is None:
            raise InvalidRequest(f"model {self.model_name!r} has no image processor (preprocessor_config.json)",
                                 param="messages")
        if getattr(self.core.runner, "model", None) is not self._built.model or self.config.tp_size > 1:
            raise InvalidRequest("images need a single-device engine", param="messages")
        backend = getattr(self.core.runner, "attn_backend", None)
        if spec.bidirectional and not getattr(backend, "bidirectional_spans", False):
            raise InvalidRequest(f"model {self.model_name!r} attends both ways within an image, which needs an "
                                 "attention backend with bidirectional image blocks (torch or triton)",
                                 param="messages")
        plain, sources = split_images(list(messages))
        images = processor.process(sources, param="messages")  # decodes, checks limits, hashes
        text: list[str] = []
        self.chat_prompt_ids(plain, text_out=text)
        pieces = text[0].split(IMAGE_MARKER)
        if len(pieces) != len(images) + 1:
            raise InvalidRequest(f"the chat template kept {len(pieces) - 1} of {len(images)} images",
                                 param="messages")
        ids: list[int] = []
        blocks: list[tuple[int, int]] = []
        block = spec.image_block()
        offset = block.index(spec.image_token_id)
        for i, piece in enumerate(pieces):
            if piece:
                ids.extend(self._encode_text(piece, False))
            if i < len(images):
                start = len(ids) + offset
                ids.extend(block)
                blocks.append((start, start + spec.tokens_per_image))
        return ids, ReqImages(spec.image_token_id, blocks, images, spec.bidirectional)

    def prepare_packed(self, packed_ids: bytes, params) -> PreparedRequest:
        """prepare() for a token-id prompt packed by messages.pack_token_ids (what a ProcessEngine's server process
        sends): the same checks and the same result, with the id range read off the packed buffer and the ids
        unpacked once (no Python step per id). Raises InvalidRequest."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        p = SamplingParams.coerce(params)
        ids = unpack_token_ids(packed_ids)
        self._validate_ids(ids, p, packed_id_range(packed_ids) if ids else None)
        return self._prepare_ids(ids, p, {})

    def _prepare_ids(self, ids: list[int], p: SamplingParams, req_fields: dict, key: list | None = None
                     ) -> PreparedRequest:
        """The rest of prepare() for validated ids and params: compile the constraint, build one Req per sample.
        key: the prompt as the cache keys it (multimodal/inputs.py keyed_prompt), when it is not ids."""
        adapter, salt = self._adapter_of(p)
        compiled = None
        if p.constraint_kind not in (None, "choices"):
            compiled = self._compile(p)
        rid = p.request_id or f"req-{uuid.uuid4().hex[:12]}"
        reqs = []
        for i in range(p.n):
            r = Req(rid=rid, prompt_ids=ids if key is None else key, params=p, sink=None, index=i,
                    salt=salt, adapter=adapter, **req_fields)
            if compiled is not None:
                max_new_tokens = min(p.max_new_tokens, self.max_context - len(ids))
                r.matcher = budget_matcher(self.grammar_compiler().backend, compiled, max_new_tokens)
                # Step-0 forced tokens join the prefill (reserve 1: the prefill still samples a token).
                r.pending_emit = jump_forward(r, self.max_context, reserve=1)
            reqs.append(r)
        return PreparedRequest(rid, ids, p, reqs)

    def _adapter_of(self, p: SamplingParams):
        """(the LoRA adapter p.lora names, the request's cache namespace): (None, cache_salt) for the base model.
        InvalidRequest if no adapter of that name is loaded."""
        if p.lora is None:
            return None, p.cache_salt
        lora = self.core.scheduler.adapters
        if lora is None:
            raise InvalidRequest(f"LoRA adapter {p.lora!r} requested, but this engine serves no LoRA adapters "
                                 "(start it with lora_adapters / --lora-modules, or enable_lora / --enable-lora)",
                                 param="model")
        adapter = lora.lookup(p.lora)
        return adapter, lora.namespace(adapter, p.cache_salt)

    def _namespace(self, cache_salt: str | None, lora: str | None):
        """The cache namespace of a prompt under cache_salt and the named adapter (InvalidRequest if unknown)."""
        return self._adapter_of(SamplingParams(max_new_tokens=0, cache_salt=cache_salt, lora=lora))[1]

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, name: str, path) -> None:
        """Load a PEFT LoRA adapter folder under `name` (it becomes resident on the device when a request needs it);
        `path` may also be a lora/peft_format.py LoraAdapter made in memory (benchmarks). ValueError if the engine
        serves no adapters, the name is taken, or the adapter does not fit the model."""
        if self.core.scheduler.adapters is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora=True / --enable-lora)")
        self.core.scheduler.adapters.register(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter. ValueError while requests use it; KeyError if no adapter has that name."""
        if self.core.scheduler.adapters is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        self._run_on_loop(lambda: self.core.scheduler.adapters.unregister(name))

    def lora_adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters (the server lists them as models whose parent is the base model)."""
        return [] if self.core.scheduler.adapters is None else sorted(self.core.scheduler.adapters.names())

    def enqueue(self, prepared: PreparedRequest, sink) -> None:
        """Hand a prepared request to the loop; its outputs go to `sink` (a RequestStream, or whatever the
        loop's deliver hook routes, e.g. the engine process's pipe). A request is enqueued at most once."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        for r in prepared.reqs:
            if r.sink is not None:
                raise RuntimeError(f"request {prepared.request_id!r} was already enqueued")
            r.sink = sink
        self._hand_over(prepared)

    def _hand_over(self, prepared: PreparedRequest) -> None:
        """Give an enqueued request to the loop (a subclass may route it elsewhere first)."""
        self._inbox.put(("add", prepared.reqs))

    # ------------------------------------------------------------------ select
    def score_continuations(self, prompt, continuations: list[list[int]], cache_salt: str | None = None,
                            lora: str | None = None) -> tuple[list[int], int, list[list[float]]]:
        """Log p(continuation tokens | prompt) for each continuation, token by token. The prompt is prefilled
        once (cache_prefix) and every continuation is an extend of it, submitted together.
        Returns (prompt ids, prompt tokens reused from the cache, per-continuation token logprobs)."""
        ids = self._tokenize(prompt)
        base = SamplingParams(max_new_tokens=0, cache_salt=cache_salt, lora=lora)
        self._validate_ids(ids, base)
        ns = self._namespace(cache_salt, lora)
        hit = self._run_on_loop(lambda: self.core.kv.cache.match_prefix(ids, ns, max_len=len(ids) - 1).length)
        if self.config.radix_cache:
            self.cache_prefix(ids, cache_salt, lora)
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
        with self._tok_lock:
            cont = [self._tokenizer.encode(c, add_special_tokens=False) for c in p.choices]
        if any(not c for c in cont):
            raise InvalidRequest("a choice tokenizes to nothing", param="choices")
        ids, hit, lps = self.score_continuations(prompt, cont, p.cache_salt, p.lora)
        uncond = None
        method = p.choices_method
        if method == "unconditional_normalized":
            bos = getattr(self._tokenizer, "bos_token_id", None)
            start = [bos] if bos is not None else cont[0][:1]
            uncond = self.score_continuations(start, cont, p.cache_salt, p.lora)[2]
        scores = score_choices(lps, normalization=method, unconditional_logprobs=uncond)
        best = best_choice(scores)
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

    def cache_prefix(self, prompt, cache_salt: str | None = None, lora: str | None = None) -> int:
        """Prefill prompt into the radix cache without generating (under the named LoRA adapter, or the base model).
        Returns how many of its tokens are cached."""
        params = SamplingParams(max_new_tokens=0, cache_salt=cache_salt, lora=lora)
        rid, stream, ids, p = self._submit(prompt, params)
        self._wait(rid, stream, ids, p)
        ns = self._namespace(cache_salt, lora)
        return self._run_on_loop(lambda: self.core.kv.cache.match_prefix(ids, ns).length)

    def abort(self, request_id: str) -> None:
        if not self._stopped:
            self._inbox.put(("abort", request_id))

    def health(self) -> str | None:
        """None while the scheduler loop runs and, with work, makes progress (engine/progress.py); else why
        not (cheap: does not wait for the loop)."""
        if self._stopped:
            return "engine is shut down"
        if not self._thread.is_alive():
            return "the scheduler loop thread has stopped"
        self.progress.observe(self.core.steps_done, self.core.has_work)
        return self.progress.stall()

    def stats(self) -> EngineStats:
        if self._stopped or not self._thread.is_alive():
            return self.core.snapshot_stats()
        return self._run_on_loop(self.core.snapshot_stats)

    def largest_prefixes(self, max_nodes: int = 40) -> list[dict]:
        """The largest cached prefixes of the radix tree as a pruned tree (RadixCache.largest_prefixes); [] for
        a cache that keeps nothing."""
        fn = getattr(self.core.kv.cache, "largest_prefixes", None)
        return self._run_on_loop(lambda: fn(max_nodes)) if fn is not None else []

    def flush_cache(self) -> None:
        self._run_on_loop(self.core.kv.flush)

    def check_integrity(self) -> None:
        """Debug: verify KV accounting now (on the loop thread); with LoRA adapters, their slots too (and that none is
        held when the engine is idle)."""
        self._run_on_loop(self.core.kv.check_integrity)
        lora = self.core.scheduler.adapters
        if lora is not None:
            self._run_on_loop(lambda: lora.check(idle=not self.core.has_work))

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is waiting or running."""
        deadline = time.monotonic() + timeout
        while self._run_on_loop(lambda: self.core.has_work):
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not become idle")
            time.sleep(0.01)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stop_workers()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self.core.detokenizer.close()
        self.core.close()  # the mask worker, if started
        self.core.kv.close()  # the host tier's copy worker, if any
        if self.core.scheduler.adapters is not None:
            self.core.scheduler.adapters.close()  # the adapter load worker, if any
        self._stopped = True
        if not self._thread.is_alive():  # the loop is gone: free the GPU memory now, not at garbage collection
            from prefixrt.engine import builder

            builder.stop_ranks(self._built)  # tensor parallelism: the other ranks return (after the loop: in step)
            builder.release(self._built)

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

