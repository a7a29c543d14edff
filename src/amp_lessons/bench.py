"""The measurements of ``python -m amp_lessons bench``: every precision this device runs,
side by side, and where a mixed-precision step's time goes. The command line and the
tables it prints are :mod:`amp_lessons.benchcli`'s.

One model and batch per row block (an MLP and a transformer stack), trained for a few
steps in fp32, tf32, bf16 and fp16 + GradScaler in one process, with the timed steps
interleaved so that all precisions share the machine's drift. Per precision: median
ms/step, speedup against fp32, activation memory saved for backward (and its ratio to
fp32), the 16-bit weight copies apart, achieved TFLOP/s, and on CUDA the step's peak
memory. A matmul block shows achieved GFLOP/s per dtype and size (the best of its repeats:
what the kernel can reach); its best size is the device's measured *peak* in that
precision, which is *why* a precision is fast or slow here. Steps are read as medians, so
on a busy machine a step's fraction of that peak reads low.

Sizes (``--size``): ``small`` is quick everywhere; ``large`` makes the matmuls most of an
fp32 step on this device type (a CPU, or a GPU); ``default`` runs the MLP at its large
size, so that every run includes a matmul-bound step, and the transformer at its small
size, so that the run stays quick. Every
configuration is estimated before it is built (parameters, bytes, FLOPs on the meta
device, extrapolated in depth): sizes that cannot fit the free memory, or whose fp32
step would take longer than ``--max-step-seconds`` at the measured matmul rate, are
refused with a size that would fit; a precision too slow for that limit is skipped and
says why.

``--breakdown`` profiles one Trainer step per precision (:mod:`amp_lessons.breakdown`:
forward and backward matmuls, the rest of each, autocast casts, optimizer, bookkeeping,
data), sets the step's matmul FLOP/s against the measured peak, bounds the speedup with
Amdahl's law, and times the changes that close part of the gap side by side.

Performance is read as ratios within one run, never as absolute thresholds.
Used in 05_putting_it_together (:func:`train_side_by_side`, :func:`run_bench`,
:func:`speed_reasons`) and by ``bench``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.nn import functional as F

from . import breakdown as bd
from .claims import measured
from .data import Dataset
from .hardware import Machine, is_x86, resolve_machine
from .measure import (
    MiB,
    SavedTensorsMeter,
    available_memory,
    cuda_peak_memory,
    matmul_flops,
    matmul_gflops,
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
from .progress import bar as progress_bar
from .seeding import rng_state, seed_everything, set_rng_state
from .training import Trainer

MODELS = ("mlp", "transformer")
SIZE_CHOICES = ("default", "small", "large")
GiB = 2**30
CLASSES = 10
MAX_STEP_SECONDS = 2.0    # a precision whose estimated step is slower is skipped, and says why
MAX_MATMUL_SECONDS = 3.0  # the same for one size of the matmul block (all its repeats)
TOO_LARGE = 2**63         # an estimate's figures when torch cannot even describe the tensors


@dataclass(frozen=True)
class Sizes:
    """Model and batch sizes: ``width`` is the MLP's hidden width and the transformer's dim."""

    width: int
    depth: int
    batch: int
    seq: int = 1
    heads: int = 4


# small: quick on any device. large: matmuls are most of an fp32 step on that kind of
# device (measured: benchmarks/README.md).
SIZES = {
    "cpu": {
        "small": {"mlp": Sizes(width=512, depth=4, batch=128),
                  "transformer": Sizes(width=128, depth=2, batch=8, seq=64)},
        "large": {"mlp": Sizes(width=1024, depth=4, batch=512),
                  "transformer": Sizes(width=256, depth=2, batch=16, seq=128)},
    },
    "cuda": {
        "small": {"mlp": Sizes(width=1024, depth=4, batch=1024),
                  "transformer": Sizes(width=512, depth=2, batch=16, seq=256, heads=8)},
        "large": {"mlp": Sizes(width=4096, depth=8, batch=4096),
                  "transformer": Sizes(width=1024, depth=4, batch=16, seq=512, heads=16)},
    },
}
DEFAULT_SIZE = {"mlp": "large", "transformer": "small"}  # --size default: a matmul-bound MLP, quickly
MATMUL_SIZES = {"cpu": (128, 256, 512, 1024), "cuda": (1024, 2048, 4096, 8192)}


class BenchMemoryError(RuntimeError):
    """The requested sizes do not fit this device's free memory."""


class BenchTooSlowError(RuntimeError):
    """The requested sizes would take too long per step on this device."""


def _table(device) -> dict:
    return SIZES["cuda"] if torch.device(device).type == "cuda" else SIZES["cpu"]


