"""Programs against a live server (the `prefixrt serve` app on a loopback port, serving a tiny engine):
RemoteEngine gives what Engine gives, OpenAIBackend's select paths, constrained gens over HTTP, and failures
of the endpoint surfacing as ProgramError (with the program's state) instead of hangs."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from prefixrt.frontend import (
    OpenAIBackend,
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
from prefixrt.remote import RemoteEngine
from tests.helpers.engines import check_and_shut_down, tiny_llama_1k
from tests.helpers.live_server import LiveServer

TIMEOUT = 60
ESSAY = "A stitch in time saves nine. The quick brown fox jumps over the lazy dog. " * 2
PROMPT = "Question: what is the capital of France? Answer:"
DIMS = ["clarity", "originality", "evidence"]


@function
def judge(s, essay):
    s += system("Evaluate an essay.")
    s += user(essay)
    forks = s.fork(3)
    for f, dim in zip(forks, DIMS):
        f += user(f"Judge {dim}.") + assistant(gen("j", max_tokens=8, stop="END"))
    s += user("Grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))
    s.forks = forks


@pytest.fixture(scope="module")
def engine(long_checkpoint, tiny_tokenizer):
    eng = tiny_llama_1k(long_checkpoint, tiny_tokenizer)
    yield eng
    check_and_shut_down(eng)


@pytest.fixture(scope="module")
def server(engine):
    from prefixrt.server.app import create_app

    with LiveServer(create_app(engine)) as live:
        yield live


@pytest.fixture
def remote(server):
    r = RemoteEngine(server.url, timeout=TIMEOUT)
    yield r
    r.close()


def _client(url: str, transport: httpx.BaseTransport | None = None, timeout: float = TIMEOUT) -> openai.OpenAI:
    http = httpx.Client(transport=transport, timeout=timeout) if transport is not None else None
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=timeout, http_client=http)


class _NoLogprobs(httpx.BaseTransport):
    """Forwards to the real server and drops `logprobs` from its answers: an endpoint that does not return
    them (as many OpenAI-compatible APIs do)."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.bodies: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        resp = self.inner.handle_request(request)
        data = json.loads(resp.read())
        for ch in data.get("choices", []):
            ch["logprobs"] = None
        return httpx.Response(resp.status_code, json=data)


def _select_method(st) -> str | None:
    return next(r.method for r in st.requests if r.kind == "select")


def _results(st):
    return [f["j"] for f in st.forks] + [st["grade"]]


# ---------------------------------------------------------------------- Engine vs RemoteEngine
def test_judge_same_on_engine_and_remote_engine(engine, remote):
    engine.flush_cache()
    on_engine = judge.run(essay=ESSAY, backend=engine, temperature=0, timeout=TIMEOUT)
    remote.flush_cache()
    on_remote = judge.run(essay=ESSAY, backend=remote, temperature=0, timeout=TIMEOUT)
    assert _results(on_remote) == _results(on_engine)
    assert [f.messages() for f in on_remote.forks] == [f.messages() for f in on_engine.forks]
    scores_e, scores_r = on_engine.select_scores("grade"), on_remote.select_scores("grade")
    assert all(abs(scores_e[c] - scores_r[c]) < 1e-4 for c in "ABCD"), (scores_e, scores_r)
    # Both used the engine's own choice scoring, and the same prompts (the server renders the messages).
    assert _select_method(on_engine) == _select_method(on_remote) == "engine"
    assert [f.requests[0].prompt_tokens for f in on_remote.forks] == \
        [f.requests[0].prompt_tokens for f in on_engine.forks]
    # Fork hint on a cold cache: every branch's first request reuses the shared prefix, on both providers.
    be = ProviderBackend(engine)
    prefix_len = len(be.encode(be.chat_format.render(on_engine.forks[0]._ex.pieces[:2])))
    for st in (on_engine, on_remote):
        assert all(f.requests[0].cached_tokens >= prefix_len - 1 for f in st.forks), \
            ([f.requests[0] for f in st.forks], prefix_len)


