"""Image content parts of chat messages: take the images out, leave a marker where each one was.

Accepted parts (in a message's `content` list):
  {"type": "image_url", "image_url": {"url": URL}} or {"type": "image_url", "image_url": URL}   (OpenAI)
  {"type": "image", "image": PIL image | bytes | path | URL}
  {"type": "image", "url": URL} / {"type": "image", "path": path}
  {"type": "image", "source_type": "base64", "data": B64, "mime_type": "image/png"}   (LangChain)
  {"type": "image", "source_type": "url", "url": URL}
  {"type": "image", "base64": B64, "mime_type": "image/png"}   (LangChain v1 blocks)
  {"type": "video", "video": [frame, ...]} / {"type": "video", "frames": [...]}   (a video as its frames)
URL: a data: URL, a file:// URL or a local path (images.load_image refuses remote ones). A frame is anything an
image part holds; a video file is refused (no video decoder is installed): sample its frames and send them.
Text parts are {"type": "text", "text": ...}. A message with image or video parts becomes a plain string
message: its text parts in order, with IMAGE_MARKER where each image was and one IMAGE_MARKER per frame, in
order and adjacent, where each video was (a video model keys and caches every frame as an image of its own).
"""

from __future__ import annotations

from prefixrt.errors import InvalidRequest

IMAGE_MARKER = "<|prefixrt:image|>"


def image_source(part: dict):
    """The image a content part holds (a PIL image, bytes, a path or a URL), or None for a part of another type."""
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise InvalidRequest("an image_url part needs image_url.url", param="messages")
        return url
    if kind in ("image", "input_image"):
        if part.get("source_type") == "base64" or ("data" in part and "mime_type" in part):
            return f"data:{part.get('mime_type') or 'image/png'};base64,{part.get('data', '')}"
        if isinstance(part.get("base64"), str):  # LangChain's v1 content blocks
            return f"data:{part.get('mime_type') or 'image/png'};base64,{part['base64']}"
        for field in ("image", "url", "path", "image_url"):
            if part.get(field) is not None:
                value = part[field]
                return value.get("url") if isinstance(value, dict) else value
        raise InvalidRequest("an image part needs one of image, url, path or data", param="messages")
    return None


def video_frames(part: dict) -> list | None:
    """The frames of a video part (a list of image sources), or None for a part of another type."""
    if part.get("type") not in ("video", "input_video"):
        return None
    frames = part.get("video", part.get("frames"))
    if isinstance(frames, (list, tuple)) and frames:
        return list(frames)
    if isinstance(frames, (str, bytes)) or hasattr(frames, "__fspath__"):
        raise InvalidRequest("video files are not decoded (no video decoder is installed): send the video as a "
                             "list of frames, {\"type\": \"video\", \"video\": [frame, ...]}", param="messages")
    raise InvalidRequest("a video part needs a non-empty list of frames in 'video'", param="messages")


def has_images(messages) -> bool:
    """Whether chat messages hold any image part."""
    if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
        return False  # a prompt of token ids (often thousands long) is not scanned
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)):
            for part in content:
                if isinstance(part, dict) and (part.get("type") in ("video", "input_video")
                                               or image_source(part) is not None):
                    return True
    return False


def split_images(messages: list[dict]) -> tuple[list[dict], list]:
    """(messages with every image replaced by IMAGE_MARKER in a string content, the image sources in order).
    Raises InvalidRequest for a malformed part or text that holds the marker itself."""
    out, sources = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            if IMAGE_MARKER in content:
                raise InvalidRequest(f"message text may not contain {IMAGE_MARKER!r}", param="messages")
            out.append(m)
            continue
        if not isinstance(content, (list, tuple)):
            out.append(m)
            continue
        pieces = []
        for part in content:
            if not isinstance(part, dict):
                raise InvalidRequest("a content part must be an object", param="messages")
            frames = video_frames(part)
            source = image_source(part) if frames is None else None
            if frames is not None:
                sources.extend(frames)
                pieces.append(IMAGE_MARKER * len(frames))
            elif source is not None:
                sources.append(source)
                pieces.append(IMAGE_MARKER)
            elif part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest("a text part needs a string 'text'", param="messages")
                if IMAGE_MARKER in text:
                    raise InvalidRequest(f"message text may not contain {IMAGE_MARKER!r}", param="messages")
                pieces.append(text)
            else:
                raise InvalidRequest(f"unsupported content part type {part.get('type')!r}", param="messages")
        out.append({**m, "content": "".join(pieces)})
    return out, sources


def restore_images(messages: list[dict], sources: list) -> list[dict]:
    """The inverse of split_images after a text-only step (a lowering): each IMAGE_MARKER in a string content
    becomes an image part again, the sources taken in order. Raises InvalidRequest if the markers and the
    sources do not pair up."""
    out, k = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or IMAGE_MARKER not in content:
            out.append(m)
            continue
        parts: list[dict] = []
        for i, piece in enumerate(content.split(IMAGE_MARKER)):
            if i:
                if k >= len(sources):
                    raise InvalidRequest(f"message text may not contain {IMAGE_MARKER!r}", param="messages")
                parts.append({"type": "image", "image": sources[k]})
                k += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    if k != len(sources):
        raise InvalidRequest(f"{len(sources) - k} images were dropped on the way to the chat template",
                         param="messages")
    return out
