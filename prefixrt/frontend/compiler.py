"""Compiler mode: trace a program into its graph of primitives, then run the graph instead of the body.

`trace(program, example_args)` runs the program's body on the interpreter with a Tracer and no model: every
gen and select yields a placeholder (a marker string), arguments neither given nor defaulted are placeholders
too (a defaulted one takes its default), and every
primitive executed on every stream becomes a Node (constant text, argument text, gens, selects, role and
var-scope boundaries, forks, joins). A generated value that the body puts back into text (`"For example," +
s["expert"]`) stays a reference to the gen's node. A body whose Python code depends on a generated value
(comparing it, computing with it) cannot be traced and raises TraceError.

`CompiledProgram` runs the graph: before its first run on a backend it sends each stream's constant prefix
(the text before the first argument or model call) to the backend's cache, and in each run it advances all
streams until each waits on a model call, then submits the waiting gens together (one `generate_many`,
one provider call per sampling setting) and the selects concurrently. Under greedy decoding it gives the
interpreter's results (tests/frontend/test_sglang_programs.py checks it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.frontend.backend import Context, ProgramBackend, SamplingArgs, as_backend
from prefixrt.frontend.chat_format import PlainFormat
from prefixrt.frontend.interpreter import JoinOp, ProgramError, StreamExecutor
from prefixrt.frontend.ir import RoleBegin, RoleEnd, SetVar, VarScopeBegin, VarScopeEnd

log = logging.getLogger("prefixrt.frontend")

_MARKER = re.compile("\x00(arg|out):([^\x00]*)\x00")


class TraceError(ProgramError):
    """The program cannot be traced: its Python code depends on a value only a model run can give."""


class Placeholder(str):
    """A traced value (an argument or a model output) as a marker string. It can be concatenated into text;
    comparing it (an `if` on a generated value) raises TraceError, since the graph cannot branch."""

    def __new__(cls, marker: str, what: str):
        obj = super().__new__(cls, marker)
        obj.what = what
        return obj

    def _refuse(self, *_):
        raise TraceError(f"the program's control flow depends on {self.what}; programs that branch on generated "
                         "values or arguments run on the interpreter (prog.run), not compiled")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = str.__hash__


def _refuse_method(name: str):
    def refuse(self, *args, **kwargs):
        raise TraceError(f"the program computes with {self.what} (str.{name}); programs whose Python code uses "
                         "generated values or arguments other than by putting them into text run on the "
                         "interpreter (prog.run), not compiled")
    return refuse


# Anything but concatenation and formatting (`+`, f-strings, join) would compute on the marker, not the value.
for _name in ("__getitem__", "__iter__", "__len__", "__contains__", "__mod__", "__mul__", "__bool__", "strip",
              "lstrip", "rstrip", "split", "rsplit", "splitlines", "lower", "upper", "title", "capitalize",
              "casefold", "swapcase", "replace", "startswith", "endswith", "find", "rfind", "index", "rindex",
              "count", "encode", "isdigit", "isalpha", "isnumeric", "isdecimal", "isspace", "isalnum", "islower",
              "isupper", "partition", "rpartition", "zfill", "center", "ljust", "rjust", "translate",
              "removeprefix", "removesuffix", "expandtabs"):
    setattr(Placeholder, _name, _refuse_method(_name))


@dataclass
class Node:
    """One primitive on one stream. kind: text | gen | select | role_begin | role_end | var_scope_begin |
    var_scope_end | set_var | media | fork | join. `text` may hold markers of arguments and gen outputs."""

    id: int
    stream: int
    kind: str
    text: str | None = None
    expr: Any = None  # gen: ir.Gen, select: ir.Select, media: ir.Media
    name: str | None = None  # role name, variable name, gen/select variable
    value: Any = None  # set_var
    k: int = 0  # fork
    children: list[int] = field(default_factory=list)  # fork: branch streams; join: joined streams
    mode: str | None = None  # join

    @property
    def constant(self) -> bool:
        """Text that is the same in every run (no argument, no generated value in it)."""
        return self.kind == "text" and _MARKER.search(self.text) is None

    def describe(self) -> str:
        if self.kind == "text":
            shown = _MARKER.sub(lambda m: "{" + ("arg " if m.group(1) == "arg" else "#") + m.group(2) + "}",
                                self.text)
            return f"{'text' if self.constant else 'text*'} {shown!r}"
        if self.kind in ("gen", "select"):
            extra = f" choices={self.expr.choices}" if self.kind == "select" else ""
            return f"{self.kind} {self.name!r}{extra}"
        if self.kind == "fork":
            return f"fork {self.k} -> streams {self.children}"
        if self.kind == "join":
            return f"join {self.mode} <- streams {self.children}"
        return f"{self.kind} {self.name!r}" if self.name is not None else self.kind


@dataclass
class Graph:
    """A traced program: nodes in stream order (stream 0 is the program, others are fork branches),
    `args`: the argument placeholders."""

    nodes: list[Node]
    args: list[str]

    def stream(self, sid: int) -> list[Node]:
        return [n for n in self.nodes if n.stream == sid]

    @property
    def streams(self) -> list[int]:
        return sorted({n.stream for n in self.nodes} | {0})

    def kinds(self) -> list[str]:
        return [n.kind for n in self.nodes]

    def __str__(self) -> str:
        lines = []
        for sid in self.streams:
            lines.append(f"stream {sid}:")
            lines.extend(f"  #{n.id} {n.describe()}" for n in self.stream(sid))
        return "\n".join(lines)


class Tracer:
    """Receives every primitive the interpreter executes while tracing (StreamExecutor._trace)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.nodes: list[Node] = []

    def record(self, ex: StreamExecutor, kind: str, **f):
        with self._lock:
            node = Node(len(self.nodes), ex.stream_id, kind)
            self.nodes.append(node)
        if kind == "text":
            node.text = f["text"]
        elif kind == "gen" or kind == "select":
            node.expr = f[kind]
            node.name = node.expr.name
            what = f"the value of {kind} {node.name!r}" if node.name else f"an unnamed {kind}'s value"
            return Placeholder(f"\x00out:{node.id}\x00", what)
        elif kind in ("role_begin", "role_end"):
            node.name = f["role"]
        elif kind in ("var_scope_begin", "var_scope_end"):
            node.name = f["name"]
        elif kind == "set_var":
            node.name, node.value = f["name"], f["value"]
        elif kind == "media":
            node.expr = f["media"]
        elif kind == "fork":
            node.k, node.children = f["k"], list(f["children"])
        elif kind == "join":
            node.mode, node.children = f["mode"], list(f["branches"])
        return None

    def graph(self, args: list[str]) -> Graph:
        """Nodes renumbered in (stream, order) and their markers rewritten to the new ids."""
        order = sorted(self.nodes, key=lambda n: (n.stream, n.id))
        new_id = {n.id: i for i, n in enumerate(order)}

        def renumber(text):
            if not isinstance(text, str):
                return text
            return _MARKER.sub(lambda m: m.group(0) if m.group(1) == "arg"
                               else f"\x00out:{new_id[int(m.group(2))]}\x00", text)

        for n in order:
            n.id = new_id[n.id]
            n.text = renumber(n.text)
            n.value = renumber(n.value)
        return Graph(order, args)


