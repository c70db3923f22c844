"""benchmarks/agent_sessions.py --smoke: agent sessions through `prefixrt serve` with the openai and anthropic
clients (tool time between turns, staggered starts, sessions ending and starting) under a full pool and a third
of it with the host tier; the table and the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.bench.test_programs import REPO, long_folder  # noqa: F401 (a fixture)


def test_agent_sessions_smoke(long_folder, tmp_path):  # noqa: F811
    cmd = [sys.executable, "benchmarks/agent_sessions.py", "--smoke", str(long_folder), "--runs", "1,1/3+host",
           "--keep", "--json", str(tmp_path / "a.json"), "--port", "31977"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "a.json").read_text())
    runs = {r["label"]: r for r in doc["runs"]}
    assert set(runs) == {"1", "1/3+host"} and runs["1"]["hit_vs_first"] == 1.0
    params = doc["params"]
    for label, r in runs.items():
        turns = doc["turns"][label]
        assert len(turns) == params["sessions"] * params["turns"]
        assert {t["client"] for t in turns} == {"openai", "anthropic"}
        assert all(0 <= t["cached_tokens"] < t["prompt_tokens"] and t["ttft_s"] <= t["e2e_s"] for t in turns)
        assert [b["turn"] for b in r["by_turn"]] == list(range(params["turns"]))
        later = [t for t in turns if t["turn"] > 0]
        assert sum(t["cached_tokens"] for t in later) > 0.5 * sum(t["prompt_tokens"] for t in later), label
    assert runs["1/3+host"]["pool_tokens"] < runs["1"]["pool_tokens"]
    assert "1/3+host" in p.stdout and "TTFT p50" in p.stdout
