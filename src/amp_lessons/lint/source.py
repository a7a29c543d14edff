"""Reading what ``amp_lessons.lint`` checks (lesson 06): a function or class (its source, with
its file's line numbers), a source string, a ``.py`` file in any encoding Python accepts (a
coding line, a BOM), a notebook cell by cell, or a directory, recursively. What cannot be read
raises :class:`LintError`, naming the file and what to do."""

from __future__ import annotations

import ast
import inspect
import io
import json
import os
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

SKIPPED_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", "node_modules", "build", "dist",
                ".tox", ".nox", ".mypy_cache", ".ruff_cache", ".pytest_cache", "site-packages",
                ".ipynb_checkpoints", ".eggs"}
SUFFIXES = (".py", ".pyi", ".ipynb")


class LintError(ValueError):
    """The source could not be read or parsed; the message says where and what to do."""


@dataclass
class Source:
    """Python source to check: its name, its text, the line of its file where the text starts,
    and for a notebook the first line of each code cell in the text (cells numbered from 1,
    code cells only). ``problems`` are the cells that could not be read."""

    name: str
    text: str
    first: int = 1
    cells: list[int] | None = None
    problems: list[str] = field(default_factory=list)

    def where(self, line: int) -> tuple[int | None, int]:
        """``(cell, line)`` of a line of the text: the file's line for a file (no cell)."""
        if self.cells is None:
            return None, line + self.first - 1
        cell = max(i for i, start in enumerate(self.cells) if start <= line)
        return cell + 1, line - self.cells[cell] + 1


def source_of(obj) -> Source:
    """The :class:`Source` of a function, method, class, module, file path or source string."""
    if isinstance(obj, Path):
        return read_path(obj)
    if isinstance(obj, str):
        return Source("the source", textwrap.dedent(obj))
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        lines, first = inspect.getsourcelines(target)
    except (OSError, TypeError) as err:
        raise LintError(f"cannot read the source of {obj!r} ({err}); pass the loop's source "
                        "as a string, or the path of its file") from err
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(obj)))
    return Source(name, textwrap.dedent("".join(lines)), max(first, 1))


def read_path(path) -> Source:
    """A ``.py`` file (decoded as Python would) or a ``.ipynb`` notebook (its code cells)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError as err:
        raise LintError(f"cannot read {path}: it is a directory; pass it as a directory "
                        "(its Python files are checked) or name a file in it") from err
    except OSError as err:
        raise LintError(f"cannot read {path}: {err.strerror or err}") from err
    if path.suffix == ".ipynb":
        return notebook_source(data, str(path))
    return Source(str(path), decode(data, str(path)))


def decode(data: bytes, name: str) -> str:
    """The text of Python source bytes: the encoding its BOM or coding line declares, else
    UTF-8, as Python reads it."""
    if b"\0" in data:
        line = data[:data.index(b"\0")].count(b"\n") + 1
        raise LintError(f"cannot read {name}: it holds a NUL byte (line {line}), so it is not Python "
                        "source; is it a binary or a UTF-16 file? Save it as UTF-8 text")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as err:
        if b"coding" in b"\n".join(data.splitlines()[:2]):
            raise LintError(f"cannot read {name}: {err}. Fix its coding line, or save it as UTF-8") from err
        encoding = "utf-8"  # not UTF-8 in its first lines: say which byte, below
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        declared = "its coding line declares" if encoding not in ("utf-8", "utf-8-sig") else "Python's default is"
        raise LintError(f"cannot read {name}: byte {data[err.start]:#04x} at line {line} is not {encoding} "
                        f"({declared} {encoding}). Save it as UTF-8, or declare its encoding in a "
                        "coding line (# -*- coding: latin-1 -*-)") from err


def notebook_source(data: bytes, name: str) -> Source:
    """The code cells of a notebook, joined into one text (names flow from cell to cell as the
    kernel runs them). IPython magics and shell lines become ``pass``; a cell that is not
    Python is left out and named in ``problems``."""
    try:
        cells = json.loads(data.decode("utf-8-sig")).get("cells")
        if not isinstance(cells, list):
            raise ValueError("no list of cells")
    except (ValueError, AttributeError) as err:
        raise LintError(f"cannot read {name} as a notebook ({err}); is it a Jupyter .ipynb file?") from err
    text, starts, problems, line = [], [], [], 1
    code = [c for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]
    for number, cell in enumerate(code, 1):
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        lines = _without_magics(source.splitlines())
        try:
            parse("\n".join(lines), f"{name}, cell {number}")
        except LintError as err:
            problems.append(str(err))
            lines = [""] * len(lines)
        starts.append(line)
        text.extend(lines or [""])
        line += len(lines or [""])
    return Source(name, "\n".join(text) + "\n", cells=starts, problems=problems)


def _without_magics(lines: list[str]) -> list[str]:
    if lines and lines[0].startswith("%%"):
        if lines[0].split()[0] not in ("%%time", "%%timeit", "%%capture"):
            return [""] * len(lines)  # another language (%%bash, %%html): nothing to check
        lines = [""] + lines[1:]
    return [line[:len(line) - len(line.lstrip())] + "pass" if _is_magic(line) else line for line in lines]


def _is_magic(line: str) -> bool:
    """An IPython line magic, shell escape or help request (``%time``, ``!pip``, ``x?``): a
    statement for the checker's purpose (it becomes ``pass``, indented as it was)."""
    text = line.strip()
    return text.startswith(("%", "!")) or (text.endswith("?") and text.rstrip("?").isidentifier())


def parse(source: str, name: str = "the source") -> ast.Module:
    """``ast.parse``, with a :class:`LintError` that says where the syntax error is."""
    try:
        return ast.parse(source)
    except SyntaxError as err:
        where = f"line {err.lineno}" + (f", column {err.offset}" if err.offset else "")
        text = f": {err.text.strip()}" if err.text and err.text.strip() else ""
        raise LintError(f"cannot parse {name}: {err.msg} at {where}{text}. check_loop reads "
                        "Python source: pass a whole function or file that Python can "
                        "compile") from err
    except (RecursionError, MemoryError) as err:
        raise LintError(f"cannot parse {name}: it is nested too deeply for Python's parser "
                        f"({type(err).__name__}); split the deepest expression") from err


def python_files(path) -> list[Path]:
    """``path`` itself if it is not a directory; else the ``.py``, ``.pyi`` and ``.ipynb`` files
    under it, recursively and sorted, leaving out hidden folders, virtual environments and
    caches (as ruff does)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if f.endswith(SUFFIXES)]
    return found
