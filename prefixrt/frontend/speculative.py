"""API speculative execution: one long continuation answers several gens, across statements.

With `@function(num_api_spec_tokens=N)` (or `OpenAIBackend(speculative_tokens=N)`), the first unconstrained
gen asks the endpoint for N tokens without its stop strings. The continuation is kept on the state as a
SpecBuffer; the items that follow (in the same or later `s += ...` statements) consume it: literal text must
appear verbatim at the buffer's head, and a gen's value is accepted only where non-speculative execution
would provably give the same text (greedy decoding, same prefix): its own stop string occurs (the value is
the text before it), or the continuation ended by itself there. Anything else (a mismatch, a select, a role
boundary, other sampling settings) drops the buffer; the next gen then makes an ordinary call, or a new
speculative one.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixrt.frontend.ir import Expr, Gen, Text


class SpecBuffer:
    """The unconsumed rest of a speculative continuation. `ended`: the continuation stopped by itself (EOS),
    not by the token budget. `args`: the SamplingArgs it was sampled with (only gens with the same
    temperature/top_p/extra sampling fields may take from it)."""

    def __init__(self, text: str, ended: bool, args=None):
        self.text = text
        self.ended = ended
        self.settings = _settings(args)
        self.finished = False  # a gen took the end of an ended continuation: nothing follows it

    def consume_text(self, text: str) -> bool:
        """Consume literal `text` from the head; False if the continuation does not go on with it."""
        if self.finished or not self.text.startswith(text):
            return False
        self.text = self.text[len(text):]
        return True

    def take(self, args, count_tokens: Callable[[str], int] | None = None) -> str | None:
        """The value of a gen with `args` (stop, max_tokens) at the head, consumed up to (not including) its
        stop string; None if it cannot be known from the continuation. count_tokens: when given, a value longer
        than the gen's max_tokens is refused (that gen would have been cut earlier)."""
        if self.finished or (args is not None and _settings(args) != self.settings):
            return None
        hits = [self.text.find(s) for s in (args.stop or []) if s and s in self.text]
        if hits:
            end = min(hits)
        elif self.ended:
            end = len(self.text)
        else:
            return None  # the budget ran out inside this gen: its true end is unknown
        value = self.text[:end]
        if count_tokens is not None and args.max_tokens is not None and count_tokens(value) > args.max_tokens:
            return None
        self.text = self.text[end:]
        if not hits:
            self.finished = True
        return value


def _settings(args) -> tuple:
    if args is None:
        return ()
    return (args.temperature, args.top_p, tuple(sorted(args.extra.items(), key=lambda kv: kv[0])))


def match_template(text: str, items: list[Expr], ended: bool,
                   count_tokens: Callable[[str], int] | None = None) -> list[str]:
    """Values of the leading gens of `items` (Text/Gen) found in `text` by a SpecBuffer: what one speculative
    call resolves of a template. `count_tokens` as in SpecBuffer.take."""
    from prefixrt.frontend.backend import SamplingArgs

    buf = SpecBuffer(text, ended, SamplingArgs(max_tokens=None, temperature=0.0))
    values: list[str] = []
    for item in items:
        if isinstance(item, Text):
            if not buf.consume_text(item.text):
                break
            continue
        if not isinstance(item, Gen):
            break
        args = SamplingArgs(max_tokens=item.max_tokens, temperature=0.0, stop=item.stop)
        value = buf.take(args, count_tokens)
        if value is None:
            break
        values.append(value)
    return values
