"""``python -m amp_lessons`` and ``amp-lessons``: ``doctor``, ``bench``, ``selfcheck``, ``lint``
and ``dist`` (the parser lives in :mod:`amp_lessons.cli`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .lint import cli as lint_cli


def lint_parser() -> argparse.ArgumentParser:
    """The parser of ``lint`` alone: a static check imports none of torch."""
    parser = argparse.ArgumentParser(prog="python -m amp_lessons", description=__doc__)
    lint_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """``lint``'s parser for ``lint``; every other command's parser imports torch, so
    :mod:`amp_lessons.cli` is imported only when one of them is asked for."""
    if argv[:1] == ["lint"]:
        return lint_parser()
    return importlib.import_module(".cli", __package__).build_parser()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser_for(argv).parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
