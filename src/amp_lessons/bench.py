"""``python -m amp_lessons bench``: every precision this device runs, side by side.

One model and batch per row block (an MLP and a transformer stack), trained for a few
steps in fp32, tf32, bf16 and fp16 + GradScaler in one process, with the timed steps
interleaved so that all precisions share the machine's drift. Per precision: median
ms/step, speedup against fp32, activation memory saved for backward (and its ratio to
fp32), the 16-bit weight copies apart, achieved TFLOP/s, and on CUDA the step's peak
memory. A matmul block shows achieved GFLOP/s per dtype, which is *why* a precision is
fast or slow on this device. Performance is read as ratios within one run, never as
absolute thresholds.

Used in 05_putting_it_together; the command prints the same table.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field

import torch
from torch.nn import functional as F

from .hardware import hardware_report, pick_device, supported_precisions
from .matmul import matmul_gflops
from .measure import (
    MB,
    SavedTensorsMeter,
    available_memory,
    cuda_peak_memory,
    saved_memory,
    step_flops,
    time_interleaved,
)
from .models import TinyTransformer, mlp
from .precision import (
    PRECISIONS,
    dtype_of,
    float32_matmul_precision,
    needs_scaler,
    parse_precision,
    uses_autocast,
)

MODELS = ("mlp", "transformer")
GiB = 2**30
CLASSES = 10


@dataclass(frozen=True)
class Sizes:
    """Model and batch sizes: ``width`` is the MLP's hidden width and the transformer's dim."""

    width: int
    depth: int
    batch: int
    seq: int = 1
    heads: int = 4


# Small enough for ~30-60 s on a 2-core CPU; large enough on a GPU to be compute-bound.
DEFAULTS = {
    "cpu": {"mlp": Sizes(width=512, depth=4, batch=128), "transformer": Sizes(width=128, depth=2, batch=8, seq=64)},
    "cuda": {"mlp": Sizes(width=4096, depth=8, batch=4096),
             "transformer": Sizes(width=1024, depth=4, batch=16, seq=512, heads=16)},
}
MATMUL_SIZES = {"cpu": (128, 256, 512), "cuda": (1024, 4096, 8192)}


class BenchMemoryError(RuntimeError):
    """The requested sizes do not fit this device's free memory."""


def default_sizes(kind: str, device) -> Sizes:
    """The sizes ``bench`` uses for ``kind`` on ``device`` when no flag overrides them."""
    if kind not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {kind!r}")
    table = DEFAULTS["cuda"] if torch.device(device).type == "cuda" else DEFAULTS["cpu"]
    return table[kind]


