"""EngineStats of one engine: the loop's counters (EngineCore.stats, kept as it runs) with the gauges and the
cache tiers' counters read at the time of the snapshot. Called on the loop thread (Engine.stats)."""

from __future__ import annotations

from prefixrt.outputs import EngineStats


def snapshot(counters: EngineStats, kv, scheduler, auditor=None, lora=None) -> EngineStats:
    """A copy of `counters` (updated in place with the derived and read values) with KV, queue, host and disk
    tier and cache-audit figures: kv is the KVManager, scheduler the Scheduler, auditor the CacheAuditor or None,
    lora the LoraManager or None (per-adapter counters, resident adapters, loads)."""
    s = counters
    s.cache_hit_rate = s.cached_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
    s.evicted_tokens_total = kv.evicted_tokens_total
    s.spec_acceptance_rate = s.spec_accepted_tokens_total / s.spec_draft_tokens_total if s.spec_draft_tokens_total \
        else 0.0
    s.spec_tokens_per_forward = s.spec_emitted_tokens_total / s.spec_verify_rows_total if s.spec_verify_rows_total \
        else 0.0
    s.requests_running = len(scheduler.running)
    s.requests_waiting = len(scheduler.waiting)
    s.kv_total = kv.total_tokens
    s.kv_free = kv.free_tokens
    s.kv_evictable = kv.evictable_tokens
    pins = kv.pins
    pins.expire()
    s.kv_pinned = kv.pinned_tokens
    s.kv_locked = s.kv_total - s.kv_free - s.kv_evictable - s.kv_pinned
    s.pins = pins.num_pins
    s.pinned_tokens_gpu, s.pinned_tokens_host = pins.tier_tokens()
    s.pins_granted_total, s.pins_refused_total, s.pins_expired_total = (
        pins.granted_total, pins.refused_total, pins.expired_total)
    tiered = kv.tiered
    if tiered is not None:
        s.kv_host_total = tiered.host_alloc.total_tokens
        s.kv_host_free = tiered.host_alloc.free_tokens
        s.kv_host_cached = tiered.host_cached_tokens
        s.host_hit_tokens_total = tiered.host_hit_tokens_total
        s.host_evicted_tokens_total = tiered.host_evicted_tokens_total
        s.host_load_failures_total = kv.tiers.load_failures_total
        s.host_prefetch_tokens_total = kv.tiers.prefetch_tokens_total
        s.host_prefetch_hits_total = kv.tiers.prefetch_hits_total
        s.host_prefetch_misses_total = kv.tiers.prefetch_misses_total
        s.retracted_to_host_tokens_total = kv.retracted_to_host_tokens_total
        s.session_prefetch_used_tokens_total = tiered.ahead_used_tokens_total
        s.session_prefetch_wasted_tokens_total = tiered.ahead_wasted_tokens_total
        sp = scheduler.session_prefetch
        if sp is not None:
            s.session_prefetch_tokens_total = sp.prefetched_tokens_total
            s.session_prefetch_arrivals_total = sp.used_total
            s.session_prefetch_lead_seconds_total = sp.lead_seconds_total
        t = tiered.transfer.stats()
        bpt = tiered.host.bytes_per_token
        s.host_load_bytes_total, s.host_load_seconds_total = t["load"][1] * bpt, t["load"][2]
        s.host_backup_bytes_total, s.host_backup_seconds_total = t["backup"][1] * bpt, t["backup"][2]
    disk = kv.tiers.disk
    if disk is not None:
        s.kv_disk_total_bytes, s.kv_disk_used_bytes = disk.max_bytes, disk.used_bytes
        s.kv_disk_cached_tokens, s.kv_disk_files = disk.cached_tokens, disk.num_files
        s.disk_hit_tokens_total = disk.hit_tokens_total
        s.disk_load_bytes_total, s.disk_load_seconds_total = disk.load_bytes_total, disk.load_seconds_total
        s.disk_write_bytes_total, s.disk_write_seconds_total = disk.write_bytes_total, disk.write_seconds_total
        s.disk_write_skipped_total, s.disk_evicted_bytes_total = disk.write_skipped_total, disk.evicted_bytes_total
        s.disk_rejected_files_total = disk.rejected_files_total
    s.salts = kv.salt_stats()
    if lora is not None:
        snap = lora.snapshot()
        s.lora_adapters = snap["adapters"]
        s.lora_slots, s.lora_resident_adapters = snap["slots"], snap["resident"]
        s.lora_loads_total, s.lora_load_seconds_total = snap["loads_total"], snap["load_seconds_total"]
        s.lora_load_busy_seconds_total = snap["load_busy_seconds_total"]
    if auditor is not None:
        s.cache_audits_total = auditor.audits_total
        s.cache_audit_mismatches_total = auditor.mismatches_total
    return EngineStats(**s.to_dict())
