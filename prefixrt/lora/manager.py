"""LoraManager: the engine's LoRA adapters. One object the engine's parts call:

- callers' threads: `register` (read a PEFT folder, check it against the model, pack its host copy) and `lookup`
  (a request's adapter by name, InvalidRequest if unknown);
- the loop thread: `unregister` (refused while a request uses the adapter), the request hooks (`on_add`,
  `on_finish`), the scheduler's gate (`admissible`, `acquire`, `release`, `prefetch`: a request runs only once its
  adapter is resident in a GPU slot, which slots.py loads beside the running batch), the forward's plan (`batch_for`:
  each sequence's slot), and the per-adapter counters (`snapshot`).

A request's adapter is part of its cache namespace (request.py AdapterNamespace, set by the engine as Req.salt):
K/V computed under one adapter is never matched by another adapter's request nor the base model's, in any tier.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from prefixrt.errors import InvalidRequest
from prefixrt.lora.peft_format import LoraAdapter, read_adapter
from prefixrt.lora.registry import AdapterRegistry, PackedAdapter, check_name, pack
from prefixrt.lora.slots import AdapterSlots
from prefixrt.model.lora import LoraBatch, LoraWeights
from prefixrt.request import AdapterNamespace, Req

COUNTERS = ("requests_total", "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total", "loads_total",
            "load_seconds_total")


class LoraManager:
    def __init__(self, linears: dict[tuple[int, str], LoraWeights], num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: bool = False, num_sms: int = 0, load_delay_s: float = 0.0):
        """linears: the model's slotted projections (model/lora.py attach_lora_slots). kernels / num_sms: how forwards
        compute the update (LoraBatch). load_delay_s: race mode for tests (slots.py)."""
        self.linears = linears
        self.rank = rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels
        self.num_sms = num_sms
        self.registry = AdapterRegistry()
        self.slots = AdapterSlots(num_slots, self.device, load_delay_s)
        self.slots.on_loaded = self._loaded
        self._inflight: dict[str, int] = {}  # adapter name -> requests added and not finished (loop thread)
        self._added: set[int] = set()  # id() of those requests
        self._held: set[int] = set()  # id() of admitted requests holding their adapter's slot
        self._counts: dict[str, dict] = {}  # adapter name -> COUNTERS
        self._lock = threading.Lock()  # _counts: written on the loop thread, created by register on any thread

    @property
    def num_slots(self) -> int:
        return len(self.slots.slots)

    # ------------------------------------------------------------------ adapters (callers' threads)
    def register(self, name: str, source: str | Path | LoraAdapter) -> PackedAdapter:
        """Load an adapter under `name` (a PEFT folder, or a LoraAdapter made in memory). Host work only: it becomes
        resident on the GPU when a request needs it. ValueError if it does not fit the model or the name is taken."""
        check_name(name)
        if self.registry.get(name) is not None:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        adapter = source if isinstance(source, LoraAdapter) else read_adapter(name, source, self.dtype)
        adapter.name = name
        packed = pack(adapter, self.linears, self.rank, pin=self.device.type == "cuda")
        self.registry.add(packed)
        with self._lock:
            self._counts.setdefault(name, dict.fromkeys(COUNTERS, 0))
        return packed

    def lookup(self, name: str) -> PackedAdapter:
        """The adapter a request names (InvalidRequest, param "model", if none is loaded under that name)."""
        packed = self.registry.get(name) if isinstance(name, str) else None
        if packed is None:
            known = ", ".join(sorted(self.registry.names())) or "none"
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded (loaded: {known})", param="model")
        return packed

    def names(self) -> list[str]:
        return self.registry.names()

    # ------------------------------------------------------------------ the loop thread
    def unregister(self, name: str) -> None:
        """Unload an adapter: refused (ValueError) while requests use it; its slot is freed unless another name holds
        the same files."""
        packed = self.registry.get(name)
        if packed is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        if self._inflight.get(name, 0):
            raise ValueError(f"LoRA adapter {name!r} is in use by {self._inflight[name]} request(s); unload it once "
                             "they finish")
        self.registry.remove(name)
        if not self.registry.shares_digest(packed.digest):
            self.slots.drop(packed.digest)

    def namespace(self, packed: PackedAdapter, cache_salt: str | None) -> AdapterNamespace:
        return AdapterNamespace(packed.digest, cache_salt)

    def on_add(self, req: Req) -> str | None:
        """A request reaches the loop: counted in use; an error message if its adapter was unloaded since."""
        packed = req.adapter
        if packed is None:
            return None
        if self.registry.get(packed.name) is not packed:
            return f"LoRA adapter {packed.name!r} was unloaded before the request could run"
        self._inflight[packed.name] = self._inflight.get(packed.name, 0) + 1
        self._added.add(id(req))
        if req.index == 0:
            self._count(packed.name, "requests_total", 1)
        return None

    def on_finish(self, req: Req) -> None:
        """A request is finished (after the scheduler released it): no longer in use; its tokens counted."""
        packed = req.adapter
        if packed is None or id(req) not in self._added:
            return
        self._added.discard(id(req))
        left = self._inflight[packed.name] - 1
        if left:
            self._inflight[packed.name] = left
        else:
            del self._inflight[packed.name]
        if req.num_cached_tokens is not None and req.prompt_counted:
            self._count(packed.name, "prompt_tokens_total", len(req.prompt_ids))
            self._count(packed.name, "cached_tokens_total", req.num_cached_tokens)
        self._count(packed.name, "generated_tokens_total", len(req.output_ids))

    def admissible(self, req: Req) -> bool:
        """Whether req may be admitted now: the base model's always; an adapter's once it is resident with its load
        complete (its load starts in `prefetch`, which the scheduler calls first in every pass; meanwhile the
        request waits and others go on)."""
        packed = req.adapter
        return packed is None or self.slots.ready(packed.digest)

    def prefetch(self, waiting: list[Req]) -> None:
        """Start the loads of the adapters waiting requests need, in their order (the scheduler's admission order),
        while slots can take them. A load never evicts an adapter that a request ahead of it in line needs: an
        adapter loaded for a waiting request stays until that request is admitted, however many requests behind it
        want a slot (else a load completing between two passes would be evicted by the next pass's loads, before
        its request could run, and the slots would thrash); and evicts one that a request behind it needs only when
        no other slot is idle."""
        wanted = {r.adapter.digest for r in waiting if r.adapter is not None}
        ahead: set[str] = set()
        started = 0
        for r in waiting:
            packed = r.adapter
            if packed is None:
                continue
            if self.slots.slot_of(packed.digest) is None:
                if started == self.num_slots or not self.slots.request(packed.digest, packed.copy_into, ahead, wanted):
                    return
                started += 1
            ahead.add(packed.digest)

    def acquire(self, req: Req) -> None:
        """An admitted request holds its adapter's slot until release (finish or retraction)."""
        if req.adapter is not None and id(req) not in self._held:
            self.slots.acquire(req.adapter.digest)
            self._held.add(id(req))

    def release(self, req: Req) -> None:
        if id(req) in self._held:
            self._held.discard(id(req))
            self.slots.release(req.adapter.digest)

    def batch_for(self, reqs: list[Req], row_lens: list[int]) -> LoraBatch | None:
        """The forward's LoraBatch (each sequence's slot), or None when every row runs the base model."""
        slot_of = self.slots.slot_of
        row_slots = [-1 if r.adapter is None else slot_of(r.adapter.digest) for r in reqs]
        if all(s == -1 for s in row_slots):
            return None
        return LoraBatch(row_slots, list(row_lens), self.device, self.kernels, self.num_sms)

    # ------------------------------------------------------------------ stats
    def _count(self, name: str, counter: str, n) -> None:
        with self._lock:
            self._counts.setdefault(name, dict.fromkeys(COUNTERS, 0))[counter] += n

    def _loaded(self, digest: str, seconds: float) -> None:
        for name in self.registry.names():
            packed = self.registry.get(name)
            if packed is not None and packed.digest == digest:
                self._count(name, "loads_total", 1)
                self._count(name, "load_seconds_total", seconds)

    def snapshot(self) -> dict:
        """Per loaded adapter (by name): its counters, cache_hit_rate and whether it is resident now; and the slots'
        totals (load_busy_seconds_total: seconds with at least one load in flight). Loop thread."""
        resident = {d for d, i in self.slots.by_digest.items() if self.slots.ready(d)}
        with self._lock:
            counts = {name: dict(c) for name, c in self._counts.items()}
        adapters = {}
        for name in self.registry.names():
            packed = self.registry.get(name)
            if packed is None:
                continue
            c = counts.get(name, dict.fromkeys(COUNTERS, 0))
            c["cache_hit_rate"] = c["cached_tokens_total"] / c["prompt_tokens_total"] if c["prompt_tokens_total"] \
                else 0.0
            c["resident"] = packed.digest in resident
            c["rank"] = packed.rank
            adapters[name] = c
        return {"adapters": adapters, "slots": self.num_slots, "resident": len(resident),
                "loads_total": self.slots.loads_total, "load_seconds_total": self.slots.load_seconds_total,
                "load_busy_seconds_total": self.slots.load_busy_seconds_total}

    def check(self, idle: bool = False) -> None:
        """Debug: the slot table agrees with itself; idle: no request holds a slot or counts as in use."""
        self.slots.check()
        if idle:
            assert not self._held and not self._inflight, (self._held, self._inflight)
            assert all(s.refs == 0 for s in self.slots.slots), "an idle engine holds a LoRA slot"

    def close(self) -> None:
        self.slots.close()
