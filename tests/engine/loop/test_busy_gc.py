"""BusyGC: the cyclic collector is off while any engine loop is busy, back on (after one young pass) when the last
goes idle, left alone where it was already off, and a long busy stretch still collects."""

from __future__ import annotations

import gc

import pytest

from prefixrt.engine.loop.busy_gc import BusyGC


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_off_while_any_loop_is_busy():
    a, b = BusyGC(), BusyGC()
    a.busy()
    assert not gc.isenabled()
    b.busy()
    a.idle()
    assert not gc.isenabled()  # b still works
    b.busy()  # every step
    b.idle()
    assert gc.isenabled()
    assert b.collections == 1 and a.collections == 0
    a.idle()  # idle twice: no effect
    assert gc.isenabled()


def test_cyclic_garbage_is_collected_when_idle():
    loop = BusyGC()
    loop.busy()

    class Node:
        pass

    n = Node()
    n.self = n  # a cycle: only the collector frees it
    before = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
    del n
    loop.idle()
    assert not any(type(o) is Node for o in gc.get_objects())
    assert before >= 1


def test_long_busy_stretch_collects_and_disabled_collector_stays_off():
    loop = BusyGC()
    loop.max_busy_s = 0.0
    loop.busy()
    loop.busy()
    assert loop.collections == 1 and not gc.isenabled()
    loop.idle()
    gc.disable()
    other = BusyGC()
    other.busy()
    other.idle()
    assert not gc.isenabled()  # it was off before: left off
    off = BusyGC(enabled=False)
    gc.enable()
    off.busy()
    assert gc.isenabled()