class _TraceBackend(ProgramBackend):
    """Never called for gens/selects (the tracer answers them); renders with the real backend's format."""

    def __init__(self, chat_format=None):
        self.chat_format = chat_format or PlainFormat()

    def generate(self, ctx, args):
        raise TraceError("a model call was made while tracing")

    def select(self, ctx, choices, method=None):
        raise TraceError("a model call was made while tracing")


def trace(program, backend, example_args: dict, timeout: float = 60) -> Graph:
    """The graph of `program` with `example_args` (missing arguments become placeholders). No model call."""
    from prefixrt.frontend.state import ProgramState

    params = program.parameters()
    unknown = sorted(set(example_args) - set(params))
    if unknown:
        raise InvalidRequest(f"{program.fn.__name__} has no argument {unknown[0]!r}", param=unknown[0])
    defaults = program.parameter_defaults()
    args = {p: example_args[p] if p in example_args else defaults[p] if p in defaults
            else Placeholder(f"\x00arg:{p}\x00", f"argument {p!r}") for p in params}
    fmt = as_backend(backend).chat_format if backend is not None else None
    tracer = Tracer()
    ex = program._executor(_TraceBackend(fmt), program._defaults({}), tracer=tracer)
    state = ProgramState(ex)
    try:
        program.fn(state, **args)
        ex.sync_tree(timeout)
    except TraceError:
        raise
    except ProgramError as e:
        cause = e.__cause__
        if isinstance(cause, TraceError):
            raise cause from None
        raise TraceError(f"{program.fn.__name__} failed while tracing: {e}") from e
    except Exception as e:
        raise TraceError(f"{program.fn.__name__} cannot be traced: {type(e).__name__}: {e} (programs that compute "
                         "with generated values or arguments run on the interpreter)") from e
    return tracer.graph([p for p in params if p not in example_args and p not in defaults])


