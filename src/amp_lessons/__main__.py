"""Command line: ``python -m amp_lessons doctor``, ``bench``, ``selfcheck``, ``lint`` and ``dist``."""

from __future__ import annotations

import argparse
import json
import sys

from . import benchcli, distributed, lint, selfcheck
from .hardware import resolve_machine


def _doctor(args) -> int:
    report = resolve_machine(args.device, measure=not args.no_measure).report()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m amp_lessons", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="what this machine can do, and the precision to use here")
    doctor.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1, mps")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true",
                        help="skip the quick matmul that decides a CPU's recommendation (it then says "
                             "it was not measured)")
    doctor.set_defaults(run=_doctor)
    benchcli.add_parser(sub)  # python -m amp_lessons bench (lesson 05)
    selfcheck.add_parser(sub)
    lint.add_parser(sub)  # python -m amp_lessons lint FILE.py (lesson 06)
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
