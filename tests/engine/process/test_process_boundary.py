"""The serve process boundary: Engine.prepare / Engine.enqueue (what the engine process calls) and the typed
pipe messages of engine/process/messages.py. tests/reliability/test_engine_death.py and tests/server run the real
two-process engine end to end."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from prefixrt.engine.process import messages as M
from prefixrt.engine.stream import RequestStream, StepOutput
from prefixrt.errors import InvalidRequest
from prefixrt.params import SamplingParams


def test_prepare_validates_without_enqueueing_and_enqueue_runs_it(make_engine):
    eng = make_engine()
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    prepared = eng.prepare("The quick brown fox", greedy)
    assert prepared.prompt_ids == eng.tokenizer.encode("The quick brown fox")
    assert [r.sink for r in prepared.reqs] == [None] and prepared.params.request_id is None
    assert eng.stats().requests_total == 0  # nothing reached the loop
    with pytest.raises(InvalidRequest):
        eng.prepare("x", {"temperature": -1})
    stream = RequestStream()
    eng.enqueue(prepared, stream)
    with pytest.raises(RuntimeError, match="already enqueued"):
        eng.enqueue(prepared, stream)
    got = eng._wait(prepared.request_id, stream, prepared.prompt_ids, prepared.params)
    assert got.token_ids == eng.generate("The quick brown fox", greedy).token_ids


def test_prepare_attaches_constraint_matchers_per_sample(make_engine):
    pytest.importorskip("llguidance")
    eng = make_engine()
    prepared = eng.prepare("Pick: ", {"regex": "(yes|no)", "n": 2, "max_new_tokens": 4})
    assert len(prepared.reqs) == 2 and all(r.matcher is not None for r in prepared.reqs)
    assert prepared.reqs[0].matcher is not prepared.reqs[1].matcher
    stream = RequestStream()
    eng.enqueue(prepared, stream)
    c = eng._wait(prepared.request_id, stream, prepared.prompt_ids, prepared.params)
    assert {o.text for o in c.outputs} <= {"yes", "no"}


MESSAGES = [
    M.Add.of(3, "req-1", [1, 2, 3], SamplingParams(max_new_tokens=2, stop="x")),
    M.Add.of(None, "req-2", [4], SamplingParams()),
    M.Abort("req-1"),
    M.Call(7, "stats", ()),
    M.Shutdown(),
    M.Batch([pickle.dumps(M.Abort("req-1")), pickle.dumps(M.Add.of(None, "req-3", [5, 6], SamplingParams()))]),
    M.Progress("loading"),
    M.Ready(M.EngineInfo("m", "rev", 320, 128, 4096, 1, "cpu", b"tok")),
    M.Outputs([("req-1", StepOutput(index=0, token_ids=[5], text="a", finished=False))]),
    M.Reply(7, True, {"x": 1}),
    M.Beat(),
    M.Bye(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_pipe(msg):
    from multiprocessing.reduction import ForkingPickler

    back = pickle.loads(bytes(ForkingPickler.dumps(msg)))
    assert type(back) is type(msg) and back == msg
    if dataclasses.fields(back):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(back, dataclasses.fields(back)[0].name, None)


def test_unpicklable_errors_are_replaced_by_their_text():
    class Local(Exception):  # a local class cannot be pickled
        pass

    e = M.picklable(Local("boom"))
    assert isinstance(e, RuntimeError) and str(e) == "Local: boom"
    ok = InvalidRequest("bad", param="regex")
    assert M.picklable(ok) is ok


@pytest.mark.parametrize("ids", [[], [0], [2**31 - 1], list(range(5000)), [7, 0, 123456, 99]])
def test_packed_token_ids_round_trip(ids):
    data = M.pack_token_ids(ids)
    assert isinstance(data, bytes) and len(data) == 4 * len(ids)
    back = M.unpack_token_ids(data)
    assert back == ids and type(back) is list and all(type(t) is int for t in back)
    msg = M.Add.of(None, "r", ids, SamplingParams())
    assert msg.prompt_ids == ids


def test_an_add_carries_its_prompt_as_one_buffer():
    from multiprocessing.reduction import ForkingPickler

    ids = [100_000 + k for k in range(4000)]
    msg = M.Add.of(None, "r", ids, SamplingParams(max_new_tokens=3))
    data = bytes(ForkingPickler.dumps(msg))
    assert len(data) < 4 * len(ids) + 1024  # the ids as int32 bytes, not a pickle opcode per id
    back = pickle.loads(data)
    assert back.prompt_ids == ids and back.params == msg.params and back.request_id == "r"


def test_ids_outside_int32_cannot_be_packed():
    with pytest.raises(OverflowError):
        M.pack_token_ids([2**31])
    with pytest.raises(OverflowError):
        M.pack_token_ids([-(2**31) - 1])


def test_step_outputs_pickle_every_field():
    """StepOutput.__reduce__ lists the fields by hand: a field added to the dataclass must be added there too."""
    values = {f.name: f"value-{k}" for k, f in enumerate(dataclasses.fields(StepOutput))}
    out = StepOutput(**values)
    assert list(out.__reduce__()[1]) == list(values.values())
    back = pickle.loads(pickle.dumps(out))
    assert type(back) is StepOutput and back == out
    full = StepOutput(index=1, token_ids=[5, 6], text="ab", logprobs=[{"token_id": 5, "logprob": -0.5}],
                      finished=True, finish_reason="stop", matched_stop="b", prompt_tokens=7, cached_tokens=3,
                      choice_scores={"a": -1.0}, final_text="ab", input_logprobs=[-0.25])
    assert pickle.loads(pickle.dumps(M.Outputs([("r", full)]))) == M.Outputs([("r", full)])


def _checked_cases(eng) -> tuple[list[list[int]], list[SamplingParams]]:
    """Token-id prompts and params that pass or fail each of prepare's checks (empty, vocabulary, int32, context)."""
    vocab, context = eng.vocab_size, eng.max_context
    prompts = [[1, 2, 3], [0], [vocab - 1] * 5, [], [vocab], [5, -1, 7], [2**31 - 1], list(range(context + 3)),
               [k % vocab for k in range(context - 1)]]
    return prompts, [SamplingParams(max_new_tokens=2, n=2, request_id="r"), SamplingParams(logit_bias={vocab: 1.0})]


