"""What the probes of engine/probes.py yield: UnitTimes (loop unit times and per-call records), ForwardLog (one
row per forward), MaskTimes (grammar mask work), HeldLoop (a loop held between steps), and the CUDA-event clock
their device times are read on. Plain containers, filled by the probes while their context is open."""

from __future__ import annotations

import time


class DeviceClock:
    """CUDA events on a common origin (an event recorded when the clock is made); inert on the CPU."""

    def __init__(self, cuda: bool):
        import torch

        self._torch = torch if cuda else None
        self._origin = self.mark()

    def mark(self):
        if self._torch is None:
            return None
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def fill(self, row: dict) -> None:
        """Replace row's `_events` (start, end) by device_start_ms / device_end_ms / device_ms (after a sync)."""
        a, b = row.pop("_events")
        if a is None:
            row["device_start_ms"] = row["device_end_ms"] = row["device_ms"] = None
            return
        row["device_start_ms"] = self._origin.elapsed_time(a)
        row["device_end_ms"] = self._origin.elapsed_time(b)
        row["device_ms"] = a.elapsed_time(b)

    def sync(self) -> None:
        if self._torch is not None:
            self._torch.cuda.synchronize()


class UnitTimes:
    """What time_units() saw: `seconds[unit]` and `calls[unit]` per unit, `seconds["wait"]` (the host's waits at
    step fences, inside process) when asked for, and with record_calls `records`: one dict per call, in call order,
    `unit`, `start`/`end` (time.perf_counter), `wall_s`, `cpu_s` (the calling thread's CPU time), `extend_rows` /
    `decode_rows` (the batch's rows feeding more than one token / one token; 0 when the call had no batch) and,
    with device_events, `device_start_ms`, `device_end_ms`, `device_ms`."""

    def __init__(self, units: tuple[str, ...], fence_wait: bool, record_calls: bool):
        self.units = units
        self.seconds = dict.fromkeys(units + (("wait",) if fence_wait else ()), 0.0)
        self.calls = dict.fromkeys(units, 0)
        self.records: list[dict] | None = [] if record_calls else None

    def per_step_ms(self, steps: int) -> dict:
        """Milliseconds per step of each unit and of the fence wait, and `host_ms`: the units' sum less the wait."""
        out = {k: round(v / steps * 1000, 3) for k, v in self.seconds.items()}
        out["host_ms"] = round(sum(self.seconds[u] for u in self.units) / steps * 1000 - out.get("wait", 0.0), 3)
        return out


class MaskTimes:
    """Grammar mask work while its time_masks() context was open: `fill_s` (the backend's native fill, on the mask
    worker), `finish_s` (its Python part, at the draw on the loop thread), `fills` (calls) and `rows` (rows filled)."""

    def __init__(self):
        self.fill_s = self.finish_s = 0.0
        self.fills = self.rows = 0


class ForwardLog:
    """One row per forward while its log_forwards() context was open: `kind` (how it ran: decode / cascade / extend
    / verify graph, or eager), `tokens`, `seqs`, `start` (time.perf_counter at launch), `wall_ms` (launch to the
    next launch; None for the last) and `device_start_ms`, `device_end_ms`, `device_ms` (None on the CPU)."""

    def __init__(self):
        self.rows: list[dict] = []

    def summary(self) -> list[dict]:
        """The rows grouped by kind and by token count (rounded up to a power of two): count and means."""
        groups: dict = {}
        for r in self.rows:
            b = 1 << max(0, (r["tokens"] - 1)).bit_length()
            groups.setdefault((r["kind"], b), []).append(r)
        out = []
        for (kind, b), rs in sorted(groups.items()):
            walls = [r["wall_ms"] for r in rs if r["wall_ms"] is not None]
            out.append({"kind": kind, "tokens_le": b, "count": len(rs),
                        "mean_tokens": round(sum(r["tokens"] for r in rs) / len(rs), 1),
                        "mean_seqs": round(sum(r["seqs"] for r in rs) / len(rs), 1),
                        "device_ms": round(sum(r["device_ms"] or 0.0 for r in rs) / len(rs), 3),
                        "wall_ms": round(sum(walls) / len(walls), 3) if walls else None})
        return out


class HeldLoop:
    """The loop held between two steps by EngineProbes.hold_loop(): requests submitted meanwhile wait in the inbox
    and reach the loop together when the hold ends."""

    def __init__(self, engine):  # an Engine (engine/engine.py, which imports this module)
        self._engine = engine

    def wait_queued(self, count: int, timeout: float = 60.0) -> bool:
        """Wait until `count` messages (one per submitted request) wait for the loop; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._engine._inbox.qsize() < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


def batch_rows(out, args) -> dict:
    """The composition of the batch a unit call returned or was given (a ScheduledBatch, or a Step holding one)."""
    for x in (out, *args):
        batch = getattr(x, "batch", x)
        num_tokens = getattr(batch, "num_tokens", None)
        if num_tokens is not None:
            extend = sum(1 for n in num_tokens if n > 1)
            return {"extend_rows": extend, "decode_rows": len(num_tokens) - extend}
    return {"extend_rows": 0, "decode_rows": 0}
