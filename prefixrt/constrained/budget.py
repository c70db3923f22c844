"""Budget-aware closing of JSON output: a JSON reply that fits its token budget ends as a complete document.

OpenAI's JSON modes promise valid JSON. Under a plain grammar a model can keep a document open (one more
invented key, one more list item, one more digit) until `max_new_tokens` cuts it, and the caller gets an
unparseable prefix. `BudgetMatcher` wraps a JSON matcher (json_schema, json_object) with the request's output
budget and follows the document's syntax (`JsonState`: open objects and arrays, inside a string, number or
literal). On top of the grammar's mask it applies one rule:

    when the tokens left are no more than the end of the document needs (+ SLACK) plus one more sibling as long
    as the longest one written so far in an open container, only the next token of the shortest way to the end
    (the longest prefix of the closing text the grammar allows) may come next.

What the end needs is measured on the grammar itself (`need`): from the current state, take the grammar's
forced tokens, else the first token it accepts from the shortest way on (`_tiers`: a prefix of the closing
text, the shortest syntactic end of the document: the open string's quote or the rest of a literal, `null`
for a pending value (`": null` after an open key), then `}` / `]` for every open container; where the grammar
refuses that, a required key or a value of a schema's type: `FILLERS`), then roll back. So a schema's
required members count, and the rule fires while they still fit. Tool-call grammars (documents one per line)
count a further call as a sibling. The measure covers JSON and the text the grammar forces after it; where free
text follows (a grammar's next field), there is none, and the rule leaves the reply's budget alone there.

The same rule holds each JSON document of a grammar to a budget of its own where the grammar gives one: a `%json`
value whose schema carries `"x-max-tokens": N` (DSPy's reply formats, adapters/dspy_formats.py, give every field
a share of the reply). The end measured is then the document's own (`need(document=True)`), and the tokens left
are the document's. Where a grammar's values carry different caps, every document is held to the smallest
(closing a document early is always allowed). llguidance's own `max_tokens` on a `%json` rule is no substitute:
it cuts the document mid-value, and counts from before the document begins.

Invariants: the rule only narrows the grammar's mask (where nothing on the shortest way is allowed, the
grammar's mask stands), so every output is one the grammar accepts; it measures the end only within
PROBE_WINDOW tokens of it (by the last measure; once a document begins, and every PROBE_WINDOW // 2 tokens, it
measures anyway), and on output that is not JSON (`JsonState.broken`) never, so with an ample budget the output
is exactly what the plain matcher gives. The state is a pure function of the accepted tokens (rollback rescans
them). A reply ended this way finishes with "stop": it is a complete document.
"""

from __future__ import annotations

import copy
import re

import torch

from prefixrt.constrained.base import CompiledGrammar, GrammarBackend, Matcher
from prefixrt.constrained.logits import fill_only

# Tokens of freedom the rule keeps in hand: one token can open a string and a container at once (`{"`), so
# the closing text may grow by a few characters between two checks.
SLACK = 3

# The starts of the shortest values, tried in this order where the grammar refuses the closing text's `null`
# (and `,` where it still requires a member).
FILLERS = ("0", '"', "[", "{", "false", ",")
# The characters closing texts and FILLERS are made of (tokens spelling only these: closing_ids).
CLOSING_CHARS = frozenset('"}]nulreas: 0[{f,')
# The rule measures the end where the tokens left are within PROBE_WINDOW of what it last measured (and every
# PROBE_WINDOW // 2 tokens in between, as a document grows deeper or longer).
PROBE_WINDOW = 64
# A `%json` schema's cap on its value, in tokens (module docstring).
MAX_TOKENS_KEY = "x-max-tokens"
_MAX_TOKENS = re.compile(r'"' + re.escape(MAX_TOKENS_KEY) + r'"\s*:\s*(\d+)')

_VALUE, _ARRAY_FIRST, _KEY_FIRST, _KEY, _STRING, _COLON, _NUMBER, _LITERAL, _AFTER, _DONE = range(10)
_WS = " \t\n\r"


