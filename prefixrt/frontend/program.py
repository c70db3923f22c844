"""`@function` programs: run one (`run`, optionally streaming), many (`run_batch`, with the batch's common
prefix pre-cached), trace one into its graph of primitives (`trace`), or compile it (`compile`, compiler.py)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.frontend.backend import (
    Context,
    ProgramBackend,
    ProviderBackend,
    SamplingArgs,
    as_backend,
    set_default_backend,  # noqa: F401 - public here too
)
from prefixrt.frontend.interpreter import ProgramError, StreamExecutor
from prefixrt.frontend.ir import RUN_SAMPLING
from prefixrt.frontend.state import ProgramState

log = logging.getLogger("prefixrt.frontend")


def sampling_defaults(where: str, given: dict) -> dict:
    """Validated sampling defaults of a run or @function (RUN_SAMPLING keys; None values dropped)."""
    from prefixrt.params import SamplingParams

    unknown = sorted(set(given) - set(RUN_SAMPLING))
    if unknown:
        raise InvalidRequest(f"{where}: unknown argument {unknown[0]!r} (sampling defaults are "
                             f"{', '.join(RUN_SAMPLING)})", param=unknown[0])
    d = {k: v for k, v in given.items() if v is not None}
    try:
        SamplingParams(**d)
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}: {e.message}", param=e.param) from e
    return d


class Program:
    """What `@function` makes of `def f(s, ...)`. Call `.run(...)`, `.run_batch(...)`, `.trace(...)` or
    `.compile()`. `num_api_spec_tokens`: API speculative execution budget (OpenAIBackend), carried across the
    program's statements; the other keyword arguments are sampling defaults of every run."""

    def __init__(self, fn, num_api_spec_tokens: int | None = None, **defaults: Any):
        self.fn = fn
        where = f"@function({getattr(fn, '__name__', 'program')})"
        if num_api_spec_tokens is not None and (not isinstance(num_api_spec_tokens, int)
                                                or isinstance(num_api_spec_tokens, bool) or num_api_spec_tokens < 0):
            raise InvalidRequest(f"{where}: num_api_spec_tokens must be an integer >= 0, got "
                                 f"{num_api_spec_tokens!r}", param="num_api_spec_tokens")
        self.num_api_spec_tokens = num_api_spec_tokens or 0
        self.defaults = sampling_defaults(where, defaults)
        functools.update_wrapper(self, fn)

    def _defaults(self, sampling: dict) -> dict:
        given = sampling_defaults(f"{self.fn.__name__}.run", sampling)
        return {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, **self.defaults, **given}

    def _executor(self, be: ProgramBackend, defaults: dict, streaming: bool = False, tracer=None) -> StreamExecutor:
        spec = self.num_api_spec_tokens or be.speculative_tokens
        return StreamExecutor(be, defaults, spec_tokens=spec, streaming=streaming, tracer=tracer)

    def run(self, *args: Any, backend=None, stream: bool = False, timeout: float | None = None,
            max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
            stop=None, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its finished state. Raises ProgramError (with `.state`) if any stream
        of the program (itself or a fork) failed, or if it did not finish within timeout seconds.

        stream=True returns the state as soon as the body has run (it only enqueues); gens stream their
        text, read with `state.text_iter()` / `text_async_iter()`. Keyword arguments that are sampling
        fields (ir.RUN_SAMPLING: top_k, min_p, ...) are defaults of every gen; the rest go to the program."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_SAMPLING}
        sampling.update(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop)
        be = as_backend(backend)
        defaults = self._defaults(sampling)
        state = ProgramState(self._executor(be, defaults, streaming=stream))
        self.fn(state, *args, **kwargs)
        if not stream:
            state._ex.sync_tree(timeout)
        return state

    def _run(self, be: ProgramBackend, defaults: dict, args, kwargs, timeout) -> ProgramState:
        state = ProgramState(self._executor(be, defaults))
        self.fn(state, *args, **kwargs)
        state._ex.sync_tree(timeout)
        return state

    def run_batch(self, batch_kwargs: list[dict], backend=None, num_threads: int | str = 16,
                  progress_bar: bool = False, generator_style: bool = False, timeout: float | None = None,
                  prefix_hint: bool = True, return_exceptions: bool = False, max_new_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, stop=None, **sampling: Any):
        """Run the program once per kwargs dict, num_threads at a time; results in input order.

        With prefix_hint, the longest prefix common to every program's first prompt is cached once first, so
        concurrent programs do not all prefill it. With return_exceptions, a failed program's ProgramError
        takes its place; otherwise the first failure is raised (after all programs finished). progress_bar:
        a tqdm bar of finished programs. generator_style: a generator of the results in input order, each
        yielded as soon as it and those before it are done (the batch keeps running while you consume it).
        """
        sampling.update(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop)
        be = as_backend(backend)
        defaults = self._defaults(sampling)
        batch_kwargs = [dict(kw) for kw in batch_kwargs]
        if num_threads == "auto":
            num_threads = max(2 * (os.cpu_count() or 1), 4)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise InvalidRequest(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}",
                                 param="num_threads")
        if prefix_hint and len(batch_kwargs) > 1 and isinstance(be, ProviderBackend) and be.prefix_hints:
            prefix = common_prefix([first_prompt(self, be, defaults, kw) for kw in batch_kwargs])
            if prefix:
                try:
                    be.cache_prefix_prompt(prefix)
                except Exception as e:  # a lost hint costs speed, not correctness
                    log.warning("batch prefix hint failed: %s", e)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.fn.__name__)

        def one(kw):
            try:
                return self._run(be, defaults, (), kw, timeout)
            except ProgramError as e:
                return e
            finally:
                if bar is not None:
                    bar.update(1)

        pool = ThreadPoolExecutor(max_workers=min(num_threads, max(1, len(batch_kwargs))))
        futures = [pool.submit(one, kw) for kw in batch_kwargs]

        def results():
            try:
                for f in futures:
                    r = f.result()
                    if isinstance(r, ProgramError) and not return_exceptions:
                        raise r
                    yield r
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
                if bar is not None:
                    bar.close()

        if generator_style:
            return results()
        pool.shutdown(wait=True)
        if bar is not None:
            bar.close()
        out = [f.result() for f in futures]
        if not return_exceptions:
            for r in out:
                if isinstance(r, ProgramError):
                    raise r
        return out

    def trace(self, backend=None, **example_args: Any):
        """The program's graph of primitives (compiler.Graph), found without calling a model. Program
        arguments not given become placeholders (their text is marked as argument input in the graph)."""
        from prefixrt.frontend.compiler import trace

        return trace(self, backend, example_args)

    def compile(self, backend=None, **constants: Any):
        """A CompiledProgram (compiler.py): same results as run() under greedy decoding; it caches each
        constant prefix before its first run and submits a run's independent gens together. `constants`:
        arguments fixed for every run (the others are traced as placeholders)."""
        from prefixrt.frontend.compiler import CompiledProgram

        return CompiledProgram(self, backend, **constants)

    def parameters(self) -> list[str]:
        """The program's argument names (after `s`)."""
        return list(inspect.signature(self.fn).parameters)[1:]

    def parameter_defaults(self) -> dict:
        """The program's arguments that have a default, with it."""
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def function(fn=None, **defaults: Any):
    """Decorator: `@function` or `@function(temperature=0, max_new_tokens=64, num_api_spec_tokens=64)`.
    Unknown keyword arguments raise InvalidRequest when the program is defined."""
    if fn is None:
        return lambda f: Program(f, **defaults)
    return Program(fn, **defaults)


