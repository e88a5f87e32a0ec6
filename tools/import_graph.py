"""The import graph of the cuflash package: cycles, and package imports placed inside functions.

    python3 tools/import_graph.py [-v]

Reads the package's own imports (``from . import x``, ``from ..plan import y``, ``import
cuflash.z``) with the ast module, without importing anything. Exits 1 if the graph has a cycle or
a function imports a cuflash module (the layers import one way, at module level; lazy imports of
optional libraries such as cupy or torch are not package imports). ``-v`` prints every module's
imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cuflash"


def modules(package: Path = PACKAGE) -> dict:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(package: Path = PACKAGE):
    """(module -> set of package modules it imports at module level, [(module, line, target)] of
    package imports inside functions)."""
    mods = modules(package)
    top, in_functions = {m: set() for m in mods}, []
    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        def targets(node):
            if isinstance(node, ast.Import):
                return [a.name for a in node.names if a.name in mods]
            stem = base[: len(base) - node.level + 1] if node.level else []
            parent = ".".join(stem + ([node.module] if node.module else []))
            found = []
            for a in node.names:
                name = f"{parent}.{a.name}"
                found.append(name if name in mods else parent)
            return [t for t in found if t in mods and t != mod]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for t in targets(child):
                        if inner:
                            in_functions.append((mod, child.lineno, t))
                        else:
                            top[mod].add(t)
                visit(child, inner)

        visit(ast.parse(path.read_text()), False)
    return top, in_functions


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            connect(v)
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top, in_functions = imports()
    if "-v" in argv:
        for mod in sorted(top):
            print(f"{mod:30s} {', '.join(sorted(top[mod]))}")
    found = cycles(top)
    for component in found:
        print("cycle:", " <-> ".join(component))
    for mod, line, target in in_functions:
        print(f"{mod}:{line}: imports {target} inside a function")
    print(f"modules: {len(top)}, cycles: {len(found)}, imports inside functions: {len(in_functions)}")
    return 1 if found or in_functions else 0


if __name__ == "__main__":
    sys.exit(main())
