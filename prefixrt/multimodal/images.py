"""Decode the images a request holds, under limits; anything undecodable or too large is an InvalidRequest.

Accepted: a PIL image, raw encoded bytes (PNG, JPEG, ... anything Pillow opens), a local file path
(str or Path), a `data:image/...;base64,` URL, or a `file://` URL. Remote URLs are refused: nothing is
downloaded. Every image is converted to RGB.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from prefixrt.errors import InvalidRequest

MAX_IMAGES_PER_REQUEST = 16
MAX_IMAGE_BYTES = 20 * 2**20  # encoded size
MAX_IMAGE_PIXELS = 40_000_000  # width * height after decoding (Pillow's own bomb check fires at ~179M)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = MAX_IMAGES_PER_REQUEST
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow comes with transformers' vision extras
        raise InvalidRequest("images need the Pillow package") from exc
    return Image


def _bytes_of(source, limits: ImageLimits, param: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, Path) or isinstance(source, str):
        text = str(source)
        if text.startswith("data:"):
            head, sep, payload = text.partition(",")
            if not sep or not head.endswith(";base64"):
                raise InvalidRequest("an image data: URL must be data:<mime>;base64,<data>", param)
            if len(payload) > limits.max_bytes * 4 // 3 + 4:
                raise InvalidRequest(f"image is larger than {limits.max_bytes} bytes", param)
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest(f"image data: URL is not valid base64: {exc}", param) from exc
        elif text.startswith(("http://", "https://")):
            raise InvalidRequest("remote image URLs are not fetched: send the image as a data: URL or a local "
                                 "file path", param)
        else:
            path = Path(text[len("file://") :] if text.startswith("file://") else text)
            if not path.is_file():
                raise InvalidRequest(f"image file {str(path)[:200]!r} does not exist", param)
            if path.stat().st_size > limits.max_bytes:
                raise InvalidRequest(f"image file is larger than {limits.max_bytes} bytes", param)
            data = path.read_bytes()
    else:
        raise InvalidRequest(f"an image must be a PIL image, bytes, a path or a data: URL, not "
                             f"{type(source).__name__}", param)
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"image is larger than {limits.max_bytes} bytes", param)
    return data


def load_image(source, limits: ImageLimits = ImageLimits(), param: str = "image"):
    """A decoded RGB PIL image from any accepted source; raises InvalidRequest (naming `param`)."""
    image_mod = _pil()
    if isinstance(source, image_mod.Image):
        image = source
    else:
        data = _bytes_of(source, limits, param)
        try:
            image = image_mod.open(io.BytesIO(data))
            if image.width * image.height > limits.max_pixels:
                raise InvalidRequest(f"image of {image.width}x{image.height} pixels is over the limit of "
                                     f"{limits.max_pixels}", param)
            image.load()
        except InvalidRequest:
            raise
        except Exception as exc:  # Pillow raises many kinds (UnidentifiedImageError, OSError, DecompressionBomb)
            raise InvalidRequest(f"cannot decode image: {exc}", param) from exc
    if image.width * image.height > limits.max_pixels:
        raise InvalidRequest(f"image of {image.width}x{image.height} pixels is over the limit of "
                             f"{limits.max_pixels}", param)
    if image.width == 0 or image.height == 0:
        raise InvalidRequest("image is empty", param)
    return image.convert("RGB") if image.mode != "RGB" else image


def load_images(sources, limits: ImageLimits = ImageLimits(), param: str = "images") -> list:
    sources = list(sources)
    if len(sources) > limits.max_images:
        raise InvalidRequest(f"{len(sources)} images in one request; the limit is {limits.max_images}", param)
    return [load_image(s, limits, param) for s in sources]


def image_hash(image, processor_settings: str) -> bytes:
    """sha256 over the RGB pixels, the size and the processor settings: the full 32-byte digest."""
    h = hashlib.sha256()
    h.update(f"{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    h.update(b"\0")
    h.update(processor_settings.encode())
    return h.digest()
