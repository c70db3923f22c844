"""Compiler mode: prog.trace() lists the program's primitives without a model call; prog.compile() gives the
interpreter's greedy results (the oracle: the same program on the interpreter, same engine), caches each
constant prefix before its first run and submits the gens of one run that are ready together."""

from __future__ import annotations

import pytest

from prefixrt.errors import InvalidRequest
from prefixrt.frontend import ProviderBackend, assistant, function, gen, select, system, user
from prefixrt.frontend.compiler import TraceError
from tests.frontend import sglang_programs as P

TIMEOUT = 120
ESSAY = "A stitch in time saves nine. The quick brown fox jumps over the lazy dog. " * 3


@function
def judge(s, essay):  # docs/api.md's program (examples/frontend_judge.py)
    s += system("Evaluate an essay.")
    s += user(essay)
    forks = s.fork(3)
    for f, dim in zip(forks, ["clarity", "originality", "evidence"]):
        f += user(f"Judge {dim}.") + assistant(gen("j", max_tokens=8, stop="END"))
    s += user("Grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))


def _results(st):
    return [b["j"] for b in st.branches] + [st["grade"]]


@pytest.fixture
def engine(make_frontend_engine):
    return make_frontend_engine()


def test_judge_graph_lists_every_primitive(engine):
    before = engine.stats().requests_total
    g = judge.trace(backend=engine)
    assert engine.stats().requests_total == before  # no model call
    assert g.args == ["essay"]
    assert [n.describe() for n in g.stream(0)] == [
        "role_begin 'system'", "text 'Evaluate an essay.'", "role_end 'system'",
        "role_begin 'user'", "text* '{arg essay}'", "role_end 'user'",
        "fork 3 -> streams [1, 2, 3]",
        "role_begin 'user'", "text 'Grade?'", "role_end 'user'",
        "role_begin 'assistant'", "select 'grade' choices=['A', 'B', 'C', 'D']", "role_end 'assistant'",
    ]
    for sid, dim in zip((1, 2, 3), ["clarity", "originality", "evidence"]):
        assert [n.describe() for n in g.stream(sid)] == [
            "role_begin 'user'", f"text 'Judge {dim}.'", "role_end 'user'",
            "role_begin 'assistant'", "gen 'j'", "role_end 'assistant'"]
        assert g.stream(sid)[4].expr.max_tokens == 8 and g.stream(sid)[4].expr.stop == ["END"]
    assert sorted(set(g.kinds())) == ["fork", "gen", "role_begin", "role_end", "select", "text"]
    assert "stream 3:" in str(g)


def test_trace_keeps_references_and_joins():
    g = P.tips_skeleton.trace(topic="tea")
    kinds = g.kinds()
    assert kinds.count("gen") == P.TIPS + P.TIPS + 1 and "fork" in kinds and "join" in kinds
    tips = [n for n in g.stream(0) if n.kind == "text" and "Tip 1:" in n.text]
    detail = g.stream(1)[-1]
    assert detail.kind == "gen" and detail.name == "detail"
    assert f"\x00out:{detail.id}\x00" in tips[0].text  # the branch's value, referenced by the parent's text
    g = P.ask_an_expert.trace(question="Why?")
    expert = next(n for n in g.nodes if n.kind == "gen" and n.name == "expert")
    assert any(n.kind == "text" and f"\x00out:{expert.id}\x00" in n.text for n in g.nodes)


def test_programs_that_compute_on_values_cannot_be_traced():
    with pytest.raises(TraceError, match="action_1"):
        P.react_agent.trace(question="Which sea lies east of Italy?")
    with pytest.raises(TraceError, match="expression"):
        P.multiply_with_tool.trace(a=2, b=3)


@pytest.mark.parametrize("prog, kwargs", [
    (judge, {"essay": ESSAY}),
    (P.few_shot_capitals, {"question": "What is the capital of Kenya?"}),
    (P.tips_skeleton, {"topic": "tea"}),
    (P.answer_from_facts, {"question": "Who owns the kite?", "fact_0": "Mia owns a bike.",
                           "fact_1": "Leo owns a kite.", "fact_2": "Ava owns a boat."}),
    (P.ask_an_expert, {"question": "How far is the moon?"}),
    (P.city_json_typed, {}),
    (P.two_turn_chat, {"first": "Name a fruit.", "second": "And a vegetable?"}),
], ids=["judge", "few_shot", "skeleton", "encoding", "expert", "json", "roles"])
def test_compiled_equals_interpreter(engine, prog, kwargs):
    interpreted = prog.run(backend=engine, temperature=0, max_new_tokens=8, timeout=TIMEOUT, **kwargs)
    compiled = prog.compile().run(backend=engine, temperature=0, max_new_tokens=8, **kwargs)
    assert compiled.variables() == interpreted.variables()
    assert compiled.text() == interpreted.text()
    assert compiled.messages() == interpreted.messages()
    assert [b.variables() for b in compiled.branches] == [b.variables() for b in interpreted.branches]


def test_compiled_batch_equals_interpreter(engine):
    essays = [ESSAY, "Short essay. " * 5, "Another one about cats. " * 4]
    compiled = judge.compile().run_batch([{"essay": e} for e in essays], backend=engine, temperature=0)
    interpreted = judge.run_batch([{"essay": e} for e in essays], backend=engine, temperature=0)
    assert [_results(c) for c in compiled] == [_results(i) for i in interpreted]


def test_compiled_prefetches_constant_prefix_and_submits_forks_together(engine):
    be = ProviderBackend(engine)
    calls = []
    many = be.generate_many
    be.generate_many = lambda c: (calls.append(len(c)), many(c))[1]
    prog = judge.compile()
    prefixes = prog.constant_prefixes(be)
    assert len(prefixes) == 1 and prefixes[0].open_role == "user"  # system message + the open user block
    prefix_ids = be.prompt(prefixes[0])
    engine.flush_cache()
    st = prog.run(backend=be, temperature=0, essay=ESSAY)
    assert calls == [3]  # the three branches' gens in one submission (the select runs beside them)
    first = min(st.branches[0].requests[0].cached_tokens, st.requests[-1].cached_tokens)
    assert first >= len(prefix_ids) - 1  # the constant prefix was cached before the first run
    assert prog.prefetch(be) == 0  # once per backend


def test_compiled_run_checks_arguments(engine):
    prog = P.react_agent  # untraceable: compile() refuses it at once
    with pytest.raises(TraceError):
        prog.compile()
    compiled = P.few_shot_capitals.compile()
    with pytest.raises(InvalidRequest, match="question"):
        compiled.run(backend=engine)
    fixed = P.answer_from_facts.compile(fact_0="a.", fact_1="b.", fact_2="c.")
    with pytest.raises(InvalidRequest, match="fixed"):
        fixed.run(backend=engine, question="?", fact_0="other.")
