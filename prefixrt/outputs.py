"""Result types returned to users: Completion, Chunk, EngineStats."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None  # the stop string or stop/EOS token id that ended the request
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[dict] | None = None  # [{token_id, token, logprob, top_logprobs: [{token_id, token, logprob}]}]
    outputs: list[Completion] = field(default_factory=list)  # the n samples when n > 1 (first is self)
    choice_scores: dict[str, float] | None = None  # select/choices: the score of each choice
    choice_logprobs: list[list[float]] | None = None  # select/choices: token logprobs of every choice
    error: str | None = None  # set when the request was aborted by an internal error

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict. `outputs` holds the n samples when n > 1 (the first being this Completion itself,
        its own `outputs` left empty), and is empty when n == 1."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outputs"}
        d["logprobs"] = copy.deepcopy(self.logprobs)
        many = len(self.outputs) > 1
        d["outputs"] = [o._flat_dict() for o in self.outputs] if many else []
        return d

    def _flat_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outputs"}
        d["logprobs"] = copy.deepcopy(self.logprobs)
        d["outputs"] = []
        return d


@dataclass
class Chunk:
    request_id: str
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    finish_reason: str | None = None  # set on the last chunk
    index: int = 0  # which of the n samples
    logprobs: list[dict] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    matched_stop: str | int | None = None
    error: str | None = None  # on the last chunk of a request aborted by an internal error


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generated_tokens_total: int = 0
    cache_hit_rate: float = 0.0
    evicted_tokens_total: int = 0
    requests_total: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_evictable: int = 0
    kv_locked: int = 0
    forward_passes_total: int = 0
    retracted_requests_total: int = 0
    aborted_requests_total: int = 0
    cache_audits_total: int = 0  # cache hits whose K/V was recomputed and compared (cache_audit_rate)
    cache_audit_mismatches_total: int = 0  # audits that found cached K/V differing from the recomputation
    # Host tier of the KV cache (host_kv_cache_tokens; all 0 when off). cached_tokens_total counts both tiers.
    kv_host_total: int = 0  # host tier size in tokens
    kv_host_free: int = 0
    kv_host_cached: int = 0  # tokens with a host copy (host-only or both tiers)
    host_hit_tokens_total: int = 0  # cached prompt tokens loaded back from the host tier at admission
    host_load_bytes_total: int = 0  # host -> pool copies (completed)
    host_load_seconds_total: float = 0.0
    host_backup_bytes_total: int = 0  # pool -> host copies (completed)
    host_backup_seconds_total: float = 0.0
    host_evicted_tokens_total: int = 0  # host copies dropped (host LRU)
    host_load_failures_total: int = 0  # admissions whose host part found no pool room (recomputed instead)
    # Disk tier (kv_disk_dir; all 0 when off). Disk hits are loaded disk -> host -> pool, so they are in
    # host_hit_tokens_total and cached_tokens_total too.
    kv_disk_total_bytes: int = 0  # the size cap
    kv_disk_used_bytes: int = 0
    kv_disk_cached_tokens: int = 0  # tokens of K/V in the directory's (indexed) files
    kv_disk_files: int = 0
    disk_hit_tokens_total: int = 0  # cached prompt tokens read from the disk tier
    disk_load_bytes_total: int = 0  # bytes of files read
    disk_load_seconds_total: float = 0.0
    disk_write_bytes_total: int = 0  # bytes of files written
    disk_write_seconds_total: float = 0.0
    disk_write_skipped_total: int = 0  # host evictions not written (the write queue was full)
    disk_evicted_bytes_total: int = 0  # files deleted by the size cap
    disk_rejected_files_total: int = 0  # files that failed a check (checksum, size, token ids): never used
    # Per cache_salt (bounded label -> counters; see cache/salt_stats.py): prompt_tokens_total,
    # cached_tokens_total (hits, all tiers), evicted_tokens_total (pool), kv_cached_tokens (now, pool).
    salts: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
