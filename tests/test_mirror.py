"""tests/ mirrors the source tree: a test lives in the folder of the code it tests.

The source folders are the package's (every folder prefixrt/source_tree.py's walk finds: prefixrt/ and the folders
under it, kernels/, adapters/) and benchmarks/. The twin of prefixrt/<path>/ is tests/<path>/ (tests/engine/loop/
for prefixrt/engine/loop/); kernels/, adapters/ and benchmarks/ have tests/kernels/, tests/adapters/ and
tests/benchmarks/; tests/ itself is the twin of the package root's modules (prefixrt/*.py). A source folder needs
no twin of its own: its tests live in the nearest twin above it (prefixrt/model/attention/ in tests/model/).

The rules, each a test below:
1. Every folder under tests/ is the twin of a source folder, or one of EXCEPTIONS (each says why).
2. Every test file (test_*.py) in a twin folder reaches code of that folder. A module belongs to the deepest twin
   folder above it: prefixrt.engine.loop.scheduler to tests/engine/loop/, prefixrt.engine.api to tests/engine/,
   prefixrt.model.attention.base to tests/model/. A file reaches a module when it imports it (anywhere in the file;
   `from prefixrt import Engine` and `prefixrt.Engine` count as prefixrt.engine.engine, through the package's lazy
   names) or names it in code it runs (a script it starts in a fresh interpreter, `"prefixrt.engine.builder"`, a
   source path such as `REPO / "benchmarks"`; docstrings are prose and do not count), when a tests/ module it
   imports does (its helpers, another test's workload), or when a fixture it asks for does (in the fixture's body,
   or in the fixtures that one asks for in turn). A fixture of the folder's own conftest.py counts as the folder's
   code: it is the folder's harness (tests/server/conftest.py's `server` runs `prefixrt serve`).
   So a test that reaches only other folders fails where it stands: a scheduler test left in tests/engine/
   reaches tests/engine/loop/'s code, not tests/engine/'s; a JSON-schema test at the root reaches lowering/'s.
3. A test file at tests/ root is named for a root module (test_<module>.py for prefixrt/<module>.py) or is one of
   REPO_CHECKS, which check the repo as a whole.

What this does not judge: a file that reaches its own folder and others besides passes, wherever its weight lies
(an engine test that also builds a cache by hand may sit in tests/engine/ or tests/cache/). It catches a file
that has nothing of its folder in it, which is what a misplaced file looks like.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from prefixrt.source_tree import package_folders

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

# Folders under tests/ with no source twin, and why.
EXCEPTIONS = {
    "helpers": "shared test code (tiny checkpoints, the paged harness, a live server, ...), imported by tests of "
               "every folder",
    "data": "data files the tests read (the FP8 evaluation text)",
    "reliability": "cross-cutting checks of the whole runtime under faults and abuse (engine death and stalls, "
                   "draining, poisoned and invalid requests, auth): each spans server/, engine/ and the layers below",
    "server/openai_spec": "OpenAI's published API spec components and the script that extracts them: "
                          "tests/server/test_conformance.py's data",
}
# Root test files that check the repo as a whole rather than one root module.
REPO_CHECKS = {
    "test_docs_paths.py": "the docs cite only files of the repo",
    "test_gpu_marker.py": "CUDA-only tests carry the gpu marker",
    "test_layering.py": "the import graph obeys docs/architecture.md's layers",
    "test_mirror.py": "this check",
    "test_mutations.py": "the mutation list stays runnable",
    "test_packaging.py": "the built distribution holds the whole tree",
}
OTHER_SOURCE_FOLDERS = ("benchmarks",)  # code of the repo outside the package, with tests of its own


@cache
def source_folders() -> dict[str, str]:
    """Source folder (from the repo root) -> its package: prefixrt/engine/loop -> prefixrt.engine.loop, kernels ->
    prefixrt.kernels, benchmarks -> benchmarks."""
    packages = {**package_folders(str(REPO)), **{name: name for name in OTHER_SOURCE_FOLDERS}}
    return {folder: package for package, folder in packages.items()}


@cache
def source_modules() -> dict[str, str]:
    """Module name (packages included) -> the source folder of its file."""
    mods = {}
    for folder, package in source_folders().items():
        mods[package] = folder
        for path in (REPO / folder).glob("*.py"):
            if path.stem != "__init__":
                mods[f"{package}.{path.stem}"] = folder
    return mods


def twin(test_folder: str) -> str | None:
    """The source folder a folder under tests/ ('' for tests/ itself, 'engine/loop', 'kernels') mirrors, if any."""
    folders = source_folders()
    for candidate in ("/".join(p for p in ("prefixrt", test_folder) if p), test_folder):
        if candidate in folders:
            return candidate
    return None


@cache
def folders_under_tests() -> tuple[str, ...]:
    """Every folder under tests/ ('/'-separated, relative to tests/), '' for tests/ itself."""
    return ("", *sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*")
                        if p.is_dir() and "__pycache__" not in p.parts))


@cache
def owner(module: str) -> str | None:
    """The deepest folder under tests/ whose twin holds `module` (a key of source_modules()), if any."""
    src = source_modules()[module]
    best = None
    for folder in folders_under_tests():
        t = twin(folder)
        if t is not None and (src == t or src.startswith(t + "/")) and (best is None or len(t) > len(twin(best))):
            best = folder
    return best


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@cache
def reexports(package: str) -> dict[str, str]:
    """Name -> the module a package's __init__.py takes it from (its imports, and prefixrt's lazy `_LAZY` table)."""
    folder = source_modules().get(package)
    init = REPO / folder / "__init__.py" if folder else None
    if init is None or not init.exists():
        return {}
    out = {}
    for node in ast.walk(parsed(init)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}" if f"{base}.{a.name}" in source_modules() else base
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            table = ast.literal_eval(node.value)
            out.update({name: module for name, (module, _) in table.items()})
    return out


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes under `tree` (prose, not code: a module named there is not reached)."""
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


