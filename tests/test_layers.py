"""The import direction of the layers (DESIGN.md, "Layout"): ``harness/`` imports nothing from
``rlm`` or ``kernels``; ``kernels/`` imports nothing from ``rlm``.

Checked statically by parsing every ``.py`` file of the two packages with ``ast``: every
``import`` and ``from ... import`` anywhere in a file (module level, inside functions, classes,
``try`` blocks or ``if TYPE_CHECKING``), relative imports resolved against the file's package,
and ``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: package -> the top-level packages it must not import.
FORBIDDEN = {
    "harness": {"rlm", "kernels"},
    "kernels": {"rlm"},
}


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


def violations(package: str) -> list[str]:
    """``"file:line imports name"`` for every forbidden import in ``package``'s ``.py`` files."""
    bad = FORBIDDEN[package]
    out = []
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no .py files found under {REPO / package}"
    for path in files:
        source = path.read_text(encoding="utf-8")
        for line, name in imported_modules(source, _package_of(path, REPO)):
            if name.split(".")[0] in bad:
                out.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(package):
    found = violations(package)
    assert not found, (f"{package}/ must not import {sorted(FORBIDDEN[package])} "
                       f"(DESIGN.md: imports point one way):\n" + "\n".join(found))


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
            from  import rlm
        except ImportError:
            pass
        import importlib
        importlib.import_module("rlm.cli.main")
        __import__("kernels")
from tests import sibling
from tests.sub import thing
'''
    names = {name for _, name in imported_modules(source, ["harness", "journal"])}
    assert {"os", "rlm.api", "rlm", "rlm.completion", "kernels.kernel", "rlm.runner",
            "harness.rlm", "rlm.cli.main", "kernels", "harness.journal.sibling",
            "harness.journal.sub", "harness.journal.sub.thing"} <= names
    # Climbing above the top-level package leaves a top-level name, which is then checked.
    top = {name for _, name in imported_modules("from ... import rlm\n", ["harness", "x"])}
    assert "rlm" in top
