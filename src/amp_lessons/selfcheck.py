"""``python -m amp_lessons selfcheck`` (``make gpu-check``): the course's claims, checked on this machine.

It needs no Jupyter: every lesson's jupytext pair (``notebooks/NN_topic.py``) is run as a
script, cell by cell, in one namespace per lesson, and every verdict the lessons print
(``amp_lessons.claims``) is collected. Then the device checks run: the statements the
lessons make about CUDA (which ops autocast keeps in float32 there, native vs emulated
bf16, TF32's effect on a float32 matmul, ...) are checked for real on a CUDA device, and
replayed or simulated (and labelled so) on a CPU. Last, the doctor report and a short
bench. The exit status is 1 when a lesson cell fails or a verdict does not hold.

Cells that need a notebook frontend (``ipywidgets``, ``IPython``) are skipped, with the
reason, where those packages are missing (a bare GPU box). Used by ``make gpu-check``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from . import claims

FRONTEND_MODULES = ("ipywidgets", "IPython", "ipykernel")
CELL = re.compile(r"^# %%(.*)$", re.M)


def default_notebooks() -> Path:
    """``notebooks/`` of the source tree this package runs from (an editable install or PYTHONPATH=src)."""
    return Path(__file__).resolve().parents[2] / "notebooks"


def lesson_paths(folder=None, only=None) -> list[Path]:
    """The lessons' jupytext pairs, in order; ``only`` keeps those whose name contains one of its strings."""
    folder = Path(folder) if folder is not None else default_notebooks()
    paths = sorted(folder.glob("[0-9][0-9]_*.py"))
    if not paths:
        raise ValueError(f"no lessons (NN_topic.py) in {folder}; pass --notebooks DIR "
                                "(the notebooks/ folder of a clone of the course)")
    if only:
        paths = [p for p in paths if any(o in p.stem for o in only)]
        if not paths:
            raise ValueError(f"no lesson matches {', '.join(only)}")
    return paths


def code_cells(text: str) -> list[str]:
    """The code cells of a jupytext percent file (markdown cells and the header dropped)."""
    parts = CELL.split(text)
    cells = []
    for marker, body in zip(parts[1::2], parts[2::2]):
        if "[markdown]" in marker or "[md]" in marker:
            continue
        source = body.strip("\n")
        if source.strip():
            cells.append(source)
    return cells


@dataclass
class LessonRun:
    """What running one lesson as a script did."""

    name: str
    cells: int = 0
    skipped: list[str] = field(default_factory=list)   # "cell N: reason"
    error: str | None = None                           # the first failing cell's error
    verdicts: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and all(v.holds for v in self.verdicts)

    def line(self) -> str:
        held = sum(v.holds for v in self.verdicts)
        state = "ok" if self.ok else "FAILED"
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return (f"{self.name:<28} {state:<7} {self.cells} cells{skipped}, "
                f"{held}/{len(self.verdicts)} verdicts held, {self.seconds:.0f} s")


def _frontend_missing(err: BaseException) -> str | None:
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] in FRONTEND_MODULES:
        return f"needs {err.name}, which is not installed here (a notebook frontend package)"
    return None


def run_lesson(path: Path, echo: bool = False) -> LessonRun:
    """Run ``path``'s code cells in order in a fresh namespace; stop at the first failing cell."""
    run = LessonRun(path.stem)
    first = len(claims.RECORDED)
    ns = {"__name__": "__main__", "__file__": str(path)}
    start = time.perf_counter()
    cwd = os.getcwd()
    os.environ["AMP_LESSONS_LESSON"] = path.stem
    try:
        os.chdir(path.parent)
        for i, source in enumerate(code_cells(path.read_text(encoding="utf-8")), 1):
            run.cells = i
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out if not echo else sys.stdout):
                    exec(compile(source, f"{path.name} cell {i}", "exec"), ns)
            except Exception as err:  # noqa: BLE001 - reported, and the lesson stops here
                reason = _frontend_missing(err)
                if reason:
                    run.skipped.append(f"cell {i}: {reason}")
                    continue
                run.error = f"cell {i}: " + "".join(traceback.format_exception_only(err)).strip()
                break
    finally:
        os.chdir(cwd)
        os.environ.pop("AMP_LESSONS_LESSON", None)
        run.seconds = time.perf_counter() - start
        run.verdicts = claims.RECORDED[first:]
    return run