def test_judge_on_openai_chat_endpoint_same_as_engine(engine, server):
    """OpenAIBackend on /v1/chat/completions: the server renders the same prompts as the Provider path, so the
    greedy judgments agree; one API call per gen."""
    on_engine = judge.run(essay=ESSAY, backend=engine, temperature=0, timeout=TIMEOUT)
    be = OpenAIBackend("tiny-llama-1k", client=_client(server.url), chat=True)
    on_api = judge.run(essay=ESSAY, backend=be, temperature=0, timeout=TIMEOUT)
    assert [f["j"] for f in on_api.forks] == [f["j"] for f in on_engine.forks]
    assert [f.messages() for f in on_api.forks] == [f.messages() for f in on_engine.forks]
    assert on_api["grade"] == on_engine["grade"]


def test_select_on_remote_engine_equals_engine(engine, remote):
    choices = [" Paris", " London", " the lazy dog", " radix trees"]

    @function
    def pick(s):
        s += PROMPT + select("x", choices=choices)

    st_e = pick.run(backend=engine, timeout=TIMEOUT)
    st_r = pick.run(backend=remote, timeout=TIMEOUT)
    assert st_r["x"] == st_e["x"]
    assert _select_method(st_r) == "engine"
    _, _, lps = engine.score_continuations(PROMPT, [engine.tokenizer.encode(c, add_special_tokens=False)
                                                     for c in choices])
    means = [sum(x) / len(x) for x in lps]
    assert st_r["x"] == choices[max(range(len(choices)), key=means.__getitem__)]


# ---------------------------------------------------------------------- OpenAIBackend select
def _top_single_token_choices(engine, prompt: str, k: int = 4) -> list[str]:
    pb = ProviderBackend(engine)
    ids = pb.encode(prompt)
    top = engine.generate(ids, {"max_new_tokens": 1, "temperature": 0, "logprobs": 8}).logprobs[0]["top_logprobs"]
    out = [t["token"] for t in top if pb.encode(prompt + t["token"]) == ids + [t["token_id"]]][:k]
    assert len(out) >= 2
    return out[::-1]  # best last: a tie cannot hide behind "first wins"


def test_openai_backend_select_uses_logprobs_when_returned(engine, server):
    choices = _top_single_token_choices(engine, PROMPT)

    @function
    def pick(s):
        s += PROMPT + select("x", choices=choices)

    be = OpenAIBackend("tiny-llama-1k", client=_client(server.url), chat=False)
    st = pick.run(backend=be, timeout=TIMEOUT)
    assert _select_method(st) == "logprobs" and be.num_api_calls == 1
    assert st["x"] == choices[-1] == pick.run(backend=engine, timeout=TIMEOUT)["x"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_backend_select_uses_constrained_choices_without_logprobs(engine, server, chat):
    choices = [" Paris", " London", " the lazy dog", " radix trees"]

    @function
    def pick(s):
        if chat:
            s += user(PROMPT) + assistant(select("x", choices=choices))
        else:
            s += PROMPT + select("x", choices=choices)

    transport = _NoLogprobs()
    be = OpenAIBackend("tiny-llama-1k", client=_client(server.url, transport), chat=chat)
    st = pick.run(backend=be, timeout=TIMEOUT)
    assert _select_method(st) == "constrained"
    assert transport.bodies[-1]["choices"] == choices  # the server's constrained `choices` picked it
    assert st["x"] == pick.run(backend=engine, timeout=TIMEOUT)["x"]  # the engine's best choice


# ---------------------------------------------------------------------- constrained gens over HTTP
@pytest.mark.parametrize("kind", ["remote", "openai"])
def test_constrained_gens_over_http(engine, server, kind):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}

    @function
    def prog(s):
        s += "Phone:" + gen("phone", max_tokens=12, regex=r" [0-9]{3}-[0-9]{4}")
        s += "\nCity:" + gen("city", choices=[" Paris", " Rome", " Oslo"])
        s += "\nJSON:" + gen("obj", max_tokens=24, json_schema=schema)

    be = RemoteEngine(server.url) if kind == "remote" else OpenAIBackend("tiny-llama-1k", client=_client(server.url),
                                                                         chat=False)
    st = prog.run(backend=be, temperature=0, timeout=TIMEOUT)
    local = prog.run(backend=engine, temperature=0, timeout=TIMEOUT)
    assert st.variables() == local.variables()
    import re

    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", st["phone"])
    assert st["city"] in (" Paris", " Rome", " Oslo")
    assert 0 <= json.loads(st["obj"])["n"] <= 9


