"""The dashboard: `GET /dashboard` (one self-contained HTML page) and `GET /dashboard/data` (the JSON it polls).

Both are admin routes (admission.py gates everything under /dashboard like /stats). The data comes from the
engine through the same calls as /stats and /metrics, so it crosses to the engine process like they do:
`engine.stats()` for counters and gauges, the engine's Prometheus text (rendered where the latency
histograms are observed) for TTFT / ITL / end-to-end percentiles and finish reasons, and
`engine.largest_prefixes()` for the radix tree. Percentiles are estimated from histogram buckets by linear
interpolation inside a bucket (as Prometheus' histogram_quantile does), over all requests and over the last
WINDOW_S seconds (the difference from the newest bucket snapshot at least WINDOW_S old). The server keeps a short history of
samples, one per poll at most every second, so cache hit rate over time survives a page reload.
The page has no external scripts, styles or fonts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from importlib.resources import files

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse

from prefixrt.server.sse import JSON

__all__ = ["router", "histogram_quantile", "parse_histograms", "DashboardHistory"]

WINDOW_S = 60.0
HISTORY_LEN = 300
QUANTILES = (0.5, 0.9, 0.99)
_HISTOGRAMS = {"ttft": "prefixrt_time_to_first_token_seconds", "itl": "prefixrt_inter_token_latency_seconds",
               "e2e": "prefixrt_e2e_request_latency_seconds"}
PREVIEW_TOKENS = 12

router = APIRouter()


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as cumulative (upper bound, count) pairs sorted by bound, the last
    bound +inf. Linear inside the bucket that holds the rank; the lowest bucket starts at 0; a rank in the
    +inf bucket gives the highest finite bound. None when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > prev_count:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def parse_histograms(text: str) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """Prometheus text -> ({"ttft" | "itl" | "e2e": cumulative buckets}, {finish_reason: finished count})."""
    from prometheus_client.parser import text_string_to_metric_families

    hists: dict[str, list[tuple[float, float]]] = {}
    finished: dict[str, float] = {}
    wanted = {v: k for k, v in _HISTOGRAMS.items()}
    for fam in text_string_to_metric_families(text):
        if fam.name in wanted:
            b = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")]
            hists[wanted[fam.name]] = sorted(b)
        elif fam.name == "prefixrt_request_finished":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    finished[s.labels.get("finish_reason", "unknown")] = s.value
    return hists, finished


def _quantiles(buckets: list[tuple[float, float]]) -> dict:
    out = {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}
    out["count"] = int(buckets[-1][1]) if buckets else 0
    return out


def _minus(now: list[tuple[float, float]], then: list[tuple[float, float]]) -> list[tuple[float, float]]:
    old = dict(then)
    return [(b, c - old.get(b, 0.0)) for b, c in now]


class DashboardHistory:
    """Samples of the engine's counters, one per `add` at most every `min_interval_s`, HISTORY_LEN kept."""

    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self.samples: deque[dict] = deque(maxlen=HISTORY_LEN)
        self.lock = threading.Lock()

    def add(self, now: float, stats: dict, hists: dict) -> None:
        with self.lock:
            last = self.samples[-1] if self.samples else None
            if last is not None and now - last["t"] < self.min_interval_s:
                return
            d_prompt = stats["prompt_tokens_total"] - (last["prompt_tokens_total"] if last else 0)
            d_cached = stats["cached_tokens_total"] - (last["cached_tokens_total"] if last else 0)
            self.samples.append({
                "t": now, "prompt_tokens_total": stats["prompt_tokens_total"],
                "cached_tokens_total": stats["cached_tokens_total"],
                "hit_rate": d_cached / d_prompt if d_prompt > 0 else None,  # over the interval since the last
                "cumulative_hit_rate": stats["cache_hit_rate"], "requests_total": stats["requests_total"],
                "requests_waiting": stats["requests_waiting"], "requests_running": stats["requests_running"],
                "evicted_tokens_total": stats["evicted_tokens_total"],
                "kv_used": stats["kv_total"] - stats["kv_free"], "hists": hists})

    def window_start(self, now: float) -> dict | None:
        """The newest sample at least WINDOW_S old (the window's baseline); None while there is none, so the
        window then covers everything since the server started."""
        with self.lock:
            older = [s for s in self.samples if now - s["t"] >= WINDOW_S]
        return older[-1] if older else None

    def series(self) -> list[dict]:
        with self.lock:
            return [{k: v for k, v in s.items() if k != "hists"} for s in self.samples]


def _preview(engine, tree: list[dict]) -> None:
    """Add "preview" (the decoded head of each node's tokens) in place."""
    tok = getattr(engine, "tokenizer", None)
    lock = getattr(engine, "tokenizer_lock", None)

    def walk(nodes):
        for n in nodes:
            if "head" in n and tok is not None:
                try:
                    if lock is not None:
                        with lock:
                            text = tok.decode(n["head"])
                    else:
                        text = tok.decode(n["head"])
                except Exception:  # a display aid: an undecodable head shows its ids
                    text = None
                n["preview"] = text + ("…" if n["tokens"] > len(n["head"]) and text is not None else "") \
                    if text is not None else None
            walk(n["children"])

    walk(tree)


def collect(engine, render_metrics, history: DashboardHistory) -> dict:
    """One /dashboard/data snapshot (blocking: run it off the event loop)."""
    stats = engine.stats().to_dict()
    try:
        hists, finished = parse_histograms(render_metrics().decode())
    except Exception:  # no prometheus-client: the page shows no latencies
        hists, finished = {}, {}
    now = time.time()
    history.add(now, stats, hists)
    start = history.window_start(now)
    latency = {}
    for key in _HISTOGRAMS:
        b = hists.get(key, [])
        then = (start or {}).get("hists", {}).get(key)
        latency[key] = {"total": _quantiles(b), "window": _quantiles(_minus(b, then) if then else b)}
    fn = getattr(engine, "largest_prefixes", None)
    tree = fn() if fn is not None else []
    _preview(engine, tree)
    n_finished = sum(finished.values())
    aborted = finished.get("abort", 0.0)
    return {
        "time": now, "window_s": WINDOW_S, "model": getattr(engine, "model_name", None), "stats": stats,
        "kv": {"total": stats["kv_total"], "used": stats["kv_total"] - stats["kv_free"],
               "locked": stats["kv_locked"], "evictable": stats["kv_evictable"], "free": stats["kv_free"]},
        "latency": latency,
        "finished": {"by_reason": {k: int(v) for k, v in finished.items()}, "total": int(n_finished),
                     "aborted": int(aborted), "error_rate": aborted / n_finished if n_finished else 0.0},
        "history": history.series(), "prefixes": tree,
    }


def _history(request: Request) -> DashboardHistory:
    state = request.app.state
    if getattr(state, "dashboard_history", None) is None:
        state.dashboard_history = DashboardHistory()
    return state.dashboard_history


@router.get("/dashboard")
async def dashboard_page():
    return HTMLResponse(files("prefixrt.server").joinpath("dashboard.html").read_text(encoding="utf-8"))


@router.get("/dashboard/data")
async def dashboard_data(request: Request):
    state = request.app.state
    data = await run_in_threadpool(collect, state.engine, state.render_metrics, _history(request))
    return JSON(data)
