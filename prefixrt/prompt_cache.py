"""PromptCache: what a request asks of the prefix cache beyond plain reuse, in the engine's terms.

The callers' vocabularies (OpenAI's `prompt_cache_key`, `prompt_cache_retention`, `prompt_cache_options` and
content-block `prompt_cache_breakpoint`; Anthropic's `cache_control`) are lowered to this record by
prefixrt/lowering/prompt_cache.py once the prompt is tokenized; it travels in SamplingParams.prompt_cache.

- `session`: the session key. Requests with one key are turns of one session: the scheduler gives them one
  priority and brings their K/V back to the pool ahead of the next turn.
- `keep`: prefixes of the prompt to keep for at least a time (a kept prefix is a contract: it is not dropped from
  the pool and host tiers before its time is up; it may move from the pool to the host tier). Each is a token
  count of the prompt, so the prefixes are nested. The engine may refuse a keep that would take a tenant
  (cache_salt) over its share; the response then says so (cache/pins.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prefixrt.errors import InvalidRequest

MAX_KEEPS = 4  # kept prefixes one request may write (OpenAI's and Anthropic's limit of breakpoints)
MAX_TTL_S = 24 * 3600.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_ttl(text: str, param: str) -> float:
    """A duration as the APIs spell it ("5m", "30m", "1h", "24h") -> seconds; InvalidRequest naming `param`."""
    m = _DURATION.match(text) if isinstance(text, str) else None
    if m is None:
        raise InvalidRequest(f"{param} must be a duration such as '5m', '30m', '1h' or '24h', got {text!r}",
                             param=param)
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not 0 < seconds <= MAX_TTL_S:
        raise InvalidRequest(f"{param} must be more than 0 and at most 24h, got {text!r}", param=param)
    return seconds


@dataclass(frozen=True)
class KeepPrefix:
    """Keep the prompt's first `num_tokens` tokens cached for at least `ttl_s` seconds from the request's end."""

    num_tokens: int
    ttl_s: float


@dataclass(frozen=True)
class PromptCache:
    session: str | None = None
    keep: tuple[KeepPrefix, ...] = ()

    def __post_init__(self):
        if self.session is not None and (not isinstance(self.session, str) or not self.session):
            raise InvalidRequest("the prompt cache key must be a non-empty string", param="prompt_cache_key")
        keep = tuple(k if isinstance(k, KeepPrefix) else KeepPrefix(**k) for k in self.keep)
        if len(keep) > MAX_KEEPS:
            raise InvalidRequest(f"at most {MAX_KEEPS} cache breakpoints per request, got {len(keep)}",
                                 param="prompt_cache")
        for k in keep:
            if isinstance(k.num_tokens, bool) or not isinstance(k.num_tokens, int) or k.num_tokens < 1:
                raise InvalidRequest(f"a kept prefix needs at least one token, got {k.num_tokens!r}",
                                     param="prompt_cache")
            if not isinstance(k.ttl_s, (int, float)) or not 0 < k.ttl_s <= MAX_TTL_S:
                raise InvalidRequest(f"a kept prefix's lifetime must be in (0, 24h], got {k.ttl_s!r} s",
                                     param="prompt_cache")
        # One entry per length (the longest lifetime wins), shortest first.
        by_len: dict[int, float] = {}
        for k in keep:
            by_len[k.num_tokens] = max(by_len.get(k.num_tokens, 0.0), float(k.ttl_s))
        object.__setattr__(self, "keep", tuple(KeepPrefix(n, t) for n, t in sorted(by_len.items())))

    @classmethod
    def coerce(cls, value) -> PromptCache | None:
        """A PromptCache, a dict of its fields ({"session", "keep": [{"num_tokens", "ttl_s"}]}) or None."""
        if value is None or isinstance(value, PromptCache):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"session", "keep"})
            if unknown:
                raise InvalidRequest(f"prompt_cache has no field {unknown[0]!r}", param="prompt_cache")
            return cls(value.get("session"), tuple(value.get("keep") or ()))
        raise InvalidRequest(f"prompt_cache must be a PromptCache or a dict, not {type(value).__name__}",
                             param="prompt_cache")

    @property
    def longest_keep(self) -> int:
        """Tokens of the longest kept prefix (0: none)."""
        return self.keep[-1].num_tokens if self.keep else 0
