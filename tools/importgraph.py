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


def _package_of(name: str) -> str:
    """The dotted package a module lives in, inside amp_lessons ("" for a top-level module;
    a subpackage's ``__init__`` is named by the subpackage)."""
    return name if name in _SUBPACKAGES else name.rpartition(".")[0]


def _resolve(base: str, module: str | None, level: int) -> str:
    """The dotted module a relative import names, seen from package ``base``."""
    parts = base.split(".") if base else []
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*parts, *(module.split(".") if module else [])])


def _targets(node: ast.AST, modules: set[str], base: str = "") -> list[str]:
    """The package modules one import statement names (dotted for a subpackage's modules)."""
    def known(dotted: str) -> list[str]:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return [dotted] if dotted else []

    if isinstance(node, ast.ImportFrom):
        if node.level >= 1:
            target = _resolve(base, node.module, node.level)
            names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            found = [n for n in names if n in modules]
            return found or known(target)
        if node.module and node.module.split(".")[0] == PACKAGE:
            target = ".".join(node.module.split(".")[1:])
            found = [f"{target}.{a.name}" if target else a.name for a in node.names]
            return [n for n in found if n in modules] or known(target)
    if isinstance(node, ast.Import):
        return [t for a in node.names if a.name.startswith(PACKAGE + ".")
                for t in known(a.name.split(".", 1)[1])]
    return []


def _imports(tree: ast.Module, modules: set[str], base: str = "") -> tuple[set[str], list[tuple[int, str]]]:
    """(every package module imported anywhere, (line, module) of those imported inside a function)."""
    everywhere, nested = set(), []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(child, modules, base):
                everywhere.add(target)
                if in_function:
                    nested.append((child.lineno, target))
            walk(child, inner)

    walk(tree, False)
    return everywhere, nested


_SUBPACKAGES: set[str] = set()


def read(src: Path = SRC) -> dict[str, ast.Module]:
    """Each module's name (dotted inside a subpackage, e.g. ``lint.rules``; a subpackage's
    ``__init__`` by the subpackage's name) and parsed source."""
    trees = {}
    for p in sorted(src.rglob("*.py")):
        parts = p.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
            _SUBPACKAGES.add(".".join(parts))
        trees[".".join(parts)] = ast.parse(p.read_text(encoding="utf-8"), str(p))
    return trees


def _path(name: str, src: Path = SRC) -> Path:
    """The file a module name from :func:`read` comes from."""
    path = src.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``__init__``'s own imports included)."""
    modules = set(trees)
    return {name: _imports(tree, modules, _package_of(name))[0] - {name} for name, tree in trees.items()}


def nested_imports(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line imports x`` for every package import placed inside a function."""
    modules = set(trees)
    return [f"{name}.py:{line} imports {target}" for name, tree in trees.items()
            for line, target in _imports(tree, modules, _package_of(name))[1]]


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
    lines = {name: len(_path(name, src).read_text(encoding="utf-8").splitlines()) for name in trees}
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
