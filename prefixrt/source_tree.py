"""Running from a source checkout: the repo's top-level `kernels/` and `adapters/` are prefixrt's, never top-level.

The design card keeps `kernels/` and `adapters/` at the repo's top level, shipped as `prefixrt.kernels` and
`prefixrt.adapters` (pyproject's package-dir). Two things follow from that layout when the repo root is on
sys.path (`python -m pytest`, `PYTHONPATH=<repo>`):

- `prefixrt.kernels` / `prefixrt.adapters` must import without an install: `SourceTreeFinder` maps exactly
  those two names to their folders (no `__path__` extension that would also expose tests/, docs/, ...).
- `import kernels` / `import adapters` must reach the installed distributions of those names (transformers
  imports the `kernels` package), not our folders: each folder's `__init__` calls `import_installed` when it
  finds itself imported under its bare name, which puts the distribution in its place in sys.modules or
  raises ModuleNotFoundError as if the folder were not there.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

SUBPACKAGES = ("kernels", "adapters")  # repo folders shipped as prefixrt.<name>


def checkout_root(package_file: str) -> str | None:
    """The repo root if prefixrt/__init__.py (`package_file`) lives in a source checkout, else None.

    An installed prefixrt sits in site-packages, where a `kernels/` beside it is the other distribution; a
    checkout is recognised by its pyproject.toml next to the subpackage folders."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(package_file)))
    marks = [os.path.join(root, "pyproject.toml")] + [os.path.join(root, n, "__init__.py") for n in SUBPACKAGES]
    return root if all(os.path.isfile(m) for m in marks) else None


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds prefixrt.kernels / prefixrt.adapters in a checkout's top-level folders: the mapping that
    pyproject's package-dir makes at install, made here for `PYTHONPATH=<repo>` and for editable installs
    of another checkout (it goes first on sys.meta_path, so this checkout's folders win)."""

    def __init__(self, root: str):
        self.folders = {f"prefixrt.{n}": os.path.join(root, n) for n in SUBPACKAGES}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def install_finder(package_file: str) -> None:
    """Put a SourceTreeFinder first on sys.meta_path when prefixrt runs from a checkout (once)."""
    root = checkout_root(package_file)
    if root is None or any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SourceTreeFinder(root))


def import_installed(name: str, shadow_file: str) -> None:
    """Replace the repo folder imported as top-level `name` by the installed distribution of that name.

    Called from the folder's own `__init__` while `import name` runs; the import system returns whatever
    sys.modules[name] holds once that `__init__` finishes. The distribution is looked up with the repo root
    left out of sys.path; none installed raises ModuleNotFoundError, as the plain import would."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shadow_file)))
    del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != root]
    try:
        spec = importlib.util.find_spec(name)
    finally:
        sys.path[:] = saved
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the repo's {name}/ folder is prefixrt.{name}, not a top-level package)",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
