"""The built distribution holds the whole package tree: every file of every folder under prefixrt/, kernels/ and
adapters/ (modules and the data files read at run time) lands in the wheel, and nothing else sits at its top.

Built as a user builds it, from a clean copy of the files git would ship from this tree (tracked, or new and not
ignored: a `git archive` of the working tree): the sdist first, then the wheel from the unpacked sdist, as
`python -m build` does, so a file the sdist leaves out is missing from the wheel too. What the wheel must hold is a
plain listing of those folders, not prefixrt/source_tree.py's walk that the build uses: the two do not share the
rule under test. Only the two roots shipped under other names (kernels/ -> prefixrt/kernels/) come from there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from prefixrt.source_tree import package_roots

REPO = Path(__file__).resolve().parents[1]


def shipped_sources() -> list[str]:
    """Repo-relative paths git would ship from the working tree (tracked and present, or untracked and not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return sorted(p for p in set(out.split("\0")) if p and (REPO / p).is_file())


def expected_in_wheel(sources: list[str]) -> dict[str, str]:
    """Wheel path -> repo path of every file under the package roots (kernels/x.py -> prefixrt/kernels/x.py)."""
    roots = {folder: name.replace(".", "/") for name, folder in package_roots().items()}
    out = {}
    for path in sources:
        top, _, rest = path.partition("/")
        if top in roots and rest:
            out[f"{roots[top]}/{rest}"] = path
    return out


def missing_packages(expected: dict[str, str], wheel_names: set[str]) -> list[str]:
    """One line per package (folder) with files missing from the wheel, naming the package and the files."""
    by_package: dict[str, list[str]] = {}
    for wheel_path, repo_path in expected.items():
        if wheel_path not in wheel_names:
            package = wheel_path.rsplit("/", 1)[0].replace("/", ".")
            by_package.setdefault(package, []).append(repo_path)
    return [f"{package} ({len(files)} files missing, {Path(files[0]).parent}/: {', '.join(sorted(files)[:4])})"
            for package, files in sorted(by_package.items())]


def build(backend_call: str, cwd: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 hook `backend_call` ("build_sdist" / "build_wheel") in `cwd`; the file it wrote."""
    code = f"from setuptools import build_meta; print(build_meta.{backend_call}({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[set[str], dict[str, str]]:
    """(the wheel's file names, expected wheel path -> repo path), built from a clean copy of the tree."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the files to build from are git's")
    tmp = tmp_path_factory.mktemp("dist")
    sources = shipped_sources()
    for path in sources:
        (tmp / "src" / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, tmp / "src" / path)
    sdist = build("build_sdist", tmp / "src", tmp / "out")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "sdist", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (tmp / "sdist").iterdir()
    built = build("build_wheel", unpacked, tmp / "out")
    with zipfile.ZipFile(built) as z:
        names = set(z.namelist())
    return names, expected_in_wheel(sources)


def test_every_package_folder_and_data_file_is_in_the_wheel(wheel):
    names, expected = wheel
    assert "prefixrt/server/dashboard.html" in expected  # the listing sees data files, not modules only
    missing = missing_packages(expected, names)
    assert not missing, "packages missing from the built wheel:\n" + "\n".join(missing)


def test_the_wheel_holds_prefixrt_alone(wheel):
    """No top-level kernels/, adapters/ or tests/: the two folders ship inside prefixrt, nothing else ships."""
    names, _ = wheel
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"prefixrt"}, sorted(tops)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_a_package_left_out_is_named(wheel):
    """The check above can fail, and says which package: the wheel's list without two packages' files."""
    names, expected = wheel
    dropped = {n for n in names if n.rsplit("/", 1)[0] in ("prefixrt/multimodal", "prefixrt/kernels")}
    assert dropped, "the wheel has no prefixrt/multimodal/ or prefixrt/kernels/ to drop"
    missing = missing_packages(expected, names - dropped)
    assert [line.split(" ")[0] for line in missing] == ["prefixrt.kernels", "prefixrt.multimodal"], missing
    assert "kernels/:" in missing[0] and "prefixrt/multimodal/:" in missing[1], missing
