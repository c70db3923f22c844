"""GrammarCompiler: compiles constraints off the scheduler thread, with a cache and a deadline.

`compile` is called at submit time from the caller's thread (an API handler, `Engine.generate`), never from
the scheduler loop. The work runs in a small thread pool (llguidance and xgrammar release the GIL while
compiling); the caller waits up to `timeout_s`. Results *and* InvalidRequest errors are cached by
(backend namespace, kind, canonical spec), and concurrent requests for the same spec share one compilation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prefixrt.constrained.base import CompiledGrammar, GrammarBackend
from prefixrt.constrained.spec import _param_for, canonical_spec
from prefixrt.errors import InvalidRequest


class GrammarCompiler:
    """Thread-safe, caching front of a `GrammarBackend`.

    max_workers: compilations that may run at once. timeout_s: how long `compile` waits. max_entries: LRU
    bound on cached results (compiled grammars for a 150k vocab can be megabytes with xgrammar).

    A compilation that times out keeps running in its worker (threads cannot be killed); when it finishes
    its result lands in the cache, so a retry of the same spec is served from it. Backends bound their own
    work (llguidance's parser limits), so a worker is not held forever.
    """

    def __init__(
        self, backend: GrammarBackend, max_workers: int = 2, timeout_s: float = 10.0, max_entries: int = 1024
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # key -> Future[CompiledGrammar]
        self.hits = 0
        self.misses = 0

    def compile(self, kind: str, spec: Any) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled now. Blocks the calling thread.

        Raises InvalidRequest for invalid specs (also when served from the cache) and
        InvalidRequest("grammar compilation timed out after ...") past the deadline.
        """
        key = (self.backend.cache_namespace, kind, canonical_spec(kind, spec))  # cheap; malformed input fails here
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                future = self._pool.submit(self._run, key, kind, spec)
                self._cache[key] = future
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise InvalidRequest(
                f"grammar compilation timed out after {self.timeout_s:g} s ({kind})", param=_param_for(kind)
            ) from None

    def _run(self, key: tuple, kind: str, spec: Any) -> CompiledGrammar:
        try:
            return self.backend.compile(kind, spec)
        except InvalidRequest:
            raise  # cached with the future: the same bad spec fails fast next time
        except Exception:
            # A backend bug, not a property of the spec: do not cache it, let a retry compile again.
            with self._lock:
                if self._cache.get(key) is not None:
                    del self._cache[key]
            raise

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        """Stop accepting work; running compilations finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