# ---------------------------------------------------------------------- running a graph
def _substitute(text, args: dict, outputs: dict):
    """text with argument and output markers replaced by their values; None if an output is not there yet."""
    if not isinstance(text, str):
        return text
    missing = False

    def value(m):
        nonlocal missing
        if m.group(1) == "arg":
            return str(args[m.group(2)])
        out = outputs.get(int(m.group(2)))
        if out is None:
            missing = True
            return ""
        return out

    result = _MARKER.sub(value, text)
    return None if missing else result


class _Run:
    """One execution of a graph: a StreamExecutor per stream (driven here, without worker threads)."""

    def __init__(self, graph: Graph, backend: ProgramBackend, defaults: dict, args: dict):
        self.graph = graph
        self.backend = backend
        self.defaults = defaults
        self.args = args
        self.outputs: dict[int, str] = {}
        self.root = StreamExecutor(backend, defaults)
        self.execs = {0: self.root}
        self.todo = {sid: graph.stream(sid) for sid in graph.streams}
        self.pos = {0: 0}
        self.hints: list = []  # submitted prefix hints, awaited before the next calls go out

    def finished(self, sid: int) -> bool:
        return sid in self.pos and self.pos[sid] == len(self.todo[sid])

    def advance(self, sid: int) -> Node | None:
        """Run stream sid's nodes until a model call (returned) or a wait or the end (None)."""
        ex, nodes = self.execs[sid], self.todo[sid]
        while self.pos[sid] < len(nodes):
            n = nodes[self.pos[sid]]
            if n.kind in ("gen", "select"):
                return n
            if n.kind == "text":
                text = _substitute(n.text, self.args, self.outputs)
                if text is None:
                    return None  # waits for another stream's output
                ex._text(text)
            elif n.kind == "set_var":
                value = _substitute(n.value, self.args, self.outputs)
                if value is None:
                    return None
                ex.execute([SetVar(n.name, value)])
            elif n.kind == "role_begin":
                ex.execute([RoleBegin(n.name)])
            elif n.kind == "role_end":
                ex.execute([RoleEnd(n.name)])
            elif n.kind == "var_scope_begin":
                ex.execute([VarScopeBegin(n.name)])
            elif n.kind == "var_scope_end":
                ex.execute([VarScopeEnd(n.name)])
            elif n.kind == "media":
                raise InvalidRequest("compiled programs do not take image/video inputs; run it with prog.run")
            elif n.kind == "fork":
                if n.k > 1 and (ex.pieces or ex.open_role):  # as the interpreter's fork: the prefix hint
                    self.hints.append(ex.backend.submit_prefix_hint(ex.context()))
                snap = ex.snapshot()
                for child in n.children:
                    c = StreamExecutor(self.backend, self.defaults, parent=ex)
                    c.init_from(snap)
                    ex.children.append(c)
                    self.execs[child], self.pos[child] = c, 0
            elif n.kind == "join":
                if not all(self.finished(b) for b in n.children):
                    return None
                JoinOp([self.execs[b] for b in n.children], n.mode).run(ex)
            self.pos[sid] += 1
        return None

    def run(self):
        while True:
            # advance every stream (new branches included) until none moves; then all waiting calls go together
            while True:
                before = (dict(self.pos), len(self.execs))
                waiting = []
                for sid in list(self.execs):
                    node = self.advance(sid)
                    if node is not None:
                        waiting.append((sid, node))
                if (dict(self.pos), len(self.execs)) == before:
                    break
            # the forks' hints (submitted together) complete before their branches' calls are sent
            hints, self.hints = self.hints, []
            for wait in hints:
                try:
                    wait()
                except Exception as e:  # a lost hint costs speed, not correctness
                    log.warning("prefix hint failed: %s", e)
            if not waiting:
                if all(self.finished(s) for s in self.execs):
                    return
                raise ProgramError("the compiled program is stuck: a stream waits for a value no stream produces")
            self._submit(waiting)

    def _submit(self, waiting: list[tuple[int, Node]]) -> None:
        gens = [(sid, n) for sid, n in waiting if n.kind == "gen"]
        selects = [(sid, n) for sid, n in waiting if n.kind == "select"]
        calls = [(self.execs[sid].context(), SamplingArgs.resolve(n.expr, self.defaults)) for sid, n in gens]
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(selects) + 1) as pool:
            sel_futures = [pool.submit(self.backend.select, self.execs[sid].context(), n.expr.choices,
                                       n.expr.choices_method) for sid, n in selects]
            gen_results = self.backend.generate_many(calls) if calls else []
            sel_results = [f.result() for f in sel_futures]
        for (sid, n), res in zip(gens, gen_results):
            ex = self.execs[sid]
            ex.record("gen", n.name, res, t0)
            self._done(sid, n, res.text)
            ex.generated(res)
        for (sid, n), res in zip(selects, sel_results):
            ex = self.execs[sid]
            ex.record("select", n.name, res, t0)
            if n.name is not None:
                ex.select_scores[n.name] = res.scores
            self._done(sid, n, res.choice)

    def _done(self, sid: int, n: Node, value: str) -> None:
        ex = self.execs[sid]
        ex._set(n.name, value)
        ex.append(value)
        self.outputs[n.id] = value
        self.pos[sid] += 1


