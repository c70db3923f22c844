"""The interpreter: every program state executes its expressions on its own background stream.

`s += expr` only enqueues; a worker thread (started on demand, gone when the queue drains) executes the
queue in order, calling the backend. Reading a variable blocks until the stream has produced it, has
finished without it (VariableNotFound) or has failed (ProgramError) — never longer. `fork(k)` enqueues a
fork point on the parent; the k children start immediately on their own streams, wait for that point,
and then run concurrently, so their requests reach the engine together.

Invariants: a stream's items execute in submission order; `all_text` is everything appended to the stream
(text, generated values, role contents) in that order, so a var_scope's value and `text_iter()` are slices
of it; a speculative buffer (API speculation across statements) is only consumed by items that follow each
other on the stream without anything else in between, and a gen takes a value from it only where its own
stop string occurs in it (or the continuation ended), so its value equals non-speculative greedy execution.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from prefixrt.errors import InvalidRequest
from prefixrt.frontend.backend import Context, GenResult, ProgramBackend, SamplingArgs
from prefixrt.frontend.chat_format import Message, Piece
from prefixrt.frontend.ir import (
    Expr,
    Gen,
    Media,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)
from prefixrt.frontend.speculative import SpecBuffer
from prefixrt.frontend.token_prefix import TokenPrefix

log = logging.getLogger("prefixrt.frontend")


class ProgramError(RuntimeError):
    """A program failed. `state` is the ProgramState at the failure (text, variables, requests so far)."""

    def __init__(self, message: str, state=None):
        super().__init__(message)
        self.message = message
        self.state = state

    def __str__(self) -> str:
        return self.message


class VariableNotFound(ProgramError, KeyError):
    """A variable was read that the program never set (KeyError-like; `state` attached)."""


@dataclass
class RequestRecord:
    """One backend call made by a state's stream (for cache accounting and API-call counting).

    kind: "gen" | "select" | "speculate" (a speculative call; its first gen's value) | "gen-speculated" (a
    value taken from an earlier speculative call: no call made) | "cache_prefix"."""

    kind: str
    name: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    method: str | None = None  # select: how the choice was scored ("engine", "logprobs", "constrained", ...)
    completion_tokens: int = 0
    finish_reason: str | None = None


class StreamExecutor:
    """Owns one state's pieces/variables and the worker that executes its queued expressions.

    defaults: the run's sampling defaults (ir.RUN_SAMPLING keys). spec_tokens: API speculation budget (0 off).
    streaming: gens stream their text into `all_text` as it is generated. tracer: compiler.Tracer when the
    program is traced (no backend call is made then)."""

    def __init__(self, backend: ProgramBackend, defaults: dict, parent: StreamExecutor | None = None,
                 spec_tokens: int = 0, streaming: bool = False, tracer=None):
        self.backend = backend
        self.defaults = defaults
        self.spec_tokens = spec_tokens
        self.streaming = streaming
        self.tracer = tracer
        self._ids = parent._ids if parent is not None else itertools.count()
        # backend.parallel False: one lock per program (shared by its forks) around every model call
        self.call_lock = parent.call_lock if parent is not None else (
            None if getattr(backend, "parallel", True) else threading.Lock())
        self.stream_id = next(self._ids)
        self.pieces: list[Piece] = []
        self.open_role: str | None = None
        self.partial = ""
        self.partial_media: list[tuple[int, Media]] = []  # (offset in partial, media) of the open block
        self.all_text = ""
        # The exact token ids the state's text begins with, from its last gen (token_prefix.py): the next prompt
        # continues them. It stays valid while text is only appended; a backend checks that it still is.
        self.token_prefix: TokenPrefix | None = None
        self.fork_pos = 0  # len(all_text) when this branch started (concate_and_append joins what follows)
        self.fork_pieces = 0  # len(pieces) then
        self.fork_last_len = 0  # len(pieces[-1]) then, when it was text
        self.fork_open_role: str | None = None
        self.var_scopes: dict[str, int] = {}  # open var scopes: name -> len(all_text) at the scope's start
        self.variables: dict[str, object] = {}
        self.streaming_vars: dict[str, str] = {}  # gens being streamed: name -> text so far
        self.select_scores: dict[str, dict[str, float]] = {}
        self.requests: list[RequestRecord] = []
        self.children: list[StreamExecutor] = []
        self.error: BaseException | None = None
        self.state = None  # the user-facing ProgramState (for error messages)
        self.spec: SpecBuffer | None = None
        self.spec_refused = False  # this role block had its one speculative call (chat endpoints)
        self._pending_sets: collections.Counter = collections.Counter()  # queued SetVar ops per name
        self._queue: collections.deque = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._worker_running = False

    # ------------------------------------------------------------------ queue and worker
    def submit(self, op) -> None:
        with self._cond:
            for name in getattr(op, "sets", ()):
                self._pending_sets[name] += 1
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
                    for name in getattr(op, "sets", ()):
                        self._pending_sets[name] -= 1
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
        def ready():
            return (name in self.variables and not self._pending_sets[name]) or self._pending == 0 \
                or self.error is not None

        ok = self._wait(ready, timeout)
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
        return Context(list(self.pieces), self.open_role, self.partial, list(self.partial_media), self.token_prefix)

    def append(self, text: str) -> None:
        if not text:
            return
        with self._cond:
            if self.open_role is not None:
                self.partial += text
            elif self.pieces and isinstance(self.pieces[-1], str):
                self.pieces[-1] += text
            else:
                self.pieces.append(text)
            self.all_text += text
            self._cond.notify_all()

    def record(self, kind: str, name: str | None, res, t0: float) -> None:
        self.requests.append(RequestRecord(kind, name, getattr(res, "prompt_tokens", 0),
                                           getattr(res, "cached_tokens", 0), time.monotonic() - t0,
                                           getattr(res, "method", None), getattr(res, "completion_tokens", 0),
                                           getattr(res, "finish_reason", None)))

    def _set(self, name: str | None, value) -> None:
        if name is not None:
            with self._cond:
                self.variables[name] = value
                self.streaming_vars.pop(name, None)
                self._cond.notify_all()

    def calls(self):
        """Context of one model call: the program's call lock when its calls run one at a time, else nothing."""
        return self.call_lock if self.call_lock is not None else contextlib.nullcontext()

    def _trace(self, kind: str, **fields):
        return self.tracer.record(self, kind, **fields) if self.tracer is not None else None

    # ------------------------------------------------------------------ execution (worker thread)
    def execute(self, items: list[Expr]) -> None:
        for item in items:
            if isinstance(item, Text):
                self._text(item.text)
            elif isinstance(item, Gen):
                self._gen(item)
            elif isinstance(item, Select):
                self.spec = None
                self._select(item)
            elif isinstance(item, Role):
                self._begin_role(item.role)
                self.execute(flatten(item.content))
                self._end_role(item.role)
            elif isinstance(item, RoleBegin):
                self._begin_role(item.role)
            elif isinstance(item, RoleEnd):
                self._end_role(item.role)
            elif isinstance(item, VarScopeBegin):
                self._trace("var_scope_begin", name=item.name)
                self.var_scopes[item.name] = len(self.all_text)
            elif isinstance(item, VarScopeEnd):
                self._trace("var_scope_end", name=item.name)
                start = self.var_scopes.pop(item.name)
                self._set(item.name, self.all_text[start:])
            elif isinstance(item, SetVar):
                self._trace("set_var", name=item.name, value=item.value)
                self._set(item.name, item.value)
            elif isinstance(item, Media):
                self._media(item)
            else:
                raise TypeError(f"cannot execute {type(item).__name__}")

    def _text(self, text: str) -> None:
        self._trace("text", text=text)
        if self.spec is not None and not self.spec.consume_text(text):
            self.spec = None  # the literal is not what the model wrote next: the guess ends here
        self.append(text)

    def _begin_role(self, role: str) -> None:
        if self.open_role is not None:
            raise InvalidRequest(f"role blocks cannot nest: a {role} block was opened inside a {self.open_role} "
                                 "block")
        self._trace("role_begin", role=role)
        self.spec, self.spec_refused = None, False
        self.open_role, self.partial, self.partial_media = role, "", []

    def _end_role(self, role: str) -> None:
        if self.open_role != role:
            raise InvalidRequest(f"{role} block closed while {self.open_role or 'no'} block is open")
        self._trace("role_end", role=role)
        self.spec = None
        with self._cond:
            self.pieces.append(Message(role, self.partial, tuple(self.partial_media)))
            self.open_role, self.partial, self.partial_media = None, "", []

    def _media(self, m: Media) -> None:
        self._trace("media", media=m)
        if self.open_role is None:
            raise InvalidRequest(f"{m.kind}() must be inside a role block, e.g. user({m.kind}(path) + question)")
        self.spec = None
        self.partial_media.append((len(self.partial), m))

    def _gen(self, g: Gen) -> None:
        if self.tracer is not None:
            value = self._trace("gen", gen=g)  # a compiler.Placeholder: the body may read it
            self._set(g.name, value)
            self.append(str.__str__(value))
            return
        args = SamplingArgs.resolve(g, self.defaults)
        t0 = time.monotonic()
        if self.spec_tokens and not args.constrained and not args.min_tokens and not self.streaming:
            res = self._gen_speculative(g, args, t0)
            if res is not None:
                self._set(g.name, res.text)
                self.append(res.text)
                return
        self.spec = None
        if self.streaming:
            res = self._gen_streamed(g, args)
        else:
            with self.calls():
                res = self.backend.generate(self.context(), args)
            self.append(res.text)
        self.generated(res)
        self.record("gen", g.name, res, t0)
        self._set(g.name, res.text)

    def generated(self, res: GenResult) -> None:
        """After a gen's text was appended: its ids, when the backend knows them, become the state's token
        prefix (otherwise the last one stays: the text still begins with it)."""
        if res.token_prefix is not None:
            self.token_prefix = res.token_prefix

    def _gen_streamed(self, g: Gen, args: SamplingArgs) -> GenResult:
        if g.name is not None:
            with self._cond:
                self.streaming_vars[g.name] = ""

        def on_text(delta: str) -> None:
            if g.name is not None:
                with self._cond:
                    self.streaming_vars[g.name] += delta
            self.append(delta)

        with self.calls():
            return self.backend.generate_stream(self.context(), args, on_text)

    def _gen_speculative(self, g: Gen, args: SamplingArgs, t0: float) -> GenResult | None:
        """The gen's value from the speculative buffer, or from a new speculative call; None: not resolvable
        that way (the caller makes an ordinary call)."""
        count = getattr(self.backend, "count_tokens", None)
        if self.spec is not None:
            value = self.spec.take(args, count)
            if value is not None:
                res = GenResult(value, finish_reason="stop")
                self.record("gen-speculated", g.name, res, t0)
                return res
            self.spec = None
        if self.spec_refused:
            return None
        with self.calls():
            spec = self.backend.speculate(self.context(), self.spec_tokens, args)
        if spec is None:
            return None  # declined: no call was made
        self.record("speculate", g.name, spec.result, t0)
        # A reply that restarts the role block (chat) is the same reply next time: one guess per block.
        self.spec_refused = spec.whole_block
        if spec.text is None:
            return None
        self.spec = SpecBuffer(spec.text, spec.ended, args)
        value = self.spec.take(args, count)
        if value is None:
            self.spec = None
            return None
        return GenResult(value, spec.result.prompt_tokens, spec.result.cached_tokens, "stop")

    def _select(self, sel: Select) -> None:
        if self.tracer is not None:
            value = self._trace("select", select=sel)
            self._set(sel.name, value)
            self.append(str.__str__(value))
            return
        t0 = time.monotonic()
        with self.calls():
            res = self.backend.select(self.context(), sel.choices, sel.choices_method)
        self.record("select", sel.name, res, t0)
        if sel.name is not None:
            self.select_scores[sel.name] = res.scores
        self._set(sel.name, res.choice)
        self.append(res.choice)

    # ------------------------------------------------------------------ forks (worker thread)
    def snapshot(self) -> tuple:
        return (list(self.pieces), dict(self.variables), self.open_role, self.partial, list(self.partial_media),
                self.all_text, self.token_prefix)

    def init_from(self, snap: tuple) -> None:
        pieces, variables, self.open_role, self.partial, self.partial_media, self.all_text, self.token_prefix = snap
        self.pieces = list(pieces)  # each branch owns its copy
        self.partial_media = list(self.partial_media)
        self.fork_pos, self.fork_pieces, self.fork_open_role = len(self.all_text), len(self.pieces), self.open_role
        self.fork_last_len = len(self.pieces[-1]) if self.pieces and isinstance(self.pieces[-1], str) else 0
        with self._cond:
            self.variables.update(variables)

    def branch_output(self) -> list[Piece]:
        """What this branch appended since the fork, in order: the text added to the piece that was last at the
        fork, then later pieces (raw text and whole messages). A branch forked inside a role block gives its
        appended text."""
        if self.fork_open_role is not None:
            return [self.all_text[self.fork_pos:]]
        out: list[Piece] = []
        if self.fork_pieces and isinstance(self.pieces[self.fork_pieces - 1], str):
            out.append(self.pieces[self.fork_pieces - 1][self.fork_last_len:])
        out.extend(self.pieces[self.fork_pieces:])
        if self.open_role is not None:
            out.append(self.partial)
        return [p for p in out if p != ""]


