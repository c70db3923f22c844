"""API speculative execution: split one long continuation into the values of several gens.

A run of template items `Gen, Text, Gen, Text, ...` is answered by one call that ignores the intermediate
stops. A gen's value is accepted only where non-speculative execution would provably give the same text
(greedy decoding, same prefix): its own stop string occurs (value = text before it), or the continuation
ended by itself. The literal text after a gen must then appear verbatim at that point for the next gen's
value to be accepted. The first mismatch ends the match; the caller runs the rest as separate calls.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixrt.frontend.ir import Expr, Gen, Text


def match_template(text: str, items: list[Expr], ended: bool,
                   count_tokens: Callable[[str], int] | None = None) -> list[str]:
    """Values for the leading gens of `items` found in `text` (the speculative continuation).

    ended: the continuation stopped by itself (EOS), not by the token budget.
    count_tokens: when given, a value longer than its gen's max_tokens is rejected (that gen would have
    been cut earlier); without it, max_tokens of individual gens is not checked.
    """
    values: list[str] = []
    pos = 0
    for item in items:
        if isinstance(item, Text):
            if not text.startswith(item.text, pos):
                break
            pos += len(item.text)
            continue
        if not isinstance(item, Gen):
            break
        rest = text[pos:]
        hits = [(rest.find(s), s) for s in (item.stop or []) if s and rest.find(s) >= 0]
        if hits:
            end = min(hits)[0]
        elif ended:
            end = len(rest)
        else:
            break  # the budget ran out inside this gen: its true end is unknown
        value = rest[:end]
        if count_tokens is not None and item.max_tokens is not None and count_tokens(value) > item.max_tokens:
            break
        values.append(value)
        pos += end
        if not hits:
            break  # the continuation ended here: nothing after it can be matched
    return values


def speculation_window(items: list[Expr]) -> list[Expr]:
    """The prefix of items that one speculative call may cover: plain gens (no constraint) sharing the
    first gen's sampling settings, and the literal text between them."""
    first = next((x for x in items if isinstance(x, Gen)), None)
    out: list[Expr] = []
    for x in items:
        if isinstance(x, Gen) and (x.constrained or x.temperature != first.temperature or x.top_p != first.top_p
                                   or x.extra != first.extra):
            break
        if not isinstance(x, (Gen, Text)):
            break
        out.append(x)
    while out and isinstance(out[-1], Text):
        out.pop()
    return out
