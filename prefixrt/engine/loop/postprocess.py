"""Post-processing: what happens to a request once the host knows its sampled token. Pure host bookkeeping on
one Req, no tensors and no tokenizer (text and stop strings are the detokenizer worker's, engine/detokenizer.py).

The units, in the order the step loop runs them for each sampled row:
  advance(r, tok, ...)   stop-token check, grammar accept, jump-forward, length check  -> Advance
  logprob_entries(...)   the OpenAI-style logprob records of the step's new tokens (token strings left None)
  step_output(...)       the StepOutput streamed for the step

jump_forward() is the one path for grammar-forced tokens: at step 0 (the caller's thread, before the prefill:
the forced tokens join it) and after every sampled token (the next forward feeds them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefixrt.engine.stream import StepOutput
from prefixrt.request import Req


@dataclass
class Advance:
    new_tokens: list[int]  # streamed this step: step-0 forced tokens, the sampled token, then forced tokens
    num_forced: int  # forced tokens appended after the sampled one (the next forward feeds them)
    finish_reason: str | None
    matched_stop: int | None  # the stop token id, when the sampled token is one


def jump_forward(r: Req, max_context: int, reserve: int) -> list[int]:
    """Append the grammar's forced continuation to r (accepting it in the matcher) and return it.

    The forced tokens are capped by the output budget and the context, each less `reserve` tokens (1 at step 0:
    the prefill must still sample a token; 0 after a sampled token). Mutates r.output_ids, r.matcher and
    r.num_forced_tokens. Raises RuntimeError if the matcher rejects a token it forced itself."""
    if r.matcher is None or not r.params.jump_forward:
        return []
    limit = min(r.remaining_new_tokens, max_context - len(r.all_ids)) - reserve
    forced = r.matcher.forced_tokens()[: max(0, limit)]
    if forced:  # one call for the run (llguidance checks and consumes them together)
        n = r.matcher.accept_tokens(forced)
        if n != len(forced):
            raise RuntimeError(f"grammar rejected its own forced token {forced[n]}")
    if forced:
        r.append_output(forced)
        r.num_forced_tokens += len(forced)
    return forced


def advance(r: Req, tok: int, eos_token_ids: set[int], max_context: int) -> Advance:
    """Append the sampled token tok to r and decide whether r is finished.

    Order: a stop token (stop_token_ids, or EOS unless ignore_eos) finishes r with the token kept in the output;
    else the grammar accepts tok, finishes r if it is complete, or appends its forced continuation; then the
    length limits (max_new_tokens, the context). Mutates r (output, matcher, pending_emit). Raises RuntimeError
    if the grammar rejects tok (the mask allowed it: a bug, which aborts this request only)."""
    new = r.pending_emit + [tok]
    r.pending_emit = []
    p = r.params
    reason, matched = None, None
    if tok in (p.stop_token_ids or ()) or (tok in eos_token_ids and not p.ignore_eos):
        reason, matched = "stop", tok
    r.append_output([tok])
    forced: list[int] = []
    if reason is None and r.matcher is not None:
        if not r.matcher.accept_token(tok):
            raise RuntimeError(f"grammar rejected sampled token {tok}")
        if r.matcher.is_finished():
            reason = "stop"
        else:
            forced = jump_forward(r, max_context, reserve=0)
            new.extend(forced)
            if forced and r.matcher.is_finished():
                reason = "stop"
    if reason is None and (len(r.output_ids) >= p.max_new_tokens or len(r.all_ids) >= max_context):
        reason = "length"
    return Advance(new, len(forced), reason, matched)


def logprob_entries(new_tokens: list[int], sampled_at: int, lp) -> list[dict]:
    """Logprob records for a step's new tokens: the sampled one (at index sampled_at) carries lp = (token
    logprob, [(token id, logprob), ...]); forced tokens are certain (logprob 0). Token strings are filled in by
    the detokenizer worker."""
    out = []
    for j, t in enumerate(new_tokens):
        tok_lp, top = lp if j == sampled_at else (0.0, [])
        out.append({"token_id": t, "token": None, "logprob": tok_lp,
                    "top_logprobs": [{"token_id": a, "token": None, "logprob": v} for a, v in top]})
    return out


def request_timing(r: Req) -> tuple[float | None, float | None, float | None]:
    """A finished request's (queue, prefill, decode) seconds: arrival to first admission, admission to first
    output token, first output token to now (None where it never got that far)."""
    now = time.monotonic()
    admitted, first = r.admitted_time, r.first_token_time
    return (None if admitted is None else admitted - r.arrival,
            None if admitted is None or first is None else first - admitted,
            None if first is None else now - first)


def step_output(r: Req, adv: Advance, logprobs: list[dict] | None) -> StepOutput:
    finished = adv.finish_reason is not None
    return StepOutput(
        index=r.index, token_ids=adv.new_tokens, text=None, logprobs=logprobs,
        finished=finished, finish_reason=adv.finish_reason, matched_stop=adv.matched_stop,
        prompt_tokens=len(r.prompt_ids), cached_tokens=r.num_cached_tokens or 0,
        timing=request_timing(r) if finished else None, keep_report=_take_keep_report(r),
    )


def final_output(r: Req, reason: str, error: str | None = None) -> StepOutput:
    """The last output of a request finished without a new token (abort, out of memory, prefill-only)."""
    return StepOutput(
        index=r.index, token_ids=[], text=None, finished=True, finish_reason=reason,
        prompt_tokens=len(r.prompt_ids), cached_tokens=r.num_cached_tokens or 0, error=error,
        input_logprobs=r.input_logprobs if r.input_logprobs_from is not None else None,
        timing=request_timing(r), keep_report=_take_keep_report(r),
    )


def _take_keep_report(r: Req) -> dict | None:
    """r's kept-prefix decision, for its first output only (it is sent once)."""
    report, r.keep_report = r.keep_report, None
    return report
