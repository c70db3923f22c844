"""The wire records of prefill/decode disaggregation (disagg/decode.py): what travels on a KV stream besides
the K/V layers themselves (parallel/kv_transport.py), one frozen dataclass per message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVRequest:
    """decode -> prefill: send K/V of positions [start, len(tokens)) of tokens (salt: the request's cache_salt)."""

    xfer_id: int
    tokens: list[int]
    salt: Any
    start: int


@dataclass(frozen=True)
class Cancel:
    """decode -> prefill: the request is gone; answer "cancelled" if the transfer has not started."""

    xfer_id: int


@dataclass(frozen=True)
class KVHeader:
    """prefill -> decode: "sending" (num_layers K/V tensors of num_tokens follow), "cancelled" (never started,
    nothing follows) or "failed" (nothing follows; error says why)."""

    xfer_id: int
    status: str
    num_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EndOfStream:
    """Either way: nothing more comes on this stream (the receiver answers with its own EndOfStream)."""
