"""Print the library's longest functions and modules, and fail when one is over the limit.

Usage: ``python scripts/check_size.py [--max-function 80] [--max-module 600]``

A function's length is the lines from its ``def`` (decorators included) to its last line, as
``ast`` reports them; nested functions count inside their parent too. A module's length is its
line count. Only the library packages (``rlm``, ``kernels``, ``harness``) are checked: tests and
benchmarks are not the library. Exit 0 when everything is within the limits, 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlm", "kernels", "harness")


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """``(lines, qualified name, first line)`` for every function and method in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[int, str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                name = f"{prefix}{child.name}"
                out.append((child.end_lineno - first + 1, name, first))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)
    walk(tree, "")
    return out


def library_files() -> list[Path]:
    """Every ``.py`` file of the library packages, sorted."""
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    """Print the five longest functions and modules and every one over the limits."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-function", type=int, default=80, help="lines (default 80)")
    ap.add_argument("--max-module", type=int, default=600, help="lines (default 600)")
    args = ap.parse_args(argv)
    functions, modules = [], []
    for path in library_files():
        rel = path.relative_to(REPO)
        modules.append((len(path.read_text(encoding="utf-8").splitlines()), str(rel)))
        functions += [(n, f"{rel}:{line} {name}") for n, name, line in function_lengths(path)]
    functions.sort(reverse=True)
    modules.sort(reverse=True)
    long_functions = [f for f in functions if f[0] > args.max_function]
    long_modules = [m for m in modules if m[0] > args.max_module]
    print(f"longest functions (limit {args.max_function} lines):")
    for n, where in functions[:5]:
        print(f"  {n:4d}  {where}")
    print(f"longest modules (limit {args.max_module} lines):")
    for n, where in modules[:5]:
        print(f"  {n:4d}  {where}")
    print(f"{len(long_functions)} functions over {args.max_function} lines, "
          f"{len(long_modules)} modules over {args.max_module} lines")
    for n, where in long_functions + long_modules:
        print(f"  over: {n} lines  {where}")
    return 1 if long_functions or long_modules else 0


if __name__ == "__main__":
    sys.exit(main())