class CompiledProgram:
    """`prog.compile()`: run/run_batch like the Program, executing its traced graph. Arguments that were given
    to compile(**constants) are fixed; the others are the graph's placeholders."""

    def __init__(self, program, backend=None, **constants: Any):
        self.program = program
        self.constants = {**{k: v for k, v in program.parameter_defaults().items() if k not in constants},
                          **constants}
        self.graph = trace(program, backend, constants)
        self._prefetched: set[int] = set()
        self._lock = threading.Lock()

    def constant_prefixes(self, backend: ProgramBackend) -> list[Context]:
        """Each stream's context up to its first argument or model call (branches continue their parent's
        when it was constant up to the fork). Empty prefixes are left out."""
        out: list[Context] = []

        def walk(sid: int, ex: StreamExecutor) -> None:
            for n in self.graph.stream(sid):
                if n.kind == "text":
                    head = n.text if n.constant else n.text[:_MARKER.search(n.text).start()]
                    ex._text(head)
                    if not n.constant:
                        break
                elif n.kind in ("role_begin", "role_end"):
                    ex.execute([(RoleBegin if n.kind == "role_begin" else RoleEnd)(n.name)])
                elif n.kind == "fork":
                    snap = ex.snapshot()
                    for child in n.children:
                        c = StreamExecutor(backend, {})
                        c.init_from(snap)
                        walk(child, c)
                    return  # what follows the fork on the parent is also reached by the branches' prefixes
                else:
                    break
            if ex.pieces or ex.partial:
                out.append(ex.context())

        walk(0, StreamExecutor(backend, {}))
        seen, unique = set(), []
        for ctx in out:
            key = backend.render(ctx)
            if key and key not in seen:
                seen.add(key)
                unique.append(ctx)
        return unique

    def prefetch(self, backend: ProgramBackend) -> int:
        """Cache the constant prefixes on backend (once per backend); returns the tokens cached."""
        with self._lock:
            if id(backend) in self._prefetched:
                return 0
            self._prefetched.add(id(backend))
        return sum(backend.cache_prefix(ctx) for ctx in self.constant_prefixes(backend))

    def run(self, backend=None, timeout: float | None = None, max_new_tokens: int | None = None,
            temperature: float | None = None, top_p: float | None = None, stop=None, **kwargs: Any):
        """Like Program.run (no stream): returns the finished ProgramState; `state.branches` are the forks."""
        from prefixrt.frontend.ir import RUN_SAMPLING
        from prefixrt.frontend.state import ProgramState

        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_SAMPLING}
        sampling.update(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop)
        for name, value in self.constants.items():
            if name in kwargs and kwargs[name] != value:
                raise InvalidRequest(f"argument {name!r} was fixed to {value!r} when the program was compiled",
                                     param=name)
        missing = sorted(set(self.graph.args) - set(kwargs))
        if missing:
            raise InvalidRequest(f"{self.program.fn.__name__} needs argument {missing[0]!r}", param=missing[0])
        be = as_backend(backend)
        self.prefetch(be)
        run = _Run(self.graph, be, self.program._defaults(sampling), {**self.constants, **kwargs})
        state = ProgramState(run.root)
        try:
            run.run()
        except Exception as e:
            if isinstance(e, ProgramError):
                raise
            err = ProgramError(f"the compiled program failed: {type(e).__name__}: {e}", state)
            raise err from e
        return state

    def run_batch(self, batch_kwargs: list[dict], backend=None, num_threads: int = 16, **sampling: Any) -> list:

        be = as_backend(backend)
        self.prefetch(be)
        with ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(batch_kwargs)))) as pool:
            return list(pool.map(lambda kw: self.run(backend=be, **sampling, **kw), batch_kwargs))

