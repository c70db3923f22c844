"""JSON string lengths (maxLength / minLength) checked beside the grammar instead of inside it.

Why: llguidance precomputes, per tokenizer, which tokens can continue a lexeme like `[^"\\]*` ("slices"), so the
mask inside an unbounded JSON string costs ~0.1 ms. A bounded string is a bounded repeat, which slices do not
cover: every mask inside it walks the whole vocabulary trie (0.3-2 ms a row for a 128k vocabulary). A schema's
`maxLength` makes every mask of a constrained batch pay that.

What: `split_lengths` takes the bounds off the string schemas whose place in the document is known from the keys
alone (reached from the root through `properties` and `items` only); the grammar is compiled without them, and
`LengthTracker` enforces them on top of its mask. The tracker follows the document's bytes (keys, nesting, and
inside a string its length in characters: an escape sequence or a UTF-8 character counts one, as the grammar's
own bounded repeat does) and removes from the grammar's mask exactly the tokens that would make a bounded string
too long, or close it too short. So masks, accepted tokens and greedy outputs are those of the grammar with the
bounds (tests compare the masks over random walks); only jump-forward differs: a string at its maximum is not a
forced run here, the model writes its closing quote.

How the mask is narrowed, per row: inside a bounded string, a token is judged by a table of its length from each
escape state (`TokenTable`: characters up to its closing quote, whether it closes), one cached packed mask per
(escape state, characters left, characters still needed); outside a string, a token can only open one through
a quote, so the tokens with a quote that the grammar allows are grouped by the text before their first quote,
and each group's opened string is found by feeding that text to a copy of the tracker (cached per state). Tokens
that cross more than one quote are fed whole to a copy of the tracker (`violates`), the reference for all of it.
"""

from __future__ import annotations

import threading

import numpy as np

# Schema keys a node may carry for its bounds to be tracked (anything else, e.g. anyOf / $ref / pattern / format /
# prefixItems, leaves that subtree's bounds in the grammar).
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
_OBJECT_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "minProperties",
                               "maxProperties", "$schema", "$id", "$defs", "definitions"}
_ARRAY_KEYS = _ANNOTATIONS | {"type", "items", "minItems", "maxItems", "$schema", "$id", "$defs", "definitions"}
_STRING_KEYS = _ANNOTATIONS | {"type", "minLength", "maxLength", "$schema", "$id"}

ITEM = None  # the path element of an array's items
MAX_CACHED_STATES = 1 << 14  # per schema: the strings opened from (state, text before a quote)

Bounds = tuple[int, "int | None"]  # (minLength, maxLength or None)