class JsonState:
    """The syntactic state of a JSON document written so far, fed one token's text at a time.

    Also records, per open container, the token length of its longest complete child (member or item) so
    far: the cost of one more sibling. Whitespace-separated documents (tool calls one per line) are a
    sequence whose documents are siblings too. Text that is not JSON makes the state `broken` (no closing
    text) until a `{` or `[` begins a line.
    """

    def __init__(self, tokens: int = 0) -> None:
        self.after_newline = False  # (broken text) the last character was a newline
        self.stack: list[list] = []  # [kind "{" or "[", longest child in tokens, token index where the child began]
        self.mode = _VALUE
        self.key = False  # the open string is a key
        self.escape = False
        self.literal_rest = ""
        self.tokens = tokens  # tokens fed so far
        self.broken = False
        self.last = ""  # the open number's last character
        self.root_start = tokens  # token index where the current top-level document began
        self.root_longest = 0  # the longest complete top-level document so far, in tokens

    def feed(self, text: str) -> None:
        for c in text:
            if self.broken:
                # Text that is not JSON: a `{` or `[` that begins a line begins a document again (a JSON value
                # a grammar puts after a header line: DSPy's `[[ ## advice ## ]]\n{...}`).
                if c in "{[" and self.after_newline:
                    self.__init__(self.tokens)
                    self._char(c)
                self.after_newline = c == "\n"
                continue
            self._char(c)
        self.tokens += 1

    def _begin_child(self) -> None:
        if self.stack:
            self.stack[-1][2] = self.tokens

    def _value_done(self) -> None:
        if not self.stack:
            self.root_longest = max(self.root_longest, self.tokens - self.root_start + 1)
            self.mode = _DONE
            return
        top = self.stack[-1]
        top[1] = max(top[1], self.tokens - top[2] + 1)
        self.mode = _AFTER

    def _start_value(self, c: str) -> None:
        if c in _WS:
            return
        if self.mode in (_VALUE, _ARRAY_FIRST) and self.stack and self.stack[-1][0] == "[":
            self._begin_child()
        if c == "{":
            self.stack.append(["{", 0, self.tokens])
            self.mode = _KEY_FIRST
        elif c == "[":
            self.stack.append(["[", 0, self.tokens])
            self.mode = _ARRAY_FIRST
        elif c == '"':
            self.mode, self.key = _STRING, False
        elif c == "-" or c.isdigit():
            self.mode = _NUMBER
            self.last = c
        elif c in "tfn":
            self.mode, self.literal_rest = _LITERAL, {"t": "rue", "f": "alse", "n": "ull"}[c]
        else:
            self.broken = True

    def _char(self, c: str) -> None:
        mode = self.mode
        if mode == _STRING:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                if self.key:
                    self.mode = _COLON
                else:
                    self._value_done()
        elif mode == _NUMBER:
            if c.isdigit() or c in ".eE+-":
                self.last = c
            else:
                self._value_done()
                self._char(c)
        elif mode == _LITERAL:
            if not self.literal_rest.startswith(c):
                self.broken = True
                return
            self.literal_rest = self.literal_rest[1:]
            if not self.literal_rest:
                self._value_done()
        elif mode in (_VALUE, _ARRAY_FIRST):
            if mode == _ARRAY_FIRST and c == "]":
                self._close()
            else:
                self._start_value(c)
        elif mode in (_KEY_FIRST, _KEY):
            if c in _WS:
                return
            if c == '"':
                self._begin_child()
                self.mode, self.key = _STRING, True
            elif c == "}" and mode == _KEY_FIRST:
                self._close()
            else:
                self.broken = True
        elif mode == _COLON:
            if c == ":":
                self.mode = _VALUE
            elif c not in _WS:
                self.broken = True
        elif mode == _AFTER:
            if c in _WS:
                return
            top = self.stack[-1][0]
            if c == ",":
                self.mode = _KEY if top == "{" else _VALUE
            elif c == ("}" if top == "{" else "]"):
                self._close()
            else:
                self.broken = True
        elif mode == _DONE and c not in _WS:
            if c in "{[":  # the next document of a sequence (tool calls one per line)
                self.root_start, self.mode = self.tokens, _VALUE
                self._start_value(c)
            else:
                self.broken = True

    def _close(self) -> None:
        self.stack.pop()
        self._value_done()

    def closing_text(self) -> str | None:
        """The shortest text that ends the document from here, or None where there is no cheap syntactic
        end (before a key that follows a comma, before the root value, mid-escape, after `-` / `1.` / `1e`)."""
        if self.broken:
            return None
        closers = "".join("}" if kind == "{" else "]" for kind, _, _ in reversed(self.stack))
        mode = self.mode
        if mode == _DONE:
            return ""
        if mode == _AFTER:
            return closers
        if mode == _STRING:
            return None if self.escape else ('": null' if self.key else '"') + closers
        if mode == _COLON:
            return ": null" + closers
        if mode == _NUMBER:
            return closers if self.last.isdigit() else None
        if mode == _LITERAL:
            return self.literal_rest + closers
        if mode == _ARRAY_FIRST or mode == _KEY_FIRST:
            return closers
        if mode == _VALUE and self.stack:
            return "null" + closers
        return None

    def in_document(self) -> bool:
        """Inside a top-level document (begun, not complete)."""
        return not self.broken and self.mode != _DONE and (bool(self.stack) or self.mode in (_STRING, _NUMBER,
                                                                                                _LITERAL))

    def document_tokens(self) -> int:
        """The tokens the current top-level document has taken so far (the one that began it included)."""
        return self.tokens - self.root_start

    def sibling_cost(self) -> int:
        """The tokens one more sibling would take (a separator and the longest so far) in the open container
        where that is most: one token may end a value and begin the next sibling (`}, {"`), in any container.
        After a complete document: one more document."""
        if self.mode == _DONE:
            return self.root_longest + 1
        return max((longest + 1 for _, longest, _ in self.stack if longest), default=0)


