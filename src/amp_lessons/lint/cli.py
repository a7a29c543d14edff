"""``python -m amp_lessons lint PATH ...`` (lesson 06): check files, notebooks and directories.

Exit status: 0 when nothing was found but notes, 1 when at least one mistake was found, 2 when
a path could not be read or parsed (that path is named on stderr and the others are still
checked). ``--format json`` prints one JSON object: ``{"findings": [...], "errors": [...]}``,
each finding with its file, cell (notebooks), line, code, kind, message and lesson.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

from . import RULES, Findings, LintError, check_source
from .source import python_files, read_path

OK, FOUND, UNREADABLE = 0, 1, 2


def lint_file(path) -> tuple[Findings, list[str]]:
    """The findings of one file, and the problems met reading it (a notebook's bad cells)."""
    source = read_path(path)
    return check_source(source), source.problems


def run(paths, out=None, err=None, fmt: str = "text") -> int:
    """Check every path (directories recursively); print findings to ``out`` (stdout) and read
    errors to ``err`` (stderr); return the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    collecting = gc.isenabled()
    gc.disable()  # a checked file's objects hold no cycles: they go by reference counting
    try:
        return _run(paths, out, err, fmt)
    finally:
        if collecting:
            gc.enable()


def _run(paths, out, err, fmt: str) -> int:
    status, findings, errors = OK, [], []
    for given in paths:
        files = python_files(given)
        if not files:
            errors.append({"file": str(given), "error": f"{given}: no Python files (.py, .ipynb) under it"})
        for path in files:
            if not path.exists():
                errors.append({"file": str(path), "error": f"{path}: no such file or directory"})
                continue
            try:
                found, problems = lint_file(path)
            except LintError as error:
                errors.append({"file": str(path), "error": str(error)})
                continue
            errors += [{"file": str(path), "error": p} for p in problems]
            findings += [(str(path), f) for f in found]
            if fmt == "text":
                _print_text(str(path), found, out)
    for e in errors:
        if fmt == "text":
            print(f"error: {e['error']}", file=err)
    if fmt == "json":
        json.dump({"findings": [{"file": p, **f.as_dict()} for p, f in findings], "errors": errors}, out, indent=2)
        out.write("\n")
    if any(f.kind == "mistake" for _, f in findings):
        status = FOUND
    return UNREADABLE if errors else status


def _print_text(path: str, found: Findings, out) -> None:
    for f in found:
        where = f"cell {f.cell}:{f.line}" if f.cell is not None else f"{f.line}"
        print(f"{path}:{where}: {f.kind}: [{f.code}] {f.message} (lesson {f.lesson})", file=out)
    if not found:
        print(f"{path}: no findings", file=out)


def main(args) -> int:
    if args.list_rules:
        for rule in RULES:
            print(f"{rule.name:<24} {rule.kind:<8} {rule.summary} (lesson {rule.lesson})")
        return OK
    if not args.paths:
        print("error: name at least one file or directory to check", file=sys.stderr)
        return UNREADABLE
    return run(args.paths, fmt=args.format)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lint", help="read training loops and name their mixed-precision mistakes (lesson 06)",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="Python files, notebooks (.ipynb) or directories (checked recursively)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    p.add_argument("--list-rules", action="store_true", help="print every rule and exit")
    p.set_defaults(run=main)
