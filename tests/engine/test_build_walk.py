"""What building a single-device engine touches: following EngineConfig from builder.build stays inside engine/,
model/ and cache/, the layers below them and hub/ for the weights (docs/architecture.md, "Building an engine").
Tensor parallelism (parallel/), disaggregation (disagg/) and the process boundary (engine/process/) are never
imported, let alone run, on that path: the rank strategy keeps them behind tp_size > 1.

The build runs in a fresh interpreter, so that what it imports is not hidden by earlier tests' imports; a
profiler records every prefixrt module whose code runs (module bodies included).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_layering import layer_table, unit_of

REPO = Path(__file__).resolve().parents[2]

WALK = r"""
import json, sys, threading
from prefixrt.config.engine_config import EngineConfig

ran = set()

def profile(frame, event, arg):
    if event == "call":
        name = frame.f_globals.get("__name__") or ""
        if name.startswith("prefixrt"):
            ran.add(name)

before = {m for m in sys.modules if m.startswith("prefixrt")}
sys.setprofile(profile)
threading.setprofile(profile)
from prefixrt.engine import builder
built = builder.build(EngineConfig(model=sys.argv[1], device="cpu", kv_cache_tokens=256, max_running_requests=4))
sys.setprofile(None)
threading.setprofile(None)
imported = {m for m in sys.modules if m.startswith("prefixrt")} - before
print(json.dumps({"ran": sorted(ran), "imported": sorted(imported), "ranks": type(built.ranks).__name__}))
"""

# The units of docs/architecture.md's layer table that a single-device build may reach (lora: the builder asks
# lora/build.py for the adapters' slots, None when LoRA is off).
ALLOWED = {"records", "kernels", "cache", "sampling", "constrained", "multimodal", "model", "hub", "engine", "lora"}


def _walk(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", WALK, str(folder)], cwd=str(REPO), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_single_device_build_stays_in_engine_model_and_cache(tmp_path, tiny_checkpoints, tiny_tokenizer):
    checkpoint, _ = tiny_checkpoints("llama")
    folder = tmp_path / "folder"
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).symlink_to(f)
    tiny_tokenizer.save_pretrained(str(folder))

    walk = _walk(folder)
    assert walk["ranks"] == "SingleDevice"
    rows = layer_table()
    reached = set(walk["ran"]) | set(walk["imported"])
    # The profiler sees the path (a broken recorder would pass everything below vacuously).
    for module in ("prefixrt.engine.builder", "prefixrt.engine.ranks", "prefixrt.model.rank_setup",
                   "prefixrt.cache.kv_manager", "prefixrt.engine.loop.core", "prefixrt.hub.loader"):
        assert module in walk["ran"], module
    outside = sorted(m for m in reached if unit_of(m, rows)[1] not in ALLOWED)
    assert outside == [], f"a single-device build reaches beyond engine/, model/, cache/: {outside}"
    assert sorted(m for m in reached if m.startswith("prefixrt.engine.process")) == []