class BudgetMatcher(Matcher):
    """`inner` (a JSON matcher) held to a budget of `budget` output tokens (module docstring).

    vocab: the GrammarBackend (its `token_text` and `eos_token_ids`; closing_ids and comma_tokens below).
    document_budget: the most tokens each top-level JSON document may take (a grammar's `x-max-tokens`), or None.
    """

    def __init__(self, inner: Matcher, budget: int, vocab, document_budget: int | None = None):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.budget = budget
        self.document_budget = document_budget
        self._vocab = vocab
        self._text = vocab.token_text
        self._closing_ids = lambda text: closing_ids(vocab, text)
        self._eos = tuple(vocab.eos_token_ids)
        self._accepted: list[int] = []
        self._state = JsonState()
        # The last measure of what the end needs, per rule: key -> (tokens needed, accepted tokens then).
        self._measured: dict[object, tuple[int, int]] = {}

    # ------------------------------------------------------------------ the rule
    def _tiers(self, state: JsonState) -> list[list[int]]:
        """The tokens of the shortest way on from `state`, best first, one tier per spelling: those spelling a
        prefix of the closing text (longest first; EOS once the document is complete), then the start of the
        shortest value of each type (FILLERS), for where the grammar refuses the closing text (a required key, a
        value not null), then a lone space. `need` takes the first token the grammar accepts and the rule keeps
        the first tier it allows, so the output follows the path measured: a shorter spelling (`"` where `"]`
        is allowed, a space where ` "` is) would cost a token the measure did not count."""
        tiers = []
        closing = state.closing_text()
        if closing == "":
            tiers.append(list(self._eos))
        elif closing:
            for lead in ("", " "):  # " ": after a `:` or `,` where the layout puts a space
                tiers += [self._closing_ids(lead + closing[:end]) for end in range(len(closing), 0, -1)]
        # Inside a number a digit would only lengthen it: the next member's comma comes first there.
        fillers = FILLERS if state.mode != _NUMBER else (",", *(f for f in FILLERS if f != ","))
        tiers += [self._closing_ids(lead + f) for lead in ("", " ") for f in fillers]
        tiers.append(self._closing_ids(" "))  # a lone space where the layout needs one and no token has it
        return [t for t in tiers if t]

    def need(self, limit: int, document: bool = False) -> int | None:
        """How many tokens the output needs to end from here under the grammar (document: the current top-level
        document only), taking its forced tokens and otherwise the first token of `_tiers` it accepts (limit + 1
        when that takes more than `limit`); None where the grammar accepts none of them, or where free text
        follows the JSON (nothing forced, nothing to close: no cheap measure). Leaves the matcher as it was: the
        probe runs on the matcher's `fork()` where it has one (llguidance), else what it accepts is rolled back."""
        fork = getattr(self.inner, "fork", None)  # a copy to probe on, where the backend has one
        inner = fork() if fork is not None else self.inner
        state, taken, accepted = copy.deepcopy(self._state), 0, 0
        start = state.root_start

        def done() -> bool:  # (document) the document the probe began in is complete
            return document and (state.root_start != start or not state.in_document())

        try:
            while not inner.is_finished():
                if taken >= limit:
                    return limit + 1
                forced = inner.forced_tokens()[: limit - taken]
                if forced:
                    n = inner.accept_tokens(forced)
                    accepted += n
                    for t in forced[:n]:
                        state.feed(self._text(t))
                        taken += 1
                        if done():
                            return taken
                    if n:
                        continue
                if state.broken:
                    return None
                step = next((t for tier in self._tiers(state) for t in tier if inner.accept_token(t)), None)
                if step is None:
                    return None
                accepted += 1
                taken += 1
                state.feed("" if step in self._eos else self._text(step))
                if done():
                    return taken
            return taken
        finally:
            if fork is None:
                inner.rollback(accepted)

    def _measure(self, key: object, left: int, document: bool) -> int | None:
        """`need(left, document)`, or None while the end is far by the last measure under `key` (more than
        PROBE_WINDOW beyond it, measured fewer than PROBE_WINDOW // 2 tokens ago; before any, it measures)."""
        now = len(self._accepted)
        last = self._measured.get(key)
        if last is not None and left > PROBE_WINDOW + last[0] and now - last[1] < PROBE_WINDOW // 2:
            return None
        need = self.need(left, document)
        if need is not None:  # (None: no measure from here, mid-escape or the like; the last one stands)
            self._measured[key] = (need, now)
        return need

    def _rule(self, left: int, need: int | None, state: JsonState) -> str:
        if need is None:
            return ""
        if left <= need + SLACK or (state.mode == _DONE and left <= need + SLACK + state.sibling_cost()):
            return "end"  # (after a document, the next one begins without a comma)
        if left <= need + SLACK + state.sibling_cost():
            return "no sibling"
        return ""

    def steer_ids(self) -> tuple[str, list[list[int]] | None]:
        """What the rule does now: ("end", tiers) when the budget is tight (the caller keeps the first tier the
        grammar allows), ("no sibling", None) when only one more sibling would not fit (tokens that begin one
        are masked out), ("", None) otherwise. The reply's budget, then the document's (module docstring)."""
        state = self._state
        if state.broken:
            return "", None
        left = self.budget - len(self._accepted)
        what = self._rule(left, self._measure("reply", left, False), state)
        if what != "end" and self.document_budget is not None and state.in_document():
            left = self.document_budget - state.document_tokens()
            doc = self._rule(left, self._measure(("document", state.root_start), left, True), state)
            what = doc if doc == "end" or not what else what
        return what, (self._tiers(state) if what == "end" else None)

    def _begins_sibling(self, text: str) -> bool:
        """Whether a token of `text` (which holds a comma) would write a `,` between values here."""
        if self._state.mode == _STRING:
            if self._state.key or '"' not in text:
                return False
            text = text.split('"', 1)[1]
        return "," in text.split('"', 1)[0]

    def steer(self, bitmask: torch.Tensor, row: int) -> None:
        """Narrow `bitmask[row]` (already filled by the grammar) by the rule; unchanged where the rule does not
        apply or would leave nothing the grammar allows."""
        if self.inner.is_finished():
            return
        what, tiers = self.steer_ids()
        words = bitmask.shape[1]
        if what == "end":
            for ids in tiers:
                keep = [t for t in ids if t // 32 < words and (int(bitmask[row, t // 32]) >> (t % 32)) & 1]
                if keep:
                    fill_only(bitmask, row, keep)
                    return
        elif what == "no sibling":
            drop = [t for t, text in comma_tokens(self._vocab) if t // 32 < words and self._begins_sibling(text)]
            if not drop:
                return
            saved = bitmask[row].clone()
            clear: dict[int, int] = {}
            for t in drop:
                clear[t // 32] = clear.get(t // 32, 0) | (1 << (t % 32))
            for word, bits in clear.items():
                value = (int(saved[word]) & 0xFFFFFFFF) & ~bits
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
            if not bool((bitmask[row] != 0).any()):  # the grammar requires a sibling here: leave it
                bitmask[row] = saved

    # ------------------------------------------------------------------ Matcher
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        self.steer(bitmask, row)

    def _feed(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self._accepted.append(t)
            self._state.feed("" if t in self._eos else self._text(t))

    def accept_token(self, token_id: int) -> bool:
        if not self.inner.accept_token(token_id):
            return False
        self._feed([token_id])
        return True

    def accept_tokens(self, token_ids: list[int]) -> int:
        n = self.inner.accept_tokens(token_ids)
        self._feed(token_ids[:n])
        return n

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        kept = self._accepted[: len(self._accepted) - num_tokens]
        self._accepted, self._state, self._measured = [], JsonState(), {}
        self._feed(kept)

    def forced_tokens(self) -> list[int]:
        return self.inner.forced_tokens()

    def is_finished(self) -> bool:
        return self.inner.is_finished()

    def can_stop(self) -> bool:
        return self.inner.can_stop()

    def error(self) -> str | None:
        return self.inner.error()


# ------------------------------------------------------------------------------ vocabulary tables, construction


def closing_ids(vocab, text: str) -> list[int]:
    """The ids of the tokens whose text is exactly `text`, for `text` made of CLOSING_CHARS (quotes, closing
    brackets, `: `, the letters of true/false/null). vocab: a GrammarBackend; the table is built once, on first
    use, and kept on it."""
    table = getattr(vocab, "_closing_table", None)
    if table is None:
        table, commas = {}, []
        for token_id in range(len(vocab.tokenizer)):
            piece = vocab.token_text(token_id)
            if token_id in vocab.eos_token_ids or not piece:
                continue
            if set(piece) <= CLOSING_CHARS:
                table.setdefault(piece, []).append(token_id)
            if "," in piece:
                commas.append((token_id, piece))
        vocab._closing_table, vocab._comma_tokens = table, commas
    return table.get(text, [])


def comma_tokens(vocab) -> list[tuple[int, str]]:
    """(id, text) of every token whose text holds a comma (the tokens that may begin a JSON sibling)."""
    if getattr(vocab, "_comma_tokens", None) is None:
        closing_ids(vocab, "")
    return vocab._comma_tokens


def document_budget(compiled: CompiledGrammar) -> int | None:
    """The most tokens each JSON document of a grammar may take: the smallest `x-max-tokens` its `%json` values
    carry (module docstring), or None."""
    if compiled.kind != "grammar":
        return None
    caps = [int(n) for n in _MAX_TOKENS.findall(compiled.spec_text)]
    return min(caps) if caps else None


def budget_matcher(backend: GrammarBackend, compiled: CompiledGrammar, max_new_tokens: int) -> Matcher:
    """`backend.matcher(compiled)`, held to `max_new_tokens` output tokens where the output may be JSON (json_schema,
    json_object, and grammars, which embed JSON for tool calls): BudgetMatcher closes the document in time, and
    stays out of output that is not JSON; a grammar's documents also within their `x-max-tokens`. Regex and
    choices: the plain matcher."""
    m = backend.matcher(compiled)
    if compiled.kind not in ("json_schema", "json_object", "grammar"):
        return m
    return BudgetMatcher(m, max_new_tokens, backend, document_budget(compiled))
