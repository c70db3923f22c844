#!/usr/bin/env bash
# The distribution as a user gets it: build the sdist and the wheel from a clean export of the commit, install the
# wheel into a venv of its own with no source tree on sys.path, and run it from outside the checkout
# (.ci/check_installed.py: every module imports; --help, models; Engine, generate and serve on a tiny checkpoint).
#
# Run with the project's venv active (.ci/run does): its python builds, and its site-packages lend the new venv
# the dependencies through a plain path line in a .pth file. A path line is all: the .pth files in that folder
# (the editable install's finder among them) are not run, so the checkout stays out of reach.
# REF (default HEAD): the commit to export.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ref="${1:-HEAD}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH
started=$SECONDS
section() { echo "== [$((SECONDS - started))s] $*"; }

section "export $(git -C "$repo" rev-parse --short "$ref") and build"
mkdir -p "$work/src" "$work/dist" "$work/from-sdist" "$work/run"
git -C "$repo" archive --format=tar "$ref" | tar -x -C "$work/src"
(cd "$work/src" && python -c "from setuptools import build_meta as b; b.build_sdist('$work/dist')" >/dev/null)
python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
python -m pip wheel -q --no-deps --no-build-isolation -w "$work/from-sdist" "$work"/dist/prefixrt-*.tar.gz
# The wheel built from the sdist holds the same files as the one built from the tree: the sdist forgets nothing.
python - "$work"/dist/prefixrt-*.whl "$work"/from-sdist/prefixrt-*.whl <<'EOF'
import sys, zipfile
a, b = (set(zipfile.ZipFile(p).namelist()) for p in sys.argv[1:])
assert a == b, f"wheel from the tree vs wheel from the sdist: {sorted(a ^ b)}"
print(f"sdist and wheel built; {len(a)} files in the wheel, the same from the sdist")
EOF

section "a venv with the wheel alone"
python -m venv --without-pip "$work/venv"
deps="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$deps" > "$site/_dependencies.pth"
python -m pip --python "$work/venv/bin/python" install -q --no-deps "$work"/dist/prefixrt-*.whl

section "a tiny checkpoint (tests/helpers, with the project's venv)"
(cd "$repo" && python - "$work/tiny" <<'EOF'
import sys
from tests.helpers.checkpoints import save_tiny_checkpoint
from tests.helpers.engines import make_tiny_tokenizer
save_tiny_checkpoint("llama", sys.argv[1])
make_tiny_tokenizer().save_pretrained(sys.argv[1])
EOF
)

section "the installed package, from $work/run"
cp "$repo/.ci/check_installed.py" "$work/run/"
(cd "$work/run" && "$work/venv/bin/python" -I check_installed.py "$work/tiny")
section "check_wheel passed"
