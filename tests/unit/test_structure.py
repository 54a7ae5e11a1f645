"""The package's layout stays true: the module graph, computed with ``ast``, obeys the layers.

Rules (docs/concepts/architecture.md):

* no import cycle between modules, imports made inside functions included;
* at most five imports of the package's own modules made inside functions
  (lazy imports of optional third-party packages are not counted);
* the package root holds entry points and edges only: at most 12 modules (the rest live in packages);
* no module over 600 lines, and each opens with a docstring naming its one job;
* no arrow runs up: every import goes from a layer to a lower one (or within one),
  by the ranks in :data:`RANKS`;
* ``format/`` and ``dcp/`` import no tier, store, daemon or higher layer;
* ``stores/`` imports only ``format/``, ``errors`` and the leaf helpers;
* ``state/`` imports only the leaf helpers and ``format/``;
* ``remote/`` and ``steps/`` never import ``saving/``, ``restoring/`` or ``node/``;
  ``saving/`` and ``restoring/`` never import each other;
* ``stores/`` holds no restore policy: it moves bytes and lists what a store
  holds, and never decides which step (or which save of a step) to take — no
  import of the lineage, retention or replica-placement modules, no scan of a
  directory's committed steps;
* nothing below the facade imports the facade (``checkpointer``, ``cli``,
  ``convert``, ``check_resume``) or the package root;
* the test files stay under their own size limit.

No torch is imported: this reads source files only.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = "shardckpt"
ROOT = Path(__file__).resolve().parents[2] / "src" / PACKAGE
MAX_LINES = 600
MAX_TEST_LINES = 900
MAX_ROOT_MODULES = 12
MAX_INNER_IMPORTS = 5
FACADE = {f"{PACKAGE}.checkpointer", f"{PACKAGE}.cli", PACKAGE, f"{PACKAGE}.__main__"}
FACADE_PACKAGES = ("cli", "convert", "check_resume")
"""Packages above every layer: their modules count as the facade."""
LEAVES = {f"{PACKAGE}.errors", f"{PACKAGE}._failpoints", f"{PACKAGE}._text", f"{PACKAGE}._proc"}
"""Modules that import nothing of the package: any layer may use them."""
LOWER_LAYERS = ("format", "dcp", "stores", "remote", "steps", "tiers", "saving", "restoring", "state", "node")
OVERSIZE_ALLOWED: set[str] = set()
"""Modules allowed over the size limit, by name (none)."""
RANKS = {
    "errors": 0, "_failpoints": 0, "_text": 0, "_proc": 0, "_version": 0, "_dist": 0,
    "format": 1, "dcp": 2, "stores": 2, "state": 3, "remote": 3, "steps": 4, "options": 4, "topology": 4,
    "saving": 5, "restoring": 5, "node": 5, "tiers": 5, "convert": 6,
    "checkpointer": 7, "cli": 7, "check_resume": 7, "__main__": 7, "": 7, "integrations": 8,
}
"""Each root module's or package's place, lowest first: an import may only go to a lower or the same rank."""
RANK_OF_MODULE = {f"{PACKAGE}.check_resume.probe": 0, f"{PACKAGE}.resume_probe": 0}
"""Modules placed apart from their package: a run's probe under check-resume imports only ``errors``, and the
config (``options``) reads it to redirect a Checkpointer."""
TESTS = ROOT.parent.parent / "tests"
TEST_OVERSIZE_ALLOWED: set[str] = set()
"""Test files allowed over their limit, by name, until their split lands."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """The package modules a module imports, each with whether the import sits inside a function."""

    def __init__(self, name: str, is_package: bool) -> None:
        self.name, self.is_package = name, is_package
        self.depth = 0
        self.found: list[tuple[str, bool, int]] = []

    def _add(self, target: str, line: int) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            self.found.append((target, self.depth > 0, line))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.name, self.is_package, node)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in MODULES else base, node.lineno)


def _graph() -> dict[str, list[tuple[str, bool, int]]]:
    out = {}
    for name, path in MODULES.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out[name] = [(t, inner, line) for t, inner, line in visitor.found if t != name]
    return out


GRAPH = _graph()


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _inner, _line in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LOWER_LAYERS else None


def test_no_import_cycle_between_modules():
    assert _cycles() == []


def test_few_imports_of_the_package_inside_functions():
    inner = sorted({f"{m}:{line}" for m, edges in GRAPH.items() for _t, is_inner, line in edges if is_inner})
    assert len(inner) <= MAX_INNER_IMPORTS, "import statements inside functions:\n" + "\n".join(inner)


def test_no_module_over_the_size_limit():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= OVERSIZE_ALLOWED, long


def test_format_and_dcp_import_no_tier():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) in ("format", "dcp")
           for t, _i, _l in edges if t not in LEAVES and _layer(t) not in ("format", "dcp")]
    assert bad == []


def test_stores_import_only_the_format_and_errors():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) == "stores"
           for t, _i, _l in edges if t not in LEAVES and _layer(t) not in ("format", "stores")]
    assert bad == []


def test_tiers_never_import_the_node_daemons():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) == "tiers"
           for t, _i, _l in edges if _layer(t) == "node"]
    assert bad == []


POLICY_MODULES = {f"{PACKAGE}.format.lineage", f"{PACKAGE}.format.retention"}
"""Modules that decide which step counts (the live branch, what to keep): restore policy."""
POLICY_NAMES = {"committed_steps", "classify", "head", "local_infos", "placement", "complete_across_any_loss",
                "committed_replicas", "fetch_step"}
"""Calls that choose among a directory's steps or saves, or place them: restore policy, not a store's job."""


def _called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def test_stores_hold_no_restore_policy():
    """A store moves and lists bytes; which step, which save of it and which source to take is decided
    once, in ``restoring/`` (the survey and the sources): a store that picked its own "newest" step is
    how the peer tier once restored another step than the one the survey chose."""
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) == "stores"
           for t, _i, _l in edges if t in POLICY_MODULES]
    bad += [f"{m} calls {sorted(found)}" for m, path in MODULES.items() if _layer(m) == "stores"
            and (found := _called_names(path) & POLICY_NAMES)]
    assert bad == []


def _facade(module: str) -> bool:
    parts = module.split(".")
    return module in FACADE or (len(parts) > 1 and parts[1] in FACADE_PACKAGES)


def test_nothing_below_the_facade_imports_the_facade_or_the_package_root():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) is not None
           for t, _i, _l in edges if _facade(t)]
    assert bad == []


def test_the_graph_is_computed_from_the_sources():
    # The checks above look at real edges: the restorer reaches the stores through the step view.
    assert f"{PACKAGE}.stores.base" in MODULES and f"{PACKAGE}.restoring.sources" in MODULES
    assert any(t == f"{PACKAGE}.steps" for t, _i, _l in GRAPH[f"{PACKAGE}.restoring.sources"])

    assert len(MODULES) == len({os.path.realpath(p) for p in MODULES.values()})


def _rank(module: str) -> int:
    if module in RANK_OF_MODULE:
        return RANK_OF_MODULE[module]
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    name = {"check_resume": "check_resume", "resume_compare": "check_resume", "state_digest": "check_resume"}.get(
        name, name)
    assert name in RANKS, f"{module}: give its package a rank in RANKS"
    return RANKS[name]


def test_no_arrow_runs_up_between_layers():
    bad = [f"{m} ({_rank(m)}) -> {t} ({_rank(t)}) line {line}" for m, edges in GRAPH.items()
           for t, _i, line in edges if _rank(t) > _rank(m)]
    assert bad == [], "imports running up the layers:\n" + "\n".join(bad)


def test_remote_and_steps_never_import_the_save_the_restore_or_the_daemons():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) in ("remote", "steps")
           for t, _i, _l in edges if _layer(t) in ("saving", "restoring", "node")]
    assert bad == []


def test_the_save_and_the_restore_never_import_each_other():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() for t, _i, _l in edges
           if {_layer(m), _layer(t)} == {"saving", "restoring"}]
    assert bad == []


def test_the_training_state_imports_only_the_helpers_below_it():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if _layer(m) == "state"
           for t, _i, _l in edges if t not in LEAVES | {f"{PACKAGE}._dist"} and _layer(t) not in ("format", "state")]
    assert bad == []


def test_every_module_names_its_job_in_a_docstring():
    missing = [m for m, path in MODULES.items() if not ast.get_docstring(ast.parse(path.read_text(), str(path)))]
    assert missing == []


def test_no_test_file_over_its_size_limit():
    long = {p.name: n for p in TESTS.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_TEST_LINES}
    assert set(long) <= TEST_OVERSIZE_ALLOWED, long


def test_the_root_holds_entry_points_and_edges_only():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
