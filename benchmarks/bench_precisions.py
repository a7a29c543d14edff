"""Every precision side by side on this device, kept as a JSON record (a benchmark, not a test).

    python benchmarks/bench_precisions.py                       # default sizes for this device
    python benchmarks/bench_precisions.py --threads 1 --model mlp --out artifacts/cpu-1thread.json

Takes every flag of ``python -m amp_lessons bench`` (see ``--help`` there) plus ``--out``,
prints the table, and writes the measurements with the device line to ``--out``
(default ``artifacts/bench-<device>.json``). Read the ratios, not the absolute times: they
are what lesson 05 compares with the card's "2-3x faster, half the memory".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from amp_lessons.benchcli import result_from_args, table
from amp_lessons.cli import build_parser


def main(argv: list[str]) -> int:
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = Path(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    args = build_parser().parse_args(["bench", *argv])
    result = result_from_args(args)
    print(table(result))
    out = out or Path("artifacts") / f"bench-{result.device.replace(':', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
