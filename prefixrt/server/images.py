"""Image parts of chat requests (`image_url` content parts) on /v1/chat/completions.

The lowering of a chat request reads text only, so a request with images is lowered with a marker text part
where each image was (`without_images`), and the lowered messages get their images back as content parts
(`with_images`) before the engine renders them (Engine.prepare: decode, limits, processor, image blocks).
URLs: data: URLs and local files (file:// or a path); remote ones are refused by the engine with a 400.
"""

from __future__ import annotations

from prefixrt.errors import InvalidRequest
from prefixrt.multimodal.messages import IMAGE_MARKER
from prefixrt.server.protocol import ChatCompletionRequest, ImageUrlPart, TextPart


def without_images(body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """(the request with each image part replaced by a marker text part, the image URLs in order)."""
    urls: list[str] = []
    messages = []
    for m in body.messages:
        if isinstance(m.content, list) and any(isinstance(p, ImageUrlPart) for p in m.content):
            if m.role != "user":
                raise InvalidRequest("images are accepted in user messages only", param="messages")
            parts = []
            for p in m.content:
                if isinstance(p, ImageUrlPart):
                    urls.append(p.image_url.url)
                    parts.append(TextPart(text=IMAGE_MARKER))
                else:
                    parts.append(p)
            m = m.model_copy(update={"content": parts})
        messages.append(m)
    return body.model_copy(update={"messages": messages}), urls


def with_images(messages: list[dict], urls: list[str]) -> list[dict]:
    """Lowered messages with each marker turned back into an image_url part (in order)."""
    out, k = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or IMAGE_MARKER not in content:
            out.append(m)
            continue
        parts = []
        for i, piece in enumerate(content.split(IMAGE_MARKER)):
            if i:
                if k >= len(urls):
                    raise InvalidRequest(f"message text may not contain {IMAGE_MARKER!r}", param="messages")
                parts.append({"type": "image_url", "image_url": {"url": urls[k]}})
                k += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    if k != len(urls):
        raise InvalidRequest(f"{len(urls) - k} images were dropped by the chat lowering", param="messages")
    return out
