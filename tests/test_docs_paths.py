"""The docs (docs/*.md, README.md) cite only files inside the repo, and those files exist.

What counts as a citation, and what is reported:
- a Markdown link whose target is not a URL or an anchor: it must resolve inside the repo and exist;
- a path that climbs out (`../...`): always reported;
- a file on someone's machine: an absolute path under /home, /root, /work, /mnt, /opt, /srv or /var, or a home
  path other than `~/.cache/` (where the runtime keeps converted models);
- a path from the repo root (its first segment is a top-level entry of the repo) naming a file (with an
  extension) or a folder (ending in /): it must exist (`*` and `{a,b}` expanded, a `:line` suffix dropped, a
  segment in CAPITALS such as NAME is a placeholder);
- a bare file name (`x.md`, `x.py`, `x.sh`, `x.json`, `x.toml`): some file of the repo must have it, unless it
  names a file that is not the repo's (a model folder's config.json and generation_config.json, a PEFT adapter
  folder's adapter_config.json, the server's openapi.json).
HTTP routes (/v1/models) and scratch paths (/tmp, /proc) are not files of the repo and are not checked.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

TOKEN = re.compile(r"[A-Za-z0-9_.~/{}*,:$@+-]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FILE_EXT = re.compile(r"\.(md|py|sh|json|toml|txt|html|png|ya?ml|cfg)$")
BARE_EXT = re.compile(r"^[\w.*-]+\.(md|py|sh|json|toml)$")
MACHINE_ROOTS = ("/home/", "/root/", "/work/", "/mnt/", "/opt/", "/srv/", "/var/")
NOT_THE_REPOS = {"config.json", "generation_config.json", "adapter_config.json", "openapi.json"}  # a model / PEFT
# adapter folder's; the server's route


def top_level() -> list[Path]:
    """The repo's own top-level entries (hidden ones but .ci, and virtual environments, left out)."""
    return [p for p in REPO.iterdir()
            if (not p.name.startswith(".") or p.name == ".ci") and p.name not in ("venv", "build", "dist")
            and not p.name.endswith(".egg-info")]


def repo_file_names() -> set[str]:
    names = set()
    for entry in top_level():
        files = [entry] if entry.is_file() else entry.rglob("*")
        names.update(f.name for f in files if "__pycache__" not in f.parts)
    return names


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    return all((REPO / p).exists() or any(REPO.glob(p)) for p in _expand(path))


def problems(text: str, doc: Path, names: set[str], tops: set[str]) -> list[str]:
    """What `text` (the contents of `doc`) cites outside the repo or that does not exist, one line each."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{doc.relative_to(REPO)}:{n}"
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(REPO) or not path.exists():
                out.append(f"{where}: link {target!r} leaves the repo or does not exist")
        for tok in TOKEN.findall(line):
            tok = tok.rstrip(".,:;")
            if "://" in tok or tok.startswith(("$", "@")) or not tok:
                continue
            if tok.startswith("../") or "/../" in tok:
                out.append(f"{where}: {tok!r} climbs out of the repo")
            elif tok.startswith(MACHINE_ROOTS) or (tok.startswith("~/") and not tok.startswith("~/.cache/")):
                out.append(f"{where}: {tok!r} is a file on a machine, not in the repo")
            elif "/" in tok and tok.split("/")[0] in tops:
                path = tok.split(":")[0]
                placeholder = any(re.fullmatch(r"[A-Z][A-Z_]*(\.\w+)?", seg) for seg in path.split("/"))
                if (FILE_EXT.search(path) or path.endswith("/")) and not placeholder and not _exists(path):
                    out.append(f"{where}: {tok!r} does not exist")
            elif "/" not in tok and BARE_EXT.match(tok) and tok not in NOT_THE_REPOS:
                if not any(fnmatch.fnmatchcase(name, tok) for name in names):
                    out.append(f"{where}: {tok!r} is no file of the repo")
    return out


def test_docs_cite_only_files_of_the_repo():
    names, tops = repo_file_names(), {p.name for p in top_level()}
    found = [p for doc in DOCS for p in problems(doc.read_text(), doc, names, tops)]
    assert not found, "\n".join(found)


def test_the_check_reports_what_it_should():
    """Citations that leave the repo or name nothing are reported; routes, scratch paths and real files are not."""
    names, tops = repo_file_names(), {p.name for p in top_level()}
    doc = REPO / "docs" / "example.md"
    bad = ["for the API.md judge program", "needs `../shared/device/wheels.sh`", "as /work/mkwt.sh does",
           "see docs/no-such-page.md", "[the guide](../outside.md)", "[a figure](missing.png)",
           "raw JSON in benchmarks/results/h200-no-such-run.json", "~/notes/todo.md"]
    for line in bad:
        assert problems(line, doc, names, tops), line
    good = ["`GET /v1/models` and /generate", "scratch in /tmp/tl3, times from /proc", "docs/architecture.md",
            "`prefixrt/cli/` and tests/cli/test_no_server_import.py:10", "[the dashboard](dashboard.png)",
            "benchmarks/results/h200-serve-{http,inprocess}-6a.json", "`PYTHONPATH=$PWD python benchmarks/NAME.py`",
            "cached under `~/.cache/prefixrt/`", "a model folder's config.json", "https://example.org/a/b.md"]
    for line in good:
        assert not problems(line, doc, names, tops), (line, problems(line, doc, names, tops))