# ---------------------------------------------------------------------- queued operations
class ExprOp:
    def __init__(self, items: list[Expr]):
        self.items = items
        self.sets = [x.name for x in items if isinstance(x, SetVar)]

    def run(self, ex: StreamExecutor) -> None:
        ex.execute(self.items)


class ForkOp:
    """On the parent: prime the backend's cache with the shared prefix (prefix hint), then hand a snapshot to the
    children. The branches start once the hint has completed, so every branch's first request reuses the whole
    shared prefix and only its own text is prefilled: the shared text is computed once, by the hint, however
    the branches' requests and the engine's steps interleave (the tokens between the last cached prefix and the
    branches' own text would otherwise be prefilled by every branch admitted beside the hint)."""

    def __init__(self, k: int, hint: bool, children: list[StreamExecutor]):
        self.k = k
        self.hint = hint
        self.children = children
        self.snapshot: Future = Future()

    def run(self, ex: StreamExecutor) -> None:
        ex.spec = None
        ex._trace("fork", k=self.k, children=[c.stream_id for c in self.children])
        if ex.tracer is None and self.hint and self.k > 1 and (ex.pieces or ex.open_role):
            t0 = time.monotonic()
            if ex.call_lock is not None:  # calls one at a time: the hint completes before the branches start
                with ex.calls():
                    self._finish_hint(ex, lambda: ex.backend.cache_prefix(ex.context()), t0)
                self.snapshot.set_result(ex.snapshot())
                return
            try:
                wait = ex.backend.submit_prefix_hint(ex.context())
            except Exception as e:  # a lost hint costs speed, not correctness; the branches' calls report errors
                log.warning("prefix hint failed: %s", e)
            else:
                self._finish_hint(ex, wait, t0)
        self.snapshot.set_result(ex.snapshot())

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


