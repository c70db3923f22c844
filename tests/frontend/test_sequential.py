"""backend.parallel=False (the "no frontend parallelism" ablation): a program's model calls, its forks' included,
are issued one at a time, with the same results; programs of a run_batch still run side by side."""

from __future__ import annotations

import threading
import time

from prefixrt.frontend import ProgramBackend, function, gen, select
from prefixrt.frontend.backend import GenResult, SelectResult


class SlowBackend(ProgramBackend):
    """Answers every gen with "x" after a short sleep; records the most calls in flight at once (overall and
    per program, by the text the program starts with)."""

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.hints = 0

    def _call(self, ctx):
        key = self.render(ctx)[:4]
        with self._lock:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self.in_flight[key])
        time.sleep(0.02)
        with self._lock:
            self.in_flight[key] -= 1

    def generate(self, ctx, args):
        self._call(ctx)
        return GenResult("x", finish_reason="stop")

    def select(self, ctx, choices, method=None):
        self._call(ctx)
        return SelectResult(choices[0], {c: 0.0 for c in choices}, "fake")

    def cache_prefix(self, ctx):
        self._call(ctx)
        self.hints += 1
        return 0


@function
def forked(s, tag: str):
    s += f"{tag} question\n"
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"branch {i}:" + gen("a", max_tokens=2) + select("c", ["y", "n"])
    forks.join()
    s += "done" + gen("final", max_tokens=2)


def _run(parallel: bool):
    be = SlowBackend(parallel)
    states = forked.run_batch([{"tag": "p00" + str(i)} for i in range(3)], backend=be, num_threads=3)
    return be, states


def test_calls_of_one_program_run_one_at_a_time():
    seq, seq_states = _run(parallel=False)
    par, par_states = _run(parallel=True)
    assert set(seq.peak) == {"p000", "p001", "p002"}
    assert max(seq.peak.values()) == 1, seq.peak
    assert max(par.peak.values()) > 1, "the parallel run was meant to overlap a program's branches"
    assert [s.text() for s in seq_states] == [s.text() for s in par_states]
    assert seq.hints == par.hints == 3, "the fork's prefix hint is still sent (before the branches)"


def test_programs_of_a_batch_still_overlap():
    be = SlowBackend(parallel=False)
    started = threading.Barrier(3, timeout=5)

    @function
    def one(s, tag: str):
        started.wait()  # all three programs are running at once
        s += f"{tag} q" + gen("a", max_tokens=1)

    states = one.run_batch([{"tag": f"q00{i}"} for i in range(3)], backend=be, num_threads=3)
    assert [s["a"] for s in states] == ["x"] * 3