# ---------------------------------------------------------------------- batch prefix
class _FirstCall(Exception):
    pass


class _TracingBackend(ProgramBackend):
    """Renders like the real backend, records the prompt of the first backend call and stops the program."""

    def __init__(self, real: ProgramBackend):
        self.real = real
        self.chat_format = real.chat_format
        self.prompt: str | None = None

    def _stop(self, ctx: Context):
        try:
            self.prompt = self.real.prompt(ctx) if isinstance(self.real, ProviderBackend) else self.real.render(ctx)
        except Exception:
            self.prompt = None
        raise _FirstCall()

    def generate(self, ctx: Context, args: SamplingArgs):
        self._stop(ctx)

    def select(self, ctx: Context, choices: list[str], method: str | None = None):
        self._stop(ctx)

    def check_media(self, kind: str) -> None:
        self.real.check_media(kind)

    def cache_prefix(self, ctx: Context) -> int:
        return 0  # a fork's hint: its prefix is also the prefix of the branch's first call


def first_prompt(program: Program, backend: ProgramBackend, defaults: dict, kwargs: dict):
    """The prompt of the program's first backend call, as the backend would send it (token ids, text or chat
    messages), found by running the program's body against a tracing backend."""
    tracer = _TracingBackend(backend)
    state = ProgramState(StreamExecutor(tracer, defaults))
    try:
        program.fn(state, **kwargs)
        state._ex.sync_tree(30)
    except Exception:  # the tracer stops the program at its first call; the body may fail on reads after it
        pass
    return tracer.prompt


def common_prefix(prompts: list):
    """The longest common prefix of prompts that are all token-id lists or all texts; None otherwise (chat
    messages are rendered by the provider, so their common token prefix is unknown here)."""
    if not prompts or any(not p for p in prompts):
        return None
    if all(isinstance(p, str) for p in prompts) or all(isinstance(p, list) and isinstance(p[0], int) for p in prompts):
        return os.path.commonprefix(prompts) or None
    return None
