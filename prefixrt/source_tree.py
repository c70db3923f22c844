"""Running from a source checkout: the repo's top-level `kernels/` and `adapters/` are prefixrt's, never top-level.

The design card keeps `kernels/` and `adapters/` at the repo's top level, shipped as `prefixrt.kernels` and
`prefixrt.adapters` (pyproject's package-dir). Two things follow from that layout when the repo root is on
sys.path (`python -m pytest`, `PYTHONPATH=<repo>`):

- `import kernels` / `import adapters` must reach the installed distributions of those names (transformers
  imports the `kernels` package), not our folders. The folders have no `__init__.py`: a directory without one is
  only a namespace-package portion, which Python's import system passes over whenever a regular package of the
  same name exists further down sys.path. With none installed, the bare name imports as an empty namespace
  package with no `__file__` and no distribution metadata, which is exactly what transformers' availability
  probe reports as "not installed" (it finds a spec, so raising ModuleNotFoundError there would break its probe).
- `prefixrt.kernels` / `prefixrt.adapters` must import without an install: `SourceTreeFinder` maps exactly
  those two names to their folders (no `__path__` extension that would also expose tests/, docs/, ...).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

SUBPACKAGES = ("kernels", "adapters")  # repo folders shipped as prefixrt.<name>


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
    pyproject's package-dir makes at install, made here for `PYTHONPATH=<repo>` and for editable installs
    of another checkout (it goes first on sys.meta_path, so this checkout's folders win). The folders have no
    `__init__.py`: each is a package with no code of its own."""

    def __init__(self, root: str):
        self.folders = {f"prefixrt.{n}": os.path.join(root, n) for n in SUBPACKAGES}

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
