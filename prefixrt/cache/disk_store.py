"""DiskKVStore: the disk tier of the KV cache, one file per radix segment, with its index and its own LRU.

A file (disk_format.py) holds one segment [start, end) of a cached prefix: the prefix's token ids [0, end), the
K/V of positions [start, end), a checksum. Its name is a hash of (engine identity, salt, token ids [0, end));
the index finds segments by the hash of the tokens *before* them plus their first page of tokens, so a chain of
segments rebuilds a long prefix. Invariants:
- A hit never trusts a hash: the lookup only proposes files; the reader (KVFileFormat.read) verifies size,
  checksum, identity, salt and every token id before anything is used. A damaged file is deleted.
- The index and the LRU belong to the loop thread. File I/O (writes, reads, deletes) runs on one worker thread;
  its results come back through a queue that `poll()` applies on the loop thread.
- Start-up scans the directory and rebuilds the index from the files' headers (the K/V is not read), so a
  restarted engine finds what an earlier one wrote. Files of another identity are left alone (not indexed);
  temporary files older than an hour (a crashed writer's) are removed.
- Size cap: the indexed files' bytes stay <= max_bytes, least recently used deleted first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefixrt.cache.disk_format import (
    SUFFIX,
    TMP_PREFIX,
    Damaged,
    KVFileFormat,
    Segment,
    namespace_json,
    token_bytes,
)
from prefixrt.request import AdapterNamespace

log = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0


def _digest(h) -> str:
    """The hex key of a hasher state (a module function: tests force collisions through it)."""
    return h.hexdigest()


@dataclass

class _Entry:
    name: str  # file name in the directory
    key: str  # hash of (identity, salt, tokens[:end])
    start_key: str  # hash of (identity, salt, tokens[:start])
    head: tuple  # tokens[start:start + page_size]
    start: int
    end: int
    nbytes: int


@dataclass
class Fetch:
    """A disk read for one request: the chain of segments to read from position `start`. Filled by the worker:
    `segments` (disk_format.Segment: the usable, verified part of each file, in order); `rejected`
    [(entry, reason, damaged)]. `done` is set when the worker is through."""

    salt: Any
    ids: list[int]
    start: int
    cap: int
    entries: list[_Entry]
    segments: list[Segment] = field(default_factory=list)
    rejected: list = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class DiskKVStore:
    def __init__(self, directory: str | os.PathLike, identity: str, max_bytes: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
                 max_pending_bytes: int = 1 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.max_bytes = max_bytes
        self.format = KVFileFormat(identity, num_layers, num_kv_heads, head_dim, dtype, page_size)
        self.page_size = page_size
        self.bytes_per_token = self.format.bytes_per_token
        self.max_pending_bytes = max_pending_bytes
        # Index (loop thread): name -> entry in LRU order (oldest first); (start_key, head) -> names; key -> name.
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._by_start: dict[tuple[str, tuple], list[str]] = {}
        self._by_key: dict[str, str] = {}
        self._pending_keys: set[str] = set()  # written, not yet indexed
        self._pending_bytes = 0  # K/V bytes queued for writing (bounded: see offer_ok)
        self._lock = threading.Lock()  # guards _pending_bytes (the worker decrements it)
        self.used_bytes = 0
        self.cached_tokens = 0  # tokens of K/V in the indexed files
        # Counters (stats()).
        self.hit_tokens_total = 0
        self.load_bytes_total = 0
        self.load_seconds_total = 0.0
        self.write_bytes_total = 0
        self.write_seconds_total = 0.0
        self.write_skipped_total = 0  # writes dropped because the queue was full
        self.rejected_files_total = 0  # files that failed a check on load (never used)
        self.evicted_bytes_total = 0
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # worker -> loop: ("written", entry, s) | ...
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._scan()
        self._thread = threading.Thread(target=self._work, name="prefixrt-kv-disk", daemon=True)
        self._thread.start()

    @property
    def num_files(self) -> int:
        return len(self._lru)

    # ------------------------------------------------------------------ keys
    def _base(self, salt) -> Any:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.identity.encode() + b"\0" + json.dumps(namespace_json(salt)).encode() + b"\0")
        return h

    def key_of(self, salt, tokens) -> str:
        h = self._base(salt)
        h.update(token_bytes(tokens))
        return _digest(h)

    @staticmethod
    def storable(salt) -> bool:
        return salt is None or isinstance(salt, (str, AdapterNamespace))

    # ------------------------------------------------------------------ the loop thread's side
    def has(self, salt, tokens) -> bool:
        """Whether a segment ending with exactly these tokens is on disk or being written (its LRU refreshed)."""
        key = self.key_of(salt, tokens)
        name = self._by_key.get(key)
        if name is not None:
            self._lru.move_to_end(name)
            return True
        return key in self._pending_keys

    def offer_ok(self, num_tokens: int) -> bool:
        """Whether a write of num_tokens tokens fits in the write queue now (else it is skipped)."""
        with self._lock:
            return self._pending_bytes + num_tokens * self.bytes_per_token <= self.max_pending_bytes

    def write(self, salt, tokens: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
              block: bool = False) -> bool:
        """Queue a segment for writing: tokens = the prefix [0, end), k/v [layers, end - start, heads, dim] (the
        store owns them now). block=False: skipped (False) when the queue is full; True: waits for room."""
        if not self.storable(salt):
            return False
        n = len(tokens) - start
        nbytes = n * self.bytes_per_token
        while not self.offer_ok(n):
            if not block or not self._thread.is_alive():
                self.write_skipped_total += 1
                return False
            time.sleep(0.005)
        key = self.key_of(salt, tokens)
        start_key = self.key_of(salt, tokens[:start])
        with self._lock:
            self._pending_bytes += nbytes
        self._pending_keys.add(key)
        self._jobs.put(("write", _Entry(f"{key}{SUFFIX}", key, start_key, tuple(tokens[start:start + self.page_size]),
                                        start, len(tokens), 0), salt, list(tokens), k, v, nbytes))
        return True

    def lookup(self, salt, ids: list[int], start: int, cap: int) -> list[_Entry]:
        """The chain of segments that may extend a match ending at `start` (page-aligned) of ids[:cap]: read-only
        but for recency. Hash-based: the reader verifies every token before anything is used."""
        if not self.storable(salt) or start >= cap:
            return []
        ps = self.page_size
        h = self._base(salt)
        h.update(token_bytes(ids[:start]))
        chain, pos = [], start
        while pos + ps <= cap:
            names = self._by_start.get((_digest(h), tuple(ids[pos:pos + ps])))
            if not names:
                break
            best, best_h, partial = None, None, None
            for name in names:
                e = self._lru[name]
                if e.end <= cap:
                    h2 = h.copy()
                    h2.update(token_bytes(ids[pos:e.end]))
                    if _digest(h2) == e.key and (best is None or e.end > best.end):
                        best, best_h = e, h2
                partial = e if partial is None or e.end > partial.end else partial
            e = best or partial
            self._lru.move_to_end(e.name)
            chain.append(e)
            if best is None:  # only a part of this segment can match: the chain ends here
                break
            pos, h = best.end, best_h
        return chain

    def fetch(self, salt, ids: list[int], start: int, cap: int, entries: list[_Entry]) -> Fetch:
        """Read (on the worker) the chain `entries` for ids[:cap] from `start`; poll f.done."""
        f = Fetch(salt, list(ids[:cap]), start, cap, entries)
        self._jobs.put(("read", f))
        return f

    def finish_fetch(self, f: Fetch) -> None:
        """Apply a done fetch's findings to the index and counters (loop thread)."""
        self.load_bytes_total += f.bytes_read
        self.load_seconds_total += f.seconds
        for e, reason, damaged in f.rejected:
            self.rejected_files_total += 1
            log.warning("KV disk tier: %s %s (not used%s)", e.name, reason, ", deleted" if damaged else "")
            if damaged:
                self._drop(e.name)

    def poll(self) -> None:
        """Index the files written since the last poll and keep the size cap (loop thread)."""
        while True:
            try:
                kind, entry, seconds = self._done.get_nowait()
            except queue.Empty:
                break
            self._pending_keys.discard(entry.key)
            if kind == "written":
                self.write_bytes_total += entry.nbytes
                self.write_seconds_total += seconds
                self._index(entry)
        self._enforce_cap()

    def flush(self) -> None:
        """Wait until every queued write is on disk and indexed."""
        ev = threading.Event()
        self._jobs.put(("mark", ev))
        ev.wait()
        self.poll()

    def clear(self) -> None:
        """Delete every indexed file (flush_cache)."""
        self.flush()
        for name in list(self._lru):
            self._drop(name)
        self.flush()

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._jobs.put(None)
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ index
    def _index(self, e: _Entry) -> None:
        if e.name in self._lru:
            self._unindex(e.name)
        self._lru[e.name] = e
        self._by_start.setdefault((e.start_key, e.head), []).append(e.name)
        self._by_key[e.key] = e.name
        self.used_bytes += e.nbytes
        self.cached_tokens += e.end - e.start

    def _unindex(self, name: str) -> _Entry | None:
        e = self._lru.pop(name, None)
        if e is None:
            return None
        names = self._by_start.get((e.start_key, e.head), [])
        if name in names:
            names.remove(name)
            if not names:
                del self._by_start[(e.start_key, e.head)]
        if self._by_key.get(e.key) == name:
            del self._by_key[e.key]
        self.used_bytes -= e.nbytes
        self.cached_tokens -= e.end - e.start
        return e

    def _drop(self, name: str) -> None:
        if self._unindex(name) is not None:
            self._jobs.put(("unlink", name))

    def _enforce_cap(self) -> None:
        while self.used_bytes > self.max_bytes and self._lru:
            name, e = next(iter(self._lru.items()))
            self.evicted_bytes_total += e.nbytes
            self._drop(name)

    def _scan(self) -> None:
        """Rebuild the index from the directory (start-up): headers and token ids only, oldest files first."""
        t0 = time.perf_counter()
        found, skipped = [], 0
        now = time.time()
        for path in self.dir.iterdir():
            name = path.name
            try:
                st = path.stat()
                if name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:  # left by a crashed writer
                        path.unlink(missing_ok=True)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                with open(path, "rb") as f:
                    parsed = self.format.read_header(f, st.st_size)
            except OSError as e:
                log.warning("KV disk tier: skipping %s at start-up: %s", name, e)
                skipped += 1
                continue
            except Damaged as e:  # never used
                log.warning("KV disk tier: %s is damaged (%s): deleted", name, e.reason)
                self.rejected_files_total += 1
                path.unlink(missing_ok=True)
                continue
            if parsed is None:  # another identity's file, or a page size this engine cannot use
                continue
            hdr, tokens, _ = parsed
            salt, start, end = hdr["namespace"], hdr["start"], hdr["end"]
            e = _Entry(name, self.key_of(salt, tokens), self.key_of(salt, tokens[:start]),
                       tuple(tokens[start:start + self.page_size]), start, end, st.st_size)
            found.append((st.st_mtime, e))
        for _, e in sorted(found, key=lambda t: t[0]):
            self._index(e)
        self._enforce_cap()
        if found or skipped:
            log.info("KV disk tier: indexed %d files (%d tokens, %.2f GiB) from %s in %.2fs%s", len(self._lru),
                     self.cached_tokens, self.used_bytes / 2**30, self.dir, time.perf_counter() - t0,
                     f", {skipped} unreadable" if skipped else "")

    def _read_segment(self, f: Fetch, e: _Entry, pos: int):
        """One file of a fetch (worker thread): KVFileFormat.read (tests wrap this to slow reads down)."""
        return self.format.read(self.dir / e.name, f.salt, f.ids, f.cap, pos)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind = job[0]
            try:
                if kind == "write":
                    _, entry, salt, tokens, k, v, nbytes = job
                    t0 = time.perf_counter()
                    try:
                        entry.nbytes = self.format.write(self.dir, entry.name, salt, tokens, entry.start, k, v)
                        self._done.put(("written", entry, time.perf_counter() - t0))
                    except OSError as e:
                        log.warning("KV disk tier: writing %s failed: %s", entry.name, e)
                        self._done.put(("failed", entry, 0.0))
                    finally:
                        with self._lock:
                            self._pending_bytes -= nbytes
                elif kind == "read":
                    f = job[1]
                    t0 = time.perf_counter()
                    pos = f.start
                    try:
                        for e in f.entries:
                            try:
                                seg, nbytes = self._read_segment(f, e, pos)
                            except Damaged as err:
                                f.rejected.append((e, err.reason, True))
                                break
                            f.bytes_read += nbytes
                            if isinstance(seg, str):
                                f.rejected.append((e, seg, False))
                                break
                            if seg is None:
                                break
                            f.segments.append(seg)
                            os.utime(self.dir / e.name)  # recency survives a restart
                            if seg.end < e.end:
                                break
                            pos = seg.end
                    except Exception as e:  # never leave the fetch hanging: what was read stays usable
                        log.warning("KV disk tier: reading failed: %s", e)
                    finally:
                        f.seconds = time.perf_counter() - t0
                        f.done.set()
                elif kind == "unlink":
                    (self.dir / job[1]).unlink(missing_ok=True)
                elif kind == "mark":
                    job[1].set()
            except Exception:  # the worker never dies
                log.exception("KV disk tier worker")