def default_sizes(kind: str, device, size: str = "default") -> Sizes:
    """The sizes ``bench`` uses for ``kind`` on ``device`` at ``--size size``, when no flag overrides them."""
    if kind not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {kind!r}")
    if size not in SIZE_CHOICES:
        raise ValueError(f"size must be one of {', '.join(SIZE_CHOICES)}; got {size!r}")
    return _table(device)[DEFAULT_SIZE[kind] if size == "default" else size][kind]


def validate_sizes(kind: str, sizes: Sizes) -> None:
    """Raise ``ValueError`` (saying what to pass) for sizes no model can be built with."""
    for name in ("width", "depth", "batch", "seq", "heads"):
        value = getattr(sizes, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--{name} must be a positive integer; got {value!r}")
    if kind == "transformer" and sizes.width % sizes.heads:
        raise ValueError(f"the transformer's --width ({sizes.width}) must be a multiple of --heads "
                         f"({sizes.heads}); e.g. --width {max(sizes.heads, sizes.width - sizes.width % sizes.heads)}")


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
    x, y = inputs(kind, sizes, device, g)
    return model, x, y


def inputs(kind: str, sizes: Sizes, device, generator=None, rows: int | None = None):
    """Random inputs and labels for ``kind``: ``rows`` examples (default ``sizes.batch``)."""
    device = torch.device(device)
    rows = sizes.batch if rows is None else rows
    shape = (rows, sizes.width) if kind == "mlp" else (rows, sizes.seq, sizes.width)
    if device.type == "meta":
        return torch.empty(shape, device=device), torch.empty(rows, dtype=torch.long, device=device)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).to(device), torch.randint(0, CLASSES, (rows,), generator=g).to(device)


@dataclass(frozen=True)
class Estimate:
    """Bytes and work of one training step, estimated on the meta device (nothing is allocated)."""

    parameters: int        # parameter count
    saved_fp32_bytes: int  # bytes saved for backward in fp32 (an upper bound for 16-bit)
    flops: int             # forward + backward FLOPs of one step (matmul work)

    def total_bytes(self, models: int = 1) -> int:
        """``models`` copies of weights + grads + Adam's two moments (4 x 4 bytes per
        parameter), and for the one step running at a time its saved activations and as
        much again for the activation gradients of backward."""
        return 16 * self.parameters * models + 2 * self.saved_fp32_bytes

    def step_seconds(self, gflops: float) -> float:
        """The step's matmul work alone at ``gflops``: a lower bound of its time."""
        return self.flops / (gflops * 1e9)


def _estimate_meta(kind: str, sizes: Sizes) -> Estimate:
    model, x, y = build(kind, sizes, "meta")
    with SavedTensorsMeter(model) as meter:
        loss = F.cross_entropy(model(x), y)
    del loss
    return Estimate(parameters=sum(p.numel() for p in model.parameters()),
                    saved_fp32_bytes=meter.result.activation_bytes, flops=step_flops(model, x, y))


def estimate(kind: str, sizes: Sizes) -> Estimate:
    """Parameter count, fp32 saved bytes and FLOPs of one step, without building the model.

    Measured on the meta device at depth 1 and 2 and extrapolated: every layer (block)
    adds the same, so the cost does not grow with ``depth`` (``--depth 1000000`` is
    answered at once).
    """
    validate_sizes(kind, sizes)
    try:
        one = _estimate_meta(kind, replace(sizes, depth=1))
        two = one if sizes.depth == 1 else _estimate_meta(kind, replace(sizes, depth=2))
    except RuntimeError as err:  # a tensor too large for torch to describe at all
        if "overflow" not in str(err).lower():
            raise
        return Estimate(TOO_LARGE, TOO_LARGE, TOO_LARGE)
    if sizes.depth == 1:
        return one
    k = sizes.depth - 1
    return Estimate(*(a + k * (b - a) for a, b in zip(asdict(one).values(), asdict(two).values())))


def check_fits(need_bytes: int, free_bytes: int | None, what: str, hint: str) -> None:
    """Raise :class:`BenchMemoryError` when ``need_bytes`` exceeds 80% of ``free_bytes``."""
    if need_bytes >= TOO_LARGE:
        raise BenchMemoryError(f"{what} holds tensors larger than torch can describe (over 2^63 "
                               f"bytes). Use smaller sizes: {hint}.")
    if free_bytes is not None and need_bytes > 0.8 * free_bytes:
        raise BenchMemoryError(
            f"{what} needs about {need_bytes / GiB:,.1f} GiB (weights, gradients and Adam state of "
            f"every model copy the bench keeps, and one step's activations) but only "
            f"{free_bytes / GiB:.1f} GiB is free. Use smaller sizes: {hint}.")


