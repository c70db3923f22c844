"""Detokenization off the scheduler loop: token ids -> text deltas, stop strings, logprob token strings.

The loop streams token ids only. Each step's outputs go to the DetokenizerWorker (a thread), which decodes every
request of the step in one batched tokenizer call, searches stop strings, fills logprob token strings, and then
delivers the outputs to their streams. A stop string ends the request's stream as soon as it appears; the worker
then tells the loop (take_stopped), which finishes the request at its next step: the few tokens computed meanwhile
are discarded, never streamed. Ordering: outputs of one request are delivered in the order the loop produced
them; the worker drops everything a request sends after its final output.

Incremental decoding uses the prefix/read offset method: decode a small window twice and emit only the stable
difference, so a multi-byte character or a word-piece merge is never split.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from prefixrt.engine.stream import StepOutput

log = logging.getLogger("prefixrt")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, lock=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.lock = lock

    def _decode(self, ids: list[int]) -> str:
        if self.lock is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, ids: list[int]) -> str:
        """ids: all output ids so far (growing). Returns the new stable text."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return delta
        return ""

    def flush(self, ids: list[int]) -> str:
        """Whatever is left at the end (a dangling partial character is emitted as-is)."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends at or after search_from. Returns (index, stop)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string: text a stream must
    hold back because a stop may still complete over it."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def batch_decode(tokenizer, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """tokenizer.decode of every sequence, in one call to the Rust tokenizer where that decodes the same."""
    fast = _fast_backend(tokenizer)
    if fast is not None:
        return fast.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]


def _fast_backend(tokenizer):
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer
    return None


class DetokState:
    """One sample's text state. Opened by the loop when the request is added (DetokenizerWorker.open, which keeps
    it by request); read and written only by the worker afterwards. `req` is handed back to the loop (take_stopped) and never read here."""

    def __init__(self, req: Any, stops: list[str] | None, skip_special_tokens: bool, detokenize: bool):
        self.req = req
        self.stops = list(stops or [])
        self.skip_special_tokens = skip_special_tokens
        self.detokenize = detokenize or bool(self.stops)
        self.ids: list[int] = []  # output ids so far
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # text so far (cut at the stop string once one matched)
        self.emitted = 0  # chars of text already streamed
        self.done = False  # the final output went out: drop anything later


class DetokenizerWorker:
    """The thread that turns the loop's token outputs into text outputs and delivers them.

    submit(items) takes one step's [(DetokState | None, sink, StepOutput)] from the loop (never waits on the worker);
    deliver(pairs) receives [(sink, StepOutput)] on the worker thread, or on the loop thread for a step of at most
    INLINE_MAX outputs while the worker has nothing queued; take_stopped() returns (to the loop) the
    requests a stop string finished since its last call. process(items) is the synchronous unit, also used by
    tests."""

    # submit() waits while more than this many steps are queued: streams lag the loop by a bounded number of
    # steps even when the loop thread holds the GIL most of the time.
    MAX_LAG_STEPS = 2
    # A step of at most this many outputs, submitted while the worker has nothing queued, is processed and delivered
    # on the submitting (loop) thread: handing it over costs more (the worker's wake-up, a GIL switch: ms on a busy
    # host) than detokenizing a few tokens, and it is what a lone request's first token waits for.
    INLINE_MAX = 4

    def __init__(self, tokenizer, lock: threading.Lock | None, deliver: Callable):
        self.tokenizer = tokenizer
        self.lock = lock or threading.Lock()
        self.deliver = deliver
        self._stopped: queue.SimpleQueue = queue.SimpleQueue()  # requests a stop string ended, for the loop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._queued = 0  # submissions not yet delivered
        self._cv = threading.Condition()
        # Each sample's text state, keyed by its Req: opened and dropped by the loop thread (the only thread that
        # touches this dict); the states themselves travel with the outputs to whichever thread processes them.
        self.states: dict[Any, DetokState] = {}

    def open(self, req: Any, stops: list[str] | None, skip_special_tokens: bool, detokenize: bool) -> None:
        """Loop thread: req's text state, from now until finished(req)."""
        self.states[req] = DetokState(req, stops, skip_special_tokens, detokenize)

    def finished(self, req: Any) -> None:
        """Loop thread: req finished; its outputs already carry its state, which goes with the last of them."""
        self.states.pop(req, None)

    def start(self) -> DetokenizerWorker:
        self._thread = threading.Thread(target=self._run, name="prefixrt-detokenizer", daemon=True)
        self._thread.start()
        return self

    def submit(self, items: list[tuple[DetokState | None, Any, StepOutput]]) -> None:
        if self._thread is not None and len(items) <= self.INLINE_MAX:
            with self._cv:
                idle = self._queued == 0  # everything submitted before is delivered: order holds
            if idle:  # (only the loop thread submits, so nothing is queued meanwhile)
                self.deliver(self.process(items))
                return
        with self._cv:
            if self._thread is not None:
                self._cv.wait_for(lambda: self._queued <= self.MAX_LAG_STEPS, timeout=1.0)
            self._queued += 1
        self._q.put(items)

    def take_stopped(self) -> list:
        """The requests a stop string ended since the last call (the loop finishes them; any thread)."""
        out = []
        while True:
            try:
                out.append(self._stopped.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued, then stop the thread."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            items = self._q.get()
            stop = items is None
            batch = [] if stop else list(items)
            taken = 0 if stop else 1
            while not stop:  # take everything queued: one batched decode for all of it
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.extend(more)
                    taken += 1
            if batch:
                try:
                    self.deliver(self.process(batch))
                except Exception:  # never let the worker die: the callers would wait forever
                    log.exception("detokenizer worker error")
            with self._cv:
                self._queued -= taken
                self._cv.notify_all()
            if stop:
                return

    # ------------------------------------------------------------------ the unit
    def process(self, items: list[tuple[DetokState | None, Any, StepOutput]]) -> list[tuple[Any, StepOutput]]:
        """Text, stop strings and logprob token strings for a batch of outputs (in order). Mutates the states;
        returns the outputs to deliver (those after a request's final one are dropped). Several steps of one
        request in the batch are taken in rounds, one output per request per round, in order."""
        # Requests without a text state (token ids only) pass straight through, in order.
        plain = [(sink, out) for st, sink, out in items if st is None]
        if len(plain) == len(items):
            return plain
        rounds: list[list] = []
        seen: dict[int, int] = {}
        for item in items:
            if item[0] is None:
                continue
            k = seen.get(id(item[0]), 0)
            seen[id(item[0])] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(item)
        return plain + [pair for rnd in rounds for pair in self._process_round(rnd)]

    def _process_round(self, items: list[tuple[DetokState | None, Any, StepOutput]]) -> list[tuple[Any, StepOutput]]:
        live = []
        for st, sink, out in items:
            if st is not None and st.done:
                continue
            if st is not None:
                st.ids.extend(out.token_ids)
            live.append((st, sink, out))
        # 1. One batched decode per skip_special_tokens setting: two windows per request with new text.
        jobs: dict[bool, list] = {}
        for k, (st, _, out) in enumerate(live):
            if st is None or not st.detokenize:
                continue
            end = len(st.ids)
            if out.finished and isinstance(out.matched_stop, int) and out.token_ids:
                end -= 1  # a stop token is not part of the text
            jobs.setdefault(st.skip_special_tokens, []).append((k, end))
        deltas: dict[int, str] = {}
        with self.lock:
            for skip, ks in jobs.items():
                seqs = []
                for k, end in ks:
                    st = live[k][0]
                    seqs.append(st.ids[st.prefix_offset : st.read_offset])
                    seqs.append(st.ids[st.prefix_offset : end])
                texts = batch_decode(self.tokenizer, seqs, skip)
                for j, (k, end) in enumerate(ks):
                    st, _, out = live[k]
                    prefix_text, new_text = texts[2 * j], texts[2 * j + 1]
                    longer = len(new_text) > len(prefix_text)
                    if out.finished:  # the rest, a dangling partial character included
                        deltas[k] = new_text[len(prefix_text):] if longer else ""
                        st.prefix_offset = st.read_offset = end
                    elif longer and not new_text.endswith("\ufffd"):
                        deltas[k] = new_text[len(prefix_text):]
                        st.prefix_offset, st.read_offset = st.read_offset, end
            strings = self._token_strings([out for st, _, out in live if st is not None and out.logprobs])
        # 2. Stop strings, holdback, final text.
        result = []
        for k, (st, sink, out) in enumerate(live):
            if st is None:
                result.append((sink, out))
                continue
            # The outputs are this pipeline's own (the loop never reads them again): fields are set in place,
            # which costs far less per request and step than dataclasses.replace.
            if out.logprobs:
                out.logprobs = [_with_strings(e, strings) for e in out.logprobs]
            if st.detokenize:
                before = len(st.text)
                st.text += deltas.get(k, "")
                hit = find_stop(st.text, st.stops, before) if st.stops else None
                if hit is not None:
                    st.text = st.text[: hit[0]]
                    out.finished, out.finish_reason, out.matched_stop = True, "stop", hit[1]
                    self._stopped.put(st.req)
                upto = len(st.text) if out.finished else len(st.text) - stop_holdback(st.text, st.stops)
                text = st.text[st.emitted:upto] if upto > st.emitted else ""
                st.emitted = max(st.emitted, upto)
                out.text, out.final_text = text, (st.text if out.finished else None)
            st.done = out.finished
            result.append((sink, out))
        return result

    def _token_strings(self, outs: list[StepOutput]) -> dict[int, str]:
        ids = sorted({e2["token_id"] for out in outs for e in out.logprobs
                      for e2 in [e, *e["top_logprobs"]] if e2["token"] is None})
        if not ids:
            return {}
        return dict(zip(ids, batch_decode(self.tokenizer, [[t] for t in ids], False)))


def _with_strings(entry: dict, strings: dict[int, str]) -> dict:
    if entry["token"] is not None:
        return entry
    return {**entry, "token": strings[entry["token_id"]],
            "top_logprobs": [{**t, "token": strings[t["token_id"]]} if t["token"] is None else t
                             for t in entry["top_logprobs"]]}