def build(kind: str, sizes: Sizes, device, seed: int = 0):
    """(model, x, y) for ``kind`` at ``sizes`` on ``device``: the same values for the same ``seed``."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    # seeded initial weights, without touching the caller's random state
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        if kind == "mlp":
            model = mlp(sizes.width, sizes.width, CLASSES, depth=sizes.depth)
        elif kind == "transformer":
            model = TinyTransformer(sizes.width, dim=sizes.width, heads=sizes.heads, depth=sizes.depth,
                                    classes=CLASSES)
        else:
            raise ValueError(f"model must be one of {', '.join(MODELS)}; got {kind!r}")
    shape = (sizes.batch, sizes.width) if kind == "mlp" else (sizes.batch, sizes.seq, sizes.width)
    if device.type == "meta":
        x = torch.empty(shape, device=device)
        y = torch.empty(sizes.batch, dtype=torch.long, device=device)
    else:
        x = torch.randn(shape, generator=g).to(device)
        y = torch.randint(0, CLASSES, (sizes.batch,), generator=g).to(device)
    return model, x, y


@dataclass(frozen=True)
class Estimate:
    """Bytes one training step needs, estimated on the meta device (nothing is allocated)."""

    parameters: int        # parameter count
    saved_fp32_bytes: int  # bytes saved for backward in fp32 (an upper bound for 16-bit)
    flops: int             # forward + backward FLOPs of one step

    def total_bytes(self, models: int = 1) -> int:
        """``models`` copies of weights + grads + Adam's two moments (4 x 4 bytes per
        parameter), and for the one step running at a time its saved activations and as
        much again for the activation gradients of backward."""
        return 16 * self.parameters * models + 2 * self.saved_fp32_bytes


def estimate(kind: str, sizes: Sizes) -> Estimate:
    """Parameter count, fp32 saved bytes and FLOPs of one step, computed on the meta device."""
    model, x, y = build(kind, sizes, "meta")
    with SavedTensorsMeter(model) as meter:
        loss = F.cross_entropy(model(x), y)
    del loss
    return Estimate(parameters=sum(p.numel() for p in model.parameters()),
                    saved_fp32_bytes=meter.result.activation_bytes, flops=step_flops(model, x, y))


def check_fits(need_bytes: int, free_bytes: int | None, what: str, hint: str) -> None:
    """Raise :class:`BenchMemoryError` when ``need_bytes`` exceeds 80% of ``free_bytes``."""
    if free_bytes is not None and need_bytes > 0.8 * free_bytes:
        raise BenchMemoryError(
            f"{what} needs about {need_bytes / GiB:.1f} GiB (weights, gradients and Adam state of "
            f"one model copy per precision, and one step's activations) but only "
            f"{free_bytes / GiB:.1f} GiB is free. "
            f"Use smaller sizes: {hint}.")


def _smaller(sizes: Sizes, est: Estimate, need: int, free: int | None) -> str:
    """A flag that would fit: a smaller width where weights dominate, else a smaller batch."""
    share = 0.7 * (free or need) / need  # a little below the 80% check
    if 16 * est.parameters > 2 * est.saved_fp32_bytes:
        return f"e.g. --width {max(8, int(sizes.width * min(1.0, share) ** 0.5))}"
    batch = int(sizes.batch * min(1.0, share))
    if batch < 1:
        return "--batch 1 and a shorter --seq (attention grows with its square)" if sizes.seq > 1 else \
            "--batch 1 and a smaller --width"
    return f"e.g. --batch {batch}"


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def make_step(model, precision: str, x, y, lr: float = 1e-3):
    """One training step in ``precision``: the card's recipe and nothing else in the timed region.

    Same order as :class:`amp_lessons.training.Trainer`, without its per-step bookkeeping
    (gradient norms, zero counts, history), which would be timed too.
    """
    name = parse_precision(precision)
    device_type = x.device.type
    dtype, use_amp = dtype_of(name), uses_autocast(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device_type, enabled=needs_scaler(name))

    def step():
        with float32_matmul_precision(name):
            with torch.autocast(device_type, dtype=dtype, enabled=use_amp):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

    return step


@dataclass
class Row:
    """One precision of one model. ``status``: ok, unsupported, out of memory, error."""

    model: str
    precision: str
    status: str
    reason: str | None = None
    ms: float | None = None
    spread: float | None = None
    speedup: float | None = None
    activation_mb: float | None = None
    activation_ratio: float | None = None
    weight_copy_mb: float | None = None
    tflops: float | None = None
    peak_mb: float | None = None


@dataclass
class MatmulRow:
    n: int
    precision: str
    gflops: float | None
    reason: str | None = None


@dataclass
class BenchResult:
    """What ``bench`` measured: rows per model and precision, the matmul block, the device."""

    device: str
    device_line: str
    sizes: dict[str, dict]
    rows: list[Row] = field(default_factory=list)
    matmul: list[MatmulRow] = field(default_factory=list)

    def row(self, model: str, precision: str) -> Row:
        for r in self.rows:
            if r.model == model and r.precision == parse_precision(precision):
                return r
        raise KeyError(f"no row for {model} {precision}")

    def as_dict(self) -> dict:
        return {"device": self.device, "device_line": self.device_line, "sizes": self.sizes,
                "rows": [asdict(r) for r in self.rows], "matmul": [asdict(m) for m in self.matmul],
                "note": self.noise_note()}

    def noise_note(self, limit: float = 0.25) -> str | None:
        """A warning when the middle half of some step's repeats spreads over more than
        ``limit`` of their median (see :attr:`amp_lessons.measure.Timing.spread`)."""
        spreads = [r.spread for r in self.rows if r.spread is not None]
        if not spreads or max(spreads) <= limit:
            return None
        hint = (" (on a busy CPU, --threads 1 can help)"
                if self.device.startswith("cpu") and torch.get_num_threads() > 1 else "")
        return (f"note: step times varied by {max(spreads):.0%} of their median between repeats: "
                f"something else is using this machine. Read the ratios from a quieter run{hint}.")

    def table(self) -> str:
        """The rows, the matmul block and the device line, as aligned text."""
        out = [self.device_line, ""]
        head = (f"{'model':<12} {'precision':<12} {'ms/step':>8} {'speedup':>8} {'act MB':>8} "
                f"{'act ratio':>9} {'w-copy MB':>9} {'TFLOP/s':>8}")
        if any(r.peak_mb is not None for r in self.rows):
            head += f" {'peak MB':>8}"
        out.append(head)
        for r in self.rows:
            label = r.precision + (" +scaler" if r.precision == "fp16" else "")
            if r.status != "ok":
                out.append(f"{r.model:<12} {label:<12} {r.status}: {r.reason}")
                continue
            line = (f"{r.model:<12} {label:<12} {r.ms:8.1f} {_x(r.speedup):>8} {r.activation_mb:8.2f} "
                    f"{_num(r.activation_ratio, '.2f'):>9} {r.weight_copy_mb:9.2f} {_num(r.tflops, '.3g'):>8}")
            if r.peak_mb is not None:
                line += f" {r.peak_mb:8.1f}"
            out.append(line)
        note = self.noise_note()
        if note:
            out += ["", note]
        if self.matmul:
            sizes = sorted({m.n for m in self.matmul})
            out += ["", "matmul GFLOP/s (n x n @ n x n): " + "  ".join(f"n={n}" for n in sizes)]
            for p in dict.fromkeys(m.precision for m in self.matmul):
                cells = {m.n: m for m in self.matmul if m.precision == p}
                first = next(iter(cells.values()))
                if first.gflops is None:
                    out.append(f"  {p:<6} {first.reason}")
                else:
                    out.append(f"  {p:<6} " + "  ".join(f"{cells[n].gflops:>{len(str(n)) + 2}.0f}" for n in sizes))
        return "\n".join(out)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _num(v, fmt) -> str:
    return "-" if v is None else format(v, fmt)


def device_line(device) -> str:
    """One line naming the device and what decides its 16-bit speed (ISA, AMX; GPU capability)."""
    r = hardware_report(device)
    if torch.device(device).type == "cuda":
        cc = "{}.{}".format(*r.cuda_capability)
        return (f"device {r.device}: {r.name} (compute capability {cc}), bf16 "
                f"{'native' if r.bf16_native else 'emulated'}, TF32 {'yes' if r.tf32_hardware else 'no'}, "
                f"torch {r.torch_version}")
    threads = torch.get_num_threads()
    return (f"device {r.device}: {r.cpu_name}, {threads} thread{'' if threads == 1 else 's'}, ISA {r.cpu_isa}, "
            f"AVX512-BF16 {'yes' if r.avx512_bf16 else 'no'}, AMX {'yes' if r.amx_bf16 else 'no'}, "
            f"torch {r.torch_version}")


def _progress_bar(total: int, progress, desc: str = "bench"):
    from .progress import bar

    return bar(total, desc, progress)


def run_bench(models=MODELS, precisions=PRECISIONS, device=None, sizes: dict | None = None,
              warmup: int = 2, repeats: int = 7, matmul_sizes=None, progress=None) -> BenchResult:
    """Measure every precision in ``precisions`` on ``device`` for each model in ``models``.

    A precision this device cannot run gets a row with ``status="unsupported"`` and the
    reason; the others still run. Sizes that cannot fit raise :class:`BenchMemoryError`
    before anything is allocated; an out-of-memory during a run marks that row.
    ``matmul_sizes=()`` skips the matmul block.
    """
    dev = pick_device(device)
    names = list(dict.fromkeys(parse_precision(p) for p in precisions))
    for kind in models:
        if kind not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}; got {kind!r}")
    why_not = supported_precisions(dev)
    runnable = [p for p in names if why_not[p] is None]
    sizes = {kind: (sizes or {}).get(kind) or default_sizes(kind, dev) for kind in models}
    estimates = {kind: estimate(kind, sizes[kind]) for kind in models}
    free = available_memory(dev)
    for kind in models:
        s, est = sizes[kind], estimates[kind]
        need = est.total_bytes(max(1, len(runnable)))
        check_fits(need, free, f"the {kind} at width {s.width}, depth {s.depth}, batch {s.batch}"
                   + (f", seq {s.seq}" if kind == "transformer" else ""), _smaller(s, est, need, free))
    if matmul_sizes is None:
        matmul_sizes = MATMUL_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    result = BenchResult(device=str(dev), device_line=device_line(dev),
                         sizes={k: asdict(v) for k, v in sizes.items()})
    bar = _progress_bar(len(models) * (repeats + len(runnable)) + len(matmul_sizes) * len(runnable), progress)
    try:
        for kind in models:
            result.rows += _bench_model(kind, sizes[kind], estimates[kind], names, why_not, dev,
                                        warmup, repeats, bar)
        for p in names:
            for n in matmul_sizes:
                result.matmul.append(_matmul_row(n, p, why_not[p], dev))
                if bar is not None and why_not[p] is None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return result


def _bench_model(kind, sizes, est, names, why_not, dev, warmup, repeats, bar) -> list[Row]:
    rows = {p: Row(kind, p, "unsupported", why_not[p]) for p in names if why_not[p] is not None}
    runnable = [p for p in names if why_not[p] is None]
    try:
        base, x, y = build(kind, sizes, dev)
    except (MemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        raise BenchMemoryError(f"the {kind} at width {sizes.width}, depth {sizes.depth}, batch "
                               f"{sizes.batch} does not fit on {dev}: use smaller --batch or --width") from err
    models, steps = {}, {}
    for p in runnable:
        try:
            models[p] = copy.deepcopy(base)
            mem = saved_memory(models[p], x, y, p)
            steps[p] = make_step(models[p], p, x, y)
            rows[p] = Row(kind, p, "ok", activation_mb=mem.activation_bytes / MB,
                          weight_copy_mb=mem.weight_copy_bytes / MB)
        except Exception as err:  # one precision failing must not stop the others
            rows[p] = _failed(kind, p, err, dev)
            models.pop(p, None)
        if bar is not None:
            bar.update(1)
    try:
        timings = time_interleaved(steps, dev, warmup=warmup, repeats=repeats,
                                   on_round=(lambda: bar.update(1)) if bar is not None else None)
    except Exception as err:
        failed = _failed(kind, "?", err, dev)
        return [Row(kind, p, failed.status, failed.reason) if p in steps else rows[p] for p in names]
    for p, timing in timings.items():
        rows[p].ms = timing.median_ms
        rows[p].spread = timing.spread
        rows[p].tflops = est.flops / (timing.median_ms * 1e-3) / 1e12
        peak = cuda_peak_memory(steps[p], dev)
        rows[p].peak_mb = None if peak is None else peak.added_mb
    fp32 = rows.get("fp32")
    if fp32 is not None and fp32.status == "ok":
        for r in rows.values():
            if r.status == "ok":
                r.speedup = fp32.ms / r.ms
                r.activation_ratio = r.activation_mb / fp32.activation_mb
    return [rows[p] for p in names]


def _failed(kind, precision, err, dev) -> Row:
    if _is_oom(err):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return Row(kind, precision, "out of memory",
                   f"{type(err).__name__}: the step did not fit on {dev}; use smaller --batch or --width")
    first = str(err).splitlines()[0] if str(err) else ""
    return Row(kind, precision, "error", f"{type(err).__name__}: {first}")


def _matmul_row(n, precision, why_not, dev) -> MatmulRow:
    if why_not is not None:
        return MatmulRow(n, precision, None, why_not)
    try:
        return MatmulRow(n, precision, matmul_gflops(n, precision, dev))
    except Exception as err:
        return MatmulRow(n, precision, None, _failed("matmul", precision, err, dev).reason)


# -- command line ------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register ``bench`` on the ``python -m amp_lessons`` command line."""
    p = subparsers.add_parser("bench", help="fp32 / tf32 / bf16 / fp16 side by side on this device")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1")
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which model (default both)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="comma-separated precisions (default: all; those this device cannot run are named)")
    p.add_argument("--width", type=int, help="MLP hidden width / transformer dim")
    p.add_argument("--depth", type=int, help="MLP hidden layers / transformer blocks")
    p.add_argument("--batch", type=int, help="batch size")
    p.add_argument("--seq", type=int, help="transformer tokens per example")
    p.add_argument("--heads", type=int, help="transformer attention heads")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per precision (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per precision; the median is reported")
    p.add_argument("--matmul-sizes", default=None,
                   help="comma-separated n for the matmul block (default per device; 'none' skips it)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice); fewer can be faster on a busy machine")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_run)


