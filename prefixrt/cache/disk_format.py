"""KVFileFormat: one disk-tier file, a segment [start, end) of a cached prefix — how it is written and verified.

Layout (little-endian):
    MAGIC (8 bytes) | header length (u32) | header JSON, space-padded so the K/V starts 64-byte aligned |
    token ids [0, end) (int64) | K [layers, end - start, kv_heads, head_dim] | V (same) | checksum (16 bytes,
    BLAKE2b of everything before it)
The header names the engine identity (model revision and weights, dtype, K/V shape), the salt
(cache_salt), start and end; a prefix with images adds "images": runs [position, length, sha256 hex, first
offset] of image positions, whose token id slots hold IMAGE_SLOT (a prompt's image token is (ImageKey, offset),
request.py), so a file's tokens are the full radix key: text ids and image digests. Invariants:
- Written atomically: a temporary file in the same directory, renamed into place once complete.
- A read is usable only if the size, the checksum and the header all check out, the header is this engine's
  (identity, salt), and the stored token ids [0, start) equal the request's; then exactly the page-aligned
  part of [start, end) whose tokens equal the request's is returned (image tokens: full digest and offset).
  Nothing here trusts a hash.
"""

from __future__ import annotations

import array
import hashlib
import io
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixrt.request import AdapterNamespace, ImageKey

MAGIC = b"PRXKV001"
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_SUM_BYTES = 16
_ALIGN = 64


IMAGE_SLOT = -1  # the int64 stored at an image position (token ids are never negative)
_IMAGE_TAG = struct.pack("<q", IMAGE_SLOT)


def token_bytes(ids) -> bytes:
    """The bytes that stand for tokens in the disk tier's hashes: int64 per text token; an image token
    (ImageKey, offset) as IMAGE_SLOT, its 32-byte digest and its offset. token_bytes(a + b) ==
    token_bytes(a) + token_bytes(b), so a hash can be extended segment by segment."""
    try:
        return array.array("q", ids).tobytes()
    except TypeError:  # an image token
        return b"".join(array.array("q", [t]).tobytes() if t.__class__ is int
                        else _IMAGE_TAG + t[0].digest + struct.pack("<q", t[1]) for t in ids)


def split_images(tokens) -> tuple[list[int], list[list]]:
    """(int64 token slots, image runs) of a keyed token list: see the module docstring."""
    ids: list[int] = []
    runs: list[list] = []
    for pos, t in enumerate(tokens):
        if t.__class__ is int:
            ids.append(t)
            continue
        ids.append(IMAGE_SLOT)
        key, off = t
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == pos and last[2] == key.digest.hex() and last[3] + last[1] == off:
            last[1] += 1
        else:
            runs.append([pos, 1, key.digest.hex(), off])
    return ids, runs


def join_images(ids: list[int], runs) -> list:
    """The inverse of split_images; raises Damaged if the runs do not fit the slots."""
    if not isinstance(runs, list):
        raise Damaged("damaged header: bad image runs")
    out: list = list(ids)
    covered = 0
    for run in runs:
        try:
            pos, n, digest, off = run
            key = ImageKey(bytes.fromhex(digest))
            ok = len(key.digest) == 32 and 0 <= pos and n > 0 and pos + n <= len(ids) and off >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok or any(t != IMAGE_SLOT for t in ids[pos:pos + n]):
            raise Damaged("damaged header: bad image runs")
        out[pos:pos + n] = [(key, off + j) for j in range(n)]
        covered += n
    if covered != sum(t == IMAGE_SLOT for t in ids):
        raise Damaged("damaged header: image slots without an image")
    return out


def namespace_json(salt) -> Any:
    """A cache namespace as the files write it: a cache_salt (None or a string) as it is; a LoRA adapter's
    (request.py AdapterNamespace) as {"lora": digest, "salt": cache_salt}, which no cache_salt string can equal. A
    namespace read back from a file is already in this form (and stays as it is)."""
    return salt.to_json() if isinstance(salt, AdapterNamespace) else salt


@dataclass
class Damaged(Exception):
    """The file is damaged (checksum, size, header): never used, to be deleted."""

    reason: str


@dataclass
class Segment:
    """The usable part of a file for one request: positions [start, end), k/v [layers, end - start, heads, dim]."""

    start: int
    end: int
    k: torch.Tensor
    v: torch.Tensor


