"""SGLang's nineteen frontend program shapes (tests/frontend/sglang_programs.py) with their assertions, except
those on answer quality, on three default backends: an in-process Engine (tiny 1k-context llama), a
RemoteEngine (`prefixrt.RuntimeEndpoint`) on a `prefixrt serve` subprocess of the same checkpoint, and
Gemma-3-270M (the session's one Gemma engine). Oracles: the provider's own generate() on the program's prompt,
Engine vs RemoteEngine on the same weights, the tokenizer, json/re parsers; speculation is counted on an
OpenAI-compatible endpoint (the real openai client over tests/frontend/fake_openai.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import struct
import threading
import zlib

import pytest

import prefixrt as pr
from prefixrt.errors import InvalidRequest
from prefixrt.frontend import OpenAIBackend, ProviderBackend
from tests.frontend import sglang_programs as P
from tests.helpers.engines import check_and_shut_down, tiny_llama_1k
from tests.helpers.fake_openai import ScriptedModel, client_for
from tests.server.conftest import ServeProcess

TIMEOUT = 300


# ---------------------------------------------------------------------- backends
@pytest.fixture(scope="module")
def tiny_engine(long_checkpoint, tiny_tokenizer):
    eng = tiny_llama_1k(long_checkpoint, tiny_tokenizer, kv_cache_tokens=16384)
    yield eng
    check_and_shut_down(eng)


@pytest.fixture(scope="module")
def served(long_checkpoint, tiny_tokenizer, tmp_path_factory):
    """`prefixrt serve` (a subprocess, as users start it) on the same tiny checkpoint."""
    src, _ = long_checkpoint
    folder = tmp_path_factory.mktemp("served") / "tiny-llama-1k"
    shutil.copytree(src, folder)
    tiny_tokenizer.save_pretrained(folder)
    args = ["--model", str(folder), "--served-model-name", "tiny-llama-1k", "--device", "cpu",
            "--kv-cache-tokens", "16384", "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as live:
        yield live


@pytest.fixture
def gemma_engine(gemma_engine_session):
    """The session's one Gemma-3-270M engine (tests/conftest.py)."""
    return gemma_engine_session


@pytest.fixture(params=["engine", "remote", "gemma"])
def provider(request):
    """The provider behind the default backend of the programs (set as SGLang programs expect)."""
    if request.param == "engine":
        prov = request.getfixturevalue("tiny_engine")
    elif request.param == "gemma":
        prov = request.getfixturevalue("gemma_engine")
    else:
        prov = pr.RuntimeEndpoint(request.getfixturevalue("served").url, timeout=TIMEOUT)
    pr.set_default_backend(prov)
    yield prov
    pr.set_default_backend(None)
    if request.param == "remote":
        prov.close()


def _direct(provider, prompt: str, **params) -> str:
    """What the provider itself generates for the prompt text (the oracle of text-only programs)."""
    return provider.generate(prompt, {"temperature": 0, **params}).text


def _prompt_before(state, value: str) -> str:
    text = state.text()
    assert text.endswith(value)
    return text[: len(text) - len(value)]


# ---------------------------------------------------------------------- the nineteen shapes
def test_few_shot_qa(provider):
    st = P.few_shot_capitals.run(question="What is the capital of Kenya?", max_new_tokens=12)
    answer = st["answer"]
    assert "\n" not in answer
    assert answer == _direct(provider, _prompt_before(st, answer), max_new_tokens=12, stop="\n")
    questions = ["What is the capital of Chile?", "What is the capital of Norway?", "What is the capital of Japan?"]
    batch = P.few_shot_capitals.run_batch([{"question": q} for q in questions], temperature=0.1, max_new_tokens=12)
    one_by_one = [P.few_shot_capitals.run(question=q, max_new_tokens=12)["answer"] for q in questions]
    assert [s["answer"] for s in batch] == one_by_one  # the gen's temperature=0 wins over the run's 0.1


