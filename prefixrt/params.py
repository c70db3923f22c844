"""SamplingParams: how to decode one request. Validated on construction; invalid values raise InvalidRequest."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest

CONSTRAINT_FIELDS = ("regex", "json_schema", "grammar", "choices")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    regex: str | None = None
    json_schema: Any = None  # dict, JSON text, or a pydantic model class
    grammar: str | None = None
    choices: list[str] | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    # Internal knobs (not in the public contract, but harmless to set):
    jump_forward: bool = True  # emit grammar-forced tokens in one forward
    # choices scoring: "token_length_normalized" (mean logprob, default) | "sum" | "unconditional_normalized"
    choices_method: str = "token_length_normalized"
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: outputs carry token ids only (token-level benchmarks)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def coerce(cls, params: SamplingParams | dict | None) -> SamplingParams:
        """Accept a SamplingParams, a plain dict (unknown keys rejected) or None (defaults)."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return dataclasses.replace(params)  # copy: never mutate the caller's object
        if isinstance(params, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(params) - names)
            if unknown:
                raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
            return cls(**params)
        raise InvalidRequest(f"params must be SamplingParams, dict or None, not {type(params).__name__}")

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, msg: str, param: str):
            if not cond:
                raise InvalidRequest(msg, param=param)

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}", "max_new_tokens")
        need(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be an integer in [0, max_new_tokens], got {self.min_new_tokens!r}",
             "min_new_tokens")
        need(is_num(self.temperature) and self.temperature >= 0,
             f"temperature must be a number >= 0, got {self.temperature!r}", "temperature")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (off) or >= 1, got {self.top_k!r}", "top_k")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(is_num(v) and -2 <= v <= 2, f"{name} must be in [-2, 2], got {v!r}", name)
        need(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        need(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            need(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
                 "stop must be a string or a list of strings", "stop")
            self.stop = [s for s in self.stop if s]  # empty stop strings would match everywhere: drop them
        if self.stop_token_ids is not None:
            need(isinstance(self.stop_token_ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be a list of non-negative integers", "stop_token_ids")
            self.stop_token_ids = list(self.stop_token_ids)
        need(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
        need(is_int(self.n) and 1 <= self.n <= 256, f"n must be an integer in [1, 256], got {self.n!r}", "n")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}", "logprobs")
        need(is_int(self.priority), "priority must be an integer", "priority")
        need(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt must be a string", "cache_salt")
        need(self.request_id is None or isinstance(self.request_id, str), "request_id must be a string", "request_id")
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        need(len(given) <= 1, f"at most one of regex, json_schema, grammar, choices may be set; got {', '.join(given)}",
             given[-1] if given else "regex")
        need(not (self.min_new_tokens and given), "min_new_tokens cannot be combined with a constraint (the "
             "constraint decides where the output ends)", "min_new_tokens")
        if self.regex is not None:
            need(isinstance(self.regex, str) and self.regex != "", "regex must be a non-empty string", "regex")
        if self.grammar is not None:
            need(isinstance(self.grammar, str) and self.grammar.strip() != "", "grammar must be a non-empty string",
                 "grammar")
        if self.choices is not None:
            need(isinstance(self.choices, (list, tuple)) and len(self.choices) > 0
                 and all(isinstance(c, str) and c for c in self.choices),
                 "choices must be a non-empty list of non-empty strings", "choices")
            self.choices = list(self.choices)

        need(self.choices_method in ("token_length_normalized", "sum", "unconditional_normalized"),
             f"choices_method must be token_length_normalized, sum or unconditional_normalized, "
             f"got {self.choices_method!r}", "choices_method")

    # ------------------------------------------------------------------ derived
    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def constraint_kind(self) -> str | None:
        for f in CONSTRAINT_FIELDS:
            if getattr(self, f) is not None:
                return f
        return None

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
