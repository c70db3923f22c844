"""Frontend programs on a tiny Engine: rendering, variables, forks, prefix hints, errors, run_batch."""

from __future__ import annotations

import threading
import time

import pytest

from prefixrt.frontend import (
    ProgramError,
    ProviderBackend,
    VariableNotFound,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from prefixrt.frontend.backend import BackendError, ProgramBackend

TIMEOUT = 60
ESSAY = "A stitch in time saves nine. The quick brown fox jumps over the lazy dog. " * 3


@function
def judge(s, essay):
    s += system("Evaluate an essay.")
    s += user(essay)
    forks = s.fork(3)
    for f, dim in zip(forks, ["clarity", "originality", "evidence"]):
        f += user(f"Judge {dim}.") + assistant(gen("j", max_tokens=8, stop="END"))
    s += user("Grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))
    s.forks = forks


def _judge_results(state):
    return [f["j"] for f in state.forks] + [state["grade"]]


@pytest.fixture
def engine(make_frontend_engine):
    return make_frontend_engine()


def test_chat_rendering_equals_engine_render(engine):
    @function
    def chat(s):
        s += system("Be brief.")
        s += user("Question: what is the capital of France?")
        s += assistant(gen("answer", max_tokens=6))

    st = chat.run(backend=engine, temperature=0, timeout=TIMEOUT)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Question: what is the capital of France?"}]
    expected = engine.generate(msgs, {"max_new_tokens": 6, "temperature": 0})
    assert st["answer"] == expected.text
    assert st.messages() == [*msgs, {"role": "assistant", "content": expected.text}]
    assert st.text() == engine.tokenizer.apply_chat_template(st.messages(), tokenize=False)
    # the gen's prompt was exactly the engine's own rendering of the messages
    assert st.requests[0].prompt_tokens == expected.prompt_tokens


def test_role_content_with_gens_and_literals(engine):
    @function
    def prog(s):
        s += user("Judge " + "clarity") + assistant("Verdict:" + gen("v", max_tokens=4, stop="END") + " done")

    st = prog.run(backend=engine, temperature=0, timeout=TIMEOUT)
    assert st.messages()[1] == {"role": "assistant", "content": "Verdict:" + st["v"] + " done"}
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Judge clarity"}], tokenize=False,
                                                  add_generation_prompt=True) + "Verdict:"
    assert st["v"] == engine.generate(ProviderBackend(engine).encode(prompt),
                                      {"max_new_tokens": 4, "temperature": 0, "stop": "END"}).text


def test_judge_is_deterministic_and_forks_share_prefix(engine):
    st1 = judge.run(essay=ESSAY, backend=engine, temperature=0, timeout=TIMEOUT)
    st2 = judge.run(essay=ESSAY, backend=engine, temperature=0, timeout=TIMEOUT)
    assert _judge_results(st1) == _judge_results(st2)
    assert st1["grade"] in "ABCD"
    # forks see the shared prefix; s continues without the forks' turns
    for f, dim in zip(st1.forks, ["clarity", "originality", "evidence"]):
        assert f.messages()[:2] == st1.messages()[:2]
        assert f.messages()[2]["content"] == f"Judge {dim}."
    assert [m["content"] for m in st1.messages()] == ["Evaluate an essay.", ESSAY, "Grade?", st1["grade"]]


def test_fork_prefix_hint_caches_shared_prefix(make_frontend_engine):
    eng = make_frontend_engine()

    @function
    def tree(s):
        s += ESSAY
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Branch {i}:" + gen("t", max_tokens=3)
        s.forks = forks

    st = tree.run(backend=eng, temperature=0, timeout=TIMEOUT)
    prefix_len = len(ProviderBackend(eng).encode(ESSAY))
    hint = [r for r in st.requests if r.kind == "cache_prefix"]
    assert hint and hint[0].cached_tokens >= prefix_len - 1
    for f in st.forks:
        first = f.requests[0]
        assert first.kind == "gen" and first.cached_tokens >= prefix_len - 1, (first, prefix_len)


def test_fork_branches_reuse_the_whole_hinted_prefix_however_short_its_uncached_tail(make_frontend_engine):
    """After a gen, the text a fork shares beyond the cache is a few tokens (here under the engine's 32-token
    shared-prefill threshold, so the engine does not hold branches back for it). The fork primes it before the
    branches start, so each branch's first request reuses the whole prefix, however busy the engine is when the
    branches arrive (here 12 programs at once)."""
    eng = make_frontend_engine()

    @function
    def expand(s, topic):
        s += f"{topic}. " + ESSAY + gen("head", max_tokens=4) + " Next:"
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"{i}" + gen("t", max_tokens=2)
        s.forks = forks

    be = ProviderBackend(eng)
    for _ in range(2):
        eng.flush_cache()
        topics = [f"Essay {n}" for n in range(12)]
        states = expand.run_batch([{"topic": t} for t in topics], backend=be, temperature=0, num_threads=12)
        for topic, st in zip(topics, states):
            hints = [r for r in st.requests if r.kind == "cache_prefix"]
            assert len(hints) == 1
            # the shared prompt as sent: the head's generated ids, not the text encoded again (token_prefix.py)
            shared = hints[0].prompt_tokens
            assert shared >= len(be.encode(f"{topic}. " + ESSAY)) + 1
            for f in st.forks:
                first = f.requests[0]
                assert first.kind == "gen" and first.cached_tokens >= shared, (first, shared)


def test_fork_hint_off_sends_no_cache_prefix(make_frontend_engine):
    eng = make_frontend_engine()
    be = ProviderBackend(eng, prefix_hints=False)

    @function
    def tree(s):
        s += ESSAY
        forks = s.fork(2)
        for f in forks:
            f += gen("t", max_tokens=2)
        s.forks = forks

    st = tree.run(backend=be, temperature=0, timeout=TIMEOUT)
    assert st.requests[0].kind == "cache_prefix" and st.requests[0].cached_tokens == 0


def test_forks_run_concurrently(engine):
    """Independent forks are in flight together: the backend sees overlapping calls."""
    inner = ProviderBackend(engine)
    active, peak, lock = [0], [0], threading.Lock()

    class Counting(ProgramBackend):
        chat_format = inner.chat_format

        def generate(self, ctx, args):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                time.sleep(0.2)
                return inner.generate(ctx, args)
            finally:
                with lock:
                    active[0] -= 1

        def select(self, ctx, choices):
            return inner.select(ctx, choices)

    @function
    def prog(s):
        s += "Question:"
        for f in s.fork(3):
            f += gen("x", max_tokens=2)

    prog.run(backend=Counting(), temperature=0, timeout=TIMEOUT)
    assert peak[0] == 3


def test_append_does_not_block(engine):
    """`s += gen(...)` returns at once; the variable read is what waits."""
    inner = ProviderBackend(engine)

    class Slow(ProgramBackend):
        chat_format = inner.chat_format

        def generate(self, ctx, args):
            time.sleep(0.3)
            return inner.generate(ctx, args)

        def select(self, ctx, choices):
            return inner.select(ctx, choices)

    @function
    def prog(s):
        t0 = time.monotonic()
        s += "Question: what is" + gen("a", max_tokens=4, temperature=0)
        s.enqueue_seconds = time.monotonic() - t0
        s.value = s["a"]
        s.read_seconds = time.monotonic() - t0

    st = prog.run(backend=Slow(), timeout=TIMEOUT)
    assert st.enqueue_seconds < 0.2 and st.read_seconds >= 0.3  # enqueue does not wait for the 0.3 s call


def test_unknown_variable_raises_with_state(engine):
    @function
    def prog(s):
        s += "Question:" + gen("a", max_tokens=2)
        s["nope"]

    with pytest.raises(VariableNotFound) as ei:
        prog.run(backend=engine, timeout=TIMEOUT)
    assert isinstance(ei.value, KeyError)
    assert ei.value.state is not None and "a" in ei.value.state.variables()
    assert "nope" in str(ei.value)


class FailingBackend(ProgramBackend):
    def __init__(self, inner, fail_after=0):
        self.inner, self.calls, self.fail_after = inner, 0, fail_after
        self.chat_format = inner.chat_format

    def generate(self, ctx, args):
        self.calls += 1
        if self.calls > self.fail_after:
            raise BackendError("endpoint unavailable")
        return self.inner.generate(ctx, args)

    def select(self, ctx, choices):
        raise BackendError("endpoint unavailable")


def test_failing_backend_raises_with_state_and_never_hangs(engine):
    be = FailingBackend(ProviderBackend(engine), fail_after=1)

    @function
    def prog(s):
        s += "Question:" + gen("a", max_tokens=2) + " more:" + gen("b", max_tokens=2)
        s += " end" + gen("c", max_tokens=2)

    t0 = time.monotonic()
    with pytest.raises(ProgramError) as ei:
        prog.run(backend=be, timeout=TIMEOUT)
    assert time.monotonic() - t0 < 30
    st = ei.value.state
    assert st is not None and st.variables() == {"a": st["a"]}
    assert "endpoint unavailable" in str(ei.value)
    with pytest.raises(ProgramError):
        st["b"]  # reading a variable of a failed program raises, it does not wait


def test_failing_backend_inside_forks(engine):
    be = FailingBackend(ProviderBackend(engine), fail_after=0)

    @function
    def prog(s):
        s += "Question:"
        for f in s.fork(3):
            f += gen("x", max_tokens=2)
        s += select("y", choices=["a", "b"])

    with pytest.raises(ProgramError) as ei:
        prog.run(backend=be, timeout=TIMEOUT)
    assert ei.value.state is not None


def test_run_batch_matches_run_and_precaches_common_prefix(make_frontend_engine):
    eng = make_frontend_engine()
    questions = ["capital of France?", "radix trees?", "quick brown fox?"]

    @function
    def qa(s, q):
        s += system("Answer questions about the corpus. " * 4)
        s += user(q) + assistant(gen("a", max_tokens=4))

    before = eng.stats().cached_tokens_total
    states = qa.run_batch([{"q": q} for q in questions], backend=eng, temperature=0, num_threads=3,
                          timeout=TIMEOUT)
    hinted = eng.stats().cached_tokens_total - before
    be = ProviderBackend(eng)
    sys_len = len(be.encode(be.chat_format.render([], "system", "Answer questions about the corpus. " * 4)))
    # every program's request reused the pre-cached system prefix
    assert all(st.requests[0].cached_tokens >= sys_len - 2 for st in states), [st.requests for st in states]
    assert hinted >= len(questions) * (sys_len - 2)
    singles = [qa.run(q=q, backend=eng, temperature=0, timeout=TIMEOUT)["a"] for q in questions]
    assert [st["a"] for st in states] == singles


def test_gen_regex_json_schema_choices_on_engine(engine):
    """Constrained gens run as the engine's constrained decoding: values match, and equal direct requests."""
    import json
    import re

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "n"], "additionalProperties": False}
    choices = [" Paris", " the lazy dog", " nine"]

    @function
    def prog(s):
        s += "Phone:" + gen("phone", max_tokens=12, regex=r" [0-9]{3}-[0-9]{4}")
        s += "\nAnswer:" + gen("answer", choices=choices)
        s += "\nJSON:" + gen("obj", max_tokens=40, json_schema=schema)

    st = prog.run(backend=engine, temperature=0, timeout=TIMEOUT)
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", st["phone"])
    obj = json.loads(st["obj"])
    assert obj["city"] in ("Paris", "Rome") and 0 <= obj["n"] <= 99
    pb = ProviderBackend(engine)
    prefix = "Phone:" + st["phone"] + "\nAnswer:"
    direct = engine.generate(pb.encode(prefix), {"choices": choices})
    assert st["answer"] == direct.text and direct.choice_scores  # the engine's best choice by its scoring
    assert st.text() == prefix + st["answer"] + "\nJSON:" + st["obj"]


def test_fork_join_returns_branch_variables(engine):
    @function
    def prog(s):
        s += "Question:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" idea {i}:" + gen("idea", max_tokens=3)
        s.joined = forks.join(timeout=TIMEOUT)
        s += " Best:" + gen("best", max_tokens=3)

    st = prog.run(backend=engine, temperature=0, timeout=TIMEOUT)
    assert [set(v) for v in st.joined] == [{"idea"}, {"idea"}]
    assert "idea" not in st.variables() and "best" in st.variables()  # s continues on its own


def test_run_batch_return_exceptions(engine):
    @function
    def prog(s, fail):
        s += "Question:" + gen("a", max_tokens=2)
        if fail:
            s["missing"]

    out = prog.run_batch([{"fail": False}, {"fail": True}], backend=engine, temperature=0, timeout=TIMEOUT,
                         return_exceptions=True)
    assert out[0]["a"] == prog.run(fail=False, backend=engine, temperature=0)["a"]
    assert isinstance(out[1], VariableNotFound) and out[1].state is not None
    with pytest.raises(VariableNotFound):
        prog.run_batch([{"fail": True}], backend=engine, timeout=TIMEOUT)