def _ints(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--matmul-sizes must be comma-separated integers or 'none'; got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"--matmul-sizes must be positive; got {text!r}")
    return values


def _run(args) -> int:
    result = result_from_args(args)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


def result_from_args(args) -> BenchResult:
    """Run the bench as the parsed ``bench`` command line asks (used by benchmarks/ too)."""
    dev = pick_device(args.device)
    models = MODELS if args.model == "both" else (args.model,)
    sizes = {}
    for kind in models:
        base = default_sizes(kind, dev)
        changes = {k: getattr(args, k) for k in ("width", "depth", "batch", "seq", "heads")
                   if getattr(args, k) is not None}
        for k, v in changes.items():
            if v <= 0:
                raise ValueError(f"--{k} must be a positive integer; got {v}")
        sizes[kind] = Sizes(**{**asdict(base), **changes})
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError("--warmup must be >= 0 and --repeats >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be a positive integer; got {args.threads}")
        torch.set_num_threads(args.threads)
    precisions = [p for p in args.precisions.split(",") if p.strip()]
    matmul_sizes = None if args.matmul_sizes is None else _ints(args.matmul_sizes)
    return run_bench(models, precisions, dev, sizes, args.warmup, args.repeats, matmul_sizes)


# -- verdicts: the card's claims against what was measured ---------------------------------

