"""StageClock charges each second to the innermost running stage: stages never overlap, a repeated name adds up,
and what no stage covers is `other`. Time is faked, so every figure is exact."""

from __future__ import annotations

import pytest

from prefixrt import stage_clock
from prefixrt.stage_clock import StageClock


@pytest.fixture
def now(monkeypatch):
    t = [100.0]
    monkeypatch.setattr(stage_clock.time, "perf_counter", lambda: t[0])
    return t


def test_nested_stages_are_charged_exclusively(now):
    clock = StageClock()
    now[0] += 1  # before any stage: other
    with clock.stage("resolve"):
        now[0] += 2
        with clock.stage("convert"):
            now[0] += 10
            with clock.stage("write shards"):
                now[0] += 3
            now[0] += 1
        now[0] += 0.5
    with clock.stage("load"):
        now[0] += 4
    with clock.stage("convert"):  # a name timed twice adds up
        now[0] += 2
    now[0] += 0.5
    assert clock.seconds == {"resolve": 2.5, "convert": 13.0, "write shards": 3.0, "load": 4.0}
    assert list(clock.seconds) == ["resolve", "convert", "write shards", "load"]  # the order stages first ran
    assert clock.total() == 24.0 and clock.named() == 22.5
    assert clock.summary() == ("24.0s: resolve 2.5s, convert 13.0s, write shards 3.0s, load 4.0s, other 1.5s "
                               "(94% named)")


def test_a_stage_that_raises_keeps_its_seconds_and_closes(now):
    clock = StageClock()
    with pytest.raises(RuntimeError), clock.stage("outer"):
        now[0] += 1
        with clock.stage("inner"):
            now[0] += 2
            raise RuntimeError("boom")
    now[0] += 5  # after both closed: charged to no stage
    assert clock.seconds == {"outer": 1.0, "inner": 2.0}
    assert clock.summary().endswith("other 5.0s (38% named)")
