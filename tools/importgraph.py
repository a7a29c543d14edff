"""The package's import graph, read from its own source with ``ast`` (nothing is imported).

    python tools/importgraph.py            # each module and the package modules it imports
    python tools/importgraph.py --check    # exit 1 on an import circle or an import inside a function
    python tools/importgraph.py --sizes    # line counts, and the longest function and class

Every ``from .x import ...``, ``from . import x`` and ``import amp_lessons.x`` counts,
wherever it stands: an import inside a function still makes a circle, only a later one.
tests/test_imports.py runs the check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "amp_lessons"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def _targets(node: ast.AST, modules: set[str]) -> list[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 1 and node.module:
            return [node.module.split(".")[0]]
        if node.level == 1:  # from . import x, y
            return [a.name for a in node.names if a.name in modules]
        if node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
            rest = node.module.split(".")[1:]
            return rest[:1] or [a.name for a in node.names if a.name in modules]
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names
                if a.name.startswith(PACKAGE + ".") and a.name.split(".")[1] in modules]
    return []


def _imports(tree: ast.Module, modules: set[str]) -> tuple[set[str], list[tuple[int, str]]]:
    """(every package module imported anywhere, (line, module) of those imported inside a function)."""
    everywhere, nested = set(), []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(child, modules):
                everywhere.add(target)
                if in_function:
                    nested.append((child.lineno, target))
            walk(child, inner)

    walk(tree, False)
    return everywhere, nested


def read(src: Path = SRC) -> dict[str, ast.Module]:
    """Each module's name and parsed source."""
    return {p.stem: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(src.glob("*.py"))}


def graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``__init__``'s own imports included)."""
    modules = set(trees)
    return {name: _imports(tree, modules)[0] - {name} for name, tree in trees.items()}


def nested_imports(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line imports x`` for every package import placed inside a function."""
    modules = set(trees)
    return [f"{name}.py:{line} imports {target}" for name, tree in trees.items()
            for line, target in _imports(tree, modules)[1]]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (each holds a circle)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def sizes(trees: dict[str, ast.Module], src: Path = SRC) -> tuple[dict[str, int], tuple, tuple]:
    """Lines per module, and (lines, name) of the longest function and the longest class."""
    lines = {name: len((src / f"{name}.py").read_text(encoding="utf-8").splitlines()) for name in trees}
    functions, classes = [], []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            length = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((length, f"{name}.{node.name}"))
            elif isinstance(node, ast.ClassDef):
                classes.append((length, f"{name}.{node.name}"))
    return lines, max(functions), max(classes)


def main(argv: list[str]) -> int:
    trees = read()
    edges = graph(trees)
    if "--sizes" in argv:
        lines, function, cls = sizes(trees)
        for name, n in sorted(lines.items(), key=lambda kv: kv[1]):
            print(f"{n:6d}  {name}")
        print(f"{sum(lines.values()):6d}  total\nlongest function: {function[1]} ({function[0]} lines)\n"
              f"longest class: {cls[1]} ({cls[0]} lines)")
        return 0
    if "--check" in argv:
        found = circles(edges)
        nested = nested_imports(trees)
        for group in found:
            print("import circle among: " + ", ".join(group))
        for line in nested:
            print("import inside a function: " + line)
        return 1 if found or nested else 0
    for name in sorted(edges):
        print(f"{name:<12} -> {', '.join(sorted(edges[name])) or '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
