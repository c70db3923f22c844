"""The repo root on sys.path is harmless: our top-level folders never stand in for installed distributions.

`python -m pytest` and `PYTHONPATH=<repo>` put the repo root first on sys.path. The repo's `kernels/` and
`adapters/` are `prefixrt.kernels` / `prefixrt.adapters` (setup.py's package_dir); under their bare names
they must resolve to the installed distributions (transformers imports the `kernels` package), or, with none
installed, to nothing transformers would take for an install.
Each check runs in a fresh interpreter so that this process's imports cannot hide a shadowing.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from prefixrt.source_tree import SUBPACKAGES

REPO = Path(__file__).resolve().parents[1]

# tests/ is the suite's own package (tests.helpers); it is first on sys.path only while the suite runs, and a
# distribution's stray top-level `tests` is not something library code imports.
NOT_SHIPPED = {"tests"}


def run_python(code: str, *, path: list[Path], isolated: bool = False, cwd: Path | None = None) -> str:
    """Run `code` with `path` put first on sys.path (and nothing but the stdlib after it if `isolated`)."""
    prelude = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}\n"
    cmd = [sys.executable, *(["-S"] if isolated else []), "-c", prelude + code]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def resolve(name: str) -> str:
    return f"""
try:
    import {name}
    print({name}.__file__ or list({name}.__path__))
except ModuleNotFoundError as e:
    print('missing:', e.name)
"""


def top_level_names() -> set[str]:
    """Names the repo root makes importable as regular packages or modules."""
    names = {p.parent.name for p in REPO.glob("*/__init__.py")}
    names |= {p.stem for p in REPO.glob("*.py")}
    return names


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_name_reaches_the_installed_distribution(name):
    out = run_python(resolve(name), path=[REPO])
    if importlib.metadata.packages_distributions().get(name):
        assert "site-packages" in out and not out.startswith(str(REPO / name)), out
    else:
        assert set(eval(out)) == {str(REPO / name)}, out  # only the empty namespace portion: see the next test


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_name_with_a_fake_distribution_and_without_one(name, tmp_path):
    fake = tmp_path / "site"
    (fake / name).mkdir(parents=True)
    (fake / name / "__init__.py").write_text("MARK = 'the distribution'\nfrom . import sub\n")
    (fake / name / "sub.py").write_text("X = 1\n")
    out = run_python(f"import {name}; print({name}.MARK, {name}.sub.X, {name}.__file__)", path=[REPO, fake])
    assert out == f"the distribution 1 {fake / name / '__init__.py'}"
    # Without site-packages (python -S) none is installed: the bare name is an empty namespace package with no
    # __file__ and no distribution metadata, which is what transformers' availability probe (find_spec, then
    # the version, then the import) reports as "not installed"; raising there would break that probe.
    code = f"""
import importlib.metadata, importlib.util
spec = importlib.util.find_spec({name!r})
import {name}
try:
    importlib.metadata.version({name!r})
    meta = True
except importlib.metadata.PackageNotFoundError:
    meta = False
print(spec.loader is None or type(spec.loader).__name__, getattr({name}, '__file__', None), meta)
"""
    assert run_python(code, path=[REPO], isolated=True) in ("True None False", "NamespaceLoader None False")


def test_subpackages_import_from_a_checkout_without_install(tmp_path):
    # python -S skips site-packages, so the editable install's finder is absent: only PYTHONPATH=<repo> remains.
    code = ("import importlib.util, prefixrt, prefixrt.kernels, prefixrt.adapters; "
            "m = importlib.util.find_spec('prefixrt.adapters.provider_handle'); "  # found, not run (it needs torch)
            "print(list(prefixrt.kernels.__path__), list(prefixrt.adapters.__path__), m.origin, prefixrt.__path__)")
    out = run_python(code, path=[REPO], isolated=True, cwd=tmp_path)
    assert out == " ".join([repr([str(REPO / "kernels")]), repr([str(REPO / "adapters")]),
                            str(REPO / "adapters" / "provider_handle.py"),
                            repr([str(REPO / "prefixrt")])])  # no __path__ extension exposing tests/, docs/, ...


def test_non_package_folders_are_not_prefixrt_subpackages():
    out = run_python(resolve("prefixrt.tests") + resolve("prefixrt.benchmarks"), path=[REPO])
    assert out.splitlines() == ["missing: prefixrt.tests", "missing: prefixrt.benchmarks"]


def test_dependency_canary_no_top_level_name_collides():
    """Fails if an installed distribution ships a top-level name that the repo root also provides unguarded."""
    dists = importlib.metadata.packages_distributions()
    for name in sorted(top_level_names() - NOT_SHIPPED - {"prefixrt"}):
        owners = dists.get(name)
        assert not owners, (
            f"installed distribution {owners} ships top-level `{name}`, which the repo's {name} shadows when the "
            f"repo root is on sys.path: a repo folder of that name must have no __init__.py (prefixrt/source_tree.py)"
        )
    for name in SUBPACKAGES:
        assert not (REPO / name / "__init__.py").exists(), f"{name}/__init__.py would shadow the `{name}` distribution"
    assert set(dists.get("prefixrt", ["prefixrt"])) == {"prefixrt"}, f"another distribution ships `prefixrt`: {dists['prefixrt']}"