def test_multi_turn_role_blocks(provider):
    # The oracle renders the messages as text: so does the program here (token_continuity=False), where by default
    # an Engine's second prompt continues the ids of the first answer (tests/frontend/test_token_prefix.py).
    st = P.two_turn_chat.run(first="Name a fruit.", second="Now name a vegetable.", temperature=0,
                             max_new_tokens=8, backend=ProviderBackend(provider, token_continuity=False))
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[3]["content"] == "Now name a vegetable."
    assert msgs[2]["content"] == st["answer_1"] and msgs[4]["content"] == st["answer_2"]
    # the second answer is what the provider answers to the first four messages (its own chat template)
    assert st["answer_2"] == _direct(provider, msgs[:4], max_new_tokens=8)


def test_select(provider):
    for statement in ["Paris is in France.", "The sun is cold.", "Blue is the best color."]:
        st = P.judge_statement.run(statement=statement)
        scores = st.select_scores("label")
        assert st["label"] in ("True", "False", "Unknown")
        assert st["label"] == max(scores, key=scores.get)
        assert st.text().endswith("Label:" + st["label"])


def test_decode_int(provider):
    st = P.count_facts.run(temperature=0.1, max_new_tokens=8)
    for name in ("days", "seconds"):
        assert re.fullmatch(r"-?[0-9]+", st[name]), st[name]
        int(st[name])


@pytest.mark.parametrize("program", [P.city_json_regex, P.city_json_typed], ids=["regex", "typed"])
def test_decode_json(provider, program):
    st = program.run(temperature=0, max_new_tokens=12)
    record = json.loads(st["record"])
    assert isinstance(record["name"], str)
    assert isinstance(record["inhabitants"], int)
    assert st.text().endswith(st["record"]) and st["record"].startswith("{\n")


def test_expert_answer(provider):
    st = P.ask_an_expert.run(question="How far is the moon?", temperature=0, max_new_tokens=8)
    expected_tail = (f"Someone who knows the answer well is{st['expert']}.\nAsked this,{st['expert']} would say "
                     f"that {st['answer']}.")
    assert st.text().endswith(expected_tail)
    assert "." not in st["answer"] and "." not in st["expert"] and "\n" not in st["expert"]


def test_tool_use(provider):
    st = P.multiply_with_tool(a=257, b=983, temperature=0, max_new_tokens=8)  # calling the program runs it
    assert st["result"] == P.calculator(st["expression"])
    assert st.text().endswith(") = " + st["result"])
    assert P.calculator("257*983") == str(257 * 983) and P.calculator("__import__('os')") == "not computable"


def test_react(provider):
    st = P.react_agent.run(question="Which sea lies east of Italy?", temperature=0.1, max_new_tokens=8)
    actions = [st.variables().get(f"action_{i}") for i in (1, 2, 3)]
    taken = [a for a in actions if a is not None]
    assert taken and all(a in ("Search", "Finish") for a in taken)
    if "Finish" in taken:  # the loop stops at the first Finish, with an answer
        assert taken.index("Finish") == len(taken) - 1 and "answer" in st
    else:
        assert len(taken) == 3 and "answer" not in st


def test_parallel_decoding(provider):
    st = P.tips_skeleton.run(topic="keeping a plant alive", temperature=0)
    assert isinstance(st["summary"], str)
    details = [b["detail"] for b in st.branches]
    assert len(details) == P.TIPS
    text = st.text()
    for i, d in enumerate(details):
        assert f"Tip {i + 1}:{d}\n" in text
        assert f"Expanding tip {i + 1}" not in text  # branch text stays in the branch (join mode gather)


def test_parallel_encoding(provider):
    facts = ["Mia owns a red bicycle.", "Leo owns a blue kite.", "Ava owns a green boat."]
    st = P.answer_from_facts.run(question="Who owns the kite?", fact_0=facts[0], fact_1=facts[1],
                                 fact_2=facts[2], temperature=0)
    text = st.text()
    assert "".join(f"Fact {i}: {f}\n" for i, f in enumerate(facts)) in text  # concate_and_append, in order
    answer = st["answer"]
    assert answer == _direct(provider, _prompt_before(st, answer), max_new_tokens=8)