CARD_SPEEDUP = (2.0, 3.0)  # "2-3x faster training ... on modern GPUs"


def speed_verdict(speedup: float, precision: str) -> str:
    """One sentence on a measured speed ratio (``fp32 time / precision time``)."""
    if speedup >= CARD_SPEEDUP[0]:
        return f"{precision} ran {speedup:.1f}x as fast as fp32 here: the card's 2-3x holds."
    if speedup >= 1.1:
        return f"{precision} ran {speedup:.2f}x as fast as fp32 here: faster, but short of the card's 2-3x."
    if speedup > 0.9:
        return f"{precision} ran {speedup:.2f}x as fast as fp32 here: no real speedup (within 10%)."
    return f"{precision} ran {speedup:.2f}x as fast as fp32 here: slower than fp32, not 2-3x faster."


def memory_verdict(ratio: float, precision: str) -> str:
    """One sentence on a measured activation-memory ratio (``precision bytes / fp32 bytes``)."""
    if 0.45 <= ratio <= 0.55:
        return f"{precision} keeps {ratio:.2f} of fp32's activation bytes: the card's 'half the memory' holds."
    if ratio < 1:
        return f"{precision} keeps {ratio:.2f} of fp32's activation bytes: less, but not half."
    return f"{precision} keeps {ratio:.2f} of fp32's activation bytes: no saving."


