"""Scheduler: decides which requests run in the next forward and how many tokens each feeds.

Each step: every running request feeds its pending tokens (one for decode; a sampled token plus
grammar-forced tokens after jump-forward; a chunk for a long prefill), then waiting requests are admitted
in policy order while the prefill token budget, the running-request cap and memory allow. Requests that
share a not-yet-cached prefix with a request already prefilling it are held back one step so the prefix is
prefilled once (the leader publishes it to the cache after each chunk).
Admission knows the budget: a waiting request is admitted only if the pool (free + evictable pages) holds its
own need (host part to load, uncached prompt, expected decode: admission.DecodeEstimate) on top of what every
running and prefetching request still needs, so a pool that cannot hold every active session runs fewer at a
time at full speed instead of admitting, growing and retracting. The first request is always admitted.
With a host tier, waiting requests next in line get their host-resident prefix loaded into the pool ahead of
admission (prefetch, overlapped with the running batch); under `wait_complete` a request is admitted once its
load is done, others going first meanwhile. A request that cannot get its pages at admission takes them from the
prefetches of the requests behind it (they would not be admitted before it).
With a host tier, a request that has produced nothing and has waited host_kv_preempt_after_s for memory preempts running
requests that have already streamed (retracted to the host, most remaining decode first, each at most
max_preemptions times): first tokens come soon even when the pool holds a few sessions of many. The victims are
held back until the request they made room for is admitted (else they would take the room back first).
Keyed sessions (engine/loop/sessions.py): waiting requests go least attained service of their session first
(after priority, before the policy's own key), so a session's turns share one priority. With a host tier and
session_prefetch, a finished turn of a keyed session (or one with kept prefixes) is remembered, and when nothing waits
its prefix is loaded back from the host tier into free pool pages that the running requests' remaining need leaves
(cache/session_prefetch.py; prefetch_sessions), so the session's next request finds it resident.
Retraction stays the last resort (the estimate was too low): prefetches are cancelled first, then the running
request that costs least to resume (lowest priority, then fewest tokens of its own: tokens shared with other
running requests are not lost) releases its K/V, published to the cache and, with a host tier, copied to the host
(retract to host), and goes back to waiting with its output so far.
With overlap scheduling a request's last token may still be on the device (Req.num_unresolved): it counts in
seq_len and is fed from the device; a request whose unresolved token is its last is not scheduled again.
The scheduler knows requests and token counts; KVManager knows memory; neither knows tensors' layouts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.session_prefetch import SessionPrefetch
from prefixrt.config.engine_config import SchedulerSettings
from prefixrt.engine.loop.admission import DecodeEstimate
from prefixrt.engine.loop.preemption import FirstTokenPreemption
from prefixrt.engine.loop.prefetch import HostPrefetch
from prefixrt.engine.loop.schedule_policy import order_waiting
from prefixrt.engine.loop.sessions import SessionService
from prefixrt.request import Req, ReqState

log = logging.getLogger(__name__)

# Hold back a waiting request when it shares at least this many uncached tokens with a request that is
# prefilling them now: cheaper to wait a step than to compute them twice.
PREFIX_DEDUP_MIN_TOKENS = 32


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    num_tokens: list[int]  # tokens fed per request (all_ids[prefix_len : prefix_len + n])
    prefix_lens: list[int]  # kv_len of each request before this forward
    slots: list[list[int]]  # pool slots receiving the new tokens' K/V
    sample: list[bool]  # True where the forward reaches the end of all_ids, so a token is sampled
    retracted: list[Req] = field(default_factory=list)
    finished_early: list[Req] = field(default_factory=list)  # could not get memory even alone: stop them ("length")
    # debug mode: why no later step could run anything (Scheduler._report_stuck); finished_early then holds every
    # waiting request, aborted with this error instead of the loop spinning on empty plans
    stuck: str | None = None
    # speculative decoding (engine/loop/speculate.py): batch index -> tokens drafted after that row's last token
    # (their slots follow the row's in `slots`; num_tokens does not count them)
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.reqs


class Scheduler:
    """settings: the engine's SchedulerSettings (config/engine_config.py); max_running_requests: its resolved cap
    (the settings' None means a default per device, which the builder resolves); adapters: the LoRA adapters' gate
    (lora/manager.py LoraManager: a request runs once its adapter is resident in a GPU slot, which it holds while
    admitted), or None (the base model only)."""

    def __init__(self, kv: KVManager, settings: SchedulerSettings, max_running_requests: int, adapters=None):
        self.kv = kv
        self.settings = settings
        self.max_running_requests = max_running_requests
        self.adapters = adapters
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.retracted_total = 0
        self.estimate = DecodeEstimate()
        self.prefetch = HostPrefetch(kv, settings)  # waiting requests whose host-tier prefix loads ahead
        self.preemption = FirstTokenPreemption(kv, settings)
        self.sessions = SessionService()
        # finished sessions' prefixes loaded back ahead of their next request (host tier only)
        self.session_prefetch = SessionPrefetch(kv) if settings.session_prefetch and kv.tiered is not None else None
        self._match_cache: dict[int, tuple[int, object]] = {}

    # ------------------------------------------------------------------ queue operations
    def add(self, req: Req) -> str | None:
        """req waits to run. Returns why it cannot instead (its LoRA adapter was unloaded after it was prepared), and
        then does not take it."""
        if self.adapters is not None and (refused := self.adapters.on_add(req)) is not None:
            return refused
        req.state = ReqState.WAITING
        keep = req.params.prompt_cache.keep if req.params.prompt_cache is not None else ()
        if keep and req.index == 0:  # (once per request: n > 1 samples share one prompt)
            grant = self.kv.pins.grant(req.prompt_ids, req.salt, keep)
            req.keep_report = grant.report()
            req.keep_grant = grant if grant.kept else None
        if self.session_prefetch is not None and req.index == 0:
            self.session_prefetch.arrived(req)
        self.waiting.append(req)
        return None

    def remove(self, req: Req) -> None:
        """Take req out of the scheduler (finish or abort) and release its memory."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.prefetch.removed(req)
        if req.finish_reason in ("stop", "length"):
            self.estimate.finished(req)
            if self.session_prefetch is not None and req.index == 0:
                self.session_prefetch.turn_ended(req)
        self.kv.release(req, final=True)
        self.kv.tiers.forget(req)
        if self.adapters is not None:
            self.adapters.release(req)
            self.adapters.on_finish(req)
        self._match_cache.pop(id(req), None)
        req.state = ReqState.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lora_batch(self, batch: ScheduledBatch, row_lens: list[int]):
        """The forward's LoRA plan (model/lora.py LoraBatch: each row's adapter slot), or None (the base model alone;
        no adapters served). row_lens: the tokens each row feeds."""
        return None if self.adapters is None else self.adapters.batch_for(batch.reqs, row_lens)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [], [], [])
        budget = self.settings.chunked_prefill_tokens
        if self.preemption.pending is not None:
            self._preempt(batch)

        # 1. Running requests: plan their tokens, retract until their pages fit.
        pages_for = self.kv.pages_for
        while True:
            plan, left, pages = [], budget, 0
            for req in self.running:  # (hot: Req.finishes_on_resolve and Req.num_pending, inlined)
                unresolved = req.num_unresolved
                if unresolved and len(req.output_ids) + unresolved >= req.params.max_new_tokens:
                    continue  # its token in flight is its last: another step would be discarded
                n = len(req.all_ids) + unresolved - req.kv_len
                if n <= 0:
                    continue
                if n > 1:  # a prefill chunk or a jump-forward run: bounded by the token budget
                    n = min(n, max(left, 1))
                    n = _chunk_end(req, n)
                    left -= n
                plan.append((req, n))
                pages += pages_for(req, n)
            if self.kv.ensure_pages(pages):
                break
            if self.prefetch.cancel_last():  # memory held for waiting requests goes before running work
                continue
            victim = self._pick_victim()
            if len(self.running) == 1:
                # Alone and still out of memory: it can never continue. Stop it (finish_reason "length").
                self.running.remove(victim)
                batch.finished_early.append(victim)
            else:
                self._retract(victim)
                batch.retracted.append(victim)

        # Leaders: requests whose prompt K/V is not in the cache yet (still prefilling, or a chunk in flight).
        # Taken over all running requests, not only those with tokens this step: with overlap, a request whose
        # last prefill chunk is still on the device has nothing to plan now, yet its prefix is not published.
        # A request released while a forward was in flight publishes its K/V only once that forward is done
        # (KVManager.release): until then it leads too (a prefill-only request, e.g. a fork's prefix hint, finishes
        # on the step that computed it, and its followers arrive meanwhile).
        prefilling = [r for r in self.running if r.kv_len < len(r.prompt_ids) or r.chunk_step is not None]
        if self.waiting and self.kv.cache.retains:
            prefilling += self.kv.held_releases()
        for req, n in plan:
            self._add_to_batch(batch, req, n)
            if n > 1:
                budget -= n

        # 2. Admit waiting requests.
        if self.waiting:
            settled = self.kv.debug and not self.running and not batch.retracted and self._settled()
            self._admit(batch, budget, prefilling)
            if batch.is_empty and not self.running:
                self.kv.tiers.wait_disk(0.002)
                if settled and not batch.finished_early and self._settled():
                    self._report_stuck(batch)
        # 3. Nothing waits: load finished sessions' prefixes into the room left.
        self.prefetch_sessions()
        return batch

    def went_idle(self) -> None:
        """The loop has nothing to run: every held release and free completes (all fences have passed), then the
        room the finished requests left may take finished sessions' prefixes back (prefetch_sessions)."""
        self.kv.reclaim(wait=True)
        self.prefetch_sessions()

    def prefetch_sessions(self) -> None:
        """When no request waits, let SessionPrefetch load remembered prefixes into the free pool pages that the
        running requests' remaining need (the rest of their prompts, their expected decode, a page each for the
        next step) leaves. Called each step and when the loop goes idle (went_idle)."""
        sp = self.session_prefetch
        if sp is None or self.waiting or not sp.due():
            return
        kv, est = self.kv, self.estimate
        reserved = len(self.running) + sum(kv.pages_to_finish(r, est.remaining(r)) for r in self.running)
        sp.run(kv.allocator.free_pages - reserved)

    def _settled(self) -> bool:
        """Nothing in flight that may change what an admission pass can do when it ends (a disk read or host copy,
        a release or free behind a fence, an adapter load), nor a kept prefix whose expiry may."""
        kv = self.kv
        return not (kv.tiers.in_flight or kv.has_deferred or kv.pins.num_pins
                    or (self.adapters is not None and any(r.adapter is not None for r in self.waiting)))

    def _report_stuck(self, batch: ScheduledBatch) -> None:
        """Debug mode: an admission pass admitted nothing with nothing running, and was settled (_settled) before it
        and after it. Then the next pass sees the same state and admits nothing again, and every one after it: the
        waiting requests are stuck. They are handed back to be aborted (batch.finished_early) with batch.stuck
        naming each and what holds it, instead of the loop spinning on empty plans."""
        kv, p = self.kv, self.preemption
        held = [f"{r.rid} ({len(r.output_ids)} tokens out"
                + (", held back" if p.holds_back(r) else "") + (", preempted for" if r is p.first else "")
                + (", prefetching" if r in self.prefetch.requests else "")
                + f", needs {kv.pages_to_admit(r, kv.match(r), self.estimate.remaining(r))} pages)"
                for r in self.waiting]
        batch.stuck = (f"scheduler stuck: nothing runs or is in flight, and no waiting request can be admitted "
                       f"({kv.allocator.free_pages} pages free, {kv.available_pages} available): " + "; ".join(held))
        log.error("%s", batch.stuck)
        batch.finished_early.extend(self.waiting)

    def _add_to_batch(self, batch: ScheduledBatch, req: Req, n: int) -> None:
        slots = self.kv.extend(req, n)
        kv_len = req.kv_len
        batch.reqs.append(req)
        batch.num_tokens.append(n)
        batch.prefix_lens.append(kv_len)
        batch.slots.append(slots)
        batch.sample.append(kv_len + n == len(req.all_ids) + req.num_unresolved)  # reaches seq_len
        req.kv_len = kv_len + n
        self.sessions.charge(req, n)

    def _admit(self, batch: ScheduledBatch, budget: int, prefilling: list[Req]) -> None:
        """Admit waiting requests in policy order while they fit (see the module docstring). What is not memory
        accounting is delegated: the disk tier's reads (KVManager.tiers), the prefill-once hold-back
        (UncachedPrefixIndex), host prefetch (HostPrefetch), first-token preemption (FirstTokenPreemption), image
        blocks (_chunk_end)."""
        kv, est, prefetch = self.kv, self.estimate, self.prefetch
        now = time.monotonic()
        version = getattr(kv.cache, "version", 0)

        def match(r: Req):
            hit = self._match_cache.get(id(r))
            if hit is None or hit[0] != version:
                hit = (version, kv.match(r))
                self._match_cache[id(r)] = hit
            return hit[1]

        order = order_waiting(self.waiting, self.settings.schedule_policy, match, now, self.settings.aging_s,
                              self.sessions.service if self.settings.session_scheduling else None)
        first = self.preemption.first
        if first is not None and first in order:  # running requests were preempted to make room for it
            order.remove(first)
            order.insert(0, first)
        else:  # admitted (or gone): its preemption's victims may run again
            self.preemption.done()
        leaders = UncachedPrefixIndex(prefilling)
        admitted: set[int] = set()
        adapters = self.adapters
        if adapters is not None:  # loads of the adapters waiting requests need start now, beside the running batch
            adapters.prefetch(order)
        # Pages the running requests still need (the rest of their prompts, their expected decode), and those the
        # prefetching ones will need once admitted.
        reserved = sum(kv.pages_to_finish(r, est.remaining(r)) for r in self.running)
        prefetch_need = prefetch.needs(match, est.remaining)
        reserved += sum(prefetch_need.values())
        reserve_pages = len(self.running)  # keep one page per running request for its next decode step
        for req in order:
            if self.preemption.holds_back(req):
                continue  # preempted for the request first in line: it goes before them
            if adapters is not None and not adapters.admissible(req):
                continue  # its LoRA adapter is loading (or waits for a slot): others go first
            m = match(req)
            if not kv.tiers.disk_ready(req, m):  # its prefix is being read from the disk tier
                continue
            if self.settings.dedup_shared_prefill and kv.cache.retains and leaders.shares(req, m.length):
                continue
            if prefetch.still_loading(req, bool(self.running)):  # (its need is in reserved): others go first
                continue
            growth = est.remaining(req)
            others = reserved - prefetch_need.pop(id(req), 0)
            need = kv.pages_to_admit(req, m, growth)
            if self.running and need + others > kv.available_pages:
                self.preemption.consider(req, need, now, self.running)
                break  # the pool cannot hold it beside what is running: it waits, and nothing overtakes it
            can_run = (len(self.running) < self.max_running_requests and kv.table.free_rows > 0
                       and budget > 0)
            if not can_run or prefetch.should_wait(req, m.host_length, bool(self.running)):
                # Next in line but not running this step: load its host part meanwhile, and keep its room.
                if prefetch.start(req, m):
                    version = getattr(kv.cache, "version", 0)
                    need = kv.pages_to_admit(req, match(req), growth)
                    prefetch_need[id(req)] = need
                reserved = others + need
                continue
            n = self._try_admit(req, m, budget, reserve_pages)
            if n is None and prefetch.cancel_behind(req, order):  # memory held for those behind it goes first
                n = self._try_admit(req, match(req), budget, reserve_pages)
            if n is None:
                break
            admitted.add(id(req))
            if req is self.preemption.first:
                self.preemption.done()
            self._match_cache.pop(id(req), None)
            prefetch.admitted(req)
            req.state = ReqState.RUNNING
            if adapters is not None:
                adapters.acquire(req)
            self.running.append(req)
            self._add_to_batch(batch, req, n)
            reserved = others + kv.pages_to_finish(req, growth)
            budget -= n
            leaders.add(req)
            version = getattr(kv.cache, "version", 0)
        if admitted:  # one pass (list.remove per request would compare Reqs field by field)
            self.waiting = [r for r in self.waiting if id(r) not in admitted]

    def _try_admit(self, req: Req, m, budget: int, reserve_pages: int) -> int | None:
        """Admit req on its match m (KVManager.admit) and get the pages of its first chunk plus reserve_pages.
        Returns the chunk's tokens, or None when the pool cannot make room (req is released again, as before)."""
        kv = self.kv
        first_admission = req.num_cached_tokens is None
        kv.admit(req, m)
        n = _chunk_end(req, min(req.num_pending, budget))
        if kv.ensure_pages(kv.pages_for(req, n) + reserve_pages):
            return n
        kv.release(req)
        if first_admission:  # it did not run: its reused-prompt count is taken when it does
            req.num_cached_tokens = None
        return None

    @staticmethod
    def _shares_uncached_prefix(req: Req, matched: int, leaders: list[Req]) -> bool:
        """The reference of UncachedPrefixIndex.shares: does req share the PREFIX_DEDUP_MIN_TOKENS tokens after
        its cached `matched` with a leader (same salt, both long enough)?"""
        ids = req.all_ids
        for leader in leaders:
            if leader.salt != req.salt:
                continue
            other = leader.all_ids
            n = min(len(ids) - 1, len(other))
            if n - matched < PREFIX_DEDUP_MIN_TOKENS or ids[matched:matched + PREFIX_DEDUP_MIN_TOKENS] != \
                    other[matched:matched + PREFIX_DEDUP_MIN_TOKENS]:
                continue
            return True
        return False

    # ------------------------------------------------------------------ preemption for a first token
    def _preempt(self, batch: ScheduledBatch) -> None:
        """Retract (to the host) running requests until the request the last admission pass recorded
        (FirstTokenPreemption.consider) fits, and put it first in this step's admission order. Done before the
        running requests are planned, so no victim is in the batch."""
        preemption = self.preemption
        req, need = preemption.pending
        preemption.pending = None
        if req not in self.waiting:
            return
        kv, est = self.kv, self.estimate
        reserved = sum(kv.pages_to_finish(r, est.remaining(r)) for r in self.running)
        for victim in preemption.candidates(req, self.running):
            if need + reserved <= kv.available_pages:
                break
            reserved -= kv.pages_to_finish(victim, est.remaining(victim))
            self._retract(victim, preempted=True)
            batch.retracted.append(victim)
            preemption.held_back.add(id(victim))
        preemption.first = req

    @property
    def preempted_total(self) -> int:
        return self.preemption.preempted_total

    # ------------------------------------------------------------------ retraction
    def _pick_victim(self) -> Req | None:
        if not self.running:
            return None
        # Lowest priority first, then the one that costs least to resume: fewest tokens of its own (its prefix
        # shared with other running requests stays in the pool), then the most recently arrived.
        shared = self.kv.cache.shared_on_path
        return min(self.running, key=lambda r: (r.params.priority, r.kv_len - shared(r.cache_handle), -r.arrival))

    def _retract(self, req: Req, preempted: bool = False) -> None:
        self._match_cache.pop(id(req), None)  # it runs on: its tokens, and so its match, change
        self.running.remove(req)
        self.kv.release(req, to_host=True)
        if self.adapters is not None:
            self.adapters.release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        self.retracted_total += 1
        if preempted:
            self.preemption.preempted_total += 1
        else:
            self.estimate.retracted()  # out of memory: the estimate was too low
        self.waiting.insert(0, req)