class KVFileFormat:
    def __init__(self, identity: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 page_size: int):
        self.identity = identity
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.page_size = page_size
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def header(self, salt: Any, start: int, end: int, images: list | None = None) -> dict:
        layers, heads, dim = self.shape
        # "namespace": the file format's name for the cache_salt (kept: files written before stay readable)
        hdr = {"identity": self.identity, "namespace": namespace_json(salt), "start": start, "end": end, "layers": layers,
               "kv_heads": heads, "head_dim": dim, "dtype": str(self.dtype).removeprefix("torch.")}
        if images:
            hdr["images"] = images
        return hdr

    def read_header(self, f, size: int) -> tuple[dict, list[int], int] | None:
        """(header, tokens (image positions as (ImageKey, offset)), offset of the K/V) of an open file; None: not
        this engine's file (another
        identity, or a page size this engine cannot use). Raises Damaged (bad magic, header or size)."""
        if f.read(len(MAGIC)) != MAGIC:
            raise Damaged("not a KV file (bad magic)")
        raw_len = f.read(4)
        if len(raw_len) != 4:
            raise Damaged("truncated header")
        (hlen,) = struct.unpack("<I", raw_len)
        if hlen > 1 << 20:
            raise Damaged("header too long")
        try:
            hdr = json.loads(f.read(hlen).decode())
            start, end = int(hdr["start"]), int(hdr["end"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise Damaged(f"damaged header: {e}") from None
        if not 0 <= start < end:
            raise Damaged("damaged header: bad segment bounds")
        if (hdr != self.header(hdr.get("namespace"), start, end, hdr.get("images"))
                or start % self.page_size or end % self.page_size):
            return None
        kv_off = len(MAGIC) + 4 + hlen + 8 * end
        if size != kv_off + (end - start) * self.bytes_per_token + _SUM_BYTES:
            raise Damaged(f"size {size} does not match its header (truncated?)")
        raw = f.read(8 * end)
        if len(raw) != 8 * end:
            raise Damaged("truncated token ids")
        ids = array.array("q", raw).tolist()
        return hdr, join_images(ids, hdr["images"]) if "images" in hdr else ids, kv_off

    def write(self, directory: Path, name: str, salt: Any, tokens: list[int], start: int, k: torch.Tensor,
              v: torch.Tensor) -> int:
        """Write the segment [start, len(tokens)) atomically as directory/name; returns the file's size."""
        ids, images = split_images(tokens)
        hdr = json.dumps(self.header(salt, start, len(tokens), images)).encode()
        pad = -(len(MAGIC) + 4 + len(hdr)) % _ALIGN  # tokens are 8 bytes each: the K/V starts aligned too
        hdr += b" " * pad
        parts = [MAGIC, struct.pack("<I", len(hdr)), hdr, array.array("q", ids).tobytes(),
                 k.contiguous().view(-1).view(torch.uint8).numpy().data,
                 v.contiguous().view(-1).view(torch.uint8).numpy().data]
        h = hashlib.blake2b(digest_size=_SUM_BYTES)
        tmp = directory / f"{TMP_PREFIX}{name}-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            for p in parts:
                h.update(p)
                f.write(p)
            f.write(h.digest())
        # No fsync: a file lost or damaged by a power cut fails its checksum or size check and is recomputed.
        os.replace(tmp, directory / name)
        return (directory / name).stat().st_size

    def read(self, path: Path, salt: Any, ids: list[int], cap: int, pos: int) -> tuple[Segment | str | None, int]:
        """Read and verify the file at path for a request (ids, salt) whose match ends at pos; use at most
        ids[:cap]. Returns (what, bytes read): a Segment; a reason string (never used, not damaged); None (gone,
        or no whole page in common). Raises Damaged."""
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                data = bytearray(size)
                got = fh.readinto(data)
        except FileNotFoundError:
            return None, 0
        if got != size or size < len(MAGIC) + 4 + _SUM_BYTES:
            raise Damaged("truncated")
        if hashlib.blake2b(memoryview(data)[:-_SUM_BYTES], digest_size=_SUM_BYTES).digest() != data[-_SUM_BYTES:]:
            raise Damaged("failed its checksum")
        parsed = self.read_header(io.BytesIO(data), size)
        if parsed is None or parsed[0]["namespace"] != namespace_json(salt):
            return "belongs to another model revision or cache_salt (hash collision)", size
        hdr, tokens, kv_off = parsed
        start, end = hdr["start"], hdr["end"]
        if start != pos or tokens[:start] != ids[:start]:
            return "stores different token ids than the request's prefix (hash collision)", size
        n, limit = 0, min(end, cap)
        while pos + n < limit and tokens[pos + n] == ids[pos + n]:
            n += 1
        n = n // self.page_size * self.page_size
        if n == 0:
            return None, size
        layers, heads, dim = self.shape
        kv = torch.frombuffer(data, dtype=self.dtype, count=2 * layers * (end - start) * heads * dim,
                              offset=kv_off).view(2, layers, end - start, heads, dim)
        return Segment(start, start + n, kv[0, :, :n], kv[1, :, :n]), size
