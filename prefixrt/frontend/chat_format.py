"""How a program's pieces (chat messages and raw text) become prompt text.

A program state is a list of pieces: completed messages `Message(role, content)` and raw text, plus at most
one open role block being filled. `TemplateFormat` renders runs of consecutive messages with the model's
own chat template (tokenizer.apply_chat_template), so a prompt equals what the engine renders for the same
messages; `PlainFormat` is a readable "Role: content" layout for endpoints without a known template.
"""

from __future__ import annotations

import base64
import logging
import mimetypes
from dataclasses import dataclass
from typing import Protocol

from prefixrt.hub.chat_templates import render_chat_template

log = logging.getLogger("prefixrt.frontend")

_SENTINEL = "\x00prefixrt-content\x00"


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    media: tuple = ()  # (offset in content, ir.Media) of the message's image/video inputs

    def to_dict(self) -> dict:
        return {"role": self.role, "content": self.content}


Piece = Message | str


def message_dict(m: Message) -> dict:
    """An OpenAI chat message; with media, the content is a list of text and image_url/video_url parts."""
    if not m.media:
        return m.to_dict()
    parts, pos = [], 0
    for offset, media in m.media:
        if m.content[pos:offset]:
            parts.append({"type": "text", "text": m.content[pos:offset]})
        pos = offset
        key = f"{media.kind}_url"
        parts.append({"type": key, key: {"url": data_url(media.path)}})
    if m.content[pos:]:
        parts.append({"type": "text", "text": m.content[pos:]})
    return {"role": m.role, "content": parts}


def data_url(path: str) -> str:
    """A file as a data: URL (its MIME type guessed from the name)."""
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    with open(path, "rb") as f:
        return f"data:{mime};base64,{base64.b64encode(f.read()).decode('ascii')}"


class ChatFormat(Protocol):
    def render(self, pieces: list[Piece], open_role: str | None = None, partial: str = "") -> str:
        """Prompt text for `pieces` followed by an open `open_role` block holding `partial` (none: no block)."""


def _runs(pieces: list[Piece]) -> list[list[Message] | str]:
    out: list[list[Message] | str] = []
    for p in pieces:
        if isinstance(p, Message):
            if out and isinstance(out[-1], list):
                out[-1].append(p)
            else:
                out.append([p])
        elif out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


class PlainFormat:
    """`System: ...\\nUser: ...\\nAssistant: ...\\n`; an open block renders as `Role: partial`."""

    def render(self, pieces: list[Piece], open_role: str | None = None, partial: str = "") -> str:
        text = "".join(p if isinstance(p, str) else f"{p.role.capitalize()}: {p.content}\n" for p in pieces)
        if open_role is not None:
            text += f"{open_role.capitalize()}: {partial}"
        return text


class TemplateFormat:
    """Renders message runs with a HF tokenizer's chat template; raw text is kept verbatim between runs.

    An open assistant block is `render(messages, add_generation_prompt=True) + partial` (exactly the prompt
    the engine builds for those messages); another open role is cut from a render with a sentinel content.
    A run the template refuses (e.g. strict role alternation) is rendered with PlainFormat and logged.
    """

    def __init__(self, tokenizer, lock=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.bos_text = tokenizer.bos_token or ""
        self._lock = lock
        self._plain = PlainFormat()

    def _apply(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._lock is None:
            return render_chat_template(self.tokenizer, messages, add_generation_prompt)
        with self._lock:
            return render_chat_template(self.tokenizer, messages, add_generation_prompt)

    def _render_run(self, run: list[Message], open_role: str | None, partial: str) -> str:
        msgs = [m.to_dict() for m in run]
        try:
            if open_role is None:
                return self._apply(msgs, False)
            if open_role == "assistant":
                return self._apply(msgs, True) + partial
            full = self._apply([*msgs, {"role": open_role, "content": _SENTINEL}], False)
            cut = full.find(_SENTINEL)
            if cut < 0:
                raise ValueError(f"the chat template does not render a {open_role} message's content in place, so "
                                 f"a {open_role}(...) block cannot contain gen/select")
            return full[:cut] + partial
        except ValueError:
            raise
        except Exception as e:  # a template that refuses this conversation (jinja raise_exception, ...)
            log.warning("chat template refused the conversation (%s); rendering it as plain text", e)
            return self._plain.render(list(run), open_role, partial)

    def render(self, pieces: list[Piece], open_role: str | None = None, partial: str = "") -> str:
        runs = _runs(pieces)
        if open_role is not None and (not runs or isinstance(runs[-1], str)):
            runs.append([])  # the open block starts a new run of messages
        parts = []
        for i, run in enumerate(runs):
            if isinstance(run, str):
                parts.append(run)
                continue
            last = i == len(runs) - 1
            text = self._render_run(run, open_role if last else None, partial if last else "")
            if i > 0 and self.bos_text and text.startswith(self.bos_text):
                text = text[len(self.bos_text):]  # only the very start of a prompt carries BOS
            parts.append(text)
        return "".join(parts)
