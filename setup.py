"""The distribution's packages, found in the tree: everything else about the build is in pyproject.toml.

pyproject's `[tool.setuptools.packages.find]` cannot name a package after a folder of another name, and the top-level
`kernels/` and `adapters/` ship as `prefixrt.kernels` / `prefixrt.adapters` (docs/architecture.md, "Where the code
lives"). So the packages, their folders and their data files come from prefixrt/source_tree.py, the one description
of the package tree, which reads them from the folders themselves: a new folder ships without being listed anywhere.
"""

import importlib.util
import os

from setuptools import setup


def _source_tree():
    """prefixrt/source_tree.py, loaded by path: importing prefixrt would import its dependencies."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefixrt", "source_tree.py")
    spec = importlib.util.spec_from_file_location("_prefixrt_source_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tree = _source_tree()
_root = os.path.dirname(os.path.abspath(__file__))
_folders = _tree.package_folders(_root)

setup(
    packages=sorted(_folders),
    package_dir={name: folder for name, folder in _folders.items() if folder != name.replace(".", "/")},
    package_data=_tree.package_data(_root, _folders),
)
