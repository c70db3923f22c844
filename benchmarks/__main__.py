"""The runnable index of the benchmarks, from the repo root:

    python -m benchmarks                     # every script: what it measures, where it runs, its command
    python -m benchmarks NAME [ARGS ...]     # run one: PYTHONPATH=$PWD python benchmarks/NAME.py ARGS (bash for .sh)

The index is read from the scripts themselves (a script's docstring, or a shell script's header comment: its
first sentence and its first command line), so it never disagrees with them. GPU scripts say so in their name
(gpu_*); `--smoke` runs their logic on tiny shapes on the CPU where a script has it.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LIBRARY = {"__init__.py", "__main__.py", "common.py"}  # imported by the scripts, not run


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and p.name not in LIBRARY)


def header(script: Path) -> str:
    """A Python script's docstring, or a shell script's header comment (after the #! line)."""
    text = script.read_text()
    if script.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    lines = text.splitlines()[1:]
    return "\n".join(line[1:].strip() for line in lines if line.startswith("#"))


def summary(doc: str, width: int = 110) -> str:
    """The header's first sentence (up to a period or a colon that ends a line), on one line, at most `width`."""
    first = []
    for line in doc.splitlines():
        if not line.strip():
            break
        first.append(line.strip())
        if re.search(r"[.:]$", line.strip()):
            break
    text = " ".join(first)
    m = re.search(r"\.(\s|$)", text)
    text = text[: m.start() + 1] if m else text
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def command(script: Path, doc: str) -> str:
    """The header's first command line for this script (its trailing comment dropped), else the plain run."""
    for line in doc.splitlines():
        if f"benchmarks/{script.name}" in line and re.search(r"\b(python|bash)\b", line):
            return line.split("  #")[0].strip()
    runner = "bash" if script.suffix == ".sh" else "python"
    return f"PYTHONPATH=$PWD {runner} benchmarks/{script.name}"


def index() -> list[dict]:
    rows = []
    for script in scripts():
        doc = header(script)
        smoke = "--smoke" in script.read_text() if script.suffix == ".py" else False
        rows.append({"name": script.stem, "file": script.name, "gpu": script.name.startswith("gpu_"),
                     "smoke": smoke, "what": summary(doc), "command": command(script, doc)})
    return rows


def show() -> None:
    for r in index():
        where = "GPU" + (", --smoke on CPU" if r["smoke"] else "") if r["gpu"] else "CPU"
        print(f"{r['name']}  [{where}]\n    {r['what']}\n    $ {r['command']}")


def run(name: str, args: list[str]) -> int:
    found = [s for s in scripts() if s.stem == name or s.name == name]
    if not found:
        raise SystemExit(f"no benchmark {name!r}: `python -m benchmarks` lists them")
    script = found[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = ["bash" if script.suffix == ".sh" else sys.executable, str(script.relative_to(REPO)), *args]
    return subprocess.call(cmd, cwd=REPO, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="a script to run (its file name, with or without the extension)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = ap.parse_args()
    if ns.name is None:
        show()
        return 0
    return run(ns.name, ns.args)


if __name__ == "__main__":
    sys.exit(main())
