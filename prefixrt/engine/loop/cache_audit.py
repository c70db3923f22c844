"""CacheAuditor: checks sampled cache hits for silent K/V corruption by recomputing the hit prefix.

A prefix cache fails not by crashing but by serving wrong K/V at rare rates (a slot reused while still being
written, a load read before it was ready). For a fraction `rate` of cache hits, the auditor locks the
matched radix path at admission (so eviction cannot take or reuse its slots), and later, off the critical
path, recomputes the same tokens' K/V with a plain forward into scratch slots and compares them, layer by
layer, with what the cache holds. Mismatches are counted and logged with the radix node that holds them.

When audits run (EngineCore.step calls `run`): after a step's outputs are delivered and the scheduler has no
work left, or, on a loop that never idles, the oldest ones while more than `max_pending` are queued — never
inside a step, so the step that uses a hit is never delayed (the next step may be, by one prefix forward per
audit: at production rates such as 0.001 that is rare). An audit needs pages for its scratch copy (evicting
unlocked LRU cache if no page is free) and a free table row; when it cannot get them it is dropped (counted
in `skipped_total`).

Tolerance: the recompute feeds the prefix in chunks of `chunk_tokens` tokens from position 0, which need not
match how the cached copy was computed (other chunking, other batch neighbours), so values agree only to
rounding: a token mismatches when max |cached - recomputed| over its heads and dims exceeds `tolerance`
times the layer's largest recomputed magnitude (NaN always mismatches). Defaults per pool dtype:
TOLERANCE.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from prefixrt.cache.allocator import pages_to_slots
from prefixrt.model.forward_batch import ForwardBatch

log = logging.getLogger("prefixrt")

# Relative tolerance per pool dtype. fp32: the same tokens recomputed with other chunking differ by ~1e-6
# relative; half types round every K/V to 8 (bf16) or 11 (fp16) bits. A corrupted slot (stale, NaN, another
# token's K/V) differs by O(1).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 6e-2, torch.float16: 1e-2,
             # e4m3 codes: a recomputation rounding the other way moves a value by one e4m3 step, at most 32/448 of
             # the largest magnitude (a step in the top binade)
             torch.float8_e4m3fn: 0.08}


@dataclass
class _Audit:
    tokens: list[int]  # the hit prefix
    salt: Any
    slots: list[int]  # the cache's slots of those tokens (locked)
    handle: Any  # lock handle: the radix node where the hit ended
    rid: str


class CacheAuditor:
    def __init__(self, kv, runner, device: torch.device, rate: float, seed: int = 0, chunk_tokens: int = 8192,
                 max_pending: int = 4, tolerance: float | None = None):
        self.kv = kv
        self.runner = runner
        self.device = device
        self.rate = rate
        self.chunk_tokens = max(1, chunk_tokens)
        self.max_pending = max_pending
        self.tolerance = TOLERANCE.get(kv.pool.dtype, 1e-2) if tolerance is None else tolerance
        self._rng = random.Random(seed)
        self.pending: deque[_Audit] = deque()
        self.audits_total = 0
        self.mismatches_total = 0
        self.skipped_total = 0

    # ------------------------------------------------------------------ sampling hits (on admission)
    def on_hit(self, req) -> None:
        """Called once per request at its first admission, with req.cached_len tokens matched. Queues an
        audit of that prefix for a `rate` fraction of hits; locks the prefix until the audit ran."""
        n = req.cached_len
        if n == 0 or req.images is not None or req.adapter is not None or self._rng.random() >= self.rate:
            # (a prefix with images is not audited: the recompute has no image inputs; nor one under a LoRA adapter:
            # the adapter may leave its GPU slot before the audit runs)
            return
        cache = self.kv.cache
        m = cache.match_prefix(req.all_ids[:n], req.salt)
        if m.length != n:  # cannot happen right after admission; be safe rather than audit the wrong slots
            self.skipped_total += 1
            return
        handle = cache.lock(m)
        self.pending.append(_Audit(list(req.all_ids[:n]), req.salt, list(m.slots), handle, req.rid))

    # ------------------------------------------------------------------ running audits (between steps)
    def run(self, idle: bool) -> None:
        """Run queued audits: all of them when the loop is idle, else the oldest while more than
        max_pending are queued (each holds a lock on its prefix)."""
        ran = False
        while self.pending and (idle or len(self.pending) > self.max_pending):
            self._run_one(self.pending.popleft())
            ran = True
        if ran and idle:  # scratch pages may have moved cache to the host tier: nothing stays held when idle
            self.kv.reclaim(wait=True)

    def drop_all(self) -> None:
        """Forget queued audits (shutdown, flush): unlock their prefixes."""
        while self.pending:
            self.kv.cache.unlock(self.pending.popleft().handle)
            self.skipped_total += 1

    def _run_one(self, job: _Audit) -> None:
        kv = self.kv
        try:
            ps = kv.page_size
            n = len(job.tokens)
            num_pages = -(-n // ps)
            # Scratch pages may evict unlocked LRU cache (the audited prefix itself is locked).
            if kv.table.free_rows == 0 or not kv.ensure_pages(num_pages):
                self.skipped_total += 1
                return
            pages = kv.allocator.alloc(num_pages)
            row = kv.table.alloc_row()
            try:
                scratch = pages_to_slots(pages, ps)[:n]
                self._recompute(job.tokens, scratch, row)
                bad = self._compare(job.slots, scratch)
            finally:
                kv.table.free_row(row)
                kv.free_pages(pages)  # poisoned in debug mode, like any freed page
            self.audits_total += 1
            if bad is not None:
                self.mismatches_total += 1
                layer, pos, err = bad
                log.error("cache audit mismatch: radix node %s (salt %r), token %d (slot %d) of a %d-token "
                          "hit of request %s, layer %d: relative error %.3g",
                          _node_covering(job.handle, pos, n), job.salt, pos, job.slots[pos], n, job.rid,
                          layer, err)
        finally:
            kv.cache.unlock(job.handle)

    def _recompute(self, tokens: list[int], scratch: list[int], row: int) -> None:
        """Forward tokens from position 0 in chunks, writing their K/V to the scratch slots."""
        table = self.kv.table
        table.write(row, 0, scratch)
        for start in range(0, len(tokens), self.chunk_tokens):
            chunk = tokens[start : start + self.chunk_tokens]
            table.flush()
            fb = ForwardBatch.build(
                req_pool_indices=[row], prefix_lens=[start], extend_tokens=[chunk],
                out_cache_loc=scratch[start : start + len(chunk)], req_to_token=table.table,
                logits_indices=[len(chunk) - 1], device=self.device,
            )
            self.runner.forward(fb)

    def _compare(self, cached_slots: list[int], scratch: list[int]) -> tuple[int, int, float] | None:
        """(layer, token position, relative error) of the first mismatch, or None."""
        pool = self.kv.pool
        ready = self.kv.tiers.load_waiter()  # host-tier loads into the cached slots may still be in flight
        if ready is not None:
            ready.wait_all()
        a_idx = torch.tensor(cached_slots, device=pool.device)
        b_idx = torch.tensor(scratch, device=pool.device)
        for layer in range(pool.num_layers):
            for buf in (pool.k_buffers[layer], pool.v_buffers[layer]):
                cached, fresh = buf[a_idx].float(), buf[b_idx].float()  # [n, heads, dim]
                scale = fresh.abs().amax().clamp_min(1e-6)
                err = (cached - fresh).abs().amax(dim=(1, 2)) / scale  # [n]
                bad = ~(err <= self.tolerance)  # NaN counts as bad
                if bool(bad.any()):
                    pos = int(bad.nonzero()[0, 0])
                    return layer, pos, float(err[pos])
        return None


def _node_covering(handle, pos: int, length: int) -> str:
    """'#id [start, end)' of the radix node on the hit path holding token pos (duck-typed radix nodes)."""
    node, end = handle, length
    while node is not None and getattr(node, "parent", None) is not None:
        start = end - len(node.key)
        if start <= pos < end:
            return f"#{node.id} [{start}, {end})"
        node, end = node.parent, start
    return repr(handle)