def split_lengths(schema) -> tuple[object, dict[tuple, Bounds]]:
    """(the schema without the bounds this module tracks, {path: (minLength, maxLength)}). A path is the tuple of
    keys from the root, ITEM for an array's items. The input is not modified; with nothing to track it is returned
    as is (and an empty dict)."""
    bounds: dict[tuple, Bounds] = {}

    def walk(node, path: tuple):
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        keys = set(node)
        if kind == "string" and keys <= _STRING_KEYS and ("maxLength" in node or "minLength" in node):
            lo, hi = node.get("minLength", 0), node.get("maxLength")
            if not _is_count(lo) or not (hi is None or _is_count(hi)) or (hi is not None and lo > hi):
                return node  # invalid or empty: the grammar reports it
            if hi == 0:
                return node  # `""`, forced: the grammar's fixed text is cheap and forced runs see it
            bounds[path] = (lo, hi)
            return {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
        if kind in ("object", None) and isinstance(node.get("properties"), dict) and keys <= _OBJECT_KEYS:
            props = {k: walk(v, path + (k,)) for k, v in node["properties"].items()}
            if all(props[k] is node["properties"][k] for k in props):
                return node
            return {**node, "properties": props}
        if kind == "array" and isinstance(node.get("items"), dict) and keys <= _ARRAY_KEYS:
            items = walk(node["items"], path + (ITEM,))
            return node if items is node["items"] else {**node, "items": items}
        return node

    return walk(schema, ()), bounds


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ------------------------------------------------------------------------------------------------ the tracker

# Escape states inside a string, by bytes of the escape still to come: 0 none, 5 after a backslash (one byte, or
# five for \uXXXX), 4..1 hex digits of a \u escape left.
ESCAPE_STATES = (0, 5, 4, 3, 2, 1)
_BACKSLASH, _QUOTE = 0x5C, 0x22
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes


def _string_bytes(data: bytes, esc: int) -> tuple[int, int, int]:
    """Walk `data` from inside a string in escape state `esc`: (characters written before the closing quote or
    the end, bytes consumed including the closing quote (len(data) if it stays open), escape state at the end
    (-1 when it closed))."""
    chars = 0
    for i, b in enumerate(data):
        if esc == 5:
            esc = 4 if b == 0x75 else 0  # \u then four hex digits; any other escape is one byte
        elif esc:
            esc -= 1
        elif b == _QUOTE:
            return chars, i + 1, -1
        elif b == _BACKSLASH:
            chars += 1
            esc = 5
        elif b & 0xC0 != 0x80:  # not a UTF-8 continuation byte: a character starts here
            chars += 1
    return chars, len(data), esc


class LengthTracker:
    """Where a JSON document written so far stands, as far as string lengths go (module docstring).

    Assumes the text is the grammar's (valid JSON so far); it only reads structure (`{}[]:,` and quotes outside
    strings, escapes and characters inside them). The state is a pure function of the bytes fed, held in
    immutable values (the open containers are a tuple of (is_array, key) pairs), so `copy()` is cheap.
    """

    __slots__ = ("rule", "bounds", "table", "stack", "expect_key", "in_string", "is_key", "key_bytes", "esc",
                 "count", "bound")

    def __init__(self, rule: LengthRule):
        self.rule = rule
        self.bounds = rule.bounds
        self.table = rule.table
        self.stack: tuple[tuple[bool, str | None], ...] = ()  # open containers, outermost first
        self.expect_key = False  # the next quote outside a string opens a key
        self.in_string = False
        self.is_key = False
        self.key_bytes = b""  # of the open key
        self.esc = 0
        self.count = 0
        self.bound: Bounds | None = None  # of the open value string

    def copy(self) -> LengthTracker:
        twin = object.__new__(LengthTracker)
        twin.rule, twin.bounds, twin.table, twin.stack = self.rule, self.bounds, self.table, self.stack
        twin.expect_key, twin.in_string, twin.is_key = self.expect_key, self.in_string, self.is_key
        twin.key_bytes, twin.esc, twin.count, twin.bound = self.key_bytes, self.esc, self.count, self.bound
        return twin

    def _path(self) -> tuple:
        return tuple(ITEM if array else key for array, key in self.stack)

    def _signature(self) -> tuple:
        """Outside a string: everything the next opened string depends on."""
        return (self.expect_key, self.stack)

    def feed(self, data: bytes) -> bool:
        """Advance past `data`; False if it breaks a bound (the state is then undefined: feed a copy to test)."""
        i, n = 0, len(data)
        while i < n:
            if self.in_string:
                chars, used, esc = _string_bytes(data[i:], self.esc)
                if self.is_key:
                    self.key_bytes += data[i:i + used]
                else:
                    self.count += chars
                    if self.bound is not None and self.bound[1] is not None and self.count > self.bound[1]:
                        return False
                i += used
                if esc >= 0:
                    self.esc = esc
                    continue
                self.in_string = False  # closed
                if self.is_key:
                    self.stack = self.stack[:-1] + ((False, _decode_key(self.key_bytes[:-1])),)
                elif self.bound is not None and self.count < self.bound[0]:
                    return False
                continue
            b = data[i]
            i += 1
            if b == _QUOTE:
                self.in_string, self.esc, self.count = True, 0, 0
                self.is_key = self.expect_key and bool(self.stack) and not self.stack[-1][0]
                self.key_bytes = b""
                self.bound = None if self.is_key else self.bounds.get(self._path())
                self.expect_key = False
            elif b == 0x7B:  # {
                self.stack += ((False, None),)
                self.expect_key = True
            elif b == 0x5B:  # [
                self.stack += ((True, None),)
                self.expect_key = False
            elif b in (0x7D, 0x5D):  # } ]
                self.stack = self.stack[:-1]
                self.expect_key = False
            elif b == 0x3A:  # :
                self.expect_key = False
            elif b == 0x2C:  # ,
                self.expect_key = bool(self.stack) and not self.stack[-1][0]
        return True

    def feed_token(self, t: int) -> bool:
        """`feed(the token's bytes)`, from the tables where the token stays inside the open string."""
        table = self.table
        if self.in_string and t < table.num_tokens and not table.closes_list[self.esc][t]:
            if self.is_key:
                self.key_bytes += table.token_bytes(t)
            else:
                self.count += table.chars_list[self.esc][t]
                if self.bound is not None and self.bound[1] is not None and self.count > self.bound[1]:
                    return False
            self.esc = table.exit_esc[self.esc][t]
            return True
        return self.feed(table.token_bytes(t))

    def at_maximum(self) -> bool:
        """Inside a value string that has reached its maxLength, not mid-escape: only its closing quote is left."""
        return (self.in_string and not self.is_key and self.esc == 0 and self.bound is not None
                and self.bound[1] is not None and self.count >= self.bound[1])

    def violates(self, data: bytes) -> bool:
        """Whether a token of these bytes would break a bound from here (the reference for `narrow`)."""
        return not self.copy().feed(data)

    # -------------------------------------------------------------------------------------- the mask
    def narrow(self, words: np.ndarray) -> None:
        """Clear, in one mask row (`words`: int32 view of it, bit t % 32 of word t // 32 is token t), the tokens
        that would break a bound (tokens the grammar already refuses may be cleared too)."""
        if self.in_string and not self.is_key and self.bound is not None:
            lo, hi = self.bound
            left = None if hi is None else hi - self.count
            need = max(0, lo - self.count)
            if left is not None or need:
                words &= self.table.keep_words(self.esc, left, need)
        where, clear = self.rule.violator_words(self)
        if len(where):
            words[where] &= clear

    def state_key(self) -> tuple:
        """What `violators` depends on: outside a string the signature; inside, also the escape state and the
        open key's text or the bounded string's length."""
        if not self.in_string:
            return ("out", self._signature())
        if self.is_key:
            return ("key", self._signature(), self.key_bytes, self.esc)
        return ("value", self._signature(), self.esc, self.count if self.bound is not None else None)

    def violators(self) -> np.ndarray:
        """The ids of the tokens that would break a bound from here, past what `TokenTable.keep_words` covers (the
        uncached answer behind `LengthRule.violators`). Inside a string: the tokens that close it and open
        another, fed whole. Outside: the tokens with a quote, by the bounds of the string their first quote opens
        (found once per text before the quote) and, where they open a second one, fed whole. The reference the
        cached path (`LengthRule.violator_words`) is built from; `violates` is its own reference."""
        table = self.table
        if self.in_string:
            return np.array([t for t in table.crossing[self.esc] if self.violates(table.token_bytes(int(t)))],
                            dtype=np.int64)
        ids = table.quoted
        lead = table.lead_of[ids]
        bad = np.zeros(len(ids), dtype=bool)
        sig = self._signature()
        for lead_id in np.unique(lead):
            bound = self.rule.opened_bound(self, sig, int(lead_id))
            if bound is None:
                continue
            group = lead == lead_id
            n, closes = table.open_chars[ids], table.open_closes[ids]
            lo, hi = bound
            bad |= group & (((n < lo) & closes) | ((n > hi) if hi is not None else False))
        for i in np.flatnonzero(table.open_crossing[ids] & ~bad):  # opens, closes and opens again
            bad[i] = self.violates(table.token_bytes(int(ids[i])))
        return ids[bad]


_CLEAR_BIT = (~(np.uint32(1) << np.arange(32, dtype=np.uint32))).view(np.int32)  # word & _CLEAR_BIT[k]: bit k off


def _decode_key(raw: bytes) -> str:
    import json
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------ token tables


class TokenTable:
    """Per-tokenizer tables of what each token does to a string (built once, kept on the grammar backend).

    For each escape state e (ESCAPE_STATES) and token t, from inside a string: `chars[e][t]` characters before the
    closing quote (or to the token's end), `closes[e][t]`, and `crossing[e]`: the ids that close the string and
    have another quote after. For tokens with a quote, from outside a string: `lead_of[t]` (an id of the text
    before the first quote), and from that quote on as above (`open_chars`, `open_closes`, `open_crossing`).
    """

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        self._bytes = token_bytes
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        n = len(token_bytes)
        self.num_tokens = n
        self.exit_esc: dict[int, list[int]] = {e: [0] * n for e in ESCAPE_STATES}  # after a token that stays open
        self.chars = {e: np.zeros(vocab_size, dtype=np.int32) for e in ESCAPE_STATES}
        self.closes = {e: np.zeros(vocab_size, dtype=bool) for e in ESCAPE_STATES}
        crossing: dict[int, list[int]] = {e: [] for e in ESCAPE_STATES}
        for t in range(n):
            data = token_bytes[t]
            if _QUOTE in data or _BACKSLASH in data:  # walk it (a few thousand tokens)
                for e in ESCAPE_STATES:
                    c, used, end = _string_bytes(data, e)
                    self.chars[e][t] = c
                    self.exit_esc[e][t] = max(end, 0)
                    if end < 0:
                        self.closes[e][t] = True
                        if _QUOTE in data[used:]:
                            crossing[e].append(t)
                continue
            # No quote, no backslash: characters = bytes that are not UTF-8 continuations, after the bytes the
            # escape state still consumes (e of them; after a backslash one, or five for `\u`).
            self.chars[0][t] = len(data.translate(None, _CONTINUATION))
            for e in (4, 3, 2, 1):
                self.chars[e][t] = len(data[e:].translate(None, _CONTINUATION))
            self.chars[5][t] = len(data[5 if data[:1] == b"u" else 1:].translate(None, _CONTINUATION))
            if len(data) < 5:  # ends inside an escape begun before it
                for e in (5, 4, 3, 2, 1):
                    self.exit_esc[e][t] = _string_bytes(data, e)[2]
        self.crossing = {e: np.array(ids, dtype=np.int64) for e, ids in crossing.items()}
        self.chars_list = {e: a[:n].tolist() for e, a in self.chars.items()}  # (per-token lookups from Python)
        self.closes_list = {e: a[:n].tolist() for e, a in self.closes.items()}
        self.quote_id = next((t for t in range(n) if token_bytes[t] == b'"'), None)  # the token that is one quote
        quoted, leads, lead_ids = [], {}, []
        open_chars, open_closes, open_crossing = [], [], []
        for t in range(n):
            data = token_bytes[t]
            q = data.find(_QUOTE)
            if q < 0:
                continue
            quoted.append(t)
            lead_ids.append(leads.setdefault(data[:q], len(leads)))
            c, used, end = _string_bytes(data[q + 1:], 0)
            open_chars.append(c)
            open_closes.append(end < 0)
            open_crossing.append(end < 0 and _QUOTE in data[q + 1 + used:])
        self.quoted = np.array(quoted, dtype=np.int64)
        self.lead_text = list(leads)
        self.lead_of = np.full(vocab_size, -1, dtype=np.int64)
        self.lead_of[self.quoted] = lead_ids
        self.open_chars = np.zeros(vocab_size, dtype=np.int32)
        self.open_closes = np.zeros(vocab_size, dtype=bool)
        self.open_crossing = np.zeros(vocab_size, dtype=bool)
        self.open_chars[self.quoted] = open_chars
        self.open_closes[self.quoted] = open_closes
        self.open_crossing[self.quoted] = open_crossing
        self._lock = threading.Lock()
        self._keep: dict[tuple, np.ndarray] = {}

    def token_bytes(self, t: int) -> bytes:
        return self._bytes[t] if t < len(self._bytes) else b""

    def keep_words(self, esc: int, left: int | None, need: int) -> np.ndarray:
        """Packed int32 mask row of the tokens that keep a string within (need, left) from escape state esc: at
        most `left` more characters (None: no limit), and if they close it, at least `need`."""
        key = (esc, left, need)
        words = self._keep.get(key)
        if words is None:
            chars, closes = self.chars[esc], self.closes[esc]
            ok = ~(closes & (chars < need))
            if left is not None:
                ok &= chars <= left
            bits = np.zeros(self.width * 32, dtype=bool)
            bits[: self.vocab_size] = ok
            bits[len(self._bytes): self.vocab_size] = True  # ids past the tokenizer: the grammar's mask decides
            words = np.packbits(bits, bitorder="little").view(np.int32)
            with self._lock:
                self._keep[key] = words
        return words


class LengthRule:
    """One compiled schema's bounds (`split_lengths`) with its tokenizer's TokenTable; shared by the schema's
    requests (thread-safe). `tracker()` starts a request's LengthTracker."""

    def __init__(self, bounds: dict[tuple, Bounds], table: TokenTable):
        self.bounds = bounds
        self.table = table
        self._lock = threading.Lock()
        self._opened: dict[tuple, Bounds | None] = {}
        self._violators: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def tracker(self) -> LengthTracker:
        return LengthTracker(self)

    def violator_words(self, tracker: LengthTracker) -> tuple[np.ndarray, np.ndarray]:
        """`tracker.violators()` as (word indices, int32 words to AND them with), cached per
        `tracker.state_key()` (a schema's states are few)."""
        key = tracker.state_key()
        hit = self._violators.get(key)
        if hit is None:
            bad = tracker.violators()
            where = np.unique(bad >> 5)
            clear = np.full(len(where), -1, dtype=np.int32)
            np.bitwise_and.at(clear, np.searchsorted(where, bad >> 5), _CLEAR_BIT[bad & 31])
            hit = (where, clear)
            with self._lock:
                if len(self._violators) < MAX_CACHED_STATES:
                    self._violators[key] = hit
        return hit

    def opened_bound(self, tracker: LengthTracker, sig: tuple, lead_id: int) -> Bounds | None:
        """The bounds of the string a quote opens after the text `table.lead_text[lead_id]` from `tracker`'s state
        (outside a string; `sig` its signature), cached per (signature, lead)."""
        key = (sig, lead_id)
        try:
            return self._opened[key]
        except KeyError:
            pass
        probe = tracker.copy()
        probe.feed(self.table.lead_text[lead_id] + b'"')
        bound = probe.bound if probe.in_string and not probe.is_key else None
        with self._lock:
            if len(self._opened) < MAX_CACHED_STATES:  # (free-form keys could grow it without end)
                self._opened[key] = bound
        return bound
