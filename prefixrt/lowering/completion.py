"""One legacy completions request (OpenAI's /v1/completions) -> its prompts and options.

The prompt is one text, one list of token ids, or a batch of either; each becomes its own engine request with
the same options. OpenAI's default output budget here is 16 tokens. Pure functions over plain values.
"""

from __future__ import annotations

from typing import Any

from prefixrt.errors import InvalidRequest
from prefixrt.lowering.options import (
    OPTION_NAMES,
    OUTPUT_BUDGET_NAMES,
    Options,
    check_stream_options,
    lower_options,
)

DEFAULT_MAX_NEW_TOKENS = 16  # OpenAI's legacy completions default


def lower_completion_request(request: dict[str, Any], prompt: Any, *, defaults: dict | None = None
                             ) -> tuple[list, Options]:
    """A completions request (its fields as a dict, None for a field not given; the prompt apart, so a long
    token-id prompt is never copied) -> (the prompts, one per engine request: a str or the token-id list as
    given; its Options). `defaults`: sampling settings for those the request leaves out (the model's
    generation config). InvalidRequest when it is malformed."""
    if request.get("suffix"):
        raise InvalidRequest("suffix is not supported", param="suffix")
    best_of = request.get("best_of")
    if best_of is not None and best_of != request.get("n", 1):
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    options = {k: v for k, v in request.items() if k in OPTION_NAMES or k in OUTPUT_BUDGET_NAMES}
    lowered = lower_options(options, what="request", default_max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
                            defaults=defaults)
    check_stream_options(request)
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequest("prompt is empty", param="prompt")
    return prompts, lowered