def speed_reasons(result: BenchResult, precision: str, step_rates: dict | None = None) -> list[str]:
    """Why ``precision`` is as fast as measured on this device, read from the measurements.

    Names the hardware (tensor cores, AMX), the matmul rate of the precision against
    fp32's, and for each fp32 training step (the bench's rows, plus ``step_rates``: label
    -> achieved GFLOP/s) whether it was big enough to be limited by matmul speed at all.
    """
    name = parse_precision(precision)
    dev = torch.device(result.device)
    reasons = []
    r = hardware_report(dev)
    if dev.type == "cpu":
        if r.amx_bf16:
            reasons.append("a CPU has no tensor cores; this one has AMX tile units, which speed up bf16 matmuls")
        elif r.avx512_bf16:
            reasons.append("a CPU has no tensor cores and this one has no AMX tile units; its AVX512-BF16 "
                           "instructions run bf16 dot products on the ordinary vector units")
        else:
            reasons.append("a CPU has no tensor cores, and this one has neither AMX nor AVX512-BF16: "
                           "16-bit math is converted to float32 and back, in software")
    elif dev.type == "cuda":
        cc = r.cuda_capability
        if cc < (7, 0):
            reasons.append(f"this GPU (compute capability {cc[0]}.{cc[1]}) has no tensor cores")
        elif name == "bf16" and not r.bf16_native:
            reasons.append("this GPU only emulates bf16 (pre-Ampere): use fp16 + GradScaler here")
        else:
            reasons.append(f"this GPU (compute capability {cc[0]}.{cc[1]}) has tensor cores for {name}")
    mm = {(m.n, m.precision): m.gflops for m in result.matmul if m.gflops}
    if mm:
        n = max(k[0] for k in mm)
        if (n, name) in mm and (n, "fp32") in mm:
            ratio = mm[n, name] / mm[n, "fp32"]
            reasons.append(f"an n={n} matmul ran at {mm[n, name]:.0f} GFLOP/s in {name} and "
                           f"{mm[n, 'fp32']:.0f} in fp32 ({ratio:.2f}x)")
        peak = max((v for (_, p), v in mm.items() if p == "fp32"), default=None)
        rates = {f"the bench {row.model}": row.tflops * 1e3 for row in result.rows
                 if row.precision == "fp32" and row.tflops}
        rates.update(step_rates or {})
        for label, rate in rates.items() if peak else ():
            share = rate / peak
            if share < 0.3:
                reasons.append(f"{label}'s fp32 step reached only {share:.0%} of fp32's matmul rate: time "
                               "goes to small kernels, elementwise ops, casts and the optimizer, which "
                               "16-bit does not speed up (too small to be compute-bound)")
            else:
                reasons.append(f"{label}'s fp32 step reached {share:.0%} of fp32's matmul rate: big enough "
                               "for the matmul speed to show")
    return reasons


