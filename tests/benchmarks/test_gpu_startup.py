"""benchmarks/gpu_startup.py --smoke: each configuration started twice in processes of its own (an empty compile
cache, then the one it filled), one more cold start under cProfile; the report carries every start's stages, the KV
pool's dtype per configuration, the profile's top functions, and the table compares each cold start with bf16's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.benchmarks.test_benchmark_scripts import REPO


def test_gpu_startup_smoke(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/gpu_startup.py", "--smoke", "--configs", "bf16,kv",
                        "--profile", "kv"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-startup.json").read_text())
    assert set(doc["runs"]) == {"bf16", "kv"}
    for label, run in doc["runs"].items():
        for start in (run["cold"], run["warm"]):
            assert start["total_s"] > 0 and {"load weights", "KV pool"} <= set(start["stages"])
            assert sum(start["stages"].values()) <= start["total_s"] + 0.05
        assert ("float8" in run["cold"]["kv_dtype"]) == (label == "kv")
    profile = doc["profile"]
    assert profile["config"] == "kv" and any("builder.py" in line for line in profile["profile_top"])
    table = p.stdout.splitlines()[-2:]
    assert table[0].startswith("bf16") and "1.00x bf16" in table[0] and table[1].startswith("kv")