def _verdict(prepare, *args):
    try:
        got = prepare(*args)
    except InvalidRequest as e:
        return "error", e.message, e.param
    return "ok", got.prompt_ids, got.params, [(r.prompt_ids, r.index) for r in got.reqs]


def test_prepare_packed_is_prepare_on_token_ids(make_engine):
    """What the engine process does with an Add: the same checks, errors and prepared request as prepare()."""
    eng = make_engine()
    prompts, params = _checked_cases(eng)
    for ids in prompts:
        for p in params:
            want = _verdict(eng.prepare, ids, p)
            assert _verdict(eng.prepare_packed, M.pack_token_ids(ids), p) == want, (ids[:5], p)
    prepared = eng.prepare_packed(M.pack_token_ids([1, 2, 3]), {"max_new_tokens": 2, "temperature": 0})
    stream = RequestStream()
    eng.enqueue(prepared, stream)
    got = eng._wait(prepared.request_id, stream, prepared.prompt_ids, prepared.params)
    assert got.token_ids == eng.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0}).token_ids


def test_the_server_side_imports_the_tokenizer_classes_before_the_engine_is_ready():
    """ProcessEngine.start's ready() imports what unpickling the engine's tokenizer needs while the engine may still
    be building; in a fresh process that is transformers' tokenizer base module, without its auto classes (whose
    import costs seconds on some installs), and the pickled tokenizer then loads without further transformers
    imports of note."""
    import subprocess
    import sys

    probe = ("import sys; from prefixrt.engine.process.client import import_tokenizer_classes; "
             "assert 'transformers' not in sys.modules; import_tokenizer_classes(); "
             "print('transformers.tokenization_utils_tokenizers' in sys.modules, "
             "'transformers.models.auto.auto_factory' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


def test_packed_ids_are_prepared_as_their_list_is(make_engine):
    """A PackedIds prompt (the server's StrictInt ids, packed once) gets the same checks, errors and prepared
    request as the plain list, and the engine takes it without copying or scanning its types again."""
    eng = make_engine()
    prompts, params = _checked_cases(eng)
    for ids in prompts:
        packed = M.PackedIds.of(ids)
        assert type(packed) is M.PackedIds and packed == ids and packed.packed == M.pack_token_ids(ids)
        for p in params:
            assert _verdict(eng.prepare, packed, p) == _verdict(eng.prepare, ids, p), (ids[:5], p)
    packed = M.PackedIds.of([1, 2, 3])
    assert eng.encode(packed) is packed  # trusted: no copy, no second scan
    assert M.token_id_range(packed) == (1, 3) == M.token_id_range([1, 2, 3])
    greedy = {"max_new_tokens": 3, "temperature": 0}
    assert eng.generate(packed, greedy).token_ids == eng.generate([1, 2, 3], greedy).token_ids


@pytest.mark.parametrize("ids", [[2**31], [1, 2.0], [1, "2"]])
def test_ids_that_cannot_be_packed_stay_a_plain_list(ids):
    """PackedIds.of leaves them as they are, so the engine's own checks name the problem."""
    assert M.PackedIds.of(ids) is ids


def test_packed_ids_survive_pickling():
    packed = M.PackedIds.of([5, 6, 7])
    back = pickle.loads(pickle.dumps(packed))
    assert type(back) is M.PackedIds and back == [5, 6, 7] and back.packed == packed.packed