# ---------------------------------------------------------------------- errors
def test_unknown_variable_on_remote_engine(remote):
    @function
    def prog(s):
        s += "Question:" + gen("a", max_tokens=2)
        s["nope"]

    with pytest.raises(VariableNotFound) as ei:
        prog.run(backend=remote, timeout=TIMEOUT)
    assert ei.value.state is not None and "a" in ei.value.state.variables()


def test_stopped_server_raises_with_state(engine):
    from prefixrt.server.app import create_app

    @function
    def prog(s):
        s += "Question:" + gen("a", max_tokens=2)
        s += " then:" + gen("b", max_tokens=2)

    with LiveServer(create_app(engine)) as live:
        url = live.url
        remote = RemoteEngine(url, timeout=10)
        be = OpenAIBackend("tiny-llama-1k", client=_client(url, timeout=10), chat=False)
        assert set(prog.run(backend=remote, temperature=0, timeout=TIMEOUT).variables()) == {"a", "b"}
    for backend in (remote, be):
        t0 = time.monotonic()
        with pytest.raises(ProgramError) as ei:
            prog.run(backend=backend, temperature=0, timeout=TIMEOUT)
        assert time.monotonic() - t0 < 10
        assert ei.value.state is not None and ei.value.state.text().startswith("Question:")
        assert "Connect" in str(ei.value)  # httpx.ConnectError / openai.APIConnectionError
    remote.close()


def test_unresponsive_server_times_out_with_state():
    """A server that accepts connections and never answers: the client's timeout ends the program."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"

        @function
        def prog(s):
            s += "Question:" + gen("a", max_tokens=2)

        for backend in (RemoteEngine(url, timeout=1.0), OpenAIBackend("x", client=_client(url, timeout=1.0),
                                                                       chat=False)):
            t0 = time.monotonic()
            with pytest.raises(ProgramError) as ei:
                prog.run(backend=backend, timeout=TIMEOUT)
            assert time.monotonic() - t0 < 10
            assert ei.value.state is not None and "timed out" in str(ei.value).lower()


# ---------------------------------------------------------------------- chat: partial assistant messages
@function
def extract_chat(s, doc):
    s += user("Extract name, job and city from: " + doc)
    s += assistant("Name:" + gen("name", max_tokens=6, stop="\n") + "\nJob:" + gen("job", max_tokens=6, stop="\n")
                   + "\nCity:" + gen("city", max_tokens=6, stop="\n"))


def test_chat_gens_after_literal_text_continue_the_assistant_message(engine, server):
    """Gens after literal text inside assistant(...) continue that message (`continue_final_message`), so the
    chat endpoint gives what the Engine gives for the same program when the Engine's prompts are their text
    encoded again, as the endpoint's are (token_continuity=False: by default the Engine's continue the ids the
    tiny model wrote, which its random answers do not encode back to)."""
    doc = "Alice Smith is an engineer in Paris."
    on_engine = extract_chat.run(doc=doc, backend=ProviderBackend(engine, token_continuity=False), temperature=0,
                                 timeout=TIMEOUT)
    be = OpenAIBackend("tiny-llama-1k", client=_client(server.url), chat=True)
    on_api = extract_chat.run(doc=doc, backend=be, temperature=0, timeout=TIMEOUT)
    assert on_api.variables() == on_engine.variables() and be.num_api_calls == 3
    assert on_api.messages() == on_engine.messages()


def test_chat_speculation_fallback_on_real_server(server):
    """The tiny model's reply does not start with the template's "Name:": the guess fails at once and every gen
    runs as its own call, with the fields of non-speculative execution."""
    doc = "Alice Smith is an engineer in Paris."
    before = httpx.get(server.url + "/stats").json()["requests_total"]
    plain = OpenAIBackend("tiny-llama-1k", client=_client(server.url), chat=True)
    spec = OpenAIBackend("tiny-llama-1k", client=_client(server.url), chat=True, speculative_tokens=24)
    st_plain = extract_chat.run(doc=doc, backend=plain, temperature=0, timeout=TIMEOUT)
    st_spec = extract_chat.run(doc=doc, backend=spec, temperature=0, timeout=TIMEOUT)
    assert st_spec.variables() == st_plain.variables()
    assert (plain.num_api_calls, spec.num_api_calls) == (3, 4)  # 1 failed guess + 3 separate calls
    assert httpx.get(server.url + "/stats").json()["requests_total"] - before == 7
