"""The judge program on the real Gemma-3-270M (one engine for the module): greedy runs repeat exactly, the
forks' first requests reuse the committed prefix, and the prompt is Gemma's own chat rendering."""

from __future__ import annotations

import pytest

from prefixrt.frontend import ProviderBackend, assistant, function, gen, select, system, user

ESSAY = ("Cities should plant more trees. Trees cool streets in summer and clean the air. A study found shaded "
         "streets were four degrees cooler.")
DIMS = ["clarity", "originality", "evidence"]


@function
def judge(s, essay):
    s += system("Evaluate an essay.")
    s += user(essay)
    forks = s.fork(3)
    for f, dim in zip(forks, DIMS):
        f += user(f"Judge {dim}.") + assistant(gen("j", max_tokens=16, stop="END"))
    s += user("Grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))
    s.forks = forks


@pytest.fixture(scope="module")
def gemma():
    import prefixrt

    try:
        eng = prefixrt.Engine("gemma-3-270m")
    except Exception as e:  # not cached on this machine
        pytest.skip(f"gemma-3-270m unavailable: {e}")
    yield eng
    eng.shutdown()


def test_judge_on_gemma(gemma):
    st1 = judge.run(essay=ESSAY, backend=gemma, temperature=0, timeout=300)
    st2 = judge.run(essay=ESSAY, backend=gemma, temperature=0, timeout=300)
    assert [f["j"] for f in st1.forks] + [st1["grade"]] == [f["j"] for f in st2.forks] + [st2["grade"]]
    assert st1["grade"] in ["A", "B", "C", "D"] and all(f["j"].strip() for f in st1.forks)
    be = ProviderBackend(gemma)
    msgs = [{"role": "system", "content": "Evaluate an essay."}, {"role": "user", "content": ESSAY}]
    prefix = gemma.tokenizer.apply_chat_template(msgs, tokenize=False)
    prefix_len = len(be.encode(prefix))
    for f, dim in zip(st1.forks, DIMS):
        first = f.requests[0]
        assert first.cached_tokens >= prefix_len - 1, (first, prefix_len)
        prompt = gemma.tokenizer.apply_chat_template([*msgs, {"role": "user", "content": f"Judge {dim}."}],
                                                     tokenize=False, add_generation_prompt=True)
        assert first.prompt_tokens == len(be.encode(prompt))  # Gemma's rendering, system folded into the user turn
        assert f.text().startswith(prompt)
