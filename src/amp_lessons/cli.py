"""The command line of ``amp-lessons`` / ``python -m amp_lessons``: ``doctor`` (00), ``bench``
(05), ``selfcheck`` (``make gpu-check``), ``lint`` (06) and ``dist`` (07).

``lint`` alone is parsed by :mod:`amp_lessons.__main__` without this module, so that a static
check imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import benchcli, distributed, selfcheck
from .hardware import resolve_machine
from .lint import cli as lint_cli


def _doctor(args) -> int:
    report = resolve_machine(args.device, measure=not args.no_measure).report()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.table())
    return 0


def program_name() -> str:
    """The name the command was run by: the installed ``amp-lessons``, or ``python -m amp_lessons``."""
    command = os.path.basename(sys.argv[0]).split(".")[0].removesuffix("-script")
    return "amp-lessons" if command == "amp-lessons" else "python -m amp_lessons"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program_name(), description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="what this machine can do, and the precision the course recommends here")
    doctor.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1, mps")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true",
                        help="skip the quick matmul that decides a CPU's recommendation (it then says "
                             "it was not measured)")
    doctor.set_defaults(run=_doctor)
    benchcli.add_parser(sub)  # python -m amp_lessons bench (lesson 05)
    selfcheck.add_parser(sub)
    lint_cli.add_parser(sub)  # python -m amp_lessons lint PATH (lesson 06)
    distributed.add_parser(sub)  # python -m amp_lessons dist (lesson 07)
    return parser
