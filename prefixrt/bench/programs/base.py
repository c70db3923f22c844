"""ProgramWorkload: one LM-program workload of the SGLang paper's evaluation (section 6), as a frontend program
(or, for DSPy, a pipeline) with its argument builder and its sizes per preset.

Presets: "ci" (a few programs: the test suite's CPU runs, on Gemma-3-270M or a tiny checkpoint), "gpu" (the H200
run of benchmarks/gpu_programs.py, sized so every workload under every ablation fits in a few minutes). Sizes
are in words of synthetic text (about one token each) and in generated tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PRESETS = ("ci", "gpu")


@dataclass
class ProgramWorkload:
    name: str
    title: str
    paper: str  # the paper's workload, in one line (docs/benchmarks-programs.md sets the sizes side by side)
    sizes: dict[str, dict[str, Any]]  # preset -> sizes (make_args reads them)
    make_args: Callable[[dict, int], list[dict]]  # (sizes, seed) -> one kwargs dict per program run
    program: Any = None  # the @function Program run with run_batch (None: `run` drives the workload itself)
    run: Callable | None = None  # (provider, args, sizes, ablation) -> None, for workloads that are not programs
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})
    frontend_ablations: bool = True  # the hint / parallelism switches mean something for this workload
    uses_fork: bool = False  # its programs fork (the parallelism ablation serialises their branches)

    def sizes_for(self, preset: str, **overrides) -> dict:
        if preset not in self.sizes:
            raise ValueError(f"{self.name}: unknown preset {preset!r} (one of {sorted(self.sizes)})")
        return {**self.sizes[preset], **{k: v for k, v in overrides.items() if v is not None}}

    def describe(self, sizes: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in sizes.items())
