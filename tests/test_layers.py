"""The layers of the code (DESIGN.md, "Layout"), checked statically: imports point one way, and
no module imports, however indirectly, a module that imports it.

Every ``.py`` file of ``rlm/``, ``kernels/`` and ``harness/`` is parsed with ``ast``: every
``import`` and ``from ... import`` anywhere in a file (module level, inside functions, classes,
``try`` blocks or ``if TYPE_CHECKING``), relative imports resolved against the file's package,
and ``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal name. A
function-local import counts like any other: a circle hidden behind one is still a circle.

The layers, top to bottom (a module may import its own layer's modules and any layer below it):

- top level: ``rlm`` (the face and everything that wires runs), ``kernels``, ``harness``;
- inside ``rlm``: ``LAYERS`` below, from the command line down to the errors.

Running this file prints the counts: ``python tests/test_layers.py``.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlm", "kernels", "harness")

#: Top-level packages, top to bottom.
TOP = ("rlm", "kernels", "harness")
#: The layers inside ``rlm``, top to bottom; each entry a module or subpackage of ``rlm``
#: (``"rlm"`` itself is the package's ``__init__``, the public face). Entries in one tuple
#: share a layer.
LAYERS = (
    ("rlm.__main__",), ("rlm.cli",), ("rlm.training",), ("rlm.serve", "rlm.serve.server"),
    ("rlm.serve.request", "rlm.serve.runs", "rlm.serve.sessions"), ("rlm.serve.errors",),
    ("rlm.evaluation",),
    ("rlm.aio",), ("rlm.session",),
    ("rlm", "rlm.api"), ("rlm.observe",), ("rlm.core",), ("rlm.config",), ("rlm.tools",), ("rlm.context",),
    ("rlm.models",), ("rlm.prompting",), ("rlm.result",), ("rlm.errors", "rlm.version"),
)


def _package_of(path: Path, root: Path) -> list[str]:
    """The package (as parts) that relative imports in ``path`` resolve against: the file's
    directory (``harness/journal/store.py`` and ``harness/journal/__init__.py`` both give
    ``["harness", "journal"]``)."""
    return list(path.relative_to(root).parent.parts)


def imported_modules(source: str, package: list[str]) -> list[tuple[int, str]]:
    """Every module name ``source`` imports, as ``(line, dotted name)``.

    ``package`` is the importing module's package as parts (``["harness", "journal"]``), used to
    resolve relative imports; for ``from X import a, b`` both ``X`` and ``X.a``, ``X.b`` are
    listed (``a`` may be a submodule), so ``from . import rlm`` at the top level is caught too.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # level 1 is the package itself, each further level one package up.
                base_parts = (package[:len(package) - node.level + 1]
                              if node.level <= len(package) else [])
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}" if base else alias.name)
                         for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (func.attr if isinstance(func, ast.Attribute)
                    else func.id if isinstance(func, ast.Name) else None)
            arg = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                found.append((node.lineno, arg.value))
    return found


def library_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the library packages (a package is its
    ``__init__``)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    assert mods, f"no modules found under {REPO}"
    return mods


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {imported module: "file:line"}}`` over the library's own modules.

    A name imported is resolved to the longest library module it starts with, so
    ``from harness.journal import Journal`` is an edge to ``harness.journal`` (the package's
    ``__init__``) and ``from rlm.context import formats`` one to ``rlm.context.formats``. The
    parent packages Python runs on the way to a module are not edges: ``import rlm.core.loop``
    runs ``rlm/__init__`` too, but the code asked for the loop only.
    """
    mods = library_modules()
    graph: dict[str, dict[str, str]] = {m: {} for m in mods}
    for mod, path in mods.items():
        source = path.read_text(encoding="utf-8")
        for line, name in imported_modules(source, _package_of(path, REPO)):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                target = ".".join(parts[:i])
                if target in mods:
                    if target != mod:
                        graph[mod].setdefault(target, f"{path.relative_to(REPO)}:{line}")
                    break
    return _drop_parent_names(graph, mods)


def _drop_parent_names(graph: dict[str, dict[str, str]], mods: dict) -> dict[str, dict[str, str]]:
    """``from X import a`` lists both ``X`` and ``X.a``; when ``X.a`` is a module the edge to
    the package ``X`` from that same line is the walker's over-report, not an import of it."""
    for edges in graph.values():
        for target, where in list(edges.items()):
            if any(other.startswith(target + ".") and edges[other] == where
                   for other in edges if other != target):
                del edges[target]
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan's
    algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def rank(module: str) -> tuple[int, int]:
    """``(top-level rank, layer rank inside rlm)``; smaller is higher. A module of ``rlm``
    that no layer names ranks at the top, so a new package must be placed in ``LAYERS``."""
    top = TOP.index(module.split(".")[0])
    if top:
        return (top, 0)
    best, best_len = 0, -1
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = i, len(entry)
    return (0, best)


def upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """``"file:line: A imports B"`` for every import of a higher layer than the importer's."""
    return [f"{where}: {mod} imports {target}"
            for mod, edges in sorted(graph.items()) for target, where in sorted(edges.items())
            if rank(target) < rank(mod)]


def unplaced() -> list[str]:
    """Subpackages and modules directly under ``rlm`` that ``LAYERS`` does not name."""
    named = {e for layer in LAYERS for e in layer}
    return sorted(m for m in library_modules()
                  if m.count(".") == 1 and m.startswith("rlm.") and m not in named)


def test_there_is_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_import_runs_up_a_layer():
    found = upward_imports(import_graph())
    assert not found, ("imports that climb a layer (tests/test_layers.py LAYERS; DESIGN.md "
                       "\"Layout\"):\n" + "\n".join(found))


def test_every_rlm_package_has_a_layer():
    assert not unplaced(), f"name these in LAYERS: {unplaced()}"


def test_the_checks_catch_a_circle_and_an_upward_import():
    """The checkers themselves, on a made-up graph: a two-module circle and a three-module one
    are found, a chain is not; harness importing rlm and rlm.errors importing rlm.core are
    upward."""
    graph = {"a": {"b": "x:1"}, "b": {"a": "x:2"}, "c": {"d": "x:3"}, "d": {"e": "x:4"},
             "e": {"c": "x:5"}, "f": {"a": "x:6"}}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert circles({"a": {"b": ""}, "b": {}}) == []
    up = upward_imports({"harness.text": {"rlm.api": "h:1"}, "rlm.errors": {"rlm.core.loop": "e:2"},
                         "rlm.core.loop": {"rlm.errors": "l:3", "harness.text": "l:4"}})
    assert up == ["h:1: harness.text imports rlm.api", "e:2: rlm.errors imports rlm.core.loop"]


def test_the_import_walker_sees_every_kind_of_import():
    """The checker itself: each of these forms is reported (so the test above cannot pass by
    overlooking an import)."""
    source = '''
import os
import rlm.api as api
from rlm import completion
from kernels.kernel import Kernel
def later():
    import rlm
    from rlm.runner import x
class C:
    def m(self):
        try:
            from .. import rlm
        except ImportError:
            pass
        import importlib
        importlib.import_module("rlm.cli.main")
        __import__("kernels")
from . import sibling
from .sub import thing
'''
    names = {name for _, name in imported_modules(source, ["harness", "journal"])}
    assert {"os", "rlm.api", "rlm", "rlm.completion", "kernels.kernel", "rlm.runner",
            "harness.rlm", "rlm.cli.main", "kernels", "harness.journal.sibling",
            "harness.journal.sub", "harness.journal.sub.thing"} <= names
    # Climbing above the top-level package leaves a top-level name, which is then checked.
    top = {name for _, name in imported_modules("from ... import rlm\n", ["harness", "x"])}
    assert "rlm" in top


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, "
          f"{len(circles(g))} circles, {len(upward_imports(g))} upward imports")
    sys.exit(1 if circles(g) or upward_imports(g) else 0)
