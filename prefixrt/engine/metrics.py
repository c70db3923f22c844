"""Prometheus metrics for one engine.

Counters and gauges are read from `Engine.stats()` at scrape time, so /metrics and /stats always agree (no
second set of books). Latency histograms (TTFT, inter-token latency, end-to-end) are observed on the
scheduler thread as an observer of the loop's events (`EngineCore.events`, engine/loop/hooks.py). There is one Metrics (and one CollectorRegistry) per
engine, shared by every app serving it (`Metrics.for_engine`); separate engines never collide.

It lives in the engine layer because the engine process installs it (engine/process/client.py) and the server
only renders it (server/app.py's /metrics). prometheus-client is an optional extra, so engine/process/client.py
imports this module lazily.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = {  # EngineStats field -> (metric name without _total, help)
    "prompt_tokens_total": ("prefixrt_prompt_tokens", "Prompt tokens of admitted requests."),
    "cached_tokens_total": ("prefixrt_cached_tokens", "Prompt tokens whose KV was reused from the radix cache."),
    "generated_tokens_total": ("prefixrt_generated_tokens", "Tokens generated (sampled or grammar-forced)."),
    "evicted_tokens_total": ("prefixrt_evicted_tokens", "Cached tokens evicted from the KV pool."),
    "requests_total": ("prefixrt_requests", "Requests submitted."),
    "aborted_requests_total": ("prefixrt_aborted_requests", "Request samples aborted."),
    "retracted_requests_total": ("prefixrt_retracted_requests", "Requests retracted under KV pressure."),
    "preempted_requests_total": ("prefixrt_preempted_requests",
                                 "Retracted requests preempted for a waiting request's first token (host tier)."),
    "forward_passes_total": ("prefixrt_forward_passes", "Model forward passes."),
    "lora_loads_total": ("prefixrt_lora_slot_loads", "LoRA adapter loads into GPU slots (all adapters, unloaded ones "
                                                     "included)."),
    "lora_load_seconds_total": ("prefixrt_lora_slot_load_seconds", "Seconds of LoRA adapter loads into GPU slots."),
    "lora_load_busy_seconds_total": ("prefixrt_lora_slot_load_busy_seconds",
                                     "Seconds with at least one LoRA adapter load in flight (loads that overlap "
                                     "count once)."),
    "spec_verify_rows_total": ("prefixrt_spec_verify_rows", "Speculating rows verified (one per request per forward)."),
    "spec_draft_tokens_total": ("prefixrt_spec_draft_tokens", "Tokens drafted by speculative decoding."),
    "spec_accepted_tokens_total": ("prefixrt_spec_accepted_tokens", "Drafted tokens accepted by verification."),
    "spec_emitted_tokens_total": ("prefixrt_spec_emitted_tokens", "Tokens emitted by speculating rows."),
    "spec_drafter_seconds_total": ("prefixrt_spec_drafter_seconds", "Host time spent drafting."),
    "cache_audits_total": ("prefixrt_cache_audits", "Cache hits whose K/V was recomputed and compared."),
    "cache_audit_mismatches_total": ("prefixrt_cache_audit_mismatch",
                                     "Cache audits whose cached K/V differed from the recomputation."),
    "host_hit_tokens_total": ("prefixrt_host_hit_tokens", "Cached prompt tokens loaded back from the host KV tier."),
    "host_load_bytes_total": ("prefixrt_host_load_bytes", "Bytes copied host KV tier -> KV pool."),
    "host_load_seconds_total": ("prefixrt_host_load_seconds", "Time spent copying host KV tier -> KV pool."),
    "host_backup_bytes_total": ("prefixrt_host_backup_bytes", "Bytes copied KV pool -> host KV tier."),
    "host_backup_seconds_total": ("prefixrt_host_backup_seconds", "Time spent copying KV pool -> host KV tier."),
    "host_evicted_tokens_total": ("prefixrt_host_evicted_tokens", "Host KV tier copies dropped by its LRU."),
    "host_load_failures_total": ("prefixrt_host_load_failures",
                                 "Admissions whose host-tier hit found no KV pool room (recomputed)."),
    "host_prefetch_tokens_total": ("prefixrt_host_prefetch_tokens",
                                   "Host KV tier tokens loaded into the pool for waiting requests (prefetch)."),
    "host_prefetch_hits_total": ("prefixrt_host_prefetch_hits",
                                 "Admissions whose host-tier prefix a prefetch had loaded."),
    "host_prefetch_misses_total": ("prefixrt_host_prefetch_misses",
                                   "Admissions that started their host-tier load themselves (no prefetch)."),
    "session_prefetch_tokens_total": ("prefixrt_session_prefetch_tokens",
                                      "Host KV tier tokens of finished sessions loaded into the pool ahead of their "
                                      "next request (session prefetch)."),
    "session_prefetch_used_tokens_total": ("prefixrt_session_prefetch_used_tokens",
                                           "Session-prefetched tokens that an admitted request then used."),
    "session_prefetch_wasted_tokens_total": ("prefixrt_session_prefetch_wasted_tokens",
                                             "Session-prefetched tokens the pool gave up before any request used "
                                             "them (wasted loads)."),
    "session_prefetch_arrivals_total": ("prefixrt_session_prefetch_arrivals",
                                        "Requests that arrived after their session's prefetch completed and found "
                                        "prefetched tokens in the pool."),
    "session_prefetch_lead_seconds_total": ("prefixrt_session_prefetch_lead_seconds",
                                            "Sum over those arrivals of the lead time: arrival minus the completion "
                                            "of the prefetch (divide by prefixrt_session_prefetch_arrivals_total)."),
    "retracted_to_host_tokens_total": ("prefixrt_retracted_to_host_tokens",
                                       "Tokens of retracted requests copied to the host KV tier at retraction."),
    "disk_hit_tokens_total": ("prefixrt_disk_hit_tokens", "Cached prompt tokens read from the disk KV tier."),
    "disk_load_bytes_total": ("prefixrt_disk_load_bytes", "Bytes of disk KV tier files read."),
    "disk_load_seconds_total": ("prefixrt_disk_load_seconds", "Time spent reading disk KV tier files."),
    "disk_write_bytes_total": ("prefixrt_disk_write_bytes", "Bytes of disk KV tier files written."),
    "disk_write_seconds_total": ("prefixrt_disk_write_seconds", "Time spent writing disk KV tier files."),
    "disk_write_skipped_total": ("prefixrt_disk_write_skipped",
                                 "Host KV tier evictions not written to disk (the write queue was full)."),
    "disk_evicted_bytes_total": ("prefixrt_disk_evicted_bytes", "Disk KV tier files deleted by its size cap."),
    "pins_granted_total": ("prefixrt_kept_prefixes_granted", "Kept prefixes (prompt-cache breakpoints) granted."),
    "pins_refused_total": ("prefixrt_kept_prefixes_refused",
                           "Kept prefixes refused (over a tenant's share or the pin capacity); the response says so."),
    "pins_expired_total": ("prefixrt_kept_prefixes_expired", "Kept prefixes whose lifetime ended."),
    "disk_rejected_files_total": ("prefixrt_disk_rejected_files",
                                  "Disk KV tier files that failed a check (checksum, size, token ids); never used."),
}
_SALT_COUNTERS = {  # EngineStats.salts[label] key -> (metric name without _total, help); labelled by `salt`
    "prompt_tokens_total": ("prefixrt_salt_prompt_tokens", "Prompt tokens of admitted requests, per cache_salt."),
    "cached_tokens_total": ("prefixrt_salt_hit_tokens", "Prompt tokens reused from the KV cache (all tiers), "
                                                        "per cache_salt."),
    "evicted_tokens_total": ("prefixrt_salt_evicted_tokens", "Cached tokens evicted from the KV pool, per cache_salt."),
}
_LORA_COUNTERS = {  # EngineStats.lora_adapters[name] key -> (metric name without _total, help); labelled by `adapter`
    "requests_total": ("prefixrt_lora_requests", "Requests run under each LoRA adapter."),
    "prompt_tokens_total": ("prefixrt_lora_prompt_tokens", "Prompt tokens of finished requests, per LoRA adapter."),
    "cached_tokens_total": ("prefixrt_lora_hit_tokens", "Prompt tokens reused from the KV cache, per LoRA adapter."),
    "generated_tokens_total": ("prefixrt_lora_generated_tokens", "Tokens generated, per LoRA adapter."),
    "loads_total": ("prefixrt_lora_loads", "Loads of each LoRA adapter into a GPU slot."),
    "load_seconds_total": ("prefixrt_lora_load_seconds", "Seconds from a load's start to its completion, per adapter."),
}
_GAUGES = {
    "kv_total": ("prefixrt_kv_total_tokens", "KV pool size in tokens."),
    "kv_free": ("prefixrt_kv_free_tokens", "Free KV slots in tokens."),
    "kv_evictable": ("prefixrt_kv_evictable_tokens", "Cached, unlocked KV in tokens (reclaimable)."),
    "kv_locked": ("prefixrt_kv_locked_tokens", "KV held by running requests, in tokens."),
    "requests_running": ("prefixrt_requests_running", "Requests in the running batch."),
    "requests_waiting": ("prefixrt_requests_waiting", "Requests waiting to be admitted."),
    "cache_hit_rate": ("prefixrt_cache_hit_rate", "cached_tokens_total / prompt_tokens_total."),
    "spec_acceptance_rate": ("prefixrt_spec_acceptance_rate", "Speculative decoding: accepted / drafted tokens."),
    "spec_tokens_per_forward": ("prefixrt_spec_tokens_per_forward",
                                "Speculative decoding: tokens emitted per speculating row per forward."),
    "kv_pinned": ("prefixrt_kv_pinned_tokens", "KV pool tokens kept prefixes hold out of eviction (no host tier)."),
    "pins": ("prefixrt_kept_prefixes", "Kept prefixes now."),
    "kv_host_total": ("prefixrt_kv_host_total_tokens", "Host KV tier size in tokens (0: no host tier)."),
    "kv_host_free": ("prefixrt_kv_host_free_tokens", "Free host KV tier slots in tokens."),
    "kv_host_cached": ("prefixrt_kv_host_cached_tokens", "Tokens with a copy in the host KV tier."),
    "kv_disk_total_bytes": ("prefixrt_kv_disk_total_bytes", "Disk KV tier size cap in bytes (0: no disk tier)."),
    "kv_disk_used_bytes": ("prefixrt_kv_disk_used_bytes", "Bytes of the disk KV tier's files."),
    "kv_disk_cached_tokens": ("prefixrt_kv_disk_cached_tokens", "Tokens of K/V in the disk KV tier's files."),
    "kv_disk_files": ("prefixrt_kv_disk_files", "Files in the disk KV tier."),
    "lora_slots": ("prefixrt_lora_slots", "GPU slots for LoRA adapters (0: no adapters served)."),
    "lora_resident_adapters": ("prefixrt_lora_resident_adapters", "LoRA adapters resident in GPU slots now."),
}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def tier_hit_rates(s) -> dict[str, float]:
    """Share of prompt tokens served from the pool, the host tier and the disk tier (disk hits load through the
    host tier, so host_hit_tokens_total includes them)."""
    if not s.prompt_tokens_total:
        return {"pool": 0.0, "host": 0.0, "disk": 0.0}
    p = s.prompt_tokens_total
    return {"pool": (s.cached_tokens_total - s.host_hit_tokens_total) / p,
            "host": (s.host_hit_tokens_total - s.disk_hit_tokens_total) / p, "disk": s.disk_hit_tokens_total / p}


class _StatsCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for fld, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, fld))
        for fld, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(s, fld))
        yield GaugeMetricFamily("prefixrt_kv_used_tokens", "KV in use (total - free), in tokens.",
                                value=s.kv_total - s.kv_free)
        fam = GaugeMetricFamily("prefixrt_tier_hit_rate", "Prompt tokens served from each KV tier / prompt tokens.",
                                labels=["tier"])
        for tier, rate in tier_hit_rates(s).items():
            fam.add_metric([tier], rate)
        yield fam
        fam = GaugeMetricFamily("prefixrt_pinned_tokens", "Tokens of kept prefixes per KV tier (a prefix in both "
                                "tiers counts in both).", labels=["tier"])
        fam.add_metric(["gpu"], s.pinned_tokens_gpu)
        fam.add_metric(["host"], s.pinned_tokens_host)
        yield fam
        fam = GaugeMetricFamily("prefixrt_host_copy_gbps", "Host KV tier copy bandwidth so far, GB/s.",
                                labels=["direction"])
        for direction in ("load", "backup"):
            secs = getattr(s, f"host_{direction}_seconds_total")
            fam.add_metric([direction], getattr(s, f"host_{direction}_bytes_total") / secs / 1e9 if secs else 0.0)
        yield fam
        # Per cache_salt, under bounded labels (a hash prefix, at most MAX_LABELS of them, then "other").
        for key, (name, doc) in _SALT_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["salt"])
            for label, c in sorted(s.salts.items()):
                fam.add_metric([label], c[key])
            yield fam
        fam = GaugeMetricFamily("prefixrt_salt_cached_tokens", "KV pool tokens cached now, per cache_salt.",
                                labels=["salt"])
        for label, c in sorted(s.salts.items()):
            fam.add_metric([label], c["kv_cached_tokens"])
        yield fam
        # Per loaded LoRA adapter, labelled by its name (names are the operator's: bounded by the adapters loaded)
        for key, (name, doc) in _LORA_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["adapter"])
            for adapter, c in sorted(s.lora_adapters.items()):
                fam.add_metric([adapter], c[key])
            yield fam
        fam = GaugeMetricFamily("prefixrt_lora_cache_hit_rate", "Cached / prompt tokens per LoRA adapter.",
                                labels=["adapter"])
        for adapter, c in sorted(s.lora_adapters.items()):
            fam.add_metric([adapter], c["cache_hit_rate"])
        yield fam
        from prefixrt.engine.compile_cache import COMPILES

        if COMPILES.installed:  # CUDA engines: Triton kernel builds at start-up and while serving (should be 0)
            fam = CounterMetricFamily("prefixrt_triton_kernel_builds", "Triton kernels built (compiled or loaded "
                                      "from the disk cache), by phase.", labels=["phase"])
            secs = CounterMetricFamily("prefixrt_triton_kernel_build_seconds", "Time spent building Triton "
                                       "kernels, by phase.", labels=["phase"])
            for phase in ("startup", "serving"):
                fam.add_metric([phase], COMPILES.counts[phase])
                secs.add_metric([phase], COMPILES.seconds[phase])
            yield fam
            yield secs


class Metrics:
    """Owns the registry of one engine's metrics; its latency histograms observe the core's loop events."""

    @classmethod
    def for_engine(cls, engine) -> Metrics:
        existing = getattr(engine, "_prometheus_metrics", None)
        if existing is None:
            existing = cls(engine)
            engine._prometheus_metrics = existing
        return existing

    def __init__(self, engine):
        self._last_token: dict[int, float] = {}  # id(req) -> time of its previous output step
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(engine))
        self.ttft = Histogram("prefixrt_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("prefixrt_inter_token_latency_seconds", "Time between a request's output steps.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("prefixrt_e2e_request_latency_seconds", "Arrival to finish, per sample.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("prefixrt_request_finished", "Finished request samples by reason.",
                                ["finish_reason"], registry=self.registry)
        core = getattr(engine, "core", None)
        if core is not None:
            core.events.subscribe(self.observe)

    def observe(self, event: str, req=None, now: float = 0.0, **_) -> None:
        """Called on the scheduler thread: keep it cheap."""
        if event == "tokens":
            last = self._last_token.get(id(req))
            if last is None:
                self.ttft.observe(now - req.arrival)
            else:
                self.itl.observe(now - last)
            self._last_token[id(req)] = now
        elif event == "finished":
            self._last_token.pop(id(req), None)
            self.e2e.observe(now - req.arrival)
            self.finished.labels(req.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
