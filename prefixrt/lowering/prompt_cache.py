"""Prompt-cache fields in the callers' vocabularies -> a CachePlan: the session key and the breakpoints (the ends
of the prefixes to keep, each with a lifetime), still as conversations; `resolve` turns them into token counts of
the rendered prompt (prefixrt/prompt_cache.py PromptCache) once the prompt is tokenized.

OpenAI (Chat Completions and Responses):
- `prompt_cache_key`: the session key.
- `prompt_cache_options` {mode, ttl}: with it, the request writes its prompt's own prefix (the implicit breakpoint,
  unless mode is "explicit") and its content-block breakpoints, each kept for `ttl` (default "30m"). Of the
  explicit breakpoints the latest ones are written: 3 beside the implicit one, 4 in explicit mode (as OpenAI).
- a content block's `prompt_cache_breakpoint` ({"mode": "explicit"}): the conversation up to the end of that
  block is kept, for the options' ttl (default "30m").
- `prompt_cache_retention`: "24h" keeps the whole prompt for 24 hours; "in_memory" asks nothing beyond the LRU.
Anthropic (Messages API, lowering/anthropic.py reads its blocks): `cache_control` {"type": "ephemeral", "ttl":
"5m" | "1h"} on a tool, a system block or a message block is a breakpoint after it; at the top level of the
request, one at the end of the prompt. At most 4 (a 400 past that, as Anthropic's).
A request that says nothing of these keeps nothing: the radix cache still reuses what its LRU holds.

Where a breakpoint falls in the tokens: the conversation cut after the marked block is rendered by the same chat
template and lowering, and the kept prefix is the longest run of tokens it shares with the full prompt (the
block's text and whatever the template puts before the next turn starts). A breakpoint on the last block of the
conversation is the whole prompt (no second render).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixrt.errors import InvalidRequest
from prefixrt.prompt_cache import KeepPrefix, PromptCache, parse_ttl

OPENAI_DEFAULT_TTL = "30m"
ANTHROPIC_DEFAULT_TTL = "5m"
ANTHROPIC_TTLS = ("5m", "1h")
MAX_BREAKPOINTS = 4


@dataclass
class Breakpoint:
    """The end of a prefix to keep: `upto`, the conversation (OpenAI chat messages) cut after the marked block,
    or None for the whole prompt; `ttl_s`, its lifetime."""

    upto: list[dict] | None
    ttl_s: float


@dataclass
class CachePlan:
    session: str | None = None
    breakpoints: list[Breakpoint] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.session is None and not self.breakpoints

    def resolve(self, ids: list, encode: Callable[[list[dict]], list]) -> PromptCache | None:
        """The PromptCache of a prompt tokenized as `ids`: each breakpoint's token count (`encode` renders and
        tokenizes a cut conversation exactly as the full one was; a cut conversation the chat template refuses,
        e.g. a system message alone for some templates, keeps nothing). Call it off the event loop."""
        if self.empty:
            return None
        keep = []
        for bp in self.breakpoints:
            if bp.upto is None:
                n = len(ids)
            else:
                try:
                    n = shared_prefix_len(ids, encode(bp.upto))
                except InvalidRequest:
                    continue
            if n > 0:
                keep.append(KeepPrefix(n, bp.ttl_s))
        return PromptCache(self.session, tuple(keep))


def shared_prefix_len(a: list, b: list) -> int:
    """Tokens a and b share from the start."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def cut_after(messages: list[dict], i: int, j: int | None) -> list[dict] | None:
    """The conversation up to block j of message i (j None: the whole message i); None when that is all of it."""
    last = len(messages) - 1
    content = messages[i].get("content")
    blocks = content if isinstance(content, list) else None
    if i == last and (j is None or blocks is None or j == len(blocks) - 1):
        return None
    out = copy.deepcopy(messages[:i + 1])
    if j is not None and blocks is not None:
        out[-1]["content"] = out[-1]["content"][: j + 1]
    return out