def _png(path) -> str:
    """A 2x2 RGB PNG written by hand (no imaging library needed)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 2 for _ in range(2))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    path.write_bytes(png)
    return str(path)


def test_image_qa_on_text_only_model(provider, tmp_path):
    path = _png(tmp_path / "red.png")
    with pytest.raises(InvalidRequest, match="text-only") as ei:
        P.describe_image.run(path=path, question="What color is this?", max_new_tokens=4)
    assert ei.value.param == "image"


def test_image_qa_on_chat_endpoint_sends_image_part(tmp_path):
    path = _png(tmp_path / "red.png")
    model = ScriptedModel([("Color", "red")])
    be = OpenAIBackend("fake", client=client_for(model))
    st = P.describe_image.run(path=path, question="What color is this?", backend=be, max_new_tokens=4)
    content = model.requests[0]["messages"][0]["content"]
    assert content[0]["type"] == "image_url" and content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[1] == {"type": "text", "text": "What color is this?"}
    assert st.messages()[0]["content"] == "What color is this?"
    with pytest.raises(InvalidRequest, match="chat endpoint"):
        P.describe_image.run(path=path, question="?", backend=OpenAIBackend("fake", client=client_for(model),
                                                                             chat=False))


def test_stream(provider):
    q = "Write about a trip to the mountains."
    st = P.chat_qa(question=q, stream=True, temperature=0, max_new_tokens=16)
    pieces = list(st.text_iter())
    st.sync()
    assert "".join(pieces) == "You are a helpful assistant." + q + st["answer"]
    st = P.chat_qa(question=q, stream=True, temperature=0, max_new_tokens=16)
    answer_pieces = list(st.text_iter("answer"))
    assert "".join(answer_pieces) == st["answer"] == P.chat_qa.run(question=q, temperature=0,
                                                                   max_new_tokens=16)["answer"]
    if st.get_meta_info("answer")["completion_tokens"] > 3:
        assert len(answer_pieces) > 1  # streamed, not delivered whole

    async def consume():
        s2 = P.chat_qa(question=q, stream=True, temperature=0, max_new_tokens=16)
        return [p async for p in s2.text_async_iter("answer")]

    assert "".join(asyncio.run(consume())) == st["answer"]


def test_regex(provider):
    st = P.dns_address.run(max_new_tokens=24)
    assert re.fullmatch(P.IPV4, st["address"]), st["address"]


def test_dtype_gen(provider):
    st = P.typed_answers.run(temperature=0, max_new_tokens=10)
    assert st["colder"] in ("True", "False")
    st["year"] = int(st["year"])
    st["root"] = float(st["root"])
    st["colder"] = st["colder"] == "True"
    assert isinstance(st["year"], int) and isinstance(st["root"], float) and isinstance(st["colder"], bool)
    assert isinstance(json.loads(st["text"]), str)  # a quoted string


def test_hellaswag_select_batch(provider, capsys):
    args = [{"context": c, "endings": e} for c, e in P.ENDING_ITEMS]
    states = P.pick_ending.run_batch(args, temperature=0, num_threads=4, progress_bar=True)
    assert f"{len(args)}/{len(args)}" in capsys.readouterr().err  # the progress bar ran to the end
    preds = [e.index(s["ending"]) for s, (_, e) in zip(states, P.ENDING_ITEMS)]
    assert preds == [e.index(P.pick_ending.run(context=c, endings=e)["ending"]) for c, e in P.ENDING_ITEMS]
    streamed = P.pick_ending.run_batch(args, temperature=0, generator_style=True)
    assert not isinstance(streamed, list)
    assert [s["ending"] for s in streamed] == [s["ending"] for s in states]


def test_min_tokens(provider):
    st = P.long_enough.run(temperature=0)
    meta = st.get_meta_info("answer")
    assert P.MIN_TOKENS <= meta["completion_tokens"] <= P.MAX_TOKENS, meta


# ---------------------------------------------------------------------- speculation (16, 17): counted calls
RECORD = [("Name", "Grace Hopper."), ("Born", "December 9, 1906."), ("Work", "Computer scientist.")]


def _api(record, chat=False):
    model = ScriptedModel(record)
    return model, OpenAIBackend("fake", client=client_for(model), chat=chat)


def test_completion_speculation_one_call_across_statements():
    _, spec = _api(RECORD)
    _, plain = _api(RECORD)
    st_spec = P.character_spec.run(backend=spec, temperature=0)
    st_plain = P.character_plain.run(backend=plain, temperature=0)
    fields = ("name", "born", "work")
    assert {k: st_spec[k] for k in fields} == {k: st_plain[k] for k in fields} == \
        {"name": " Grace Hopper.", "born": " December 9, 1906.", "work": " Computer scientist."}
    assert st_spec.text() == st_plain.text()
    assert spec.token_usage.num_calls == 1 and plain.token_usage.num_calls == 3
    assert spec.token_usage.prompt_tokens < plain.token_usage.prompt_tokens
    assert [r.kind for r in st_spec.requests] == ["speculate", "gen-speculated", "gen-speculated"]


def test_completion_speculation_guess_fails_same_variables():
    swapped = [RECORD[0], RECORD[2], RECORD[1]]  # the model writes Work before Born
    _, spec = _api(swapped)
    _, plain = _api(swapped)
    st_spec = P.character_spec.run(backend=spec, temperature=0)
    st_plain = P.character_plain.run(backend=plain, temperature=0)
    assert st_spec.variables() == st_plain.variables() and st_spec.text() == st_plain.text()
    assert spec.token_usage.num_calls == 3  # name guessed; born and work each from a new speculative call


def test_chat_speculation_one_call():
    model, spec = _api(RECORD, chat=True)
    st = P.character_chat_spec.run(backend=spec, temperature=0)
    assert spec.token_usage.num_calls == 1 and "continue_final_message" not in model.requests[0]
    assert st["name"] == " Grace Hopper." and st["work"] == " Computer scientist."


def test_speculation_on_real_server_same_variables(served):
    """On `prefixrt serve`'s completions API (greedy), speculation gives the variables of plain execution
    whether the random model's continuation matches the template or not."""
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT)
    spec = OpenAIBackend("tiny-llama-1k", client=client, chat=False)
    plain = OpenAIBackend("tiny-llama-1k", client=client, chat=False)
    st_spec = P.character_spec.run(backend=spec, temperature=0, max_new_tokens=12)
    st_plain = P.character_plain.run(backend=plain, temperature=0, max_new_tokens=12)
    assert st_spec.variables() == st_plain.variables()
    assert plain.token_usage.num_calls == 3 and 1 <= spec.token_usage.num_calls <= 6
    chat = OpenAIBackend("tiny-llama-1k", client=client)  # min_tokens reaches the server as `min_tokens`
    st = P.long_enough.run(backend=chat, temperature=0)
    assert P.MIN_TOKENS <= chat.token_usage.completion_tokens <= P.MAX_TOKENS and st["answer"]


