"""GrammarCompiler: cache, cached errors, shared in-flight compilations, timeout, thread safety."""

from __future__ import annotations

import threading
import time

import pytest

from prefixrt.constrained.base import CompiledGrammar, GrammarBackend
from prefixrt.constrained.compiler import GrammarCompiler
from prefixrt.errors import InvalidRequest


class FakeBackend(GrammarBackend):
    """Counts compilations; sleeps `delay_s`; rejects regexes containing "(" without ")"."""

    name = "fake"
    vocab_size = 64
    eos_token_ids = (0,)

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls = 0
        self._lock = threading.Lock()

    @property
    def cache_namespace(self) -> tuple:
        return ("fake",)

    def compile(self, kind, spec):
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        if kind == "regex" and "(" in spec and ")" not in spec:
            raise InvalidRequest("invalid regex: unclosed group", param="regex")
        if spec == "boom":
            raise RuntimeError("backend bug")
        return CompiledGrammar(kind, str(spec), self.name, handle=object())

    def matcher(self, compiled):
        raise NotImplementedError


def test_cache_hit_returns_same_object():
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        a = compiler.compile("json_schema", {"type": "object", "properties": {"x": {"type": "integer"}}})
        b = compiler.compile("json_schema", '{"type": "object",  "properties": {"x": {"type": "integer"}}}')
        assert a is b and backend.calls == 1 and compiler.hits == 1
        compiler.compile("json_schema", {"properties": {"x": {"type": "integer"}}, "type": "object"})
        assert backend.calls == 2  # key order matters for JSON (it decides output order): a different spec


def test_errors_are_cached():
    backend = FakeBackend(delay_s=0.05)
    with GrammarCompiler(backend) as compiler:
        for _ in range(3):
            with pytest.raises(InvalidRequest, match="unclosed group"):
                compiler.compile("regex", "(abc")
        assert backend.calls == 1


def test_backend_bugs_are_not_cached():
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                compiler.compile("regex", "boom")
        assert backend.calls == 2


def test_malformed_spec_fails_in_caller_without_compiling():
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        with pytest.raises(InvalidRequest):
            compiler.compile("choices", [])
        with pytest.raises(InvalidRequest):
            compiler.compile("json_schema", "{not json")
        assert backend.calls == 0


def test_timeout_raises_invalid_request_quickly():
    backend = FakeBackend(delay_s=1.0)
    compiler = GrammarCompiler(backend, timeout_s=0.1)
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="grammar compilation timed out after 0.1 s"):
        compiler.compile("regex", "[a-z]+")
    assert time.monotonic() - start < 0.8
    compiler.close()


def test_timeout_with_real_backend(small_backends):
    # A large schema on a real backend with a deadline no compilation can meet.
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 3}}}$"}
                                               for i in range(40)}}
    compiler = GrammarCompiler(small_backends["llguidance"], timeout_s=1e-4)
    with pytest.raises(InvalidRequest, match="timed out"):
        compiler.compile("json_schema", schema)
    compiler.close()


def test_concurrent_callers_share_one_compilation():
    backend = FakeBackend(delay_s=0.2)
    results, errors = [], []
    with GrammarCompiler(backend, max_workers=2) as compiler:
        def worker(i):
            try:
                results.append(compiler.compile("regex", "[0-9]+" if i % 2 else "[a-z]+"))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and len(results) == 16
    assert backend.calls == 2 and len({id(r) for r in results}) == 2


def test_lru_bound():
    backend = FakeBackend()
    with GrammarCompiler(backend, max_entries=3) as compiler:
        for i in range(5):
            compiler.compile("regex", f"a{{{i}}}")
        assert compiler.cache_size() == 3
        compiler.compile("regex", "a{0}")  # evicted: compiled again
        assert backend.calls == 6


def test_real_backend_through_compiler(small_backends):
    for backend in small_backends.values():
        with GrammarCompiler(backend) as compiler:
            a = compiler.compile("regex", r"\d+")
            assert compiler.compile("regex", r"\d+") is a
            with pytest.raises(InvalidRequest):
                compiler.compile("json_schema", {"$ref": "#"})
