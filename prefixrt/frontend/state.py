"""ProgramState (`s` in a program) and ForkGroup: what program code and callers touch.

Every method that appends only enqueues on the state's stream (interpreter.StreamExecutor); every method
that reads (a variable, the text, the messages) waits for the stream as far as it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from prefixrt.frontend.chat_format import Message
from prefixrt.frontend.interpreter import (
    ExprOp,
    ForkOp,
    InitFromForkOp,
    JoinOp,
    ProgramError,
    RequestRecord,
    StreamExecutor,
    VariableNotFound,
)
from prefixrt.frontend.ir import (
    ROLES,
    Media,
    Role,
    RoleBegin,
    RoleEnd,
    SetVar,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    to_expr,
)

JOIN_MODES = ("gather", "concate_and_append")


class ProgramState:
    """`s` in a program: `s += expr`, `s["name"]`, `s["name"] = v`, `with s.user():`, `with s.var_scope(n):`,
    `s.fork(k)`; after a run: `text()`, `messages()`, `text_iter()`, `requests`."""

    def __init__(self, executor: StreamExecutor):
        self._ex = executor
        executor.state = self

    # ------------------------------------------------------------------ appending
    def __iadd__(self, other) -> ProgramState:
        items = flatten(to_expr(other))
        if self._ex.tracer is None:
            for kind in sorted({x.kind for x in _media(items)}):
                self._ex.backend.check_media(kind)  # a text-only model refuses images here, at build time
        self._ex.submit(ExprOp(items))
        return self

    def _block(self, begin, end):
        @contextlib.contextmanager
        def block():
            self._ex.submit(ExprOp([begin]))
            try:
                yield self
            finally:
                self._ex.submit(ExprOp([end]))

        return block()

    def _role(self, role: str, expr):
        if expr is not None:
            self += Role(role, to_expr(expr))
            return None
        return self._block(RoleBegin(role), RoleEnd(role))

    def system(self, expr=None):
        """`s.system(expr)` appends a system message; `with s.system():` makes what is appended inside it one."""
        return self._role("system", expr)

    def user(self, expr=None):
        """`s.user(expr)` appends a user message; `with s.user():` makes what is appended inside it one."""
        return self._role("user", expr)

    def assistant(self, expr=None):
        """`s.assistant(expr)` appends an assistant message; `with s.assistant():` opens one."""
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        """`with s.var_scope(name):` — everything appended inside the block (text and generated values)
        becomes variable `name` when the block ends."""
        if not isinstance(name, str) or not name:
            raise ProgramError("var_scope needs a variable name", self)
        return self._block(VarScopeBegin(name), VarScopeEnd(name))

    def __setitem__(self, name: str, value) -> None:
        """Set variable `name` at this point of the stream (reads after it see the new value)."""
        self._ex.submit(ExprOp([SetVar(name, value)]))

    def set_var(self, name: str, value) -> None:
        self[name] = value

    def fork(self, size: int = 1, prefix_hint: bool = True) -> ForkGroup:
        """`size` states sharing everything appended so far. The shared prefix is committed to the backend's
        cache first (a prefix hint), so the branches never prefill it `size` times. Forks run concurrently."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProgramError(f"fork needs a size >= 1, got {size!r}", self)
        ex = self._ex
        children = [StreamExecutor(ex.backend, ex.defaults, parent=ex, spec_tokens=ex.spec_tokens,
                                   streaming=ex.streaming, tracer=ex.tracer) for _ in range(size)]
        op = ForkOp(size, prefix_hint, children)
        ex.submit(op)
        states = []
        for child in children:
            ex.children.append(child)
            st = ProgramState(child)
            child.submit(InitFromForkOp(op))
            states.append(st)
        return ForkGroup(states, self)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str):
        return self._ex.get(name)

    def get(self, name: str, timeout: float | None = None):
        """The variable's value, waiting for the stream to produce it (up to timeout seconds)."""
        return self._ex.get(name, timeout)

    get_var = get

    def __contains__(self, name: str) -> bool:
        self._ex._wait(lambda: name in self._ex.variables or self._ex._pending == 0, None)
        return name in self._ex.variables

    def sync(self, timeout: float | None = None) -> ProgramState:
        """Wait until everything appended so far (forks included) has executed; raise ProgramError if the
        stream failed."""
        self._ex.sync_tree(timeout)
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

    def get_meta_info(self, name: str) -> dict:
        """Token counts and finish reason of the call that produced variable `name`."""
        self.get(name)
        rec = next((r for r in reversed(self._ex.requests) if r.name == name), None)
        if rec is None:
            return {}
        return {"prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
                "completion_tokens": rec.completion_tokens, "finish_reason": rec.finish_reason, "kind": rec.kind}

    # ------------------------------------------------------------------ streaming
    def text_iter(self, var_name: str | None = None, timeout: float | None = None) -> Iterator[str]:
        """Yield text as the program produces it (run with stream=True for gens to stream token by token).

        var_name None: everything appended to the state (literal text, generated text, role contents) in
        order. A name: the pieces of that variable's value as it is generated. Raises ProgramError if the
        program fails, VariableNotFound if it finishes without setting var_name."""
        pos = 0
        while True:
            piece, pos, done = self._next_piece(var_name, pos, timeout)
            if piece:
                yield piece
            if done:
                return

    async def text_async_iter(self, var_name: str | None = None,
                              timeout: float | None = None) -> AsyncIterator[str]:
        """text_iter for asyncio code: each wait runs in a worker thread, so the event loop never blocks."""
        pos = 0
        while True:
            piece, pos, done = await asyncio.to_thread(self._next_piece, var_name, pos, timeout)
            if piece:
                yield piece
            if done:
                return

    def _next_piece(self, var: str | None, pos: int, timeout: float | None) -> tuple[str, int, bool]:
        """(new text after pos, new pos, finished): waits until there is new text or the source is complete."""
        ex = self._ex

        def source() -> tuple[str | None, bool]:
            if var is None:
                return ex.all_text, ex._pending == 0 or ex.error is not None
            if var in ex.variables and not ex._pending_sets[var]:
                value = ex.variables[var]
                return (value if isinstance(value, str) else str(value)), True
            if var in ex.streaming_vars:
                return ex.streaming_vars[var], False
            return None, ex._pending == 0 or ex.error is not None

        if not ex._wait(lambda: (lambda t, d: d or (t is not None and len(t) > pos))(*source()), timeout):
            raise ProgramError(f"timed out after {timeout}s waiting for text", self)
        with ex._cond:
            text, done = source()
        if text is None:
            if ex.error is not None:
                raise ex._program_error(f"the program failed before setting {var!r}")
            raise VariableNotFound(f"variable {var!r} is not set by the program (set: {sorted(ex.variables)})", self)
        if done and var is None and ex.error is not None:
            raise ex._program_error("the program failed")
        return text[pos:], len(text), done

    # ------------------------------------------------------------------ inspection
    @property
    def requests(self) -> list[RequestRecord]:
        """ProgramBackend calls made by this state's stream so far (forks keep their own)."""
        return list(self._ex.requests)

    @property
    def branches(self) -> list[ProgramState]:
        """The states of the forks made from this state, in fork order."""
        return [c.state if c.state is not None else ProgramState(c) for c in self._ex.children]

    @property
    def error(self) -> BaseException | None:
        return self._ex.error

    @property
    def backend(self):
        return self._ex.backend

    def __repr__(self) -> str:
        ex = self._ex
        status = "failed" if ex.error else ("running" if ex._pending else "done")
        return f"ProgramState({status}, variables={sorted(ex.variables)})"