# ---------------------------------------------------------------------- language rules
def test_forks_add_to_every_branch(tiny_engine):
    @pr.function
    def prog(s):
        s += "Start."
        forks = s.fork(3)
        forks += " shared"
        forks += lambda i: f" branch{i}"
        forks.join(mode="concate_and_append")
        s += " end"

    st = prog.run(backend=tiny_engine)
    assert [b.text() for b in st.branches] == [f"Start. shared branch{i}" for i in range(3)]
    assert st.text() == "Start." + "".join(f" shared branch{i}" for i in range(3)) + " end"


def test_unknown_arguments_rejected_at_build_time(tiny_engine):
    with pytest.raises(InvalidRequest, match=r"gen\('answer'\): unknown argument 'max_length'") as ei:
        pr.gen("answer", max_length=5)
    assert ei.value.param == "max_length"
    with pytest.raises(InvalidRequest, match=r"@function\(prog\): unknown argument 'temprature'"):
        @pr.function(temprature=0)
        def prog(s):
            s += "x"
    with pytest.raises(InvalidRequest, match=r"select\('c'\): unknown argument 'method'"):
        pr.select("c", ["a", "b"], method="sum")
    with pytest.raises(InvalidRequest, match="dtype"):
        pr.gen("n", dtype=list)

    @pr.function
    def body_error(s):
        s += "Q:" + pr.gen("x", frequency_penality=1.0)

    calls = []
    be = ProviderBackend(tiny_engine)
    be.generate = lambda *a: calls.append(a)  # nothing may reach the model
    with pytest.raises(InvalidRequest, match=r"gen\('x'\): unknown argument 'frequency_penality'"):
        body_error.run(backend=be)
    assert calls == []