def describe(kind: str, sizes: Sizes) -> str:
    """``the mlp at width 1024, depth 4, batch 512`` (and seq for the transformer)."""
    return (f"the {kind} at width {sizes.width}, depth {sizes.depth}, batch {sizes.batch}"
            + (f", seq {sizes.seq}" if kind == "transformer" else ""))


def _dims(kind: str) -> tuple[str, ...]:
    return ("batch", "width", "depth", "seq") if kind == "transformer" else ("batch", "width", "depth")


def suggest(kind: str, sizes: Sizes, fits, prefer=()) -> str:
    """A flag that would fit: the largest value of one size that makes ``fits(sizes)`` true,
    trying the sizes in ``prefer`` first (those the caller raised), then batch, width, depth, seq."""
    order = list(dict.fromkeys([*prefer, *_dims(kind)]))
    step = {"width": sizes.heads if kind == "transformer" else 1}
    for dim in order:
        unit = step.get(dim, 1)
        cur = getattr(sizes, dim) // unit
        if cur <= 1 or not fits(replace(sizes, **{dim: unit})):
            continue
        lo, hi = 1, cur - 1
        while lo < hi:  # largest value that fits
            mid = (lo + hi + 1) // 2
            if fits(replace(sizes, **{dim: mid * unit})):
                lo = mid
            else:
                hi = mid - 1
        return f"e.g. --{dim} {lo * unit}"
    return "--batch 1 and smaller --width and --depth"


def _raised(kind: str, sizes: Sizes, device) -> list[str]:
    """The sizes set above this device's large defaults, the most raised first."""
    base = SIZES["cuda" if torch.device(device).type == "cuda" else "cpu"]["large"][kind]
    grown = [(getattr(sizes, d) / getattr(base, d), d) for d in _dims(kind) if getattr(sizes, d) > getattr(base, d)]
    return [d for _, d in sorted(grown, reverse=True)]


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
    """One precision of one model. ``status``: ok, unsupported, too slow, out of memory, error."""

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
    """What ``bench`` measured: rows per model and precision, the matmul block, the device,
    and with ``--breakdown`` the step breakdowns and the closing-the-gap tables."""

    device: str
    device_line: str
    sizes: dict[str, dict]
    rows: list[Row] = field(default_factory=list)
    matmul: list[MatmulRow] = field(default_factory=list)
    breakdowns: list[bd.Breakdown] = field(default_factory=list)
    closing: dict[str, bd.Closing] = field(default_factory=dict)
    load: tuple[float, float, float] | None = None
    machine: Machine | None = field(default=None, repr=False, compare=False)  # what ran it; not in as_dict

    def row(self, model: str, precision: str) -> Row:
        for r in self.rows:
            if r.model == model and r.precision == parse_precision(precision):
                return r
        raise KeyError(f"no row for {model} {precision}")

    def peak(self, precision: str) -> tuple[float, int] | None:
        """(GFLOP/s, n): the matmul block's best size in ``precision``, the device's measured peak."""
        rates = [(m.gflops, m.n) for m in self.matmul if m.precision == parse_precision(precision) and m.gflops]
        return max(rates) if rates else None

    def breakdown(self, model: str, precision: str) -> bd.Breakdown | None:
        for b in self.breakdowns:
            if b.model == model and b.precision == parse_precision(precision):
                return b
        return None

    def amdahl(self, model: str, precision: str) -> bd.Amdahl | None:
        """Amdahl's bound for ``precision`` against fp32 on ``model`` (needs ``--breakdown``)."""
        fp32, other = self.breakdown(model, "fp32"), self.breakdown(model, precision)
        return bd.amdahl(fp32, other) if fp32 and other else None

    def as_dict(self) -> dict:
        return {"device": self.device, "device_line": self.device_line, "sizes": self.sizes,
                "rows": [asdict(r) for r in self.rows], "matmul": [asdict(m) for m in self.matmul],
                "peaks": {p: self.peak(p) for p in dict.fromkeys(m.precision for m in self.matmul)},
                "breakdowns": [b.as_dict() for b in self.breakdowns],
                "amdahl": [asdict(a) for a in (self.amdahl(b.model, b.precision) for b in self.breakdowns
                                               if b.precision != "fp32") if a],
                "closing": {k: {"rows": [asdict(r) for r in c.rows], "rounds": c.rounds}
                            for k, c in self.closing.items()},
                "load": self.load, "note": self.noise_note()}

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