class InitFromForkOp:
    def __init__(self, fork: ForkOp):
        self.fork = fork

    def run(self, ex: StreamExecutor) -> None:
        try:
            snap = self.fork.snapshot.result()
        except BaseException as e:
            raise ProgramError(f"the parent failed before the fork point: {type(e).__name__}: {e}", ex.state) from e
        ex.init_from(snap)


class JoinOp:
    """On the parent, after the branches finished: `concate_and_append` appends what every branch appended
    since the fork, in branch order; `gather` appends nothing (the branches' variables are read from them)."""

    def __init__(self, branches: list[StreamExecutor], mode: str):
        self.branches = branches
        self.mode = mode

    def run(self, ex: StreamExecutor) -> None:
        ex.spec = None
        ex._trace("join", mode=self.mode, branches=[b.stream_id for b in self.branches])
        if self.mode != "concate_and_append":
            return
        for b in self.branches:
            for piece in b.branch_output():
                if isinstance(piece, str):
                    ex.append(piece)
                elif ex.open_role is not None:
                    raise InvalidRequest("join(mode='concate_and_append') cannot add a branch's messages inside an "
                                         f"open {ex.open_role} block")
                else:
                    with ex._cond:
                        ex.pieces.append(piece)
                        ex.all_text += piece.content
