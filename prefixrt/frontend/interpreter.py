"""The interpreter: every program state executes its expressions on its own background stream.

`s += expr` only enqueues; a worker thread (started on demand, gone when the queue drains) executes the
queue in order, calling the backend. Reading a variable blocks until the stream has produced it, has
finished without it (VariableNotFound) or has failed (ProgramError) — never longer. `fork(k)` enqueues a
fork point on the parent; the k children start immediately on their own streams, wait for that point,
and then run concurrently, so their requests reach the engine together.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from prefixrt.frontend.backend import Context, ProgramBackend, SamplingArgs
from prefixrt.frontend.chat_format import Message, Piece
from prefixrt.frontend.ir import Expr, Gen, Role, Select, Text, flatten, to_expr

log = logging.getLogger("prefixrt.frontend")


class ProgramError(RuntimeError):
    """A program failed. `state` is the ProgramState at the failure (text, variables, requests so far)."""

    def __init__(self, message: str, state: ProgramState | None = None):
        super().__init__(message)
        self.message = message
        self.state = state

    def __str__(self) -> str:
        return self.message


class VariableNotFound(ProgramError, KeyError):
    """A variable was read that the program never set (KeyError-like; `state` attached)."""


@dataclass
class RequestRecord:
    """One backend call made by a state's stream (for cache accounting and API-call counting)."""

    kind: str  # "gen" | "select" | "speculate" | "cache_prefix"
    name: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    method: str | None = None  # select: how the choice was scored ("engine", "logprobs", "constrained", ...)


