"""Generated model folders on disk: built once, atomically, under a lock, and rebuilt when their recipe changes.

Folders live under `$PREFIXRT_CACHE_DIR` (default `~/.cache/prefixrt`). Each is built in a temporary
sibling directory and renamed into place, under a file lock, so a crash never leaves a half folder and two
processes never build at once. A marker file records what built the folder (the recipe) and its revision;
a folder made by another recipe is rebuilt. Knows nothing of particular models (catalogue.py does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefixrt.stage_clock import StageClock

MARKER_FILE = "prefixrt_model.json"
# Bump when a catalogue recipe changes what it writes; cached folders with another value are rebuilt.
RECIPE_VERSION = 2


def cache_dir() -> Path:
    """Root of prefixrt's generated model folders: $PREFIXRT_CACHE_DIR or ~/.cache/prefixrt."""
    configured = os.environ.get("PREFIXRT_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "prefixrt"


def entry_folder(name: str) -> Path:
    return cache_dir() / name


def recipe_id(name: str, source: dict[str, Any]) -> dict[str, Any]:
    """What a folder's content depends on; a cached folder built from anything else is stale."""
    return {"name": name, "recipe_version": RECIPE_VERSION, **source}


def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_current(folder: Path, recipe: dict[str, Any]) -> bool:
    marker = read_marker(folder)
    return marker is not None and marker.get("recipe") == recipe


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


# Files whose bytes define a folder's revision; weight files count by name and size only (hashing
# gigabytes on every start would be too slow, and a re-saved checkpoint changes size in practice).
_HASHED_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name == MARKER_FILE:
            continue
        content = (
            path.read_bytes() if path.name.endswith(_HASHED_SUFFIXES) else str(path.stat().st_size).encode()
        )
        digest.update(path.name.encode() + b"\0" + content + b"\0")
    return digest.hexdigest()


def materialize(name: str, build: Callable[[Path, StageClock], None], source: dict[str, Any],
                clock: StageClock | None = None) -> tuple[Path, dict[str, Any]]:
    """Return the folder `cache_dir()/name` and its marker, building it first if missing or stale.

    `build(tmp_dir, clock)` writes the folder's files into an empty temporary sibling, which is renamed into
    place, timing its stages on `clock`; `source` is what the build reads besides its code (package versions,
    digests), kept in the marker's recipe so a change rebuilds the folder.
    """
    clock = clock or StageClock()
    folder = entry_folder(name)
    recipe = recipe_id(name, source)
    if is_current(folder, recipe):
        return folder, read_marker(folder) or {}
    with _file_lock(folder.parent / f".{name}.lock"):
        if is_current(folder, recipe):  # another process built it while we waited
            return folder, read_marker(folder) or {}
        for pattern in (f".{name}.build-*", f".{name}.stale-*"):
            for leftover in folder.parent.glob(pattern):  # from a crashed build; we hold the lock
                shutil.rmtree(leftover, ignore_errors=True)
        build_dir = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=folder.parent))
        try:
            started = time.monotonic()
            build(build_dir, clock)
            marker = {
                "recipe": recipe,
                "revision": f"{name}@{folder_digest(build_dir)[:16]}",
                "build_seconds": round(time.monotonic() - started, 1),
            }
            (build_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            # mkdtemp and some writers create owner-only entries; the cache is meant to be shared.
            build_dir.chmod(0o755)
            for path in build_dir.iterdir():
                path.chmod(0o755 if path.is_dir() else 0o644)
            if folder.exists():  # stale: move aside first, so the swap itself is one rename
                stale_dir = folder.parent / f".{name}.stale-{os.getpid()}"
                os.rename(folder, stale_dir)
                shutil.rmtree(stale_dir, ignore_errors=True)
            os.rename(build_dir, folder)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return folder, marker