# ---------------------------------------------------------------------------------------------- OpenAI
def openai_cache_plan(request: dict, messages: list[dict] | None = None) -> CachePlan:
    """The prompt-cache fields of an OpenAI request (its body as a dict) -> a CachePlan over `messages` (the chat
    messages it renders; default: request["messages"]). InvalidRequest for malformed fields."""
    messages = request.get("messages") if messages is None else messages
    key = request.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise InvalidRequest("prompt_cache_key must be a non-empty string", param="prompt_cache_key")
    retention = request.get("prompt_cache_retention")
    if retention not in (None, "in_memory", "24h"):
        raise InvalidRequest(f"prompt_cache_retention must be 'in_memory' or '24h', got {retention!r}",
                             param="prompt_cache_retention")
    options = request.get("prompt_cache_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("prompt_cache_options must be an object", param="prompt_cache_options")
    mode = (options or {}).get("mode", "implicit")
    if mode not in ("implicit", "explicit"):
        raise InvalidRequest(f"prompt_cache_options.mode must be 'implicit' or 'explicit', got {mode!r}",
                             param="prompt_cache_options.mode")
    ttl_s = parse_ttl((options or {}).get("ttl") or OPENAI_DEFAULT_TTL, "prompt_cache_options.ttl")
    marked = []
    for i, m in enumerate(messages or []):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            mark = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
            if mark is None:
                continue
            if not isinstance(mark, dict) or mark.get("mode", "explicit") != "explicit":
                raise InvalidRequest("prompt_cache_breakpoint must be {\"mode\": \"explicit\"}",
                                     param=f"messages[{i}].content[{j}].prompt_cache_breakpoint")
            marked.append((i, j))
    implicit = options is not None and mode == "implicit"
    marked = marked[-(MAX_BREAKPOINTS - 1 if implicit else MAX_BREAKPOINTS):] if marked else []
    bps = [Breakpoint(cut_after(messages, i, j), ttl_s) for i, j in marked]
    if implicit:
        bps.append(Breakpoint(None, ttl_s))
    if retention == "24h":
        bps.append(Breakpoint(None, parse_ttl("24h", "prompt_cache_retention")))
    return CachePlan(key, bps)


def responses_cache_plan(request: dict, items, to_messages: Callable[[list], list[dict]]) -> CachePlan:
    """The prompt-cache fields of a Responses request (its body as a dict; `items` its `input`) -> a CachePlan;
    to_messages(items) gives the chat messages the request renders for input items (instructions and the
    earlier turns before them), so a breakpoint on block j of item k cuts the conversation there."""
    full = to_messages(items)
    plan = openai_cache_plan({**request, "messages": []}, full)
    if isinstance(items, str):
        return plan
    marked = []
    for k, item in enumerate(items):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            mark = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
            if mark is None:
                continue
            if not isinstance(mark, dict) or mark.get("mode", "explicit") != "explicit":
                raise InvalidRequest("prompt_cache_breakpoint must be {\"mode\": \"explicit\"}",
                                     param=f"input[{k}].content[{j}].prompt_cache_breakpoint")
            marked.append((k, j))
    options = request.get("prompt_cache_options")
    implicit = options is not None and options.get("mode", "implicit") == "implicit"
    marked = marked[-(MAX_BREAKPOINTS - 1 if implicit else MAX_BREAKPOINTS):] if marked else []
    ttl_s = parse_ttl((options or {}).get("ttl") or OPENAI_DEFAULT_TTL, "prompt_cache_options.ttl")
    for k, j in marked:
        last = k == len(items) - 1 and j == len(items[k]["content"]) - 1
        cut = None if last else to_messages([*items[:k], {**items[k], "content": items[k]["content"][: j + 1]}])
        plan.breakpoints.insert(0, Breakpoint(cut, ttl_s))
    return plan


# ---------------------------------------------------------------------------------------------- Anthropic
def anthropic_ttl(cache_control, param: str) -> float:
    """An Anthropic `cache_control` ({"type": "ephemeral", "ttl": "5m" | "1h"}) -> its lifetime in seconds."""
    if not isinstance(cache_control, dict) or cache_control.get("type") != "ephemeral":
        raise InvalidRequest(f"{param}: cache_control must be {{\"type\": \"ephemeral\"}} (with an optional "
                             "ttl of '5m' or '1h')", param=param)
    ttl = cache_control.get("ttl") or ANTHROPIC_DEFAULT_TTL
    if ttl not in ANTHROPIC_TTLS:
        raise InvalidRequest(f"{param}: cache_control.ttl must be '5m' or '1h', got {ttl!r}", param=param)
    return parse_ttl(ttl, param)


def check_breakpoint_count(n: int) -> None:
    if n > MAX_BREAKPOINTS:
        raise InvalidRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                             f"Found {n}.", param="cache_control")
