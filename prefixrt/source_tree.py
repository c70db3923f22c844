"""The package tree: which folders are prefixrt's packages, and how a source checkout imports them.

The design card keeps `kernels/` and `adapters/` at the repo's top level, shipped as `prefixrt.kernels` and
`prefixrt.adapters`. The packages are read from the tree, never listed: `package_folders` is every folder under
`prefixrt/`, `kernels/` and `adapters/`, and setup.py builds the distribution from it (with every other file in
those folders as package data), so a new folder ships without anyone adding it to a list. tests/test_layering.py
walks the same tree.

When the repo root is on sys.path (`python -m pytest`, `PYTHONPATH=<repo>`), two things follow from that layout:

- `import kernels` / `import adapters` must reach the installed distributions of those names (transformers
  imports the `kernels` package), not our folders. The folders have no `__init__.py`: a directory without one is
  only a namespace-package portion, which Python's import system passes over whenever a regular package of the
  same name exists further down sys.path. With none installed, the bare name imports as an empty namespace
  package with no `__file__` and no distribution metadata, which is exactly what transformers' availability
  probe reports as "not installed" (it finds a spec, so raising ModuleNotFoundError there would break its probe).
- `prefixrt.kernels` / `prefixrt.adapters` must import without an install: `SourceTreeFinder` maps exactly
  those two names to their folders (no `__path__` extension that would also expose tests/, docs/, ...).

This module imports only the standard library: setup.py loads it by path, before anything is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

PACKAGE = "prefixrt"
SUBPACKAGES = ("kernels", "adapters")  # repo folders shipped as prefixrt.<name>
_NOT_PACKAGES = frozenset({"__pycache__"})  # (and hidden folders)
_NOT_DATA = (".py", ".pyc", ".pyo")  # modules ship as modules; byte code is the installer's to write


def package_roots() -> dict[str, str]:
    """Import name -> repo folder of each tree the distribution ships: prefixrt/, and kernels/ and adapters/ as
    prefixrt.<name>."""
    return {PACKAGE: PACKAGE, **{f"{PACKAGE}.{n}": n for n in SUBPACKAGES}}


def package_folders(root: str) -> dict[str, str]:
    """Every package of the distribution -> its folder relative to the repo root `root` ('/'-separated): each
    tree of package_roots() and every folder under it but `__pycache__` and hidden ones, with or without an
    `__init__.py` (a folder without one imports as a namespace package, and its files must ship all the same).
    Raises ValueError where two folders would be the same package (a prefixrt/kernels/ beside kernels/)."""
    out: dict[str, str] = {}
    for name, top in package_roots().items():
        for dirpath, dirnames, _ in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in _NOT_PACKAGES and not d.startswith("."))
            rel = os.path.relpath(dirpath, os.path.join(root, top))
            parts = [] if rel == os.curdir else rel.split(os.sep)
            package, folder = ".".join([name, *parts]), "/".join([top, *parts])
            if package in out:
                raise ValueError(f"{out[package]}/ and {folder}/ would both be the package {package}")
            out[package] = folder
    return out


def package_data(root: str, folders: dict[str, str]) -> dict[str, list[str]]:
    """Package -> the names of its folder's files that are not Python modules (templates, the dashboard, tables
    read at run time, ...): every such file ships beside the modules, by this rule rather than by a list.
    `folders`: package_folders(root)."""
    out: dict[str, list[str]] = {}
    for package, folder in folders.items():
        path = os.path.join(root, folder)
        names = sorted(n for n in os.listdir(path) if not n.startswith(".") and not n.endswith(_NOT_DATA)
                       and os.path.isfile(os.path.join(path, n)))
        if names:
            out[package] = names
    return out


def checkout_root(package_file: str) -> str | None:
    """The repo root if prefixrt/__init__.py (`package_file`) lives in a source checkout, else None.

    An installed prefixrt sits in site-packages, where a `kernels/` beside it is the other distribution; a
    checkout is recognised by its pyproject.toml next to the subpackage folders."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(package_file)))
    ok = os.path.isfile(os.path.join(root, "pyproject.toml")) and all(os.path.isdir(os.path.join(root, n))
                                                                     for n in SUBPACKAGES)
    return root if ok else None


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds prefixrt.kernels / prefixrt.adapters in a checkout's top-level folders: the mapping that
    setup.py's package_dir makes at install, made here for `PYTHONPATH=<repo>` and for editable installs
    of another checkout (it goes first on sys.meta_path, so this checkout's folders win). The folders have no
    `__init__.py`: each is a package with no code of its own."""

    def __init__(self, root: str):
        self.folders = {name: os.path.join(root, top) for name, top in package_roots().items() if name != PACKAGE}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [folder]
        return spec


def install_finder(package_file: str) -> None:
    """Put a SourceTreeFinder first on sys.meta_path when prefixrt runs from a checkout (once)."""
    root = checkout_root(package_file)
    if root is None or any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SourceTreeFinder(root))
