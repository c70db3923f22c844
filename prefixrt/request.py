"""Req: one sequence being generated, as the scheduler loop sees it (one per sample when n > 1).

A shared record on the bottom floor (beside params.py and outputs.py): the engine creates and advances it,
cache/kv_manager.py owns its KV fields, sampling/sampler.py reads its params and sampling state. It imports
nothing but SamplingParams, so all of them depend downward on it. What another component keeps about a request
(its host-tier loads and disk reads: cache/tier_loads.py; its speculation state: speculative/; its text state:
engine/detokenizer.py) is held by that component, keyed by the request: a Req hashes and compares by identity. ImageKey, the token of an image position in a
keyed prompt, lives here for the same reason: multimodal/ makes it, cache/ stores it.

Token layout: all_ids = prompt_ids + output_ids, every token the host knows. With overlap scheduling the
sequence may be one token longer than that: a token sampled on the device whose value the host has not read
yet (num_unresolved, at most 1 when the scheduler runs). seq_len counts it; the next forward feeds it from the
device (`future`). The pool holds K/V for positions [0, kv_len); the next forward feeds positions
[kv_len, seq_len) (the whole prompt at first, in chunks; then one sampled token, or a sampled token followed
by grammar-forced ones).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from prefixrt.params import SamplingParams


@dataclass(frozen=True, eq=False)
class ImageKey:
    """The content key of one processed image (multimodal/processor.py makes them): equal only when the full
    sha256 digests are equal. An image token in a radix key is (ImageKey, offset), so an image token never
    equals a text token (an int) nor the token of a different image, in any tier of the cache (the disk tier
    stores the digests with the K/V: cache/disk_format.py)."""

    digest: bytes  # sha256, 32 bytes

    def __eq__(self, other) -> bool:
        return isinstance(other, ImageKey) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"ImageKey({self.digest.hex()[:12]}...)"


@dataclass(frozen=True)
class AdapterNamespace:
    """The cache namespace of a request run under a LoRA adapter (Req.salt; the base model's requests keep their
    cache_salt as it is). Equal only to another AdapterNamespace of the same adapter digest and cache_salt, so K/V
    computed under an adapter is never matched by the base model, another adapter or another tenant, in any tier:
    no string a caller sends (cache_salt, prompt_cache_key) can spell it. The disk tier writes it as to_json()."""

    adapter: str  # the adapter's digest (lora/peft_format.py): same files, same K/V
    salt: str | None = None  # the request's cache_salt

    def to_json(self) -> dict:
        return {"lora": self.adapter, "salt": self.salt}


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Any  # where its StepOutputs go: a RequestStream (engine/stream.py) or the process pipe's sink
    index: int = 0  # which of the n samples
    salt: Any = None  # its cache namespace: cache_salt, or AdapterNamespace under a LoRA adapter (never shared)
    adapter: Any = None  # the LoRA adapter it runs under (lora/registry.py PackedAdapter); None: the base model
    # Images (multimodal/inputs.py ReqImages) or None: prompt_ids then holds (ImageKey, offset) at their placeholders
    images: Any = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    all_ids: list[int] = field(default_factory=list)  # prompt_ids + output_ids, kept in step with them
    state: ReqState = ReqState.WAITING
    # KV state (owned by KVManager)
    row: int | None = None  # row in the request-to-token table
    pages: list[int] = field(default_factory=list)  # pool pages covering positions [0, len(pages)*page_size)
    kv_len: int = 0  # tokens of all_ids with K/V in the pool
    cached_len: int = 0  # leading tokens whose pages belong to the radix tree (locked via cache_handle)
    cache_handle: Any = None
    # Reporting
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission (None: not admitted yet)
    prompt_counted: bool = False  # its prompt/cached tokens are in EngineStats (counted once, at first forward)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    first_token_time: float | None = None
    admitted_time: float | None = None  # when it was first admitted to run (time.monotonic())
    num_forced_tokens: int = 0  # tokens emitted by jump-forward without sampling
    pending_emit: list[int] = field(default_factory=list)  # step-0 forced tokens, streamed with the first token
    # Sampling state
    generator: Any = None  # torch.Generator when params.seed is set
    matcher: Any = None  # grammar matcher when a constraint is set
    # Prompt logprobs (select scoring): report log p(all_ids[k]) for k >= input_logprobs_from
    input_logprobs_from: int | None = None
    input_logprobs: list[float] = field(default_factory=list)
    retractions: int = 0
    # Overlap scheduling (engine/loop/core.py): samples launched on the device and not yet read by the host
    num_unresolved: int = 0
    future: Any = None  # (step, row): where the last unresolved token lives on the device
    chunk_step: Any = None  # the step whose prefill chunk is launched and not yet published to the cache
    epoch: int = 0  # bumped when the host rewrites what follows (jump-forward): samples in flight go stale
    # Kept prefixes (params.prompt_cache.keep): the decision on them (cache/pins.py KeepGrant), held until the last
    # release pins them; keep_report is what the request's next output says about it (KeepGrant.report), sent once
    keep_grant: Any = None
    keep_report: dict | None = None

    def __post_init__(self):
        self.all_ids = list(self.prompt_ids) + list(self.output_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_ids.extend(token_ids)
        self.all_ids.extend(token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence, including a sampled token the host has not read yet."""
        return len(self.all_ids) + self.num_unresolved

    @property
    def num_pending(self) -> int:
        """Tokens the next forward must feed for this request."""
        return self.seq_len - self.kv_len

    @property
    def in_prefill(self) -> bool:
        return self.num_pending > 1 or not self.output_ids

    @property
    def remaining_new_tokens(self) -> int:
        """Output tokens still allowed, counting only tokens the host knows."""
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finishes_on_resolve(self) -> bool:
        """Its unresolved token is its last (max_new_tokens): scheduling it again would only be discarded."""
        return self.num_unresolved > 0 and len(self.output_ids) + self.num_unresolved >= self.params.max_new_tokens