class StreamExecutor:
    """Owns one state's pieces/variables and the worker that executes its queued expressions."""

    def __init__(self, backend: ProgramBackend, defaults: dict, parent: StreamExecutor | None = None):
        self.backend = backend
        self.defaults = defaults
        self.pieces: list[Piece] = []
        self.open_role: str | None = None
        self.partial = ""
        self.variables: dict[str, object] = {}
        self.select_scores: dict[str, dict[str, float]] = {}
        self.requests: list[RequestRecord] = []
        self.children: list[StreamExecutor] = []
        self.hints: list[threading.Thread] = []  # in-flight prefix hints (joined by sync_tree)
        self.error: BaseException | None = None
        self.state: ProgramState | None = None  # the user-facing wrapper (for error messages)
        self._queue: collections.deque = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._worker_running = False

    # ------------------------------------------------------------------ queue and worker
    def submit(self, op) -> None:
        with self._cond:
            self._queue.append(op)
            self._pending += 1
            if not self._worker_running:
                self._worker_running = True
                threading.Thread(target=self._work, name="prefixrt-program-stream", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._worker_running = False
                    return
                op = self._queue.popleft()
                failed = self.error is not None
            try:
                if failed:
                    op_fail = getattr(op, "fail", None)
                    if op_fail is not None:
                        op_fail(self.error)
                else:
                    op.run(self)
            except BaseException as e:  # noqa: BLE001 - any failure ends this stream, never the process
                with self._cond:
                    self.error = e
                fail = getattr(op, "fail", None)
                if fail is not None:
                    fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _wait(self, done, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def get(self, name: str, timeout: float | None = None):
        ok = self._wait(lambda: name in self.variables or self._pending == 0 or self.error is not None, timeout)
        if name in self.variables:
            return self.variables[name]
        if not ok:
            raise ProgramError(f"timed out after {timeout}s waiting for variable {name!r}", self.state)
        if self.error is not None:
            raise self._program_error(f"the program failed before setting {name!r}")
        raise VariableNotFound(f"variable {name!r} is not set by the program (set: {sorted(self.variables)})",
                               self.state)

    def sync(self, timeout: float | None = None) -> None:
        if not self._wait(lambda: self._pending == 0, timeout):
            raise ProgramError(f"timed out after {timeout}s waiting for the program's stream", self.state)
        if self.error is not None:
            raise self._program_error("the program failed")

    def sync_tree(self, timeout: float | None = None) -> None:
        """Wait for this stream and every fork below it; raise the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.sync(timeout)
        for t in list(self.hints):
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for child in list(self.children):
            child.sync_tree(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _program_error(self, what: str) -> ProgramError:
        e = self.error
        if isinstance(e, ProgramError):
            err = ProgramError(f"{what}: {e.message}", self.state)
        else:
            err = ProgramError(f"{what}: {type(e).__name__}: {e}", self.state)
        err.__cause__ = e
        return err

    # ------------------------------------------------------------------ state helpers (worker thread)
    def context(self) -> Context:
        return Context(list(self.pieces), self.open_role, self.partial)

    def append(self, text: str) -> None:
        if not text:
            return
        if self.open_role is not None:
            self.partial += text
        elif self.pieces and isinstance(self.pieces[-1], str):
            self.pieces[-1] += text
        else:
            self.pieces.append(text)

    def record(self, kind: str, name: str | None, res, t0: float) -> None:
        self.requests.append(RequestRecord(kind, name, getattr(res, "prompt_tokens", 0),
                                           getattr(res, "cached_tokens", 0), time.monotonic() - t0,
                                           getattr(res, "method", None)))

    # ------------------------------------------------------------------ execution (worker thread)
    def execute(self, items: list[Expr]) -> None:
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, Text):
                self.append(item.text)
            elif isinstance(item, Role):
                self._role(item)
            elif isinstance(item, Gen):
                done = self._speculate(items, i) if self.backend.speculative_tokens > 0 else 0
                if done:
                    i += done
                    continue
                self._gen(item)
            elif isinstance(item, Select):
                self._select(item)
            else:
                raise TypeError(f"cannot execute {type(item).__name__}")
            i += 1

    def _role(self, block: Role) -> None:
        if self.open_role is not None:
            raise RuntimeError("role blocks cannot nest")
        self.open_role, self.partial = block.role, ""
        self.execute(flatten(block.content))
        self.pieces.append(Message(block.role, self.partial))
        self.open_role, self.partial = None, ""

    def _set(self, name: str | None, value) -> None:
        if name is not None:
            with self._cond:
                self.variables[name] = value
                self._cond.notify_all()

    def _gen(self, g: Gen) -> None:
        t0 = time.monotonic()
        res = self.backend.generate(self.context(), SamplingArgs.resolve(g, self.defaults))
        self.record("gen", g.name, res, t0)
        self._set(g.name, res.text)
        self.append(res.text)

    def _select(self, sel: Select) -> None:
        t0 = time.monotonic()
        res = self.backend.select(self.context(), sel.choices)
        self.record("select", sel.name, res, t0)
        if sel.name is not None:
            self.select_scores[sel.name] = res.scores
        self._set(sel.name, res.choice)
        self.append(res.choice)

    def _speculate(self, items: list[Expr], i: int) -> int:
        """Run the gens from items[i] on through the backend's speculative execution.
        Returns how many items were consumed (0: nothing resolved, run items[i] normally)."""
        j = i
        while j < len(items) and isinstance(items[j], (Text, Gen)):
            j += 1
        window = items[i:j]
        t0 = time.monotonic()
        results = self.backend.speculate(self.context(), window, self.defaults)
        if results is None:  # the backend declined: no call was made
            return 0
        consumed, k = 0, 0
        for item in window:
            if isinstance(item, Gen):
                if k == len(results):
                    break
                res = results[k]
                self.record("speculate" if k == 0 else "gen-speculated", item.name, res, t0)
                self._set(item.name, res.text)
                self.append(res.text)
                k += 1
            else:
                self.append(item.text)
            consumed += 1
        # The unmatched remainder runs as separate calls (no second guess): results never rest on a guess.
        for item in window[consumed:]:
            if isinstance(item, Gen):
                self._gen(item)
            else:
                self.append(item.text)
        return len(window)


# ---------------------------------------------------------------------- queued operations
class _ExprOp:
    def __init__(self, items: list[Expr]):
        self.items = items

    def run(self, ex: StreamExecutor) -> None:
        ex.execute(self.items)


class _ForkOp:
    """On the parent: send the shared prefix to the backend's cache (prefix hint), then hand a snapshot to the
    children. The hint is submitted before the branches start, so it reaches the engine first and the
    branches' first requests reuse the prefix; it is not awaited on an in-process engine (no extra round
    trip per fork: the engine prefills the shared part once, with the hint as the leader)."""

    def __init__(self, k: int, hint: bool):
        self.k = k
        self.hint = hint
        self.snapshot: Future = Future()

    def run(self, ex: StreamExecutor) -> None:
        if self.hint and self.k > 1 and (ex.pieces or ex.open_role):
            t0 = time.monotonic()
            try:
                wait = ex.backend.submit_prefix_hint(ex.context())
            except Exception as e:  # a lost hint costs speed, not correctness; the branches' calls report errors
                log.warning("prefix hint failed: %s", e)
            else:
                t = threading.Thread(target=self._finish_hint, args=(ex, wait, t0), name="prefixrt-prefix-hint",
                                     daemon=True)
                ex.hints.append(t)
                t.start()
        self.snapshot.set_result((list(ex.pieces), dict(ex.variables)))

    @staticmethod
    def _finish_hint(ex: StreamExecutor, wait, t0: float) -> None:
        try:
            cached = wait()
        except Exception as e:
            log.warning("prefix hint failed: %s", e)
            return
        ex.requests.append(RequestRecord("cache_prefix", None, cached, cached, time.monotonic() - t0))

    def fail(self, error: BaseException) -> None:
        if not self.snapshot.done():
            self.snapshot.set_exception(error)


class _InitFromForkOp:
    def __init__(self, fork: _ForkOp):
        self.fork = fork

    def run(self, ex: StreamExecutor) -> None:
        try:
            pieces, variables = self.fork.snapshot.result()
        except BaseException as e:
            raise ProgramError(f"the parent failed before the fork point: {type(e).__name__}: {e}", ex.state) from e
        ex.pieces = list(pieces)  # each branch owns its copy
        with ex._cond:
            ex.variables.update(variables)


# ---------------------------------------------------------------------- the user-facing state
class ProgramState:
    """`s` in a program: `s += expr`, `s["name"]`, `s.fork(k)`, `s.text()`, `s.messages()`."""

    def __init__(self, executor: StreamExecutor):
        self._ex = executor
        executor.state = self

    def __iadd__(self, other) -> ProgramState:
        self._ex.submit(_ExprOp(flatten(to_expr(other))))
        return self

    def __getitem__(self, name: str):
        return self._ex.get(name)

    def get(self, name: str, timeout: float | None = None):
        """The variable's value, waiting for the stream to produce it (up to timeout seconds)."""
        return self._ex.get(name, timeout)

    def __contains__(self, name: str) -> bool:
        self._ex._wait(lambda: name in self._ex.variables or self._ex._pending == 0, None)
        return name in self._ex.variables

    def fork(self, k: int, prefix_hint: bool = True) -> ForkGroup:
        """k states sharing everything appended so far. The shared prefix is committed to the backend's cache
        first (a prefix hint), so the branches never prefill it k times. Forks run concurrently."""
        if not isinstance(k, int) or k < 1:
            raise ValueError("fork needs k >= 1")
        op = _ForkOp(k, prefix_hint)
        self._ex.submit(op)
        children = []
        for _ in range(k):
            child = StreamExecutor(self._ex.backend, self._ex.defaults, parent=self._ex)
            self._ex.children.append(child)
            st = ProgramState(child)
            child.submit(_InitFromForkOp(op))
            children.append(st)
        return ForkGroup(children)

    def sync(self, timeout: float | None = None) -> ProgramState:
        """Wait until everything appended so far has executed; raise ProgramError if the stream failed."""
        self._ex.sync(timeout)
        return self

    def text(self, timeout: float | None = None) -> str:
        """The whole prompt text so far, rendered with the backend's chat format."""
        self._ex._wait(lambda: self._ex._pending == 0, timeout)
        ex = self._ex
        return ex.backend.chat_format.render(list(ex.pieces), ex.open_role, ex.partial)

    def messages(self, timeout: float | None = None) -> list[dict]:
        """The completed chat messages ({"role", "content"}); raw text outside role blocks is not included."""
        self._ex._wait(lambda: self._ex._pending == 0, timeout)
        return [p.to_dict() for p in self._ex.pieces if isinstance(p, Message)]

    def variables(self, timeout: float | None = None) -> dict:
        self._ex._wait(lambda: self._ex._pending == 0, timeout)
        return dict(self._ex.variables)

    def select_scores(self, name: str) -> dict[str, float]:
        """The per-choice scores of select `name`."""
        self.get(name)
        return dict(self._ex.select_scores[name])

    @property
    def requests(self) -> list[RequestRecord]:
        """ProgramBackend calls made by this state's stream so far (forks keep their own)."""
        return list(self._ex.requests)

    @property
    def error(self) -> BaseException | None:
        return self._ex.error

    @property
    def backend(self) -> ProgramBackend:
        return self._ex.backend

    def __repr__(self) -> str:
        ex = self._ex
        status = "failed" if ex.error else ("running" if ex._pending else "done")
        return f"ProgramState({status}, variables={sorted(ex.variables)})"


class ForkGroup(list):
    """The states returned by fork(k). `join()` waits for all of them and returns their variables."""

    def join(self, timeout: float | None = None) -> list[dict]:
        for st in self:
            st._ex.sync_tree(timeout)
        return [dict(st._ex.variables) for st in self]

    def __getitem__(self, i):
        return list.__getitem__(self, i)