def device_line(device) -> str:
    """One line naming the device and what decides its 16-bit speed (ISA, AMX; GPU capability)."""
    m = resolve_machine(device, measure=False)
    if m.type == "cuda":
        cc = "{}.{}".format(*m.cuda_capability)
        return (f"device {m.device}: {m.name} (compute capability {cc}), bf16 "
                f"{'native' if m.bf16_native else 'emulated'}, TF32 {'yes' if m.tf32_hardware else 'no'}, "
                f"torch {torch.__version__}")
    threads = torch.get_num_threads()
    return (f"device {m.device}: {m.cpu_name}, {threads} thread{'' if threads == 1 else 's'}, ISA {m.cpu_isa}, "
            f"AVX512-BF16 {'yes' if m.avx512_bf16 else 'no'}, AMX {'yes' if m.amx_bf16 else 'no'}, "
            f"torch {torch.__version__}")


def _progress_bar(total: int, progress, desc: str = "bench"):
    return progress_bar(total, desc, progress)


def _check_names(models, precisions) -> list[str]:
    for kind in models:
        if kind not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}; got {kind!r}")
    names = list(dict.fromkeys(parse_precision(p) for p in precisions))
    if not names:
        raise ValueError(f"precisions must name at least one of {', '.join(PRECISIONS)}; got none")
    if not models:
        raise ValueError(f"models must name at least one of {', '.join(MODELS)}; got none")
    return names


def run_bench(models=MODELS, precisions=PRECISIONS, device=None, sizes: dict | None = None,
              warmup: int = 2, repeats: int = 7, matmul_sizes=None, progress=None, size: str = "default",
              breakdown: bool = False, compile: bool = False, profile_steps: int = 5,
              max_step_seconds: float = MAX_STEP_SECONDS) -> BenchResult:
    """Measure every precision in ``precisions`` on ``device`` for each model in ``models``.

    A precision this device cannot run gets a row with ``status="unsupported"`` and the
    reason; one whose step would take longer than ``max_step_seconds`` at its measured
    matmul rate, ``"too slow"``; the others still run. Sizes that cannot fit raise
    :class:`BenchMemoryError`, and sizes too slow in every precision
    :class:`BenchTooSlowError`, before anything is allocated, naming a size that would fit;
    an out-of-memory during a run marks that row. ``matmul_sizes=()`` skips the matmul
    block (a quick probe still sets the time estimate). ``breakdown=True`` adds the step
    breakdowns and the closing table (``compile=True``: with a ``torch.compile`` row).
    """
    machine = resolve_machine(device, measure=False)
    dev = machine.device
    names = _check_names(models, precisions)
    why_not = machine.supported()
    runnable = [p for p in names if why_not[p] is None]
    sizes = {kind: (sizes or {}).get(kind) or default_sizes(kind, dev, size) for kind in models}
    changes = (*bd.CHANGES, bd.COMPILE) if compile else bd.CHANGES
    copies = max(1, len(runnable)) * (1 + (len(changes) if breakdown else 0))
    estimates = {kind: estimate(kind, sizes[kind]) for kind in models}
    free = available_memory(dev)
    for kind in models:
        s, est = sizes[kind], estimates[kind]

        def fits_memory(candidate, kind=kind):
            need = estimate(kind, candidate).total_bytes(copies)
            return need < TOO_LARGE and (free is None or need <= 0.8 * free)

        if est.parameters >= TOO_LARGE or not fits_memory(s):
            check_fits(est.total_bytes(copies), free, describe(kind, s),
                       suggest(kind, s, fits_memory, _raised(kind, s, dev)))
    if matmul_sizes is None:
        matmul_sizes = MATMUL_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    result = BenchResult(device=str(dev), device_line=device_line(machine),
                         sizes={k: asdict(v) for k, v in sizes.items()}, load=bd.load_average(), machine=machine)
    for p in names:
        result.matmul += _matmul_rows(matmul_sizes, p, why_not[p], dev)
    rates = {p: _rate(result, p, dev) for p in runnable}
    too_slow = {kind: _too_slow(kind, sizes[kind], estimates[kind], runnable, rates, max_step_seconds, dev)
                for kind in models}
    per_model = repeats + len(runnable) + (len(runnable) * len(changes) + repeats + 1 if breakdown else 0)
    bar = _progress_bar(len(models) * per_model, progress)
    try:
        for kind in models:
            slow = too_slow[kind]
            result.rows += _bench_model(kind, sizes[kind], estimates[kind], names, why_not, slow, dev,
                                        warmup, repeats, bar)
            ok = [p for p in runnable if p not in slow and result.row(kind, p).status == "ok"]
            if breakdown and ok:
                _breakdown(result, kind, sizes[kind], estimates[kind], ok, dev, changes, warmup, repeats,
                           profile_steps, bar)
    finally:
        if bar is not None:
            bar.close()
    return result


