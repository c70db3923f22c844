"""Reasoning parsers: a reasoning model's reply text -> (reasoning, content), whole or as it streams.

`prefixrt serve --reasoning-parser NAME` (and `reasoning_parser=` on `create_app`, the in-process OpenAI shim
and the LangChain adapter) names the model family's form:

  qwen3        Qwen3 / QwQ: the reply opens with `<think>`, thinks, closes it with `</think>`, then answers. A
               reply that does not open with `<think>` is all content (thinking switched off).
  deepseek-r1  DeepSeek-R1 and its distills: the chat template opens `<think>` in the prompt, so the reply starts
               thinking (a leading `<think>` the model writes anyway is dropped) and everything before `</think>`
               is reasoning; a reply without `</think>` is all reasoning (cut short by max_tokens).

Either way, a prompt that ends with an open `<think>` (a template that opens it, as Qwen3's thinking-only
models do) starts the reply in reasoning. Whitespace around the reasoning, and between `</think>` and the
answer, is dropped. `chat_template_kwargs: {"enable_thinking": false}` turns parsing off for a request (the
template then closes the thinking block in the prompt; the reply is all content).

`ReasoningSplitter` splits text as it streams: it holds back only what may still be the start of a tag (or
whitespace that may turn out to end the reasoning), so deltas never show a tag or half of one.
Pure text functions: nothing here knows tokens, engines or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")


def check_parser(name: str | None) -> str | None:
    """`name` when it is None or one of PARSERS; ValueError naming the choices otherwise."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
    return name


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feeds a reply's text in pieces; each `feed` returns the (reasoning, content) text that is now certain,
    `finish` what was held back. `saw_reasoning` says whether the reply had a reasoning part at all."""

    def __init__(self, starts_in_reasoning: bool = False):
        self._buf = ""
        self._state = "lead"  # lead -> reasoning -> gap -> content (lead may go to content directly)
        self._default = "reasoning" if starts_in_reasoning else "content"
        self.saw_reasoning = starts_in_reasoning
        self._began = False  # reasoning text has been emitted (its leading whitespace is gone)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            buf = self._buf
            if self._state == "lead":
                head = buf.lstrip()
                if head.startswith(START):
                    self._buf, self._state, self.saw_reasoning = head[len(START):], "reasoning", True
                    continue
                if START.startswith(head):  # empty, or a part of the tag: wait for more
                    return "".join(reasoning), "".join(content)
                self._state = self._default
                if self._state == "content":
                    continue
                self._buf = head
                continue
            if self._state == "reasoning":
                if not self._began:
                    buf = self._buf = buf.lstrip()
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at].rstrip())
                    self._buf, self._state = buf[at + len(END):], "gap"
                    continue
                keep = _partial_suffix(buf, END)
                body = buf[:len(buf) - keep]
                emit = body.rstrip()
                reasoning.append(emit)
                self._buf = buf[len(emit):]
                self._began = self._began or bool(emit)
                return "".join(reasoning), "".join(content)
            if self._state == "gap":
                self._buf = buf.lstrip()
                if not self._buf:
                    return "".join(reasoning), "".join(content)
                self._state = "content"
                continue
            content.append(buf)
            self._buf = ""
            return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the reply (a tag's start that never completed is text after all)."""
        buf, state = self._buf, self._state
        self._buf = ""
        if state == "lead":
            state = self._default
            buf = buf.lstrip() if state == "reasoning" else buf
        if state == "reasoning":
            return buf.rstrip(), ""
        if state == "gap":
            return "", ""
        return "", buf


@dataclass(frozen=True)
class ReasoningParser:
    """One family's reasoning form (PARSERS)."""

    name: str

    def __post_init__(self):
        check_parser(self.name)

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether the reply begins inside the reasoning block, given the end of the rendered prompt."""
        return self.name == "deepseek-r1" or prompt_tail.rstrip().endswith(START)

    def splitter(self, prompt_tail: str = "") -> ReasoningSplitter:
        return ReasoningSplitter(self.starts_in_reasoning(prompt_tail))

    def split(self, text: str, prompt_tail: str = "") -> tuple[str | None, str]:
        """(reasoning or None when the reply has none, content) of a whole reply."""
        s = self.splitter(prompt_tail)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2 if s.saw_reasoning else None), c1 + c2


def thinking_enabled(template_kwargs: dict | None) -> bool:
    """False when a request switches thinking off in its chat_template_kwargs (`enable_thinking: false`, or
    `thinking: false` as some templates name it)."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking", True) is not False and kw.get("thinking", True) is not False


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning parser and the end of its rendered prompt (which may open the reasoning block)."""

    parser: ReasoningParser
    prompt_tail: str = ""

    def splitter(self) -> ReasoningSplitter:
        return self.parser.splitter(self.prompt_tail)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.parser.split(text, self.prompt_tail)
