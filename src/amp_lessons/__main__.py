"""Command line: ``python -m amp_lessons doctor``, ``bench``, ``selfcheck`` and ``lint``."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _doctor(args) -> int:
    from .hardware import hardware_report

    report = hardware_report(args.device, measure=not args.no_measure)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    # the name it was run by: the installed `amp-lessons` command, or python -m amp_lessons
    command = os.path.basename(sys.argv[0]).split(".")[0].removesuffix("-script")
    parser = argparse.ArgumentParser(prog="amp-lessons" if command == "amp-lessons" else "python -m amp_lessons",
                                     description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="what this machine can do, and the precision to use here")
    doctor.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1, mps")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true",
                        help="skip the quick matmul that grounds a CPU's recommendation")
    doctor.set_defaults(run=_doctor)
    try:
        from . import bench
    except ImportError:  # pragma: no cover - bench lands with lesson 05
        bench = None
    if bench is not None:
        bench.add_parser(sub)
    from . import selfcheck

    selfcheck.add_parser(sub)
    from . import lint

    lint.add_parser(sub)  # python -m amp_lessons lint FILE.py (lesson 06)
    from . import distributed

    distributed.add_parser(sub)  # python -m amp_lessons dist (lesson 07)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
