"""DiskTieredRadixCache: the two-tier radix tree (tiered_radix.py) with a disk tier below the host tier.

Where K/V goes: pool -> host (GPU eviction) -> disk (host eviction), and back disk -> host -> pool: a request
whose match ends where a disk segment begins has the segment read off the loop (DiskKVStore's worker), then
attached to the tree as host-only nodes, then loaded to the pool by the host tier's load-back at admission (its
forward waits per layer, as for any host hit). Invariants, on top of TieredRadixCache's:
- Lifetimes: a host copy leaving the tier for the disk keeps its host slots until it is snapshotted (copied
  into the write queue's own tensors). The snapshot waits for a transfer marker issued when the copy left, so
  every copy into those slots (the backup that filled them) is done first; only then do the slots return to
  the host allocator. Held slots count neither as cached nor as free: host free + cached + held == total, and
  nothing is held once the loop is idle (spill(wait=True)).
- Slots for a disk segment are fresh host slots written from the loop thread after a transfer barrier (no copy
  issued earlier may still read or write them), before the load that reads them is issued (FIFO).
- The disk never decides a hit alone: the store verifies every token, and a segment is attached only where the
  tree holds exactly the tokens before it.
- Shutdown writes every cached node not yet on disk (persist), so a restarted engine comes up warm.
"""

from __future__ import annotations

import logging
import time

import torch

from prefixrt.cache.disk_store import DiskKVStore, Fetch
from prefixrt.cache.kv_pool import byte_view
from prefixrt.cache.radix import _common_prefix_len
from prefixrt.cache.tiered_radix import TieredRadixCache, _TNode

log = logging.getLogger(__name__)


class DiskTieredRadixCache(TieredRadixCache):
    def __init__(self, *args, disk: DiskKVStore, **kwargs):
        super().__init__(*args, **kwargs)
        self.disk = disk
        self._held: list = []  # (marker, host slots, salt, path tokens [0, end), start), FIFO order
        self._held_tokens = 0
        self._spill_off = False  # flush(): copies leaving the host tier are dropped, not written

    # ------------------------------------------------------------------ host -> disk
    def _path_tokens(self, node) -> list[int]:
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def _host_copy_dropped(self, node, slots: list[int]) -> None:
        salt = self._salt_of(node)
        if self._spill_off or not self.disk.storable(salt):
            self._free_host(slots)
            return
        if not self.disk.offer_ok(len(slots)):  # the disk is behind: this copy is dropped, not queued
            self.disk.write_skipped_total += 1
            self._free_host(slots)
            return
        tokens = self._path_tokens(node)
        if self.disk.has(salt, tokens):
            self._free_host(slots)
            return
        self._host_cached -= len(slots)
        self._held_tokens += len(slots)
        self._held.append((self.transfer.marker(), list(slots), salt, tokens, len(tokens) - len(node.key)))

    @property
    def host_held_tokens(self) -> int:
        return self._held_tokens

    def spill(self, wait: bool = False) -> None:
        """Snapshot the held host copies whose marker passed (wait=True: all) into the disk's write queue and
        free their host slots; then apply the disk's finished writes to its index (loop thread)."""
        keep = []
        for rec in self._held:
            mark, slots, salt, tokens, start = rec
            if wait:
                mark.wait()
            if keep or not mark.query():  # FIFO: a later mark cannot pass before an earlier one
                keep.append(rec)
                continue
            k, v = self.host.read(slots)
            self.disk.write(salt, tokens, start, k, v)  # [layers, n, kv_heads, head_dim]; skipped if the queue is full
            self._held_tokens -= len(slots)
            self._return_host_slots(slots)
        self._held = keep
        self.disk.poll()

    def _alloc_host(self, num_tokens: int) -> list[int] | None:
        if self._held:
            self.spill()
        got = super()._alloc_host(num_tokens)
        if got is None and self._held:  # room was made, but its slots are still being snapshotted
            self.spill(wait=True)
            got = super()._alloc_host(num_tokens)
        return got

    # ------------------------------------------------------------------ disk -> host
    def _walk(self, salt, tokens: list[int], limit: int):
        """Read-only: (matched tokens, last node, tokens of it matched) of tokens[:limit]; node None: no root."""
        root = self._roots.get(salt)
        if root is None:
            return 0, None, 0
        node, pos = root, 0
        while pos < limit:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._align(_common_prefix_len(child.key, tokens[pos:limit]))
            pos += n
            if n < len(child.key):
                return pos, child, n
            node = child
        return pos, node, len(node.key)

    def attach_from_disk(self, salt, ids: list[int], fetch: Fetch) -> int:
        """Insert a finished fetch's verified segments as host-only nodes where the tree holds exactly the
        tokens before them. Returns the tokens attached (counted as disk hits)."""
        attached = 0
        for seg in fetch.segments:
            start, end, k, v = seg.start, seg.end, seg.k, seg.v
            pos, node, off = self._walk(salt, ids, end)
            if pos < start:
                break  # the path to the segment left the tree meanwhile
            if pos >= end:
                continue
            host = self._alloc_host(end - pos)
            if host is None:
                break
            if self._walk(salt, ids, end) != (pos, node, off):  # making room changed the path
                self._return_host_slots(host)
                break
            self.transfer.barrier()
            self.host.write(host, k[:, pos - start:], v[:, pos - start:])  # k, v: [layers, end - start, kvh, d]
            if node is None:
                node = self._roots[salt] = _TNode([], [], None, 0)
            elif off < len(node.key):
                node = self._split(node, off)
            new = _TNode(list(ids[pos:end]), None, node, next(self._clock), host)
            node.children[self._page_key(new.key, 0)] = new
            self._num_nodes += 1
            self._host_cached += len(host)
            self.version += 1
            self._push_host(new)
            attached += end - pos
        self.disk.hit_tokens_total += attached  # (then loaded like any host hit)
        return attached

    # ------------------------------------------------------------------ whole-cache operations
    def flush(self) -> int:
        """Drop every unlocked entry of every tier, the disk's files included."""
        self._spill_off = True
        try:
            freed = super().flush()
        finally:
            self._spill_off = False
        self.spill(wait=True)
        self.disk.clear()
        return freed

    def persist(self) -> int:
        """Write every cached node not on disk yet (shutdown: nothing runs). Returns tokens written."""
        t0, written = time.perf_counter(), 0
        self.spill(wait=True)
        self.transfer.barrier()
        pool = self.transfer.pool
        for node in list(self._iter_nodes()):  # parents before children
            salt = self._salt_of(node)
            tokens = self._path_tokens(node)
            if not self.disk.storable(salt) or self.disk.has(salt, tokens):
                continue
            if node.host_slots is not None:
                k, v = self.host.read(node.host_slots)
            else:
                idx = torch.tensor(node.slots, dtype=torch.int64, device=pool.device)
                k, v = (byte_view(t).index_select(1, idx).cpu().view(t.dtype) for t in (pool.k_all, pool.v_all))
            if self.disk.write(salt, tokens, len(tokens) - len(node.key), k, v, block=True):
                written += len(node.key)
        self.disk.flush()
        if written:
            log.info("KV disk tier: wrote %d cached tokens at shutdown in %.2fs", written, time.perf_counter() - t0)
        return written

    def close(self) -> None:
        self.persist()
        self.disk.close()
