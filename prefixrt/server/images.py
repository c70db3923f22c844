"""Image parts of chat requests (`image_url` content parts) on /v1/chat/completions.

The lowering of a chat request reads text only, so a request with images is lowered with a marker text part
where each image was (`without_images`), and the lowered messages get their images back as content parts
(`with_images`) before the engine renders them (Engine.prepare: decode, limits, processor, image blocks).
URLs: data: URLs and local files (file:// or a path); remote ones are refused by the engine with a 400.
"""

from __future__ import annotations

from prefixrt.errors import InvalidRequest
from prefixrt.multimodal.messages import IMAGE_MARKER, restore_images
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
    """Lowered messages with each marker turned back into an image part (in order)."""
    return restore_images(messages, urls)
