"""Tool calls read while they are generated: a reply's text, fed as it streams, -> each call's start (its name) and
its arguments' JSON text as it grows, as OpenAI streams `function.arguments`.

A call is a JSON object `{"name": <tool>, "<key>": {...arguments}}` (lowering/tools.py; the key is "arguments", or
"parameters" in Llama 3's form), wrapped in its syntax's open/close text (`<tool_call>` tags, a Mistral array):
anything between calls is skipped. Decoding under the tool plan's constraint writes the name before the arguments;
arguments that come first are held until the name is known. The scanner reads characters once (a streamed reply
costs what its length costs) and is pure text: the routes turn its events into their protocols' deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CallStarted:
    """Call `index` (0-based in the reply) named `name` began."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of call `index`'s arguments JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnded:
    """Call `index`'s object closed (its arguments are whole)."""

    index: int


class CallStreamer:
    """Feed a reply's text (`feed`, in any pieces): the CallStarted / ArgumentsDelta / CallEnded events of its calls,
    in order, each call's argument text coalesced per feed. `started` counts the calls begun so far."""

    def __init__(self, key: str = "arguments"):
        self.key = key
        self.started = 0
        self._state = "between"
        self._depth = 0  # nesting inside the call object (1: its own members)
        self._in_string = self._escape = False
        self._token = ""  # the key or name string being read
        self._member: str | None = None  # the key whose value is being read
        self._name: str | None = None
        self._args: list[str] = []  # argument text not yet emitted (held until the name is known)
        self._value_depth = 0

    def feed(self, text: str) -> list:
        events: list = []
        for c in text:
            self._char(c, events)
        self._flush(events)
        return events

    def _flush(self, events: list) -> None:
        if self._name is not None and self._args:
            events.append(ArgumentsDelta(self.started - 1, "".join(self._args)))
            self._args = []

    def _char(self, c: str, events: list) -> None:
        state = self._state
        if state == "between":
            if c == "{":
                self._state, self._name, self._args = "expect_key", None, []
            return
        if state == "expect_key":
            if c == '"':
                self._state, self._token = "key", ""
            elif c == "}":
                self._end(events)
            return
        if state in ("key", "name"):
            if self._escape:
                self._token += c
                self._escape = False
            elif c == "\\":
                self._token += c
                self._escape = True
            elif c == '"':
                if state == "key":
                    self._member, self._state = _unescape(self._token), "expect_colon"
                else:
                    self._name = _unescape(self._token)
                    self.started += 1
                    events.append(CallStarted(self.started - 1, self._name))
                    self._flush(events)
                    self._state = "after_value"
            else:
                self._token += c
            return
        if state == "expect_colon":
            if c == ":":
                self._state = "expect_value"
            return
        if state == "expect_value":
            if c.isspace():
                return
            if self._member == "name" and c == '"':
                self._state, self._token = "name", ""
                return
            self._state, self._value_depth, self._in_string, self._escape = "value", 0, False, False
        if self._state == "value":
            if not self._in_string and self._value_depth == 0 and c in ",}":
                # a bare scalar (number, true, false, null) ended: the delimiter is the object's
                self._state = "after_value"
                self._char(c, events)
                return
            if self._member == self.key:
                self._args.append(c)
            self._scan_value(c)
            return
        if state == "after_value":
            if c == ",":
                self._state = "expect_key"
            elif c == "}":
                self._end(events)

    def _scan_value(self, c: str) -> None:
        """Track one JSON value's end: a container's closing bracket or a string's closing quote (a bare scalar's
        end is the object's delimiter after it, read by the caller)."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._value_depth == 0:
                    self._state = "after_value"
            return
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._value_depth += 1
        elif c in "}]":
            self._value_depth -= 1
            if self._value_depth == 0:
                self._state = "after_value"

    def _end(self, events: list) -> None:
        self._flush(events)
        if self._name is not None:
            events.append(CallEnded(self.started - 1))
        self._state, self._member = "between", None


def _unescape(token: str) -> str:
    try:
        return json.loads(f'"{token}"')
    except ValueError:
        return token
