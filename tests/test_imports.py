"""The imports run one way (DESIGN.md, docs/structure.md), checked on the source alone.

A pure AST walk over the product packages: no module is imported, so a slow or broken import
hides no edge, and the walk takes a fraction of a second. An import is every ``import`` and
``from ... import`` anywhere in a file (at module level, inside a function, under
``if TYPE_CHECKING:``: each is a design dependency all the same) and every
``importlib.import_module("a.literal")``; relative imports are resolved against the file's
package. Three rules:

1. **Layers.** A package imports itself and the packages in its row of ``MAY_IMPORT``, no
   other project package (nor ``tests``).
2. **No cycles** among the modules of one package: an edge goes from a module to the module
   it names (``from pkg import sub`` names ``pkg.sub`` when that is a module; importing
   ``pkg.a.b`` runs ``pkg/__init__.py`` and ``pkg/a/__init__.py`` too, but those implicit
   edges are not counted).
3. **Every file is on the map.** Each ``.py`` file of a package in ``DOCUMENTED`` (but
   ``__init__.py`` and the generated ``cluster/proto/*_pb2*``) is named in the package's row
   of the table in docs/structure.md (the row whose first cell is the package's folder, as
   ``pkg/`` in backticks): some backticked token in that row is the file's path within the
   package (``routing/table.py``) or its bare file name (``table.py``, as the cluster row
   lists ``routing/`` (``table.py``, ...)). A file name shared by two folders of one package
   is thus matched by either's entry: the rule checks the map is complete, not its layout.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_BELOW_DEPLOYMENTS = ("serving", "runtime", "models", "kvtransfer", "speculation")

# Which project packages each package may import besides itself, top to bottom:
# | package     | may import                                                              |
# |-------------|-------------------------------------------------------------------------|
# | bench       | distill and everything distill may                                      |
# | distill     | cluster and everything cluster may                                      |
# | cluster     | prefill, decode, serving, runtime, models, kvtransfer, speculation      |
# | prefill     | serving, runtime, models, kvtransfer, speculation (not decode)          |
# | decode      | serving, runtime, models, kvtransfer, speculation (not prefill)         |
# | serving     | models, kvtransfer, speculation (not runtime: peers)                    |
# | runtime     | models, kvtransfer, speculation (not serving: peers)                    |
# | kvtransfer  | models, speculation                                                     |
# | models      | speculation (not kvtransfer)                                            |
# | speculation | nothing: a leaf everyone may import                                     |
# No package may import bench or tests; only bench may import distill.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "bench": frozenset({"distill", "cluster", "prefill", "decode", *_BELOW_DEPLOYMENTS}),
    "distill": frozenset({"cluster", "prefill", "decode", *_BELOW_DEPLOYMENTS}),
    "cluster": frozenset({"prefill", "decode", *_BELOW_DEPLOYMENTS}),
    "prefill": frozenset(_BELOW_DEPLOYMENTS),
    "decode": frozenset(_BELOW_DEPLOYMENTS),
    "serving": frozenset({"models", "kvtransfer", "speculation"}),
    "runtime": frozenset({"models", "kvtransfer", "speculation"}),
    "kvtransfer": frozenset({"models", "speculation"}),
    "models": frozenset({"speculation"}),
    "speculation": frozenset(),
}
PROJECT = frozenset({*MAY_IMPORT, "tests"})  # the names an import is checked against
DOCUMENTED = (
    "models",
    "runtime",
    "kvtransfer",
    "speculation",
    "serving",
    "prefill",
    "decode",
    "cluster",
    "distill",
)
GENERATED = re.compile(r"^cluster/proto/.*_pb2.*\.py$")


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module, dotted
    target: str  # the module (or name) imported, dotted, resolved to a module where one exists
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``packages`` (``pkg/__init__.py`` is
    ``pkg``)."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _named(node: ast.AST, base: str) -> Iterable[tuple[str, str | None, int]]:
    """What ``node`` imports: (module, name imported from it or None, line); ``base`` is the
    file's package, for relative imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None, node.lineno
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
            module = ".".join([*anchor, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        for alias in node.names:
            yield module, (alias.name if alias.name != "*" else None), node.lineno
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "import_module" and isinstance(node.args[0].value, str):
            yield node.args[0].value, None, node.lineno


def _resolve(module: str, name: str | None, known: Mapping[str, Path]) -> str:
    """``from module import name``: ``module.name`` when that is a module; else (and for
    ``import module``) the longest prefix of ``module`` that is one, or ``module`` itself."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return module


def import_edges(root: Path, packages: Iterable[str]) -> list[Edge]:
    """Every import of a project package (``PROJECT``) made by a file under ``packages``."""
    known = modules(root, packages)
    edges = []
    for module, path in known.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target, name, line in _named(node, base):
                if target.split(".")[0] in PROJECT:
                    edges.append(Edge(module, _resolve(target, name, known), path, line))
    return edges


def upward_imports(
    edges: Iterable[Edge], may_import: Mapping[str, frozenset[str]], root: Path
) -> list[str]:
    """The edges that break ``may_import`` (a package imports itself and its row)."""
    bad = []
    for e in edges:
        src, dst = e.source.split(".")[0], e.target.split(".")[0]
        if src != dst and dst not in may_import.get(src, frozenset()):
            allowed = ", ".join(sorted(may_import.get(src, ()))) or "nothing of the project"
            bad.append(f"{e.where(root)}: {src} imports {e.target} (it may import: {allowed})")
    return bad


def cycles(edges: Iterable[Edge], package: str) -> list[tuple[list[str], list[str]]]:
    """The import cycles among ``package``'s modules: for each strongly connected set of
    modules, one cycle through it (its first module repeated at the end) and the whole set."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source.split(".")[0] == package == e.target.split(".")[0] and e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    found = []
    for scc in _strongly_connected(graph):
        if len(scc) > 1:
            found.append((_a_cycle(graph, scc[0], set(scc)), scc))
    return found


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; each component sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        scc.append(top)
                        if top == node:
                            break
                    out.append(sorted(scc))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _a_cycle(graph: Mapping[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest path from ``start`` back to itself within ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def doc_rows(text: str) -> dict[str, set[str]]:
    """The backticked tokens of each row of the markdown tables in ``text``, by the row's
    first cell (```pkg/``` -> ``pkg``)."""
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            head = re.fullmatch(r"\s*`([\w/]+)/`\s*", cells[1])
            if head:
                rows[head.group(1)] = set(re.findall(r"`([^`]+)`", "|".join(cells[2:])))
    return rows


def undocumented(root: Path, package: str, rows: Mapping[str, set[str]]) -> list[str]:
    """``package``'s files that its row of the table does not name (module doc, rule 3)."""
    tokens = rows.get(package, set())
    missing = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root / package).as_posix()
        if path.name == "__init__.py" or GENERATED.match(f"{package}/{rel}"):
            continue
        if rel not in tokens and path.name not in tokens:
            missing.append(f"{package}/{rel}")
    return missing


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(ROOT, MAY_IMPORT)


def test_imports_run_down_the_layers(edges: list[Edge]) -> None:
    assert upward_imports(edges, MAY_IMPORT, ROOT) == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_has_no_import_cycle(edges: list[Edge], package: str) -> None:
    found = cycles(edges, package)
    assert not found, "\n".join(
        f"{' -> '.join(cycle)} (the cycle's {len(scc)} modules: {', '.join(scc)})"
        for cycle, scc in found
    )


@pytest.mark.parametrize("package", DOCUMENTED)
def test_every_file_is_named_in_the_structure_doc(package: str) -> None:
    rows = doc_rows((ROOT / "docs" / "structure.md").read_text())
    assert package in rows, f"docs/structure.md has no row for `{package}/`"
    missing = undocumented(ROOT, package, rows)
    assert not missing, f"not named in docs/structure.md's `{package}/` row: {', '.join(missing)}"


def test_the_layer_table_runs_one_way() -> None:
    """No package may import one that may import it back, and a layer may import whatever
    its own imports may (the table is closed: layers, not a list of exceptions)."""
    for pkg, below in MAY_IMPORT.items():
        assert pkg not in below
        for dep in below:
            assert pkg not in MAY_IMPORT[dep], (pkg, dep)
            assert MAY_IMPORT[dep] <= below, (pkg, dep, MAY_IMPORT[dep] - below)
    assert all("distill" not in MAY_IMPORT[p] for p in ("cluster", *_BELOW_DEPLOYMENTS, "prefill"))
    assert "decode" not in MAY_IMPORT["prefill"] and "prefill" not in MAY_IMPORT["decode"]


def _tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_catches_upward_imports_of_every_form(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "models/__init__.py": "",
            "models/ok.py": "import torch\nfrom speculation import goodput\n",
            "models/lazy.py": "def f():\n    from decode.engine import DecodeEngine\n",
            "models/typed.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvtransfer.pool\n"
            ),
            "models/dynamic.py": "import importlib\nimportlib.import_module('cluster.cli')\n",
            "decode/__init__.py": "",
            "decode/engine.py": "from ..prefill import worker\nfrom . import engine\n",
            "speculation/__init__.py": "",
            "speculation/goodput.py": "from tests.helpers import x\n",
        },
    )
    bad = upward_imports(import_edges(tmp_path, MAY_IMPORT), MAY_IMPORT, tmp_path)
    assert sorted(bad) == [
        "decode/engine.py:1: decode imports prefill (it may import: "
        "kvtransfer, models, runtime, serving, speculation)",
        "models/dynamic.py:2: models imports cluster.cli (it may import: speculation)",
        "models/lazy.py:2: models imports decode.engine (it may import: speculation)",
        "models/typed.py:3: models imports kvtransfer.pool (it may import: speculation)",
        "speculation/goodput.py:1: speculation imports tests.helpers "
        "(it may import: nothing of the project)",
    ]


def test_the_checker_catches_a_cycle_and_names_its_modules(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "models/__init__.py": "",
            "models/a.py": "from models.b import B\n",
            "models/b.py": "from . import c\n",
            "models/c.py": "def f():\n    from models import a\n",
            "models/d.py": "from models import a\n",  # into the cycle, not part of it
            "models/sub/__init__.py": "",
            "models/sub/e.py": "from ..sub import f\n",
            "models/sub/f.py": "from models.sub.e import E\n",
        },
    )
    found = cycles(import_edges(tmp_path, MAY_IMPORT), "models")
    assert found == [
        (["models.a", "models.b", "models.c", "models.a"], ["models.a", "models.b", "models.c"]),
        (["models.sub.e", "models.sub.f", "models.sub.e"], ["models.sub.e", "models.sub.f"]),
    ]


def test_the_doc_rule_matches_paths_and_file_names(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "cluster/__init__.py": "",
            "cluster/cli.py": "",
            "cluster/routing/table.py": "",
            "cluster/routing/score.py": "",
            "cluster/proto/tandem_pb2.py": "",
            "cluster/new.py": "",
        },
    )
    rows = doc_rows(
        "| package | files |\n|---|---|\n"
        "| `cluster/` | `cli.py` (the CLI), `routing/` (`table.py`), `routing/score.py` |\n"
        "| `serving/` | `new.py` |\n"
    )
    assert undocumented(tmp_path, "cluster", rows) == ["cluster/new.py"]
