"""The import graph obeys docs/architecture.md's layer table: no upward or sideways import, no cycle.

The layer table is read from docs/architecture.md itself (the rows between the `layers:begin` and
`layers:end` markers), and module names from the package tree as prefixrt/source_tree.py reads it from the folders
(adapters/ -> prefixrt.adapters, kernels/ -> prefixrt.kernels; setup.py builds the distribution from the same
walk), so the doc, the packaging and this check cannot drift apart. Every import counts, including imports inside
functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prefixrt.source_tree import package_folders

REPO = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    """Every module of the distribution -> its file: the .py files of source_tree's package folders."""
    mods: dict[str, Path] = {}
    for package, folder in package_folders(str(REPO)).items():
        for path in sorted((REPO / folder).glob("*.py")):
            mods[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return mods


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """prefixrt modules that `name` imports. `from pkg import sub` counts as an import of pkg.sub only
    (pkg's __init__ runs for any submodule import, so it is not an edge of its own)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "prefixrt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "prefixrt":
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(target)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    g = {}
    for name, path in files.items():
        deps = imports_of(name, path, known)
        unknown = deps - known
        assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
        g[name] = deps
    return g


def layer_table() -> list[tuple[int, str, list[str]]]:
    """(level, unit, module prefixes) rows of docs/architecture.md's layer table."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    assert block, "docs/architecture.md has no layer table between <!-- layers:begin/end --> markers"
    rows = []
    for line in block.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        prefixes = re.findall(r"`(prefixrt(?:\.[\w.]+)?)`", cells[2])
        assert prefixes, f"layer row without modules: {line}"
        rows.append((int(cells[0]), cells[1], prefixes))
    return rows


def unit_of(module: str, rows) -> tuple[int, str]:
    best = None
    for level, unit, prefixes in rows:
        for p in prefixes:  # the bare `prefixrt` row is the package's __init__ only, not a catch-all
            if (module == p or (p != "prefixrt" and module.startswith(p + "."))) and (best is None or len(p) > best[0]):
                best = (len(p), level, unit)
    assert best is not None, f"{module} is in no layer of docs/architecture.md's table: add it there"
    return best[1], best[2]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(g: dict[str, set[str]], rows) -> list[str]:
    """Every import whose target is in another unit of the same or a higher level."""
    bad = []
    for mod, deps in sorted(g.items()):
        level, unit = unit_of(mod, rows)
        for dep in sorted(deps):
            dep_level, dep_unit = unit_of(dep, rows)
            if dep_unit != unit and dep_level >= level:
                way = "sideways" if dep_level == level else "upward"
                bad.append(f"{mod} ({unit}, {level}) -> {dep} ({dep_unit}, {dep_level}): {way}")
    return bad


def test_every_module_has_a_layer_and_imports_only_downward():
    bad = violations(graph(), layer_table())
    assert not bad, "imports against docs/architecture.md's layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_checker_reports_upward_sideways_and_cycles():
    """The checks above can fail: fabricated upward and sideways edges and a cycle are all reported."""
    rows = layer_table()
    g = graph()
    assert "prefixrt.request" in g["prefixrt.cache.kv_manager"]  # the graph sees real imports
    assert "prefixrt.kernels.decode_attention" in g["prefixrt.model.attention.triton_backend"]
    g["prefixrt.cache.kv_manager"] = g["prefixrt.cache.kv_manager"] | {"prefixrt.engine.request_stub"}
    g["prefixrt.engine.request_stub"] = set()
    rows = rows + [(4, "engine", ["prefixrt.engine"])]
    g["prefixrt.sampling.sampler"] = g["prefixrt.sampling.sampler"] | {"prefixrt.constrained.logits"}
    bad = violations(g, rows)
    assert any(b.startswith("prefixrt.cache.kv_manager (cache, 1) -> prefixrt.engine.request_stub") and
               b.endswith("upward") for b in bad), bad
    assert any(b.startswith("prefixrt.sampling.sampler") and b.endswith("sideways") for b in bad), bad
    g["prefixrt.request"] = g["prefixrt.request"] | {"prefixrt.cache.kv_manager"}
    assert any({"prefixrt.cache.kv_manager", "prefixrt.request"} <= set(c) for c in cycles(g))


def test_layer_table_names_only_what_the_tree_has():
    """Every module prefix of the layer table is a module or package of the tree: a row outliving its code, or a
    misspelt name, fails here (a module with no row fails test_every_module_has_a_layer_and_imports_only_downward)."""
    modules = set(module_files()) | set(package_folders(str(REPO)))
    stale = sorted(p for _, _, prefixes in layer_table() for p in prefixes if p not in modules)
    assert stale == [], f"docs/architecture.md's layer table names modules the tree does not have: {stale}"


def test_every_folder_of_the_tree_is_a_package():
    """The walk finds the folders no list names: each package folder of the tree, with or without __init__.py."""
    folders = package_folders(str(REPO))
    on_disk = {p.parent for root in ("prefixrt", "kernels", "adapters") for p in (REPO / root).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert {REPO / f for f in folders.values()} >= on_disk
    assert folders["prefixrt.multimodal"] == "prefixrt/multimodal"
    assert folders["prefixrt.bench.programs"] == "prefixrt/bench/programs"
    assert folders["prefixrt.kernels"] == "kernels" and folders["prefixrt.adapters"] == "adapters"


def test_package_dir_mapping_is_what_the_layers_name():
    """kernels/ and adapters/ are imported as prefixrt.kernels / prefixrt.adapters (source_tree's package roots)."""
    files = module_files()
    assert files["prefixrt.kernels.decode_attention"] == REPO / "kernels" / "decode_attention.py"
    assert files["prefixrt.adapters.dspy"] == REPO / "adapters" / "dspy.py"
    assert unit_of("prefixrt.kernels.decode_attention", layer_table())[1] == "kernels"


def test_module_map_names_every_module():
    """A newcomer finds any module from docs/architecture.md in one hop: every module file is a row of its map."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table_paths = set(re.findall(r"^\| ((?:prefixrt|kernels|adapters)/[\w/]+\.py) \|", text, re.M))
    files = {str(p.relative_to(REPO)) for p in module_files().values()}
    empty_inits = {f for f in files if f.endswith("__init__.py") and not (REPO / f).read_text().strip()}
    assert sorted(files - empty_inits - table_paths) == [], "modules missing from docs/architecture.md's map"
    assert sorted(table_paths - files) == [], "docs/architecture.md's map names files that do not exist"


def test_parallel_and_disagg_layers():
    """Tensor parallelism and disaggregation have rows of their own: parallel/ below hub/ (the loader shards
    through it), its rank processes above hub/, both below engine/; disagg/ above engine/ and below server/.
    An engine module importing disagg/, or parallel/ importing the engine, is reported."""
    rows = layer_table()
    level = {unit: lvl for lvl, unit, _ in rows}
    assert unit_of("prefixrt.parallel.tp_runner", rows)[1] == unit_of("prefixrt.parallel.kv_transport", rows)[1]
    parallel, ranks = unit_of("prefixrt.parallel.layers", rows), unit_of("prefixrt.parallel.tp_worker", rows)
    engine, disagg = unit_of("prefixrt.engine.loop.core", rows), unit_of("prefixrt.disagg.decode", rows)
    assert parallel[0] < level["hub"] < ranks[0] < engine[0] < disagg[0] < level["server"]
    assert unit_of("prefixrt.engine.process.client", rows) == engine
    g = graph()
    g["prefixrt.engine.builder"] = g["prefixrt.engine.builder"] | {"prefixrt.disagg.decode"}
    g["prefixrt.parallel.tp_runner"] = g["prefixrt.parallel.tp_runner"] | {"prefixrt.engine.loop.core"}
    bad = violations(g, rows)
    assert any(b.startswith("prefixrt.engine.builder") and "prefixrt.disagg.decode" in b for b in bad), bad
    assert any(b.startswith("prefixrt.parallel.tp_runner") and b.endswith("upward") for b in bad), bad


def test_the_loop_does_not_know_the_process_boundary():
    """engine/loop/ (the scheduler loop's units) imports neither engine/process/ nor the Engine or its builder:
    the same loop runs in a thread and in the engine process."""
    g = graph()
    outside = {"prefixrt.engine.engine", "prefixrt.engine.builder", "prefixrt.engine.api"}
    bad = sorted((m, d) for m, deps in g.items() if m.startswith("prefixrt.engine.loop.")
                 for d in deps if d.startswith("prefixrt.engine.process") or d in outside)
    assert bad == []


def test_engine_modules_stay_readable():
    """No module of prefixrt/engine/ (the loop, the process boundary, the builder) is over 500 lines: a concern
    that outgrows that gets a module of its own (as engine/warm_up.py and engine/loop/batch_inputs.py did)."""
    long = {str(p.relative_to(REPO)): n for p in (REPO / "prefixrt" / "engine").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
