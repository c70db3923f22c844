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
    # {"queue_s", "prefill_s", "decode_s"}: waiting to be admitted, admission to first token, first token to
    # finish (None where the request never got that far); None when the engine does not report it
    timing: dict[str, float | None] | None = field(default=None, compare=False)  # (never equal twice)
    # With kept prefixes asked for (SamplingParams.prompt_cache.keep): {"kept_tokens", "refused_tokens", "reason"}
    # (cache/pins.py KeepGrant.report); None otherwise
    keep_report: dict | None = None

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


def completion_from_dict(d: dict[str, Any]) -> Completion:
    """The inverse of Completion.to_dict (RemoteEngine reads the server's JSON with it)."""
    d = dict(d)
    outs = [completion_from_dict(o) for o in d.pop("outputs", []) or []]
    c = Completion(**d)
    c.outputs = outs if outs else [c]
    return c


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
    timing: dict[str, float | None] | None = field(default=None, compare=False)  # last chunk: as Completion.timing
    keep_report: dict | None = None  # first chunk: as Completion.keep_report

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields (shallow: the lists are this Chunk's own, not copies)."""
        return {name: getattr(self, name) for name in _CHUNK_FIELDS}


_CHUNK_FIELDS = tuple(f.name for f in fields(Chunk))


def coalesce_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Consecutive chunks of one stream, joined per sample: the later chunks of a sample are appended to its
    first (text and token ids concatenated, logprob entries concatenated; finish_reason, counters, matched_stop
    and error from the latest), so a caller that fell behind emits one chunk per sample instead of one per step.
    What a consumer reads is unchanged: per sample, the concatenated text, token ids and logprobs and the final
    chunk's fields are those of the input. An "abort" chunk is never joined to earlier ones and nothing after
    it is joined to anything before it (a route turns it into an error where it stands). Returns new Chunks in
    the order of each run's first chunk; the input is not modified."""
    out: list[Chunk] = []
    open_at: dict[int, int] = {}  # sample index -> position in out of its chunk still being joined to
    for ch in chunks:
        if ch.finish_reason == "abort":
            open_at.clear()
            out.append(ch)
            continue
        k = open_at.get(ch.index)
        if k is None:
            if ch.finish_reason is None:
                open_at[ch.index] = len(out)
            out.append(ch)
            continue
        a = out[k]
        out[k] = Chunk(
            request_id=ch.request_id, text=a.text + ch.text, token_ids=a.token_ids + ch.token_ids,
            finish_reason=ch.finish_reason, index=ch.index,
            logprobs=None if a.logprobs is None and ch.logprobs is None else (a.logprobs or []) + (ch.logprobs or []),
            prompt_tokens=ch.prompt_tokens, cached_tokens=ch.cached_tokens, completion_tokens=ch.completion_tokens,
            matched_stop=ch.matched_stop, error=ch.error, timing=ch.timing,
            keep_report=a.keep_report if a.keep_report is not None else ch.keep_report)
        if ch.finish_reason is not None:
            del open_at[ch.index]
    return out


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
    kv_pinned: int = 0  # pool tokens kept prefixes hold out of eviction (no host tier; idle: free + evictable + pinned == total)
    forward_passes_total: int = 0
    retracted_requests_total: int = 0
    preempted_requests_total: int = 0  # of the retracted: preempted for a waiting request's first token (host tier)
    aborted_requests_total: int = 0
    # Speculative decoding (EngineConfig.speculative; all 0 when off): per speculating row of a forward, drafted
    # and accepted tokens, tokens emitted (accepted + the bonus or corrected one), and the drafters' host time.
    spec_verify_rows_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_emitted_tokens_total: int = 0
    spec_drafter_seconds_total: float = 0.0
    spec_acceptance_rate: float = 0.0  # accepted / drafted
    spec_tokens_per_forward: float = 0.0  # emitted / verify rows: tokens a speculating row gains per forward
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
    host_prefetch_tokens_total: int = 0  # host-tier tokens loaded for waiting requests ahead of their admission
    host_prefetch_hits_total: int = 0  # admissions that found their host part already loaded by a prefetch
    host_prefetch_misses_total: int = 0  # admissions that started their host-part load themselves
    # Session prefetch (session_prefetch; cache/session_prefetch.py): finished sessions' prefixes loaded from the host
    # tier ahead of their next request. Tokens loaded; of those, tokens an admission used and tokens the pool gave up
    # before any admission used them (wasted); arrivals after their session's load completed that found loaded tokens
    # in the pool, and the sum of their lead times (arrival minus the load's completion).
    session_prefetch_tokens_total: int = 0
    session_prefetch_used_tokens_total: int = 0
    session_prefetch_wasted_tokens_total: int = 0
    session_prefetch_arrivals_total: int = 0
    session_prefetch_lead_seconds_total: float = 0.0
    retracted_to_host_tokens_total: int = 0  # retracted requests' tokens given a host copy at retraction
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
    # Kept prefixes (cache/pins.py): pins now, their tokens by tier (a node in both tiers counts in both), keeps
    # granted / refused by the limits, pins whose lifetime ended
    pins: int = 0
    pinned_tokens_gpu: int = 0
    pinned_tokens_host: int = 0
    pins_granted_total: int = 0
    pins_refused_total: int = 0
    pins_expired_total: int = 0
    # Per cache_salt (bounded label -> counters; see cache/salt_stats.py): prompt_tokens_total,
    # cached_tokens_total (hits, all tiers), evicted_tokens_total (pool), kv_cached_tokens (now, pool).
    salts: dict = field(default_factory=dict)
    # LoRA adapters (EngineConfig.lora_adapters / enable_lora; all 0 when off): GPU slots, adapters resident in them
    # now, slot loads and their seconds (summed over loads; lora_load_busy_seconds_total: seconds with at least one
    # load in flight, the union of their intervals, so its share of a run's wall time); per loaded adapter (name -> requests_total, prompt_tokens_total,
    # cached_tokens_total, generated_tokens_total, cache_hit_rate, loads_total, load_seconds_total, resident, rank)
    lora_slots: int = 0
    lora_resident_adapters: int = 0
    lora_loads_total: int = 0
    lora_load_seconds_total: float = 0.0
    lora_load_busy_seconds_total: float = 0.0
    lora_adapters: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
