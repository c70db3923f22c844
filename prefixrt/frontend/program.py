"""`@function` programs: run one (`run`) or many (`run_batch`, with the batch's common prefix pre-cached)."""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefixrt.frontend.backend import Context, ProgramBackend, ProviderBackend, SamplingArgs
from prefixrt.frontend.interpreter import ProgramError, ProgramState, StreamExecutor

log = logging.getLogger("prefixrt.frontend")

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
                             "prefixrt.frontend.set_default_backend")
        return _default_backend
    if isinstance(backend, ProgramBackend):
        return backend
    if callable(getattr(backend, "generate", None)) and callable(getattr(backend, "cache_prefix", None)):
        return ProviderBackend(backend)
    raise TypeError(f"backend must be a Provider or a frontend ProgramBackend, not {type(backend).__name__}")


class Program:
    """What `@function` makes of `def f(s, ...)`. Call `.run(...)` or `.run_batch(...)`."""

    def __init__(self, fn, **defaults: Any):
        self.fn = fn
        self.defaults = defaults
        functools.update_wrapper(self, fn)

    def _defaults(self, sampling: dict) -> dict:
        d = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, **self.defaults}
        d.update({k: v for k, v in sampling.items() if v is not None})
        return d

    def run(self, *args: Any, backend=None, temperature: float | None = None, max_new_tokens: int | None = None,
            top_p: float | None = None, timeout: float | None = None, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its finished state. Raises ProgramError (with `.state`) if any stream
        of the program (itself or a fork) failed, or if it did not finish within timeout seconds."""
        be = as_backend(backend)
        defaults = self._defaults(dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p))
        return self._run(be, defaults, args, kwargs, timeout)

    def _run(self, be: ProgramBackend, defaults: dict, args, kwargs, timeout) -> ProgramState:
        state = ProgramState(StreamExecutor(be, defaults))
        self.fn(state, *args, **kwargs)
        state._ex.sync_tree(timeout)
        return state

    def run_batch(self, batch_kwargs: list[dict], backend=None, num_threads: int | str = 16,
                  temperature: float | None = None, max_new_tokens: int | None = None, top_p: float | None = None,
                  timeout: float | None = None, prefix_hint: bool = True,
                  return_exceptions: bool = False) -> list[ProgramState | ProgramError]:
        """Run the program once per kwargs dict, num_threads at a time; results in input order.

        With prefix_hint, the longest prefix common to every program's first prompt is cached once first, so
        concurrent programs do not all prefill it. With return_exceptions, a failed program's ProgramError
        takes its place in the list; otherwise the first failure is raised (after all programs finished).
        """
        be = as_backend(backend)
        defaults = self._defaults(dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p))
        if num_threads == "auto":
            num_threads = max(2 * (os.cpu_count() or 1), 4)
        if prefix_hint and len(batch_kwargs) > 1 and isinstance(be, ProviderBackend) and be.prefix_hints:
            prefix = common_prefix([first_prompt(self, be, defaults, kw) for kw in batch_kwargs])
            if prefix:
                try:
                    be.cache_prefix_prompt(prefix)
                except Exception as e:  # a lost hint costs speed, not correctness
                    log.warning("batch prefix hint failed: %s", e)

        def one(kw):
            try:
                return self._run(be, defaults, (), kw, timeout)
            except ProgramError as e:
                return e

        with ThreadPoolExecutor(max_workers=max(1, int(num_threads))) as pool:
            results = list(pool.map(one, batch_kwargs))
        if not return_exceptions:
            for r in results:
                if isinstance(r, ProgramError):
                    raise r
        return results

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def function(fn=None, **defaults: Any):
    """Decorator: `@function` or `@function(temperature=0, max_new_tokens=64)` (the program's defaults)."""
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

    def select(self, ctx: Context, choices: list[str]):
        self._stop(ctx)

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
