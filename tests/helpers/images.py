"""Images for multimodal tests: random RGB images and the ways a request carries them."""

from __future__ import annotations

import base64
import io

import numpy as np


def random_image(seed: int, size=(40, 28)):
    """A random RGB PIL image of size (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def ask(question: str, *images) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]