# -- lesson 05: one model trained in every precision, side by side --------------------------


@dataclass
class Run:
    """One precision's training run through :class:`~amp_lessons.training.Trainer`."""

    precision: str
    accuracy: float
    losses: list[float]
    ms: float                 # median ms per optimizer step (after the first few)
    activation_mb: float      # saved for backward by one batch
    weight_copy_mb: float     # autocast's 16-bit weight copies, counted apart
    skipped: int              # steps GradScaler skipped
    gflops: float = 0.0       # achieved GFLOP/s of the median step (matmul work only)
    trainer: object = field(repr=False, default=None)


@dataclass
class SideBySide:
    """The runs of :func:`train_side_by_side`, keyed by precision."""

    runs: dict[str, Run]
    device: str

    def speedup(self, precision: str) -> float:
        return self.runs["fp32"].ms / self.runs[parse_precision(precision)].ms

    def memory_ratio(self, precision: str) -> float:
        return self.runs[parse_precision(precision)].activation_mb / self.runs["fp32"].activation_mb

    def quality_table(self) -> str:
        """Accuracy, final loss, skipped steps and activation memory: the stable columns."""
        lines = [f"{'precision':<13}{'accuracy':>9}{'final loss':>11}{'skipped':>8}"
                 f"{'act MB':>9}{'vs fp32':>8}{'w-copy MB':>10}"]
        for p, r in self.runs.items():
            label = p + (" +scaler" if needs_scaler(p) else "")
            lines.append(f"{label:<13}{r.accuracy:>9.2f}{r.losses[-1]:>11.2f}{r.skipped:>8}"
                         f"{r.activation_mb:>9.3f}{self.memory_ratio(p):>8.2f}{r.weight_copy_mb:>10.3f}")
        return "\n".join(lines)

    def speed_table(self) -> str:
        """Median ms per step and the speed ratio to fp32: these change from run to run."""
        lines = [f"{'precision':<13}{'ms/step':>9}{'speed vs fp32':>15}{'GFLOP/s':>9}"]
        for p, r in self.runs.items():
            label = p + (" +scaler" if needs_scaler(p) else "")
            lines.append(f"{label:<13}{r.ms:>9.2f}{self.speedup(p):>14.2f}x{r.gflops:>9.1f}")
        return "\n".join(lines)


