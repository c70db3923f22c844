"""Every script in benchmarks/ answers `--help` from the repo root as documented (`PYTHONPATH=$PWD python
benchmarks/NAME.py`), with CUDA hidden, and none edits sys.path: what they share comes from benchmarks/common.py.
`python -m benchmarks` (benchmarks/__main__.py) indexes every one of them and runs one by name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
LIBRARY = {"__init__.py", "__main__.py", "common.py"}  # imported by the scripts, or the index (tested below)


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and p.name not in LIBRARY)


def first_doc_line(script: Path) -> str:
    """A shell script's first header comment line (after the #! line)."""
    return next(line[1:].strip() for line in script.read_text().splitlines()[1:] if line.startswith("#"))


def run_help(script: Path) -> subprocess.CompletedProcess:
    cmd = ["bash" if script.suffix == ".sh" else sys.executable, str(script.relative_to(REPO)), "--help"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_every_script_answers_help_without_a_gpu():
    found = scripts()
    assert len(found) >= 15, [p.name for p in found]
    with ThreadPoolExecutor(max_workers=4) as pool:  # ~1.5 s each (most import torch)
        results = dict(zip(found, pool.map(run_help, found)))
    failed = {}
    for script, r in results.items():
        if script.suffix == ".py":  # argparse's answer
            answered = r.stdout.startswith("usage: ")
        else:  # the header comment, not a run that took --help for an argument
            answered = " ".join(first_doc_line(script).split()) in " ".join(r.stdout.split())
        if r.returncode != 0 or not answered:
            failed[script.name] = f"exit {r.returncode}; stdout {r.stdout[:300]!r}; stderr {r.stderr[-1500:]}"
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_no_script_edits_sys_path():
    offenders = [p.name for p in sorted(BENCH.glob("*.py")) if re.search(r"\bsys\.path\b", p.read_text())]
    assert not offenders, f"run from the repo root with PYTHONPATH=$PWD instead: {offenders}"


def test_the_index_lists_every_script_with_its_command():
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    entries = [line.split()[0] for line in r.stdout.splitlines() if line and not line.startswith(" ")]
    assert entries == [p.stem for p in scripts()]
    commands = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("$ ")]
    assert len(commands) == len(entries)
    for script, cmd in zip(scripts(), commands):
        assert f"benchmarks/{script.name}" in cmd, (script.name, cmd)
    whats = [line.strip() for line in r.stdout.splitlines() if line.startswith("    ") and not line.strip().startswith("$ ")]
    assert len(whats) == len(entries) and all(whats), whats


def test_the_index_runs_a_script_by_name():
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks", "sse_events", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: sse_events.py"), (r.stdout[:300], r.stderr[-500:])
    r = subprocess.run([sys.executable, "-m", "benchmarks", "no_such_benchmark"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no benchmark 'no_such_benchmark'" in r.stderr
