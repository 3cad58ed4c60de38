"""The layers you can see: the import-linter layers contract names every module of the
package, and the package has no import circle (grimp's graph, type-checking imports too)."""

from __future__ import annotations

import pkgutil
import tomllib
from importlib import import_module
from pathlib import Path

import grimp

import vramplan

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _layers() -> list[set[str]]:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers"]
    return [{name.strip() for name in layer.split("|")} for layer in contract["layers"]]


def _covered(module: str, named: set[str]) -> bool:
    """Named itself, or a package each of whose modules is covered."""
    if module in named:
        return True
    package = import_module(module)
    children = [f"{module}.{m.name}" for m in pkgutil.iter_modules(getattr(package, "__path__",
                                                                             []))]
    return bool(children) and all(_covered(child, named) for child in children)


def test_the_layers_contract_names_every_module_of_the_package():
    named = set().union(*_layers())
    top = [f"vramplan.{m.name}" for m in pkgutil.iter_modules(vramplan.__path__)]
    assert "vramplan.engines" in top and "vramplan.views" in top
    assert [m for m in top if not _covered(m, named)] == []
    assert not [m for m in named if m not in top and not m.startswith(tuple(
        f"{t}." for t in top))]  # and nothing that does not exist


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(
                        graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("vramplan")
    assert _cycles(graph) == []
    # the check sees a circle where there is one
    graph.add_import(importer="vramplan.fit", imported="vramplan.engines.runtime")
    assert ["vramplan.engines.runtime", "vramplan.fit"] in _cycles(graph)
