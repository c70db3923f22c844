"""benchmarks/gpu_lora.py --smoke: PEFT adapter folders written for the model's shape, the LoRA kernels against
their reference (Triton interpreted), the RAG shape per adapter on the base model and under the adapters (hit rate of
each adapter equal to the base model's on its prefix, the engine's per-adapter counters equal to the usage), more
adapters than slots (the run completes, loads about one a request, their share of wall time), and an engine without
LoRA; the table and the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.benchmarks.test_benchmark_scripts import REPO


def test_gpu_lora_smoke(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/gpu_lora.py", "--smoke"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-lora.json").read_text())
    assert "FAILED" not in p.stdout and "SKIPPED" not in p.stdout, p.stdout[-3000:]
    assert doc["kernels"]["ok"] and doc["kernels"]["base_rows_changed"] == 0
    variants = doc["kernels"]["decode64_launch_variants"]
    assert "current" in variants and len(variants) >= 2 and all(v["rel_err"] < 2e-2 for v in variants.values())

    rag = doc["adapters64"]
    trace = rag["trace"]
    adapters, requests = trace["adapters"], trace["requests"]
    per_adapter = requests // adapters
    assert rag["errors"] == 0 and rag["greedy_differs_from_base"] and rag["engine_counters_agree"]
    assert rag["hits_equal"] == adapters and rag["hit_rate_max_abs_diff"] == 0
    # round-robin from an empty cache: each adapter's first request computes its prefix, the others reuse it whole
    prompt = trace["shared"] + trace["unique"]
    want = (per_adapter - 1) * trace["shared"] / (per_adapter * prompt)
    assert all(abs(r - want) < 1e-3 for r in rag["hit_rate_adapters"]), (rag["hit_rate_adapters"], want)
    for label in ("base", "adapters"):
        run = rag["runs"][label][-1]
        assert run["output_tokens"] == requests * trace["output"] and run["loads"] == 0
    assert rag["ratio"] > 0

    many = doc["adapters256"]
    assert many["completed"] and many["run"]["num_errors"] == 0
    n = many["trace"]["requests"]
    assert many["trace"]["adapters"] > many["trace"]["resident"]
    assert many["trace"]["adapters"] - many["trace"]["resident"] <= many["loads"] <= n  # no thrashing
    assert 0 < many["load_busy_seconds"] <= many["load_seconds_sum"] + 1e-6
    assert 0 < many["load_share_of_wall"] <= 1
    assert many["resident_after"] == many["trace"]["resident"]

    assert doc["plain"]["hits"] == rag["runs"]["base"][-1]["hits"]
    assert doc["ratio_vs_plain_engine"] > 0
    table = p.stdout[p.stdout.rindex("prefixrt LoRA"):]
    for row in ("LoRA kernels vs reference", "hit rate per adapter = base's on its prefix",
                "adapter loads: share of wall (in flight)", "adapters / base on an engine without LoRA"):
        assert row in table, table