def test_text_iter_yields_before_the_gen_ends(tiny_engine):
    """The stream's first piece arrives while the gen is still generating: the provider below holds the
    rest of the stream until the consumer has seen a piece (event order, no clock)."""
    events = []
    first_seen = threading.Event()

    class Gated:
        tokenizer = tiny_engine.tokenizer
        model_name = tiny_engine.model_name

        def generate(self, *a, **k):
            return tiny_engine.generate(*a, **k)

        def cache_prefix(self, *a, **k):
            return tiny_engine.cache_prefix(*a, **k)

        def stream(self, prompt, params):
            for i, chunk in enumerate(tiny_engine.stream(prompt, params)):
                if i == 1:
                    events.append("held" if first_seen.wait(30) else "not seen")
                yield chunk
            events.append("gen ended")

    st = P.chat_qa.run(question="Tell a story.", backend=Gated(), stream=True, temperature=0, max_new_tokens=16,
                       ignore_eos=True)
    pieces = []
    for piece in st.text_iter("answer"):
        if not pieces:
            events.append("first piece")
            first_seen.set()
        pieces.append(piece)
    assert events == ["first piece", "held", "gen ended"]
    assert len(pieces) > 1 and "".join(pieces) == st["answer"]


def test_token_usage_counted_on_backend(tiny_engine):
    be = ProviderBackend(tiny_engine)
    st = P.few_shot_capitals.run(question="What is the capital of Kenya?", backend=be, max_new_tokens=6)
    rec = st.requests[0]
    assert be.token_usage.num_calls == 1 and be.token_usage.prompt_tokens == rec.prompt_tokens > 0
    assert be.token_usage.completion_tokens == rec.completion_tokens > 0
    be.token_usage.reset()
    assert be.token_usage.num_calls == 0


def test_runtime_endpoint_is_remote_engine():
    from prefixrt.remote import RemoteEngine

    assert pr.RuntimeEndpoint is RemoteEngine


def test_react_cannot_be_compiled():
    from prefixrt.frontend.compiler import TraceError

    with pytest.raises(TraceError, match="action_1"):
        P.react_agent.trace(question="Which sea lies east of Italy?")


def test_engine_and_remote_engine_agree(tiny_engine, served):
    """Given the same prompt text. A RemoteEngine without a tokenizer sends text or messages, so the Engine's
    prompts are their text encoded here too (token_continuity=False: the tiny model's random answers do not
    encode back to the ids it wrote)."""
    remote = pr.RuntimeEndpoint(served.url, timeout=TIMEOUT)
    engine = ProviderBackend(tiny_engine, token_continuity=False)
    try:
        for prog, kw in [(P.few_shot_capitals, {"question": "What is the capital of Kenya?"}),
                         (P.two_turn_chat, {"first": "Name a fruit.", "second": "And a vegetable?"}),
                         (P.judge_statement, {"statement": "The sun is cold."})]:
            a = prog.run(backend=engine, temperature=0, max_new_tokens=8, **kw)
            b = prog.run(backend=remote, temperature=0, max_new_tokens=8, **kw)
            assert a.variables() == b.variables(), prog.__name__
    finally:
        remote.close()


def test_image_qa_on_a_vision_language_model(make_vlm, tmp_path):
    """SGLang's image QA program, unchanged, on a tiny VLM engine: the image reaches the vision tower, and a
    second question about it reuses the image's K/V (the tower does not run again)."""
    from prefixrt.frontend.backend import ProviderBackend
    from tests.helpers.images import png_bytes, random_image

    path = tmp_path / "pic.png"
    path.write_bytes(png_bytes(random_image(5)))
    eng = make_vlm()
    be = ProviderBackend(eng)
    st = P.describe_image.run(path=str(path), question="What color is this?", backend=be, max_new_tokens=4,
                              temperature=0)
    assert isinstance(st["answer"], str)
    assert eng._built.model.vision_runs == 1
    P.describe_image.run(path=str(path), question="Where is it?", backend=be, max_new_tokens=4, temperature=0)
    assert eng._built.model.vision_runs == 1
    assert eng.stats().cached_tokens_total > 0
    # video(path) needs a decoder: refused when the program is built, with what to send instead
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 16)

    @pr.function
    def describe_video(s, path):
        s += pr.user(pr.video(path, 4) + "What happens?")
        s += pr.assistant(pr.gen("answer"))

    with pytest.raises(InvalidRequest, match="video decoder") as ei:
        describe_video.run(path=str(clip), backend=be)
    assert ei.value.param == "video"