def _too_slow(kind, sizes, est, runnable, rates, limit, dev) -> dict[str, str]:
    """The precisions whose step would take longer than ``limit`` seconds, with the reason;
    raises :class:`BenchTooSlowError` (naming a size that would do) when that is all of them."""
    slow = {}
    for p in runnable:
        seconds = est.step_seconds(rates[p]) if rates[p] else 0.0
        if seconds > limit:
            slow[p] = (f"one step is {est.flops:.3g} FLOPs: about {seconds:,.1f} s at the {rates[p]:.3g} "
                       f"GFLOP/s {p} matmuls reach here (limit --max-step-seconds {limit:g})")
    if runnable and len(slow) == len(runnable):
        fastest = max(runnable, key=lambda p: rates[p] or 0.0)

        def fits(candidate):
            return estimate(kind, candidate).step_seconds(rates[fastest]) <= limit

        raise BenchTooSlowError(
            f"{describe(kind, sizes)}: {slow[fastest]}. Use smaller sizes: "
            f"{suggest(kind, sizes, fits, _raised(kind, sizes, dev))}, or raise --max-step-seconds.")
    return slow


def _rate(result, precision, dev) -> float | None:
    """The matmul rate the time estimate uses: the block's peak, or where the block has no
    size as large as a quick probe's (tiny matmuls measure call overhead), the probe's."""
    probe_n = 2048 if dev.type == "cuda" else 256
    peak = result.peak(precision)
    if peak and peak[1] >= probe_n:
        return peak[0]
    try:
        probe = matmul_gflops(probe_n, precision, dev, warmup=1, repeats=2)
    except Exception:
        probe = None
    return max(v for v in (probe, peak[0] if peak else None, 0.0) if v is not None) or None


def _bench_model(kind, sizes, est, names, why_not, slow, dev, warmup, repeats, bar) -> list[Row]:
    rows = {p: Row(kind, p, "unsupported", why_not[p]) for p in names if why_not[p] is not None}
    rows.update({p: Row(kind, p, "too slow", why) for p, why in slow.items()})
    runnable = [p for p in names if why_not[p] is None and p not in slow]
    if not runnable:
        return [rows[p] for p in names]
    base, x, y = _build_or_refuse(kind, sizes, dev)
    for p in slow:  # not timed, but its memory is still measured: cheaply, on one and two examples
        try:
            mem = _memory_by_extrapolation(base, kind, sizes, dev, p)
            rows[p].activation_mb, rows[p].weight_copy_mb = mem.activation_bytes / MiB, mem.weight_copy_bytes / MiB
        except Exception:  # the reason already says why the row did not run
            pass
    models, steps = {}, {}
    for p in runnable:
        try:
            models[p] = copy.deepcopy(base)
            mem = saved_memory(models[p], x, y, p)
            steps[p] = make_step(models[p], p, x, y)
            rows[p] = Row(kind, p, "ok", activation_mb=mem.activation_bytes / MiB,
                          weight_copy_mb=mem.weight_copy_bytes / MiB)
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
    if fp32 is not None and fp32.activation_mb:
        for r in rows.values():
            if r.status == "ok" and fp32.status == "ok":
                r.speedup = fp32.ms / r.ms
            if r.activation_mb is not None:
                r.activation_ratio = r.activation_mb / fp32.activation_mb
    return [rows[p] for p in names]


def _memory_by_extrapolation(model, kind, sizes, dev, precision):
    """:func:`saved_memory` at ``sizes.batch``, from one forward pass on one example and one
    on two: every example adds the same bytes, so the line through them is exact, and a
    precision too slow to train still gets its memory figures."""
    one, two = (saved_memory(model, *inputs(kind, replace(sizes, batch=n), dev), precision) for n in (1, 2))
    per_example = two.activation_bytes - one.activation_bytes
    return replace(one, activation_bytes=one.activation_bytes + (sizes.batch - 1) * per_example)


