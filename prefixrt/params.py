"""SamplingParams: how to decode one request. Validated on construction; invalid values raise InvalidRequest."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.text_checks import MAX_JSON_DEPTH, check_json_value, check_text
from prefixrt.prompt_cache import PromptCache

CONSTRAINT_FIELDS = ("regex", "json_schema", "grammar", "choices", "json_object")

# Sampler ranges (validate() documents them). Temperatures below MIN_TEMPERATURE decode greedily (as vLLM);
# above MAX_TEMPERATURE the distribution is uniform for any practical purpose.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# Dividing or multiplying float32 logits by the penalty must stay finite.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # int64 or uint64, what torch.Generator.manual_seed accepts


def internal(default: Any = dataclasses.MISSING, **kw) -> Any:
    """A SamplingParams field that is no request option (requests cannot set it by name; lowering/options.py)."""
    return field(default=default, metadata={"option": None}, **kw)


def option_names(params_cls: type | None = None) -> dict[str, str]:
    """Request option name -> SamplingParams field: every field but the internal ones, under its own name or the
    name its metadata gives (`option`). One declaration of a field is all a new option needs: lowering
    (lowering/options.py) and the server's request bodies (server/protocol.py) read this."""
    out = {}
    for f in dataclasses.fields(params_cls or SamplingParams):
        name = f.metadata.get("option", f.name)
        if name is not None:
            out[name] = f.name
    return out


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    # EOS and stop_token_ids are masked until this many tokens were generated (requests say min_tokens, as vLLM)
    min_new_tokens: int = field(default=0, metadata={"option": "min_tokens"})
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    regex: str | None = None
    json_schema: Any = None  # dict, JSON text, or a pydantic model class (prefixrt/lowering/json_schema.py)
    grammar: str | None = None
    choices: list[str] | None = None
    json_object: bool = False  # any JSON object (OpenAI response_format json_object)
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = internal(None)
    speculative: bool = True  # False: this request never speculates (an engine with speculative decoding on)
    # Internal knobs (not in the public contract, but harmless to set):
    jump_forward: bool = internal(True)  # emit grammar-forced tokens in one forward
    # choices scoring: "token_length_normalized" (mean logprob, default) | "sum" | "unconditional_normalized"
    choices_method: str = internal("token_length_normalized")
    skip_special_tokens: bool = True
    detokenize: bool = internal(True)  # False: outputs carry token ids only (token-level benchmarks)
    extra: dict = internal(default_factory=dict)
    # The session key and kept prefixes of the prompt (prefixrt/prompt_cache.py), set by lowering; None: plain reuse
    prompt_cache: PromptCache | None = internal(None)
    # The LoRA adapter to run under, by its loaded name (None: the base model); set in-process, or by the server from
    # a request's `model` (so no request option: an OpenAI body names its adapter by model only)
    lora: str | None = internal(None)

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
        """Check every field against the range the sampler executes; normalise stop/stop_token_ids/choices.

        Ranges (an out-of-range value raises InvalidRequest naming the field; NaN and infinities never pass):
        temperature in [0, MAX_TEMPERATURE] (below MIN_TEMPERATURE it means greedy), top_p in (0, 1],
        top_k -1 (off) or >= 1 (the sampler clamps it to the vocabulary), min_p in [0, 1], frequency and
        presence penalties in [-2, 2], repetition_penalty in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY],
        seed a signed or unsigned 64-bit integer (the generator of sample i uses (seed + i) mod 2**64),
        n in [1, 256], logprobs None or in [0, 20], max_new_tokens >= 0. Text fields must be valid Unicode
        without NUL; a JSON schema is bounded in depth and size (text_checks).
        """
        def need(cond: bool, msg: str, param: str):
            if not cond:
                raise InvalidRequest(msg, param=param)

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                return False
            try:
                return math.isfinite(x)
            except OverflowError:  # an int too large for a float
                return False

        def in_range(x, lo, hi):
            return is_num(x) and lo <= x <= hi

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}", "max_new_tokens")
        need(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be an integer in [0, max_new_tokens], got {self.min_new_tokens!r}",
             "min_new_tokens")
        need(in_range(self.temperature, 0, MAX_TEMPERATURE),
             f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}", "temperature")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (off) or >= 1, got {self.top_k!r}", "top_k")
        need(in_range(self.min_p, 0, 1), f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(in_range(v, -2, 2), f"{name} must be in [-2, 2], got {v!r}", name)
        need(in_range(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
             f"got {self.repetition_penalty!r}", "repetition_penalty")
        if self.logit_bias is not None:
            self.logit_bias = checked_logit_bias(self.logit_bias) or None
        need(self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            need(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
                 "stop must be a string or a list of strings", "stop")
            for s in self.stop:
                check_text(s, "stop")
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
        need(isinstance(self.speculative, bool), "speculative must be a boolean", "speculative")
        need(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt must be a string", "cache_salt")
        need(self.lora is None or (isinstance(self.lora, str) and self.lora != ""),
             "lora must be the name of a loaded LoRA adapter", "lora")
        need(self.request_id is None or isinstance(self.request_id, str), "request_id must be a string", "request_id")
        self.prompt_cache = PromptCache.coerce(self.prompt_cache)
        need(isinstance(self.json_object, bool), "json_object must be a boolean", "json_object")
        if isinstance(self.json_schema, str) and self.json_schema == "json_object":  # the earlier spelling
            self.json_schema, self.json_object = None, True
        given = [f for f in CONSTRAINT_FIELDS if _constraint_given(self, f)]
        need(len(given) <= 1,
             f"at most one of regex, json_schema, grammar, choices, json_object may be set; got {', '.join(given)}",
             given[-1] if given else "regex")
        need(not (self.min_new_tokens and given), "min_new_tokens cannot be combined with a constraint (the "
             "constraint decides where the output ends)", "min_new_tokens")
        if self.regex is not None:
            need(isinstance(self.regex, str) and self.regex != "", "regex must be a non-empty string", "regex")
            check_text(self.regex, "regex")
        if self.grammar is not None:
            need(isinstance(self.grammar, str) and self.grammar.strip() != "", "grammar must be a non-empty string",
                 "grammar")
            check_text(self.grammar, "grammar")
        if self.choices is not None:
            need(isinstance(self.choices, (list, tuple)) and len(self.choices) > 0
                 and all(isinstance(c, str) and c for c in self.choices),
                 "choices must be a non-empty list of non-empty strings", "choices")
            for c in self.choices:
                check_text(c, "choices")
            self.choices = list(self.choices)
        if self.json_schema is not None:
            _check_json_schema(self.json_schema)

        need(self.choices_method in ("token_length_normalized", "sum", "unconditional_normalized"),
             f"choices_method must be token_length_normalized, sum or unconditional_normalized, "
             f"got {self.choices_method!r}", "choices_method")

    def generator_seed(self, index: int) -> int:
        """The torch.Generator seed of sample `index`: (seed + index) mod 2**64, always accepted by
        torch.Generator.manual_seed."""
        return (self.seed + index) % 2**64

    # ------------------------------------------------------------------ derived
    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below MIN_TEMPERATURE (dividing logits by it would overflow float32
        into NaN probabilities) or top_k == 1."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def constraint_kind(self) -> str | None:
        """The one constraint set ("regex" | "json_schema" | "grammar" | "choices" | "json_object"), or None."""
        for f in CONSTRAINT_FIELDS:
            if _constraint_given(self, f):
                return f
        return None

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def checked_logit_bias(bias: Any) -> dict[int, float]:
    """A logit_bias ({token id: bias}; ids may be JSON strings, as OpenAI sends them) -> {int id: float}.
    Raises one InvalidRequest naming every offending key: ids must be integers >= 0 (the vocabulary bound is
    the engine's to check), values numbers in [-100, 100] (OpenAI's range)."""
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    out: dict[int, float] = {}
    not_ids, bad_values = [], []
    for k, v in bias.items():
        try:
            tid = int(k) if not isinstance(k, (bool, float)) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or tid < 0:
            not_ids.append(k)
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:  # NaN fails too
            bad_values.append(f"{k!r}: {v!r}")
        else:
            out[tid] = float(v)
    problems = []
    if not_ids:
        problems.append(f"keys that are not token ids: {', '.join(repr(k) for k in not_ids)}")
    if bad_values:
        problems.append(f"values outside [-100, 100] (numbers only): {', '.join(bad_values)}")
    if problems:
        raise InvalidRequest(f"logit_bias has {'; '.join(problems)}", param="logit_bias")
    return out


def _constraint_given(p: SamplingParams, name: str) -> bool:
    value = getattr(p, name)
    return value is True if name == "json_object" else value is not None


def _check_json_schema(spec: Any) -> None:
    """Depth, size and text checks of a json_schema given as a dict or JSON text (pydantic classes make their
    own bounded schemas; other types are refused later by the constraint compiler)."""
    if isinstance(spec, type):
        return
    if isinstance(spec, bytes):
        try:
            spec = spec.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("json_schema is not valid UTF-8", param="json_schema") from None
    if isinstance(spec, str):
        check_text(spec, "json_schema")
        try:
            spec = json.loads(spec)
        except RecursionError:
            raise InvalidRequest(f"json_schema is nested too deeply (more than {MAX_JSON_DEPTH} levels)",
                                 param="json_schema") from None
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", param="json_schema") from None
    check_json_value(spec, "json_schema")