def _chunk_end(req: Req, n: int) -> int:
    """n tokens of req's pending ones, fewer where they would split an image block (its tokens attend each other)."""
    return n if req.images is None else req.images.chunk_end(req.kv_len, n)


class UncachedPrefixIndex:
    """The leaders of one admission pass (requests prefilling tokens that are not cached yet), indexed for
    Scheduler._shares_uncached_prefix's question: per position p asked about, the set of (salt, the
    PREFIX_DEDUP_MIN_TOKENS tokens at p) of the leaders long enough. One dict lookup per waiting request instead
    of a slice comparison per leader (64 requests on one shared prefix: 63 followers x up to 63 leaders)."""

    def __init__(self, leaders: list[Req]):
        self._leaders: list[Req] = list(leaders)
        self._by_pos: dict[int, set[tuple]] = {}

    def add(self, leader: Req) -> None:
        self._leaders.append(leader)
        for pos, windows in self._by_pos.items():
            self._index(windows, pos, leader)

    def shares(self, req: Req, matched: int) -> bool:
        ids = req.all_ids
        if len(ids) - 1 - matched < PREFIX_DEDUP_MIN_TOKENS:
            return False
        windows = self._by_pos.get(matched)
        if windows is None:
            windows = self._by_pos[matched] = set()
            for leader in self._leaders:
                self._index(windows, matched, leader)
        return (req.salt, tuple(ids[matched:matched + PREFIX_DEDUP_MIN_TOKENS])) in windows

    @staticmethod
    def _index(windows: set[tuple], pos: int, leader: Req) -> None:
        other = leader.all_ids
        if len(other) - pos >= PREFIX_DEDUP_MIN_TOKENS:
            windows.add((leader.salt, tuple(other[pos:pos + PREFIX_DEDUP_MIN_TOKENS])))
