"""SGLang's native /generate request (its GenerateReqInput, as SGLang's http_server takes it) -> engine requests.

A body holds `text` (one string or a batch) or `input_ids` (one id list or a batch), `sampling_params` (one dict
for every prompt, or one per prompt) in SGLang's names, and per prompt (a value, or a list of one per prompt)
`rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num`. `n` > 1 in the sampling params makes a batch
of n samples per prompt, ordered as SGLang orders them: all prompts' first samples, then all prompts' second
samples (output k is sample k // B of prompt k % B for B prompts); a single prompt with n > 1 answers a list.

SGLang's sampling names -> SamplingParams: the shared ones as they are; `sampling_seed` -> seed, `ebnf` ->
grammar, `json_schema` (JSON text in SGLang, a dict accepted too), `top_k` of 0 or below (or SGLang's 1 << 30)
-> all tokens. `spaces_between_special_tokens`, `stream_interval`, `custom_params` and `no_stop_trim: false`
change nothing here and are accepted; `stop_regex`, `structural_tag`, `no_stop_trim: true` and `beam_width` are
refused (400) rather than ignored. A value of None means "not set", as SGLang's clients send it. Pure functions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.params import SamplingParams

_SAME = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
         "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "n", "regex",
         "skip_special_tokens")
_RENAMED = {"sampling_seed": "seed", "ebnf": "grammar"}
_NO_EFFECT = ("spaces_between_special_tokens", "stream_interval", "custom_params")
_REFUSED = {"stop_regex": "stop_regex (stop on a regular expression) is not supported; use stop strings",
            "structural_tag": "structural_tag is not supported; use json_schema, regex or ebnf",
            "beam_width": "beam search is not supported"}
_TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs' range


@dataclass(frozen=True)
class LogprobRequest:
    """What logprobs one prompt's outputs carry: `input_from` the first prompt position whose token's logprob is
    returned (None: no prompt logprobs; SGLang's -1), `top` the alternatives per position, `with_text` whether
    each entry carries its token's text."""

    input_from: int | None
    top: int
    with_text: bool


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate request: its text or token ids, its SamplingParams (request_id set), and its
    LogprobRequest (None without return_logprob)."""

    prompt: str | list[int]
    params: SamplingParams
    logprobs: LogprobRequest | None


@dataclass(frozen=True)
class GeneratePlan:
    """A /generate request lowered: its prompts, whether it answers one object (a single prompt, n == 1) or a
    list, and n."""

    items: list[GenerateItem]
    single: bool
    n: int

    def output_position(self, item: int, sample: int) -> int:
        """Where sample `sample` of prompt `item` goes in the answer (SGLang's order)."""
        return sample * len(self.items) + item


def sglang_sampling_params(given: dict[str, Any] | None, *, param: str = "sampling_params") -> dict[str, Any]:
    """SGLang's sampling_params dict -> SamplingParams keyword arguments. InvalidRequest names `param`.field for
    an unknown or refused field."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    out: dict[str, Any] = {}
    for key, value in given.items():
        if value is None:
            continue
        where = f"{param}.{key}"
        if key in _SAME:
            out[key] = value
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key == "json_schema":
            out["json_schema"] = _schema(value, where)
        elif key == "logit_bias":
            out["logit_bias"] = _logit_bias(value, where)
        elif key == "no_stop_trim":
            if value:
                raise InvalidRequest("no_stop_trim (keep the stop string in the text) is not supported", param=where)
        elif key in _NO_EFFECT:
            continue
        elif key in _REFUSED:
            if value not in ((), [], "", False):
                raise InvalidRequest(_REFUSED[key], param=where)
        else:
            raise InvalidRequest(f"unknown sampling parameter {key!r}", param=where)
    if "stop" in out and not out["stop"]:
        del out["stop"]  # SGLang's clients send stop=() / [] for none
    if "stop_token_ids" in out and not out["stop_token_ids"]:
        del out["stop_token_ids"]
    top_k = out.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and (top_k <= 0 or top_k >= _TOP_K_ALL):
        out["top_k"] = -1
    return out


def _schema(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", param=where) from None
    return value


def _logit_bias(value: Any, where: str) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must map token ids to numbers", param=where)
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        raise InvalidRequest("logit_bias keys must be token ids", param=where) from None


def _per_item(value: Any, count: int, name: str, scalar_types: tuple) -> list:
    """A field given once for every prompt or as a list of one value per prompt -> one value per prompt."""
    if isinstance(value, list) and not isinstance(value, scalar_types):
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} values for {count} prompts", param=name)
        return list(value)
    return [value] * count


def lower_generate_request(body: dict[str, Any], new_rid) -> GeneratePlan:
    """SGLang's /generate body (its fields as a dict; None for one not given) -> a GeneratePlan. `new_rid()`
    makes a request id where the body gives none. InvalidRequest when the body is malformed."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of text and input_ids", param="text")
    if text is not None:
        single = isinstance(text, str)
        prompts: list = [text] if single else list(text)
    else:
        single = not input_ids or isinstance(input_ids[0], int)
        prompts = [list(input_ids)] if single else [list(p) for p in input_ids]
    if not prompts:
        raise InvalidRequest("the batch is empty", param="text" if text is not None else "input_ids")
    count = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != count:
            raise InvalidRequest(f"sampling_params has {len(raw_params)} entries for {count} prompts",
                                 param="sampling_params")
        given = [sglang_sampling_params(p, param=f"sampling_params[{k}]") for k, p in enumerate(raw_params)]
    else:
        one = sglang_sampling_params(raw_params)
        given = [dict(one) for _ in range(count)]
    ns = {g.get("n", 1) for g in given}
    if len(ns) != 1:
        raise InvalidRequest("every prompt of a batch must ask for the same n", param="sampling_params")
    n = ns.pop()
    rids = body.get("rid")
    if isinstance(rids, str) and count > 1:
        rids = [f"{rids}-{k}" for k in range(count)]  # SGLang: a string is the batch's prefix
    rids = _per_item(rids, count, "rid", (str,))
    want = _per_item(body.get("return_logprob"), count, "return_logprob", (bool,))
    starts = _per_item(body.get("logprob_start_len"), count, "logprob_start_len", (int,))
    tops = _per_item(body.get("top_logprobs_num"), count, "top_logprobs_num", (int,))
    with_text = bool(body.get("return_text_in_logprobs"))
    items = []
    for k in range(count):
        fields = given[k]
        logprobs = None
        if want[k]:
            logprobs = _logprob_request(starts[k], tops[k], with_text, k if count > 1 else None)
            fields = {**fields, "logprobs": logprobs.top}
        rid = rids[k] if rids[k] is not None else new_rid()
        if not isinstance(rid, str):
            raise InvalidRequest("rid must be a string", param="rid")
        try:
            params = SamplingParams(**fields, request_id=rid)
        except TypeError as e:  # a duplicate given under two names (seed and sampling_seed)
            raise InvalidRequest(f"sampling_params: {e}", param="sampling_params") from None
        except InvalidRequest as e:
            raise InvalidRequest(e.message, param=f"sampling_params.{e.param}" if e.param else "sampling_params"
                                 ) from None
        items.append(GenerateItem(prompts[k], params, logprobs))
    return GeneratePlan(items, single and n == 1, n)


def _logprob_request(start: Any, top: Any, with_text: bool, index: int | None) -> LogprobRequest:
    at = "" if index is None else f"[{index}]"
    start = -1 if start is None else start
    top = 0 if top is None else top
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise InvalidRequest("logprob_start_len must be -1 (output logprobs only) or a prompt position",
                             param=f"logprob_start_len{at}")
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param=f"top_logprobs_num{at}")
    if start >= 0 and top > 0:
        raise InvalidRequest("top_logprobs_num with prompt logprobs (logprob_start_len >= 0) is not supported: "
                             "prompt positions report their own token's logprob only", param=f"top_logprobs_num{at}")
    return LogprobRequest(None if start < 0 else start, top, with_text)


def without_n(params: SamplingParams) -> SamplingParams:
    """params for one of its n samples: n = 1 (a request whose samples are run apart)."""
    return dataclasses.replace(params, n=1)
