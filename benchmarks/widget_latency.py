"""How fast each lesson widget redraws in JupyterLab (a benchmark, not a test).

    python benchmarks/widget_latency.py                      # every lesson, 5 round trips per control
    python benchmarks/widget_latency.py --lessons 01 03 --repeats 10
    python benchmarks/widget_latency.py --threads 1 --json artifacts/widget-latency.json

The same JupyterLab in headless Chromium as the browser tests (``tests/_browser_lab.py``;
Debian's ``chromium`` and ``playwright``): each lesson is copied, opened and run with
Run > Run All Cells, then every control of every widget is moved with real key presses
and clicks, ``--repeats`` times there and back. For each move the page measures, from the
input event, when the last view showed its new content (``redraw``) and, for widgets
that show a busy cue while they compute, when the cue appeared (``cue``).

A slider walks: ``--repeats`` steps out (settings the widget has not drawn yet: ``new``)
and as many back (settings it has drawn, which a widget that caches, like 03's, redraws
without recomputing). Buttons and text boxes go there and back.

The table gives per control the median, the fastest and the slowest redraw in ms over
all its moves, the median over new settings only, and the median cue. The goal (issue
13): every control redraws in under 1 s, or shows its busy cue in under 1 s for the part
that cannot. Timings depend on the machine and on what else runs on it, so run this
alone; nothing here asserts a time (the browser tests check only that each control
redraws).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _browser_lab import (  # noqa: E402  (tests/ is not a package)
    LabServer,
    change_control,
    control_labels,
    find_chromium,
    find_widget,
    launch_chromium,
    open_notebook,
    run_all,
    slider_key,
    toggle,
    type_text,
)

GOAL_S = 1.0
MAX_REPEATS = 7  # 03's init_scale starts at 2^16 of 2^24: walks longer than 8 steps would run off its end

# lesson -> [(a control that finds the widget, [(there, back) for each of its controls])].
# Each pair leaves the control where it was, so the moves repeat.
MOVES = {
    "00_start_here": [
        ("precision", [(toggle("precision", "fp16"), toggle("precision", "bf16"))]),
    ],
    "01_number_formats": [
        ("loss scale", [(slider_key("loss scale", "ArrowRight"), slider_key("loss scale", "ArrowLeft"))]),
        ("format", [
            (toggle("format", "bf16"), toggle("format", "fp16")),
            (type_text("value", "2^-24"), type_text("value", "1e-8")),
        ]),
    ],
    "02_autocast": [
        ("dtype", [
            (toggle("dtype", "float16"), toggle("dtype", "bfloat16")),
            (toggle("model", "TransformerBlock"), toggle("model", "card_model")),
        ]),
    ],
    "03_grad_scaler": [
        ("init_scale", [
            (slider_key("init_scale", "ArrowRight"), slider_key("init_scale", "ArrowLeft")),
            (slider_key("growth_interval", "ArrowLeft"), slider_key("growth_interval", "ArrowRight")),
            (slider_key("inf at step (-1: none)", "ArrowRight"),
             slider_key("inf at step (-1: none)", "ArrowLeft")),
        ]),
    ],
}  # fmt: skip


def measure_lesson(context, lab, lesson: str, repeats: int, log=print) -> list[dict]:
    """Open ``lesson``, Run All, and move each control there and back ``repeats`` times."""
    page = open_notebook(context, lab, f"{lesson}.ipynb")
    try:
        log(f"{lesson}: Run All Cells took {run_all(page, timeout=300):.1f} s")
        rows = []
        for anchor, pairs in MOVES[lesson]:
            box = find_widget(page, anchor)
            box.scroll_into_view_if_needed()
            labels = control_labels(box)
            unmoved = sorted(set(labels) - {there.label for there, _ in pairs})
            if unmoved:
                log(f"  note: {lesson}'s widget has controls this benchmark does not move: {unmoved}")
            for there, back in pairs:
                walks = getattr(there, "walks", False)
                moves = [there] * repeats + [back] * repeats if walks else [there, back] * repeats
                redraw, new, cue = [], [], []
                for i, act in enumerate(moves):
                    change = change_control(page, box, act, timeout=60)
                    redraw.append(change.latency_s)
                    if i < repeats or not walks:
                        new.append(change.latency_s)
                    if change.cue_s is not None:
                        cue.append(change.cue_s)
                rows.append(summary(lesson, there.label, redraw, new, cue))
                log(format_row(rows[-1]))
        return rows
    finally:
        page.close()
        lab.shutdown_kernels()


def summary(lesson: str, control: str, redraw: list[float], new: list[float], cue: list[float]) -> dict:
    return {
        "lesson": lesson, "control": control, "moves": len(redraw),
        "median_ms": 1000 * statistics.median(redraw), "min_ms": 1000 * min(redraw),
        "max_ms": 1000 * max(redraw), "new_median_ms": 1000 * statistics.median(new),
        "cue_median_ms": 1000 * statistics.median(cue) if cue else None,
        "cue_moves": len(cue),
    }  # fmt: skip


HEADER = (f"{'lesson':<20}{'control':<24}{'moves':>6}{'median ms':>11}{'min':>7}{'max':>7}"
          f"{'new ms':>8}{'cue ms':>8}  verdict")


def verdict(row: dict) -> str:
    slowest = max(row["median_ms"], row["new_median_ms"])
    if slowest < 1000 * GOAL_S:
        return f"redraws in under {GOAL_S:g} s"
    if row["cue_median_ms"] is not None and row["cue_median_ms"] < 1000 * GOAL_S:
        return f"slower than {GOAL_S:g} s, busy cue shown first"
    return f"slower than {GOAL_S:g} s with no busy cue"


def format_row(row: dict) -> str:
    cue = "-" if row["cue_median_ms"] is None else f"{row['cue_median_ms']:.0f}"
    return (f"{row['lesson']:<20}{row['control']:<24}{row['moves']:>6}{row['median_ms']:>11.0f}"
            f"{row['min_ms']:>7.0f}{row['max_ms']:>7.0f}{row['new_median_ms']:>8.0f}{cue:>8}  {verdict(row)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lessons", nargs="+", default=list(MOVES), metavar="NN",
                        help="lessons to measure, by number or name (default: all with a widget)")
    parser.add_argument("--repeats", type=int, default=5, help="round trips per control (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the kernels (default: as inherited)")
    parser.add_argument("--chromium", default=None, help="the chromium binary (default: Debian's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    lessons = [next((name for name in MOVES if name.startswith(key)), key) for key in args.lessons]
    unknown = [name for name in lessons if name not in MOVES]
    if unknown:
        parser.error(f"no widget lesson {unknown}; choose from {', '.join(MOVES)}")
    if not 1 <= args.repeats <= MAX_REPEATS:
        parser.error(f"--repeats must be from 1 to {MAX_REPEATS} (a slider walks that many steps "
                     f"from where the lesson leaves it); got {args.repeats}")
    chromium = args.chromium or find_chromium()
    if chromium is None:
        print("chromium not found: install Debian's with `apt-get install chromium`, or pass --chromium",
              file=sys.stderr)
        return 2
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright is not installed: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("AMP_LESSONS_PROGRESS", "0")

    print(f"widget latency: {args.repeats} round trips per control; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}; load average {os.getloadavg()[0]:.2f}")
    rows = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="widget-latency-") as tmp:
        root, home = Path(tmp, "lessons"), Path(tmp, "home")
        root.mkdir()
        home.mkdir()
        for name in lessons:
            shutil.copy2(ROOT / "notebooks" / f"{name}.ipynb", root)
        lab = LabServer(root, home)
        try:
            lab.start()
            with sync_playwright() as pw:
                context = launch_chromium(pw, chromium, Path(tmp, "profile"))
                try:
                    for name in lessons:
                        rows += measure_lesson(context, lab, name, args.repeats)
                finally:
                    context.close()
        finally:
            lab.stop()
    print(f"\n{HEADER}")
    print("\n".join(format_row(r) for r in rows))
    print(f"({time.monotonic() - start:.0f} s in all; load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