MODULE_NAME = re.compile(r"\b(?:prefixrt|benchmarks)(?:\.\w+)+")


def imported(tree: ast.AST, strings: bool = True) -> tuple[set[str], set[str]]:
    """(source modules, tests/ modules) that the code under `tree` imports or names. A name a package re-exports
    counts as the module it comes from (`from prefixrt import Engine`, `prefixrt.Engine`). Strings count where they
    are code or a path, not prose: a module named in one (a script run in a fresh interpreter, `"prefixrt.engine.
    builder"`) and a source folder, or a file under one, given as a path (`REPO / "benchmarks"`)."""
    mods = source_modules()
    src, tests = set(), set()

    def add(name: str) -> None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name:
            src.add(name)

    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (tests.add(a.name) if a.name.startswith("tests.") else add(a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.startswith("tests."):
                tests |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                continue
            for a in node.names:
                full = f"{node.module}.{a.name}"
                add(full if full in mods else reexports(node.module).get(a.name, node.module))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "prefixrt":
            add(reexports("prefixrt").get(node.attr, f"prefixrt.{node.attr}"))
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            for name in MODULE_NAME.findall(node.value):
                add(name)
            path = node.value.strip("/")
            for folder, package in source_folders().items():
                if path == folder or path.startswith(folder + "/"):
                    add(package)
    return src, tests


def helper_imports(names: set[str]) -> set[str]:
    """The source modules that the tests/ modules `names` import themselves (one level, not what they import)."""
    out = set()
    for name in names:
        path = REPO / (name.replace(".", "/") + ".py")
        if path.exists():
            out |= imported(parsed(path), strings=False)[0]
    return out


@cache
def fixture_defs(path: Path) -> dict[str, tuple[Path, ast.FunctionDef | None]]:
    """Fixtures a file defines or imports: name -> (where it is defined, its function; None when not found)."""
    out = {}
    for node in parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = (path, node)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            source = REPO / (node.module.replace(".", "/") + ".py")
            for a in node.names:
                if source.exists() and a.name in (defs := fixture_defs(source)):
                    out[a.asname or a.name] = defs[a.name]
    return out


def visible_fixtures(test_file: Path, folder: Path) -> list[dict]:
    """The fixture tables a test file in `folder` sees, innermost first: its own, then each conftest.py from
    `folder` up to tests/."""
    tables = [fixture_defs(test_file)]
    while True:
        conftest = folder / "conftest.py"
        if conftest.exists():
            tables.append(fixture_defs(conftest))
        if folder == TESTS:
            return tables
        folder = folder.parent


def requested(tree: ast.AST) -> set[str]:
    """Names a file's (or a fixture's) functions ask pytest for: their parameters and `usefixtures` arguments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("usefixtures"):
            names |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return names


def reached(test_file: Path, folder: str) -> tuple[set[str], set[str]]:
    """(source modules that `test_file`, standing in tests/<folder>/, reaches; the fixtures it asks for from
    tests/<folder>/conftest.py)."""
    tree = parsed(test_file)
    src, tests = imported(tree)
    src |= helper_imports(tests)
    conftest = TESTS / folder / "conftest.py"
    own = set(fixture_defs(conftest)) if folder and conftest.exists() else set()
    tables = visible_fixtures(test_file, TESTS / folder)
    asked = requested(tree)
    seen: set[str] = set()
    todo = list(asked)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = next((t[name] for t in tables if name in t), None)
        if found is None or found[1] is None:
            continue
        fsrc, ftests = imported(found[1], strings=False)
        src |= fsrc | helper_imports(ftests)
        todo.extend(requested(found[1]) - seen)
    return src, asked & own


def misplaced(test_file: Path, folder: str) -> str | None:
    """Why `test_file` does not belong in tests/<folder>/ ('' for tests/ itself; rules 2 and 3 above), or None
    when it does."""
    if folder == "":
        stem = test_file.stem.removeprefix("test_")
        if test_file.name in REPO_CHECKS or source_modules().get(f"prefixrt.{stem}") == "prefixrt":
            return None
        return "a test at tests/ root is named for a root module (test_<module>.py) or is one of REPO_CHECKS"
    src, own_fixtures = reached(test_file, folder)
    if own_fixtures or any(owner(m) == folder for m in src):
        return None
    elsewhere = ", ".join(sorted({f"tests/{owner(m)}/".replace("//", "/") for m in src
                                  if owner(m) is not None})) or "no test folder"
    return (f"it reaches no code of {twin(folder)}/ (what it reaches belongs to {elsewhere}) and asks for no "
            f"fixture of tests/{folder}/conftest.py")


def test_every_test_folder_mirrors_a_source_folder():
    orphans = [f for f in folders_under_tests() if f not in EXCEPTIONS and twin(f) is None]
    assert orphans == [], f"folders under tests/ with no source twin (add the source folder's twin or an exception): " \
                          f"{orphans}"
    stale = sorted(f for f in EXCEPTIONS if not (TESTS / f).is_dir() or twin(f) is not None)
    assert stale == [], f"EXCEPTIONS names folders that are gone or that have a twin after all: {stale}"
    assert sorted(f for f in REPO_CHECKS if not (TESTS / f).is_file()) == [], "REPO_CHECKS names files that are gone"


def test_every_test_file_tests_its_folder():
    bad = []
    for folder in folders_under_tests():
        if folder in EXCEPTIONS or any(folder.startswith(e + "/") for e in EXCEPTIONS):
            continue
        for path in sorted((TESTS / folder).glob("test_*.py")):
            why = misplaced(path, folder)
            if why:
                bad.append(f"tests/{path.relative_to(TESTS)}: {why}")
    assert bad == [], "test files outside the folder of the code they test:\n" + "\n".join(bad)


def test_the_check_reports_misplaced_files():
    """The rules can fail: real test files put where they do not belong are reported, each where it stands is not."""
    def at(path: str) -> Path:
        return TESTS / path

    wrong = [("lowering/test_json_schema.py", ""),  # a lowering test loose at the root
             ("lowering/test_json_schema.py", "cache"),  # in a folder it has nothing of
             ("engine/loop/test_scheduler.py", "engine"),  # a loop test in the engine's folder
             ("engine/process/test_pipe_writer.py", "engine"),
             ("routing/test_routing_lora.py", "lora"),
             ("hub/test_gemma_real.py", "model")]
    for path, folder in wrong:
        assert misplaced(at(path), folder), (path, folder)
    for path, _ in wrong:
        assert misplaced(at(path), str(Path(path).parent)) is None, path
    # evidence of each kind: an import, a lazy name, a module in a script string, a folder's path, a fixture of
    # the root conftest, a fixture of the folder's own conftest
    assert misplaced(at("engine/test_smollm2_engine.py"), "engine") is None  # prefixrt.Engine
    assert misplaced(at("engine/test_build_walk.py"), "engine") is None  # the script it runs
    assert misplaced(at("benchmarks/test_results_cited.py"), "benchmarks") is None  # REPO / "benchmarks"
    assert misplaced(at("engine/test_salt_quota.py"), "engine") is None  # make_engine
    assert misplaced(at("server/test_anthropic_api.py"), "server") is None  # tests/server/conftest.py's server
    assert misplaced(at("server/test_anthropic_api.py"), "routing")  # ... which no other folder's harness is
    assert twin("engine/loop") == "prefixrt/engine/loop" and twin("kernels") == "kernels" and twin("helpers") is None
    assert owner("prefixrt.model.attention.base") == "model" and owner("prefixrt.engine.loop.core") == "engine/loop"
