"""The real Gemma-3-270M: the session's in-process Engine and its `prefixrt serve` subprocess of the same model
(the black box; both from tests/conftest.py). The docs/api.md judge example gives the same greedy results on
Engine and RemoteEngine; the forks' first requests reuse the committed prefix; a 3-field extraction on the server's OpenAI API makes
one call instead of three with speculation (counted by the server's /stats), and when the guess fails the
fallback gives the fields of non-speculative execution."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import openai
import pytest

from prefixrt.frontend import OpenAIBackend, ProviderBackend, function, gen
from prefixrt.remote import RemoteEngine

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300
FIELDS = ("name", "job", "city")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


judge_example = _example("frontend_judge")
extraction_example = _example("openai_extraction")


@pytest.fixture(scope="module")
def gemma(gemma_engine_session, gemma_server_session):
    """(engine, server url): the session's one Gemma engine and one Gemma server (tests/conftest.py)."""
    return gemma_engine_session, gemma_server_session.url


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def test_judge_example_same_on_engine_and_remote_engine(gemma):
    eng, url = gemma
    judge, essay = judge_example.judge, judge_example.ESSAY
    dims = ["clarity", "originality", "evidence"]
    on_engine = judge.run(essay=essay, backend=eng, temperature=0, timeout=TIMEOUT)
    with RemoteEngine(url) as remote:
        on_remote = judge.run(essay=essay, backend=remote, temperature=0, timeout=TIMEOUT)
    results = [f["j"] for f in on_engine.forks] + [on_engine["grade"]]
    assert [f["j"] for f in on_remote.forks] + [on_remote["grade"]] == results
    assert on_engine["grade"] in "ABCD" and all(f["j"].strip() for f in on_engine.forks)
    scores_e, scores_r = on_engine.select_scores("grade"), on_remote.select_scores("grade")
    assert all(abs(scores_e[c] - scores_r[c]) < 1e-3 for c in "ABCD"), (scores_e, scores_r)

    # Fork hint: each branch's first request reused the committed prefix, on both providers; the prompts are
    # Gemma's own chat rendering (the system turn folded into the user turn).
    be = ProviderBackend(eng)
    msgs = [{"role": "system", "content": "Evaluate an essay."}, {"role": "user", "content": essay}]
    prefix_len = len(be.encode(eng.tokenizer.apply_chat_template(msgs, tokenize=False)))
    for st in (on_engine, on_remote):
        for f, dim in zip(st.forks, dims):
            first = f.requests[0]
            assert first.cached_tokens >= prefix_len - 1, (first, prefix_len)
            prompt = eng.tokenizer.apply_chat_template([*msgs, {"role": "user", "content": f"Judge {dim}."}],
                                                       tokenize=False, add_generation_prompt=True)
            assert first.prompt_tokens == len(be.encode(prompt))
    for f, dim in zip(on_engine.forks, dims):
        assert f.text().startswith(eng.tokenizer.apply_chat_template(
            [*msgs, {"role": "user", "content": f"Judge {dim}."}], tokenize=False, add_generation_prompt=True))


def _run_counted(program, url: str, speculative_tokens: int):
    """Run program on the server's /v1/completions; (state, calls, prompt tokens) from the server's /stats."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=120)
    backend = OpenAIBackend("gemma-3-270m", client=client, speculative_tokens=speculative_tokens, chat=False)
    before = _stats(url)
    st = program.run(doc=extraction_example.DOC, backend=backend, temperature=0, timeout=TIMEOUT)
    after = _stats(url)
    calls = after["requests_total"] - before["requests_total"]
    prompt_tokens = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert calls == backend.num_api_calls and prompt_tokens == backend.prompt_tokens  # client and server agree
    client.close()
    return st, calls, prompt_tokens


def test_speculation_on_prefixrt_serve_one_call_when_guess_holds(gemma):
    _, url = gemma
    extract = extraction_example.extract
    plain, plain_calls, plain_tokens = _run_counted(extract, url, 0)
    spec, spec_calls, spec_tokens = _run_counted(extract, url, 24)
    assert (plain_calls, spec_calls) == (3, 1)
    assert plain_tokens >= 2 * spec_tokens, (plain_tokens, spec_tokens)
    assert {k: spec[k] for k in FIELDS} == {k: plain[k] for k in FIELDS}
    assert all(spec[k].strip() for k in FIELDS)
    assert spec.text() == plain.text()


@function
def extract_occupation(s, doc):
    """The one-shot example says "Job:", this template "Occupation:": the model's continuation writes "Job:"
    after the name, so the guess fails there and the next gen starts a new speculative call."""
    s += extraction_example.SHOT + "Text: " + doc + "\n"
    s += "Name:" + gen("name", max_tokens=16, stop="\n") + "\nOccupation:" + gen("job", max_tokens=16, stop="\n") \
        + "\nCity:" + gen("city", max_tokens=16, stop="\n")


def test_speculation_on_prefixrt_serve_falls_back_when_guess_fails(gemma):
    _, url = gemma
    plain, plain_calls, _ = _run_counted(extract_occupation, url, 0)
    spec, spec_calls, _ = _run_counted(extract_occupation, url, 24)
    # the first guess resolves "name" and breaks at "Occupation:"; a second speculative call from there
    # resolves "job" and, from the same continuation, "city"
    assert plain_calls == 3 and spec_calls == 2
    assert [r.kind for r in spec.requests] == ["speculate", "speculate", "gen-speculated"]
    assert {k: spec[k] for k in FIELDS} == {k: plain[k] for k in FIELDS}
    assert spec.text() == plain.text()