def train_side_by_side(make_model, data, precisions=None, steps: int = 200, device=None,
                       progress=None, **trainer_kwargs) -> SideBySide:
    """Train ``make_model()`` on ``data`` in each precision this device runs, step by step in turn.

    Every precision starts from the same weights (``make_model`` is called after the same
    seed) and sees the same batches. The runs advance one optimizer step each in turn, so
    their step times share the machine's drift. ``trainer_kwargs`` go to every
    :class:`~amp_lessons.training.Trainer` (lr, batch_size, optimizer, seed, ...).
    """
    from .seeding import seed_everything
    from .training import Trainer

    dev = pick_device(device)
    why_not = supported_precisions(dev)
    names = [p for p in (precisions or PRECISIONS) if why_not[parse_precision(p)] is None]
    names = list(dict.fromkeys(parse_precision(p) for p in names))
    if "fp32" not in names:
        names.insert(0, "fp32")
    seed = trainer_kwargs.get("seed", 0)
    trainers = {}
    for p in names:
        seed_everything(seed)
        trainers[p] = Trainer(make_model(), data, precision=p, device=dev, progress=False, **trainer_kwargs)
    bar = _progress_bar(steps * len(names), progress, desc="side by side")
    try:
        for _ in range(steps):
            for p, t in trainers.items():
                with float32_matmul_precision(p):
                    t.step()
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    runs = {}
    for p, t in trainers.items():
        x, y = data.batch(0, t.batch_size, t.seed)
        mem = saved_memory(t.model, x.to(dev), y.to(dev), p)
        ms = float(torch.tensor(t.history["ms"][min(5, steps - 1):]).median())
        gflops = step_flops(t.model, x, y) / (ms * 1e-3) / 1e9
        runs[p] = Run(p, t.evaluate(), t.history["loss"], ms, mem.activation_bytes / MB,
                      mem.weight_copy_bytes / MB, t.history.skipped, gflops, t)
    return SideBySide(runs, str(dev))