def _build_or_refuse(kind, sizes, dev):
    try:
        return build(kind, sizes, dev)
    except (MemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        raise BenchMemoryError(f"{describe(kind, sizes)} does not fit on {dev}: use smaller --batch "
                               "or --width") from err


def _breakdown(result, kind, sizes, est, precisions, dev, changes, warmup, repeats, profile_steps, bar):
    """Time the closing changes side by side, then profile the Trainer as the lessons use it."""
    state = rng_state()  # the Trainers seed the global generators: put them back afterwards
    try:
        base, _, _ = _build_or_refuse(kind, sizes, dev)
        x, y = inputs(kind, sizes, dev, torch.Generator().manual_seed(1), rows=2 * sizes.batch)
        data = Dataset(x, y, x[:1], y[:1], name=f"bench {kind}")

        def make(p, change):
            return bd.make_trainer(copy.deepcopy(base), data, p, result.machine or dev, change,
                                   batch_size=sizes.batch)

        tick = (lambda: bar.update(1)) if bar is not None else None
        closing, trainers = bd.closing_runs(make, precisions, dev, changes, warmup, repeats, on_step=tick)
        result.closing[kind] = closing
        first = changes[0].label
        chosen = {p: trainers[p, first] for p in precisions if (p, first) in trainers}
        for p, b in bd.profile_trainers(chosen, steps=profile_steps, warmup=0, model=kind).items():
            b.flops, b.step_ms = est.flops, closing.row(p, first).ms
            peak = result.peak(p)
            if peak:
                b.peak_gflops, b.peak_n = peak
            result.breakdowns.append(b)
        if tick:
            tick()
        del trainers
    finally:
        set_rng_state(state)


def _failed(kind, precision, err, dev) -> Row:
    if _is_oom(err):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return Row(kind, precision, "out of memory",
                   f"{type(err).__name__}: the step did not fit on {dev}; use smaller --batch or --width")
    first = str(err).splitlines()[0] if str(err) else ""
    return Row(kind, precision, "error", f"{type(err).__name__}: {first}")


def _matmul_rows(sizes, precision, why_not, dev, limit: float = MAX_MATMUL_SECONDS) -> list[MatmulRow]:
    """The matmul block for one precision, smallest size first; a size whose repeats would
    take longer than ``limit`` seconds at the rate of the size before it is skipped, saying so."""
    if why_not is not None:
        return [MatmulRow(n, precision, None, why_not) for n in sizes]
    rows, rate = [], None
    for n in sorted(sizes):
        if rate and 7 * matmul_flops(n) / (rate * 1e9) > limit:
            rows.append(MatmulRow(n, precision, None, f"skipped: about {matmul_flops(n) / (rate * 1e9):.1f} s "
                                  f"per call at the {rate:.3g} GFLOP/s measured at a smaller size"))
            continue
        try:
            rate = matmul_gflops(n, precision, dev)
            rows.append(MatmulRow(n, precision, rate))
        except Exception as err:
            rows.append(MatmulRow(n, precision, None, _failed("matmul", precision, err, dev).reason))
    return rows


# -- verdicts: the card's claims against what was measured ---------------------------------

CARD_SPEEDUP = (2.0, 3.0)  # "2-3x faster training ... on modern GPUs"


def speed_verdict(speedup: float | None, precision: str, row: Row | None = None) -> str:
    """One sentence on a measured speed ratio (``fp32 time / precision time``); ``None``
    (a row the bench did not time) says so, with the ``row``'s status and reason where given (05)."""
    if speedup is None:
        if row is not None and row.reason:
            return f"{precision} was not timed here ({row.status}): {row.reason}"
        return f"{precision} was not timed here: the bench's table says why."
    if speedup > CARD_SPEEDUP[1]:
        return f"{precision} ran {speedup:.1f}x as fast as fp32 here: above the card's 2-3x."
    if speedup >= CARD_SPEEDUP[0]:
        return (f"{precision} ran {speedup:.1f}x as fast as fp32 here: within the card's 2-3x "
                "(which the card says of modern GPUs).")
    if speedup >= 1.1:
        return f"{precision} ran {speedup:.2f}x as fast as fp32 here: faster, but short of the card's 2-3x."
    if speedup > 0.9:
        return f"{precision} ran {speedup:.2f}x as fast as fp32 here: no real speedup (within 10%)."
    return f"{precision} ran {speedup:.2f}x as fast as fp32 here: slower than fp32, not 2-3x faster."


def _hardware_reason(r, name: str) -> str:
    """Why ``name`` is fast or slow on the machine ``r`` (a :class:`~amp_lessons.hardware.Machine`)."""
    if r.type == "cuda":
        cc = r.cuda_capability
        if cc < (7, 0):
            return f"this GPU (compute capability {cc[0]}.{cc[1]}) has no tensor cores"
        if name == "bf16" and not r.bf16_native:
            return "this GPU only emulates bf16 (pre-Ampere): use fp16 + GradScaler here"
        if cc >= (8, 0):
            return f"this GPU (compute capability {cc[0]}.{cc[1]}) has tensor cores for {name}"
        # 7.x: a T4 has tensor cores, a GTX 1660 of the same 7.5 has none
        return (f"compute capability {cc[0]}.{cc[1]} does not say whether this GPU has tensor cores: "
                f"the rates below say how fast {name} runs")
    if r.type != "cpu":
        return f"{r.type}: the rates below were measured on it"
    if name == "bf16":
        if not is_x86(r.cpu_arch):
            return (f"a CPU has no tensor cores, and the course does not probe the bf16 instructions of "
                    f"this {r.cpu_arch} CPU (some Arm CPUs have them): the matmul block measures what it does")
        if r.amx_bf16:
            return "a CPU has no tensor cores; this one has AMX tile units for bf16 matmuls"
        if r.avx512_bf16:
            return ("a CPU has no tensor cores and this one has no AMX tile units; its AVX512-BF16 "
                    "instructions run bf16 dot products on the ordinary vector units")
        return ("a CPU has no tensor cores, and this one has neither AMX nor AVX512-BF16: bf16 math "
                "is converted to float32 and back, in software")
    if name == "fp16":
        return ("a CPU has no tensor cores: fp16 matmuls are as fast as the kernel this torch build has "
                "for this CPU, which the matmul block measures")
    return "fp32 is the reference every ratio is taken against"


def _matmul_reason(name, mine, fp32, ratio) -> str:
    text = (f"the best {name} matmul rate here is {mine[0]:.0f} GFLOP/s (n={mine[1]}) against fp32's "
            f"{fp32[0]:.0f} (n={fp32[1]}): {ratio:.2f}x")
    if ratio < 0.2:
        return text + f": this device has no fast {name} matmul kernel, so its {name} matmuls, at the sizes measured, are a slowdown"
    if ratio < 0.9:
        return text + f": {name} matmuls are slower than fp32's here"
    if ratio <= 1.1:
        return text + ": about fp32's speed, so 16-bit matmuls gain nothing here"
    return text + (": a ratio of best sizes, not a ceiling: a step's own matmuls run at their shapes' "
                   "rates, which the breakdown measures")


def _share_reason(label, share, profiled, name, ratio) -> str:
    if profiled:
        text = f"{label}'s fp32 step spends {share:.0%} of its time in matmuls (profiled)"
    else:
        text = (f"{label}'s fp32 step did its matmul work at {share:.0%} of fp32's peak rate, so at peak "
                f"speed its matmuls would be {share:.0%} of its time")
    if ratio is not None and share > 0:
        bound = bd.amdahl_bound(share, ratio)
        if ratio >= 1:
            text += (f"; with only the matmuls {ratio:.2f}x faster, Amdahl's law estimates the step's gain, if nothing else changed, at "
                     f"{bound:.2f}x")
        else:
            text += f"; with the matmuls at {ratio:.2f}x fp32's speed, the step can only lose: {bound:.2f}x"
        if share < 1:
            text += f" (even infinitely fast matmuls: {1 / (1 - share):.2f}x)"
    if not profiled:
        return text + (": a floor on their share, not the share (small matmuls can run far below peak "
                       "and still take most of the step); only a profile measures it")
    if share >= 0.6:
        return text + ": matmul-bound, so the matmul speed shows in the step"
    if share >= 0.3:
        return text + ": the rest of the step (elementwise ops, casts, optimizer) weighs as much"
    return text + (": elementwise ops, casts, the optimizer and bookkeeping dominate; 16 bits speeds up "
                   "the elementwise ops at most (half the bytes), not the optimizer or the bookkeeping")


def speed_reasons(result: BenchResult, precision: str, step_rates: dict | None = None,
                  with_shares: bool = True) -> list[str]:
    """Why ``precision`` is as fast as measured on this device, read from the measurements.

    Names the hardware, the best matmul rate of ``precision`` against fp32's (the matmul
    block's best size), and for each fp32 training step the share of its time that
    matmuls take and the speedup Amdahl's law allows from it. The share is profiled where
    ``result`` has a breakdown; otherwise it is the step's matmul rate over fp32's peak
    (the bench's rows, and ``step_rates``: label -> achieved GFLOP/s of an fp32 step).
    ``with_shares=False`` leaves the per-step lines to :func:`share_reasons`.
    """
    name = parse_precision(precision)
    reasons = [_hardware_reason(result.machine or resolve_machine(result.device, measure=False), name)]
    mine, fp32 = result.peak(name), result.peak("fp32")
    ratio = None
    if mine and fp32 and name != "fp32":
        ratio = mine[0] / fp32[0]
        reasons.append(_matmul_reason(name, mine, fp32, ratio))
    if not fp32 or not with_shares:
        return reasons
    reasons += [_share_reason(label, share, profiled, name, ratio)
                for label, (share, profiled) in _fp32_shares(result, step_rates).items()]
    return reasons


def _fp32_shares(result: BenchResult, step_rates: dict | None) -> dict:
    """label -> (matmul share of that fp32 step, profiled?): see :func:`speed_reasons`."""
    fp32 = result.peak("fp32")
    shares = {}
    if not fp32:
        return shares
    for b in result.breakdowns:
        if b.precision == "fp32" and b.total_ms:
            shares[f"the bench {b.model}"] = (b.matmul_share, True)
    for row in result.rows:
        label = f"the bench {row.model}"
        if row.precision == "fp32" and row.tflops and label not in shares:
            shares[label] = (min(1.0, row.tflops * 1e3 / fp32[0]), False)
    for label, rate in (step_rates or {}).items():
        shares[label] = (min(1.0, rate / fp32[0]), False)
    return shares


def share_reasons(result: BenchResult, precisions, step_rates: dict | None = None,
                  amdahl: bool = True) -> list[str]:
    """Each fp32 step's matmul share once, with (``amdahl=True``) Amdahl's estimate for every
    16-bit precision in ``precisions`` (their best matmul rate against fp32's best), for
    lesson 05, which prints :func:`speed_reasons` per precision with ``with_shares=False``
    and this after (without Amdahl: its breakdown section says it once)."""
    fp32 = result.peak("fp32")
    ratios = {}
    for p in precisions:
        name, mine = parse_precision(p), result.peak(p)
        if name != "fp32" and mine and fp32:
            ratios[name] = mine[0] / fp32[0]
    out = []
    for label, (share, profiled) in _fp32_shares(result, step_rates).items():
        text = _share_reason(label, share, profiled, "fp32", None)
        if amdahl and ratios and share > 0:
            text += ("; Amdahl's law, with only the matmuls at each precision's best-size ratio and "
                     "nothing else changed: " + ", ".join(
                         f"{p} ({r:.2f}x) {bd.amdahl_bound(share, r):.2f}x" for p, r in ratios.items()))
            if share < 1:
                text += f"; infinitely fast matmuls: {1 / (1 - share):.2f}x"
        out.append(text)
    return out


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
        """Accuracy, final loss, skipped steps and activation memory. The memory columns are
        exact byte counts; accuracy and loss come out of float kernels (``≈``, lesson 05)."""
        lines = [f"{'precision':<13}{'accuracy':>9}{'final loss':>11}{'skipped':>8}"
                 f"{'act MiB':>9}{'act ratio':>10}{'w-copy MiB':>11}"]
        for p, r in self.runs.items():
            label = p + (" +scaler" if needs_scaler(p) else "")
            lines.append(f"{label:<13}{measured(r.accuracy, '.2f'):>9}{measured(r.losses[-1], '.2f'):>11}"
                         f"{r.skipped:>8}{r.activation_mb:>9.3f}{self.memory_ratio(p):>10.2f}{r.weight_copy_mb:>11.3f}")
        return "\n".join(lines)

    def speed_table(self) -> str:
        """Median ms per step and the speed ratio to fp32: these change from run to run (``≈``)."""
        lines = [f"{'precision':<13}{'ms/step':>9}{'speed vs fp32':>15}{'GFLOP/s':>9}"]
        for p, r in self.runs.items():
            label = p + (" +scaler" if needs_scaler(p) else "")
            lines.append(f"{label:<13}{measured(r.ms, '.2f'):>9}{measured(self.speedup(p), '.2f') + 'x':>15}"
                         f"{measured(r.gflops, '.1f'):>9}")
        return "\n".join(lines)


def train_side_by_side(make_model, data, precisions=None, steps: int = 200, device=None,
                       progress=None, **trainer_kwargs) -> SideBySide:
    """Train ``make_model()`` on ``data`` in each precision this device runs, step by step in turn.

    Every precision starts from the same weights (``make_model`` is called after the same
    seed) and sees the same batches. The runs advance one optimizer step each in turn, so
    their step times share the machine's drift. ``trainer_kwargs`` go to every
    :class:`~amp_lessons.training.Trainer` (lr, batch_size, optimizer, seed, ...).
    """
    machine = resolve_machine(device, measure=False)
    dev = machine.device
    why_not = machine.supported()
    names = [p for p in (precisions or PRECISIONS) if why_not[parse_precision(p)] is None]
    names = list(dict.fromkeys(parse_precision(p) for p in names))
    if "fp32" not in names:
        names.insert(0, "fp32")
    seed = trainer_kwargs.get("seed", 0)
    trainers = {}
    for p in names:
        seed_everything(seed)
        trainers[p] = Trainer(make_model(), data, precision=p, device=machine, progress=False, **trainer_kwargs)
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
        runs[p] = Run(p, t.evaluate(), t.history["loss"], ms, mem.activation_bytes / MiB,
                      mem.weight_copy_bytes / MiB, t.history.skipped, gflops, t)
    return SideBySide(runs, str(dev))
