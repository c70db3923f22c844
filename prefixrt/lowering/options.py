"""Options under OpenAI's and the frameworks' names -> SamplingParams fields, each checked once.

Every door lowers its options here: the server's chat, completions and Responses routes (lowering/chat.py,
lowering/completion.py) and the DSPy and LangChain adapters (`sampling_options`). An option prefixrt has no
meaning for is refused (no silent drops). What OpenAI asks of an option beyond what the engine accepts is
checked here and nowhere else; what the engine accepts is SamplingParams' own validation (prefixrt/params.py),
which every caller of the engine meets.

The output budget has one name from here to the scheduler: `max_new_tokens`, SamplingParams' field. OpenAI's
names for it (`max_tokens`, `max_completion_tokens`, `max_output_tokens`) are read here, once:
- OpenAI's rule: at least 1 (the engine's own max_new_tokens may be 0), and two names given with different
  values is an error;
- a request that gives none gets its door's default (`default_max_new_tokens`: the context for chat, 16 for
  legacy completions);
- once the prompt is tokenized, `fit_to_context` fits max_new_tokens to the room the context leaves after it, as
  vLLM does: an explicit budget that does not fit is an error naming the option it came under; a default one is
  cut to what fits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.constraints import schema_types
from prefixrt.lowering.json_schema import to_json_schema
from prefixrt.params import CONSTRAINT_FIELDS, SamplingParams, checked_logit_bias, option_names

# Request option name -> SamplingParams field, read off SamplingParams' declarations (params.option_names): a
# field declared there is an option here. The output budget's names are OUTPUT_BUDGET_NAMES.
OPTION_NAMES = option_names()

# OpenAI's names of the output budget (and SamplingParams' own), in the order a request's value is read.
OUTPUT_BUDGET_NAMES = ("max_completion_tokens", "max_tokens", "max_output_tokens", "max_new_tokens")
# The same names in the order an error about two of them names them.
_BUDGET_ORDER = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
OPENAI_SEED_MIN, OPENAI_SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM checks it


@dataclass
class Options:
    """A request's options lowered: SamplingParams fields, and where its output budget came from."""

    params: dict[str, Any]  # SamplingParams fields (max_new_tokens always set)
    max_new_tokens_param: str | None = None  # the option the request gave max_new_tokens under; None: a default
    warnings: list[str] = field(default_factory=list)  # what was read other than as written (schema type names)
    params_cls: type = SamplingParams

    def fit_to_context(self, prompt_tokens: int, max_context: int, **fields) -> SamplingParams:
        """SamplingParams of these options (plus `fields`, e.g. request_id) with max_new_tokens fitted to the
        context after a prompt of `prompt_tokens` (module docstring). Raises InvalidRequest."""
        params = self.sampling_params(**fields)
        room = max_context - prompt_tokens
        if params.max_new_tokens <= room:
            return params
        if self.max_new_tokens_param is not None:
            raise InvalidRequest(f"{self.max_new_tokens_param} is {params.max_new_tokens}, but the model's context "
                                 f"is {max_context} tokens and the prompt has {prompt_tokens}: at most {room} new "
                                 "tokens fit", param=self.max_new_tokens_param)
        return dataclasses.replace(params, max_new_tokens=room)

    def sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams of these options plus `fields` (InvalidRequest when out of range, or when this build
        cannot decode the constraint)."""
        sp = self.params_cls(**{**self.params, **fields})
        kind = sp.constraint_kind
        if kind is not None and not constrained_decoding_available():
            raise InvalidRequest("constrained decoding (regex, json_schema, grammar, choices, response_format, "
                                 "tool_choice) is not available in this build", param=kind)
        return sp


def lower_options(options: dict[str, Any], *, what: str, default_max_new_tokens: int | None = None,
                  defaults: dict | None = None, warnings: list[str] | None = None,
                  params_cls: type = SamplingParams) -> Options:
    """Options under OpenAI names -> Options. None values mean "not given".

    default_max_new_tokens: max_new_tokens when no output budget is given (None: SamplingParams' default).
    defaults: SamplingParams fields for the sampling settings the request leaves out (the model's generation
    config, hub/generation.py). Raises InvalidRequest naming an option prefixrt has no meaning for (`what` says
    who passed it), an output budget below 1 or given twice with different values, or a seed outside the
    signed 64-bit range. A `json_schema` has its type names normalised, each rename appended to `warnings`.
    params_cls: SamplingParams (or a class declaring more options)."""
    names = OPTION_NAMES if params_cls is SamplingParams else option_names(params_cls)
    warnings = [] if warnings is None else warnings
    max_new_tokens_param, max_new_tokens = _given_max_new_tokens(options)
    params: dict[str, Any] = {}
    for key, value in options.items():
        if value is None or key in OUTPUT_BUDGET_NAMES:
            continue
        name = names.get(key)
        if name is None:
            raise InvalidRequest(f"{what}: prefixrt has no sampling option {key!r}", param=key)
        if key == "seed" and (isinstance(value, bool) or not isinstance(value, int)
                              or not OPENAI_SEED_MIN <= value <= OPENAI_SEED_MAX):
            raise InvalidRequest(f"seed must be an integer in [-2**63, 2**63 - 1], got {value!r}", param="seed")
        if name == "stop":
            value = [value] if isinstance(value, str) else list(value)
            if not value:
                continue
        if name == "logit_bias":  # OpenAI sends token ids as JSON strings
            value = checked_logit_bias(value)
        if name == "json_schema" and not isinstance(value, type):
            value = schema_types(to_json_schema(value), "json_schema", warnings)
        params[name] = value
    for name, value in (defaults or {}).items():
        params.setdefault(name, value)
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    elif default_max_new_tokens is not None:
        params["max_new_tokens"] = default_max_new_tokens
    return Options(params, max_new_tokens_param, warnings, params_cls)


def _given_max_new_tokens(options: dict[str, Any]) -> tuple[str | None, int | None]:
    """(the option max_new_tokens is given under, its value), or (None, None); OpenAI's rule checked."""
    given = [(k, options[k]) for k in _BUDGET_ORDER if options.get(k) is not None]
    if any(v != given[0][1] for _, v in given):
        other = next(k for k, v in given if v != given[0][1])
        raise InvalidRequest(f"give {given[0][0]} or {other}, not both", param=given[0][0])
    for key, value in given:
        if key != "max_new_tokens" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidRequest(f"{key} must be at least 1, got {value!r}", param=key)
    reported = next((k for k in OUTPUT_BUDGET_NAMES if options.get(k) is not None), None)
    return reported, options[reported] if reported is not None else None


def sampling_options(options: dict[str, Any], *, what: str, warnings: list[str] | None = None) -> dict[str, Any]:
    """Options under OpenAI names -> a SamplingParams dict (lower_options, for callers that build
    SamplingParams themselves: the adapters)."""
    return lower_options(options, what=what, warnings=warnings).params


def check_stream_options(request: dict[str, Any]) -> None:
    """OpenAI's rule for a request's `stream_options`: only beside `stream: true`."""
    if request.get("stream_options") is not None and not request.get("stream"):
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")


def with_request_id(params: dict[str, Any]) -> dict[str, Any]:
    """`params` (a SamplingParams dict) with a fresh request_id unless it has one."""
    params.setdefault("request_id", f"req-{uuid.uuid4().hex[:12]}")
    return params


def constraint_of(params: dict) -> str | None:
    """The constraint field a SamplingParams dict sets, or None."""
    return next((k for k in CONSTRAINT_FIELDS if params.get(k) not in (None, False)), None)


def constrained_decoding_available() -> bool:
    return importlib.util.find_spec("prefixrt.constrained.compiler") is not None