def _media(items) -> list[Media]:
    out = []
    for x in items:
        if isinstance(x, Media):
            out.append(x)
        elif isinstance(x, Role):
            out.extend(_media(flatten(x.content)))
    return out


class ForkGroup(list):
    """The states returned by fork(k). `forks += expr` appends expr to every branch (`forks += lambda i: ...`
    appends expr(i) to branch i); `join(mode)` waits for all of them and returns their variables."""

    def __init__(self, states: list[ProgramState], parent: ProgramState | None = None):
        super().__init__(states)
        self.parent = parent

    def __iadd__(self, other) -> ForkGroup:
        for i, st in enumerate(self):
            st += other(i) if callable(other) else other
        return self

    def join(self, mode: str = "gather", timeout: float | None = None) -> list[dict]:
        """Wait for every branch. mode "gather": the parent is unchanged; "concate_and_append": what each
        branch appended since the fork is appended to the parent, branch by branch."""
        if mode not in JOIN_MODES:
            raise ProgramError(f"join mode must be one of {', '.join(JOIN_MODES)}, got {mode!r}", self.parent)
        for st in self:
            st._ex.sync_tree(timeout)
        if self.parent is not None:
            self.parent._ex.submit(JoinOp([st._ex for st in self], mode))
        return [dict(st._ex.variables) for st in self]

    def __getitem__(self, i):
        return list.__getitem__(self, i)


__all__ = ["ProgramState", "ForkGroup", "JOIN_MODES", "ROLES"]
