"""Tabulate the lessons' verdicts across the test matrix: the evidence for every margin.

    python tools/claims_report.py artifacts/claims      (written by `make test-matrix`)

Each ``<config>.jsonl`` holds one JSON line per verdict a lesson printed under that
configuration (``amp_lessons.claims`` writes them when AMP_LESSONS_CLAIMS_LOG is set).
Prints, per claim, its bound and the value measured under each configuration, and
whether it held; exits 1 if any verdict did not hold anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path) -> tuple[list[str], dict[str, dict[str, list[dict]]]]:
    """(configs, claim -> config -> rows), in the order the claims first appeared."""
    configs, table = [], {}
    for path in sorted(folder.glob("*.jsonl")):
        config = path.stem
        configs.append(config)
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                table.setdefault(row["claim"], {}).setdefault(config, []).append(row)
    return configs, table


def _bound(rows: list[dict]) -> str:
    for row in rows:
        low, high = row.get("bound") or (None, None)
        if low is not None and high is not None:
            return f"{low:g}..{high:g}"
        if low is not None:
            return f">= {low:g}"
        if high is not None:
            return f"<= {high:g}"
    return "-"


def _cell(rows: list[dict] | None) -> str:
    if not rows:
        return "."
    parts = []
    for row in rows:
        v = row.get("value")
        text = "yes" if v is None else f"{v:.3g}"
        parts.append(text if row["holds"] else f"{text}!")
    return ",".join(parts)


def report(folder: Path) -> tuple[str, int]:
    configs, table = load(folder)
    if not configs:
        return f"no verdict logs (*.jsonl) in {folder}; run `make test-matrix` first", 1
    width = max([len(c) for c in configs] + [8])
    head = f"{'bound':>14}  " + "  ".join(f"{c:>{width}}" for c in configs) + "  claim"
    lines, failed = [head], 0
    for claim, by_config in table.items():
        rows = [r for rs in by_config.values() for r in rs]
        failed += sum(not r["holds"] for r in rows)
        cells = "  ".join(f"{_cell(by_config.get(c)):>{width}}" for c in configs)
        lines.append(f"{_bound(rows):>14}  {cells}  {claim}")
    lines.append(f"{len(table)} claims under {len(configs)} configurations; "
                 f"{failed} verdicts did not hold (marked !); '.' = not run there")
    return "\n".join(lines), 1 if failed else 0


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "artifacts/claims")
    text, status = report(folder)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