# --- device checks: what the lessons say about devices other than the one they ran on --------

def device_checks(device) -> list[tuple[str, list]]:
    """``(topic, verdicts)`` from every module that states device-specific facts.

    Each module offers a ``selfcheck(device)`` (or similar) that checks for real on a CUDA
    device and replays or simulates on a CPU, saying which in its verdicts' words.
    """
    found = []
    for topic, module, func in _DEVICE_CHECKS:
        try:
            mod = __import__(f"amp_lessons.{module}", fromlist=[func])
        except ImportError:
            continue
        check = getattr(mod, func, None)
        if check is None:
            continue
        first = len(claims.RECORDED)
        try:
            returned = check(device)
        except Exception as err:  # noqa: BLE001 - a crashing check is a failed verdict
            returned = [claims.check(f"{topic}: the device check ran", False,
                                     "".join(traceback.format_exception_only(err)).strip())]
        verdicts = list(returned or []) or claims.RECORDED[first:]
        found.append((topic, verdicts))
    return found


_DEVICE_CHECKS = (
    ("hardware", "hardware", "selfcheck"),
    ("matmul precision (lessons 01, 05)", "matmul", "selfcheck"),
    ("autocast lists (lesson 02)", "trace", "selfcheck"),
    ("error messages (lesson 06)", "errors", "selfcheck"),
    ("torch.distributed (lesson 07)", "distributed", "selfcheck"),
    ("fp8 (lesson 08)", "fp8", "selfcheck"),
    ("block scales (lesson 09)", "blockscale", "selfcheck"),
)


def main(args) -> int:
    """The CLI: lessons, device checks, doctor, bench; exit 1 if anything failed."""
    import matplotlib

    matplotlib.use("Agg")
    from .hardware import hardware_report, pick_device

    device = pick_device(args.device)
    print(f"amp-lessons selfcheck on {device}\n")
    print(hardware_report(device).table(), "\n", sep="")
    runs = []
    for path in lesson_paths(args.notebooks, args.lesson):
        print(f"running {path.name} ...", flush=True)
        run = run_lesson(path, echo=args.verbose)
        runs.append(run)
        for v in run.verdicts:
            print(f"  {v.line()}")
        for s in run.skipped:
            print(f"  skipped {s}")
        if run.error:
            print(f"  ERROR {run.error}")
    print("\ndevice checks:")
    checks = device_checks(device)
    for topic, verdicts in checks:
        print(f"  {topic}")
        for v in verdicts:
            print(f"    {v.line()}")
    if not args.no_bench:
        from . import bench

        print("\nbench:")
        try:
            print(bench.selfcheck_table(device))
        except AttributeError:
            print(bench.run_bench(device=device, warmup=1, repeats=3).table())
    print("\nlessons:")
    for run in runs:
        print("  " + run.line())
    device_verdicts = [v for _, vs in checks for v in vs]
    all_verdicts = [v for r in runs for v in r.verdicts] + device_verdicts
    print("\n" + claims.summary(all_verdicts))
    failed_lessons = [r.name for r in runs if r.error]
    if failed_lessons:
        print(f"lessons that stopped on an error: {', '.join(failed_lessons)}")
    return 0 if not failed_lessons and all(v.holds for v in all_verdicts) else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("selfcheck", help="run every lesson as a script and check every verdict "
                              "(make gpu-check)")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, mps")
    p.add_argument("--notebooks", default=None, help="the notebooks/ folder (default: this source tree's)")
    p.add_argument("--lesson", action="append", default=None,
                   help="only lessons whose name contains this (repeatable), e.g. --lesson 02")
    p.add_argument("--no-bench", action="store_true", help="skip the bench at the end")
    p.add_argument("--verbose", action="store_true", help="show what the lessons print")
    p.set_defaults(run=main)
