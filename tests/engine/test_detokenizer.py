"""The detokenizer worker on hand-built requests: text deltas equal the tokenizer's own decode, stop strings cut
the text exactly where they start (across token boundaries, held back while they may still complete), the loop
is told, and nothing after a request's final output is delivered."""

from __future__ import annotations

import threading

import pytest

from prefixrt.engine.detokenizer import DetokenizerWorker, DetokState
from prefixrt.engine.stream import RequestStream, StepOutput

TEXT = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine."


class _Req:  # stands in for prefixrt.request.Req: the worker only hands it back
    pass


def _worker(tok):
    return DetokenizerWorker(tok, threading.Lock(), deliver=None)


def _out(ids, finished=False, reason=None, matched=None, logprobs=None):
    return StepOutput(index=0, token_ids=list(ids), text=None, finished=finished, finish_reason=reason,
                      matched_stop=matched, logprobs=logprobs)


def _run(worker, st, ids, per_step=1, batched=False, last_reason="length"):
    """Feed ids in steps of per_step tokens; returns the delivered outputs."""
    steps = [ids[i:i + per_step] for i in range(0, len(ids), per_step)]
    items = [(st, "sink", _out(s, finished=k == len(steps) - 1, reason=last_reason if k == len(steps) - 1 else None))
             for k, s in enumerate(steps)]
    if batched:
        return [o for _, o in worker.process(items)]
    return [o for item in items for _, o in worker.process([item])]


@pytest.mark.parametrize("per_step, batched", [(1, False), (3, False), (1, True), (2, True)])
def test_text_deltas_equal_the_tokenizer_decode(tiny_tokenizer, per_step, batched):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    w = _worker(tiny_tokenizer)
    st = DetokState(_Req(), None, True, True)
    outs = _run(w, st, ids, per_step, batched)
    assert "".join(o.text for o in outs) == tiny_tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert outs[-1].final_text == TEXT and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.token_ids] == ids
    assert w.take_stopped() == []


@pytest.mark.parametrize("stop", ["quick b", "k br", "s ov", "dog.", "nine."])
@pytest.mark.parametrize("per_step, batched", [(1, False), (2, True)])
def test_stop_string_cuts_text_and_tells_the_loop(tiny_tokenizer, stop, per_step, batched):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    w = _worker(tiny_tokenizer)
    req = _Req()
    st = DetokState(req, [stop, "\x00never"], True, True)
    outs = _run(w, st, ids, per_step, batched)
    cut = TEXT.index(stop)
    assert "".join(o.text for o in outs) == TEXT[:cut]
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.matched_stop == stop
    assert last.final_text == TEXT[:cut]
    assert all(not o.finished for o in outs[:-1])
    assert w.take_stopped() == [req] and w.take_stopped() == []
    # Tokens end with the step whose text completed the stop: none after it is streamed.
    streamed = [t for o in outs for t in o.token_ids]
    assert streamed == ids[: len(streamed)]
    before = tiny_tokenizer.decode(streamed[: len(streamed) - len(last.token_ids)])
    assert stop not in before and stop in tiny_tokenizer.decode(streamed)
    # Streamed text never included the stop's first characters before the stop was certain.
    acc = ""
    for o in outs[:-1]:
        acc += o.text
        assert len(acc) <= cut


def test_stop_token_is_not_text_and_final_after_stop_is_dropped(tiny_tokenizer):
    ids = tiny_tokenizer.encode("A stitch in time", add_special_tokens=False)
    eos = tiny_tokenizer.eos_token_id
    w = _worker(tiny_tokenizer)
    st = DetokState(_Req(), None, False, True)
    outs = [o for _, o in w.process([(st, "s", _out(ids[:2])), (st, "s", _out(ids[2:] + [eos], True, "stop", eos))])]
    assert "".join(o.text for o in outs) == "A stitch in time"
    assert outs[-1].matched_stop == eos
    assert w.process([(st, "s", _out([5], True, "abort"))]) == []  # after the final output: dropped

    # A stop string found, then the loop's own outputs for the same request are dropped.
    st2 = DetokState(_Req(), ["stitch"], True, True)
    got = w.process([(st2, "s", _out(ids)), (st2, "s", _out([7])), (st2, "s", _out([], True, "stop"))])
    assert len(got) == 1 and got[0][1].finish_reason == "stop" and got[0][1].text == "A "


def test_logprob_strings_and_passthrough(tiny_tokenizer):
    ids = tiny_tokenizer.encode("quick brown", add_special_tokens=False)
    lps = [{"token_id": t, "token": None, "logprob": -0.5,
            "top_logprobs": [{"token_id": t, "token": None, "logprob": -0.5},
                             {"token_id": 3, "token": None, "logprob": -1.0}]} for t in ids]
    w = _worker(tiny_tokenizer)
    st = DetokState(_Req(), None, True, False)  # logprobs only: no text
    (_, out), = w.process([(st, "s", _out(ids, logprobs=lps))])
    assert out.text is None
    assert [e["token"] for e in out.logprobs] == [tiny_tokenizer.decode([t]) for t in ids]
    assert out.logprobs[0]["top_logprobs"][1]["token"] == tiny_tokenizer.decode([3])
    raw = _out([4, 5])
    assert w.process([(None, "s", raw)]) == [("s", raw)]  # no state: delivered untouched


def test_worker_thread_delivers_in_order(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    stream = RequestStream()
    w = DetokenizerWorker(tiny_tokenizer, threading.Lock(), RequestStream.push_many).start()
    st = DetokState(_Req(), None, True, True)
    for i, t in enumerate(ids):
        w.submit([(st, stream, _out([t], i == len(ids) - 1, "length" if i == len(ids) - 1 else None))])
    w.close()
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(stream.get(timeout=10))
    assert "".join(o.text for o in outs) == TEXT


def test_a_small_step_on_an_idle_worker_is_delivered_on_the_loop_thread(tiny_tokenizer):
    """No hand-off for a lone request's token (the worker's wake-up is what its first token would wait for); a
    larger step still goes to the worker thread; order holds either way."""
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    where, got = [], []

    def deliver(pairs):
        where.append(threading.current_thread() is threading.main_thread())
        got.extend(out for _, out in pairs)

    w = DetokenizerWorker(tiny_tokenizer, threading.Lock(), deliver).start()
    st = DetokState(_Req(), None, True, True)
    w.submit([(st, "s", _out(ids[:1]))])
    assert where == [True] and got[0].text  # delivered before submit returned, on this thread
    big = [(DetokState(_Req(), None, True, True), "s", _out([t])) for t in ids[1:1 + w.INLINE_MAX + 1]]
    w.submit(big)
    w.close()
    assert where == [True, False] and len(got) == 1 + len(big)
