"""SaltCounters: cache counters per cache_salt under a bounded set of labels.

A salt is often a tenant or user id: it is never exported as is. Its label is `salt-` + the first 12 hex digits
of its SHA-256 ("none" for requests without a salt); the first MAX_LABELS salts seen get their own label,
every later one counts under "other". So the label set (Prometheus series, stats() keys) and this object's
memory stay bounded however many salts arrive, and a salt's label never changes (counters stay monotonic).
"""

from __future__ import annotations

import hashlib
from typing import Any

MAX_LABELS = 32
OTHER = "other"
COUNTERS = ("prompt_tokens_total", "cached_tokens_total", "evicted_tokens_total")


class SaltCounters:
    def __init__(self, max_labels: int = MAX_LABELS):
        self.max_labels = max_labels
        self._labels: dict[Any, str] = {}  # at most max_labels entries
        self._counts: dict[str, dict[str, int]] = {}

    def label(self, salt: Any) -> str:
        lab = self._labels.get(salt)
        if lab is None:
            if len(self._labels) >= self.max_labels:
                return OTHER
            lab = "none" if salt is None else "salt-" + hashlib.sha256(str(salt).encode()).hexdigest()[:12]
            self._labels[salt] = lab
        return lab

    def add(self, salt: Any, counter: str, n: int) -> None:
        if n:
            c = self._counts.setdefault(self.label(salt), dict.fromkeys(COUNTERS, 0))
            c[counter] += n

    def snapshot(self, resident: dict[Any, int]) -> dict[str, dict[str, int]]:
        """label -> the counters and `kv_cached_tokens` (pool tokens cached now, from `resident`: salt ->
        tokens)."""
        out = {lab: {**c, "kv_cached_tokens": 0} for lab, c in self._counts.items()}
        for salt, tokens in resident.items():
            if tokens:
                entry = out.setdefault(self.label(salt), {**dict.fromkeys(COUNTERS, 0), "kv_cached_tokens": 0})
                entry["kv_cached_tokens"] += tokens
        return out
