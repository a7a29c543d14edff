"""``python -m amp_lessons bench``: the command line, and the tables it prints.

The measurements are :mod:`amp_lessons.bench`'s (:func:`~amp_lessons.bench.run_bench`);
this module parses the flags into a run (:func:`result_from_args`) and prints its result
(:func:`table`: the rows, the matmul block and, with ``--breakdown``, each model's step
breakdown and closing table). Lesson 05 prints :func:`table` too; ``make gpu-check`` prints
:func:`selfcheck_table`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch
from matplotlib.figure import Figure

from . import bench
from .bench import MAX_STEP_SECONDS, MODELS, SIZE_CHOICES, BenchResult
from .hardware import pick_device, resolve_machine
from .plots import step_breakdown
from .precision import PRECISIONS, parse_precision

MAX_MATMUL_SIZE = 16384  # three float32 matrices of 16384^2 take 3 GiB: larger is not a quick bench
MAX_REPEATS = 1000  # --warmup and --repeats: more steps than this measure nothing new

# -- printing -------------------------------------------------------------------------------


def table(result: BenchResult, breakdown: bool = True) -> str:
    """The rows, the matmul block and the device line, as aligned text; with the
    breakdown (unless ``breakdown=False``), its tables after them."""
    out = [result.device_line]
    for kind, s in result.sizes.items():
        out.append(f"  {bench.describe(kind, bench.Sizes(**s))}" + (f", {s['heads']} heads" if kind == "transformer" else ""))
    out.append("")
    head = (f"{'model':<12} {'precision':<12} {'ms/step':>8} {'speedup':>8} {'act MiB':>8} "
            f"{'act ratio':>9} {'w-copy MiB':>10} {'TFLOP/s':>8}")
    if any(r.peak_mb is not None for r in result.rows):
        head += f" {'peak MiB':>8}"
    out.append(head)
    for r in result.rows:
        label = r.precision + (" +scaler" if r.precision == "fp16" else "")
        if r.status != "ok" and r.activation_mb is None:
            out.append(f"{r.model:<12} {label:<12} {r.status}: {r.reason}")
            continue
        if r.status != "ok":  # not timed, memory measured
            out.append(f"{r.model:<12} {label:<12} {'-':>8} {'-':>8} {r.activation_mb:8.2f} "
                       f"{_num(r.activation_ratio, '.2f'):>9} {r.weight_copy_mb:10.2f} {'-':>8}  "
                       f"{r.status}: {r.reason}")
            continue
        line = (f"{r.model:<12} {label:<12} {r.ms:8.1f} {_x(r.speedup):>8} {r.activation_mb:8.2f} "
                f"{_num(r.activation_ratio, '.2f'):>9} {r.weight_copy_mb:10.2f} {_num(r.tflops, '.3g'):>8}")
        if r.peak_mb is not None:
            line += f" {r.peak_mb:8.1f}"
        out.append(line)
    note = result.noise_note()
    if note:
        out += ["", note]
    out += _matmul_lines(result)
    for kind in dict.fromkeys(b.model for b in result.breakdowns) if breakdown else ():
        out += ["", *breakdown_lines(result, kind)]
    return "\n".join(out)

def _matmul_lines(result: BenchResult) -> list[str]:
    if not result.matmul:
        return []
    sizes = sorted({m.n for m in result.matmul})
    out = ["", "matmul GFLOP/s (n x n @ n x n): " + "  ".join(f"n={n}" for n in sizes) + "   peak"]
    notes = []
    for p in dict.fromkeys(m.precision for m in result.matmul):
        cells = {m.n: m for m in result.matmul if m.precision == p}
        if all(m.gflops is None for m in cells.values()):
            out.append(f"  {p:<6} {next(iter(cells.values())).reason}")
            continue
        line = "  ".join(f"{cells[n].gflops:>{len(str(n)) + 2}.0f}" if cells.get(n) and cells[n].gflops
                         else f"{'-':>{len(str(n)) + 2}}" for n in sizes)
        rate, n = result.peak(p)
        out.append(f"  {p:<6} {line}   {rate:.0f} (n={n})")
        notes += [f"  {p} n={m.n}: {m.reason}" for m in cells.values() if m.gflops is None and m.reason]
    return out + notes

def breakdown_lines(result: BenchResult, kind: str, amdahl: bool = True) -> list[str]:
    """One model's step breakdown, fraction of peak, Amdahl lines (``amdahl=False`` leaves
    them out, as 05 does) and closing table."""
    bds = [b for b in result.breakdowns if b.model == kind]
    if not bds:
        return []
    names = list(bds[0].ms)
    out = [f"where one Trainer step's time goes: {bench.describe(kind, bench.Sizes(**result.sizes[kind]))} "
           f"(torch.profiler, median of {bds[0].steps} steps; ms and share)",
           f"{'':<18}" + "".join(f"{b.precision:>16}" for b in bds)]
    for name in names:
        out.append(f"{name:<18}" + "".join(f"{b.ms[name]:>9.1f} {b.share(name):>5.0%}" for b in bds))
    out.append(f"{'sum of the above':<18}" + "".join(f"{b.total_ms:>9.1f}{'':>7}" for b in bds))
    out.append(f"{'profiled step':<18}" + "".join(f"{b.wall_ms:>9.1f}{'':>7}" for b in bds))
    out.append(f"{'step, no profiler':<18}" + "".join(
        f"{b.step_ms:>9.1f}{'':>7}" if b.step_ms else f"{'-':>9}{'':>7}" for b in bds))
    out.append("")
    for b in bds:
        line = f"{b.precision}: the step's matmuls run at {b.step_gflops:.0f} GFLOP/s over the whole step"
        if b.peak_gflops:
            line += (f", {b.peak_fraction:.0%} of this device's measured {b.precision} peak "
                     f"({b.peak_gflops:.0f} at n={b.peak_n})")
            line += f"; inside the matmul ops {b.matmul_gflops:.0f} ({b.matmul_gflops / b.peak_gflops:.0%})"
        out.append(line)
    lines = [result.amdahl(kind, b.precision) for b in bds if b.precision != "fp32"] if amdahl else []
    fp32 = result.breakdown(kind, "fp32")
    if fp32 is not None and amdahl:
        out.append(f"fp32: if everything but the matmuls were free, the step would be "
                   f"{1 / fp32.matmul_share if fp32.matmul_share else float('inf'):.2f}x faster")
    out += [a.line() for a in lines if a is not None]
    closing = result.closing.get(kind)
    if closing is not None:
        out += ["", "what closes part of the gap (each change's gain, side by side in one run):",
                closing.table()]
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _num(v, fmt) -> str:
    return "-" if v is None else format(v, fmt)


def selfcheck_table(device) -> str:
    """The bench with its breakdown, short repeats (``make gpu-check`` prints it)."""
    return table(bench.run_bench(device=device, warmup=1, repeats=3, breakdown=True, profile_steps=3))


# -- command line ------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register ``bench`` on the ``python -m amp_lessons`` command line."""
    p = subparsers.add_parser("bench", help="fp32 / tf32 / bf16 / fp16 side by side on this device")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1")
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which model (default both)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="comma-separated precisions (default: all; those this device cannot run are named)")
    p.add_argument("--size", choices=SIZE_CHOICES, default="default",
                   help="small: quick; large: matmuls are most of an fp32 step on this device type; "
                        "default: the MLP large (matmul-bound) and the transformer small")
    p.add_argument("--width", type=int, help="MLP hidden width / transformer dim")
    p.add_argument("--depth", type=int, help="MLP hidden layers / transformer blocks")
    p.add_argument("--batch", type=int, help="batch size")
    p.add_argument("--seq", type=int, help="transformer tokens per example")
    p.add_argument("--heads", type=int, help="transformer attention heads")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per precision (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per precision; the median is reported")
    p.add_argument("--matmul-sizes", default=None,
                   help="comma-separated n for the matmul block (default per device; 'none' skips it)")
    p.add_argument("--max-step-seconds", type=float, default=MAX_STEP_SECONDS,
                   help=f"skip a precision whose step would take longer, estimated from its matmul "
                        f"rate (default {MAX_STEP_SECONDS:g})")
    p.add_argument("--breakdown", action="store_true",
                   help="profile one Trainer step per precision by op category, with the fraction of "
                        "matmul peak, Amdahl's bound, and the changes that close part of the gap")
    p.add_argument("--compile", action="store_true",
                   help="with --breakdown: add a torch.compile row (compiling takes a minute or more; "
                        "on a CPU it needs a C++ compiler)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice); fewer can be faster on a busy machine")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="with --breakdown: save the stacked-bar figure of the breakdown to FILE (.png, .svg)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_run)


def _ints(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--matmul-sizes must be comma-separated integers or 'none'; got {text!r}") from None
    if any(not 0 < v <= MAX_MATMUL_SIZE for v in values):
        raise ValueError(f"--matmul-sizes must be from 1 to {MAX_MATMUL_SIZE}; got {text!r}")
    return values


def _run(args) -> int:
    result = result_from_args(args)
    print(json.dumps(result.as_dict(), indent=2) if args.json else table(result))
    if getattr(args, "plot", None):
        if not result.breakdowns:
            raise ValueError("--plot draws the breakdown: add --breakdown")
        for kind in dict.fromkeys(b.model for b in result.breakdowns):
            path = args.plot if len(result.closing) <= 1 else _suffixed(args.plot, kind)
            step_breakdown(result, kind).savefig(path, dpi=120, bbox_inches="tight")
    return 0


def _plot_formats() -> set[str]:
    """The file endings matplotlib can save a figure as here (``--plot``)."""
    return set(Figure().canvas.get_supported_filetypes())


def _suffixed(path: str, kind: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{kind}.{ext}" if dot else f"{path}-{kind}"


def _check_run_arguments(args) -> None:
    """``--warmup``, ``--repeats``, ``--plot``, ``--max-step-seconds``, ``--compile`` and
    ``--threads``, refused before the bench runs (not after it)."""
    if not 0 <= args.warmup <= MAX_REPEATS or not 1 <= args.repeats <= MAX_REPEATS:
        raise ValueError(f"--warmup must be from 0 to {MAX_REPEATS} and --repeats from 1 to {MAX_REPEATS}")
    plot = getattr(args, "plot", None)
    if plot and not getattr(args, "breakdown", False):
        raise ValueError("--plot draws the breakdown: add --breakdown")
    if plot and not os.path.isdir(os.path.dirname(os.path.abspath(plot))):
        raise ValueError(f"--plot {plot}: its folder does not exist; create it first or save elsewhere")
    if plot and "." in os.path.basename(plot) and plot.rpartition(".")[2].lower() not in _plot_formats():
        raise ValueError(f"--plot {plot}: matplotlib cannot save that; end the name with one of "
                         f"{', '.join(sorted(_plot_formats()))}")
    max_step = getattr(args, "max_step_seconds", MAX_STEP_SECONDS)
    if not max_step > 0:
        raise ValueError(f"--max-step-seconds must be positive; got {max_step}")
    if getattr(args, "compile", False) and not getattr(args, "breakdown", False):
        raise ValueError("--compile adds a row to the breakdown's closing table: add --breakdown")
    if args.threads is not None and not 1 <= args.threads <= (os.cpu_count() or 1):
        raise ValueError(f"--threads must be from 1 to {os.cpu_count() or 1} (this machine's CPU "
                         f"threads); got {args.threads}")


def result_from_args(args) -> BenchResult:
    """Run the bench as the parsed ``bench`` command line asks (used by benchmarks/ too). Every
    argument is checked before the machine is measured or a step runs."""
    device = pick_device(args.device)
    models = MODELS if args.model == "both" else (args.model,)
    precisions = [p for p in args.precisions.split(",") if p.strip()]
    if not precisions:
        raise ValueError(f"--precisions needs at least one of {', '.join(PRECISIONS)} (comma-separated); "
                         f"got {args.precisions!r}")
    for name in precisions:
        parse_precision(name)  # a misspelt name is refused here, not after the machine is measured
    size = getattr(args, "size", "default")
    sizes = {}
    for kind in models:
        base = bench.default_sizes(kind, device, size)
        changes = {k: getattr(args, k) for k in ("width", "depth", "batch", "seq", "heads")
                   if getattr(args, k) is not None}
        sizes[kind] = bench.Sizes(**{**asdict(base), **changes})
        bench.validate_sizes(kind, sizes[kind])
    _check_run_arguments(args)
    matmul_sizes = None if args.matmul_sizes is None else _ints(args.matmul_sizes)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = resolve_machine(device)
    max_step = getattr(args, "max_step_seconds", MAX_STEP_SECONDS)
    return bench.run_bench(models, precisions, dev, sizes, args.warmup, args.repeats, matmul_sizes, size=size,
                           breakdown=getattr(args, "breakdown", False), compile=getattr(args, "compile", False),
                           max_step_seconds=max_step)


