"""Where a training step's time goes: one :class:`~amp_lessons.training.Trainer` step split
by op category with ``torch.profiler``, and the changes that close part of the gap.

The card promises 2-3x. A step gains less than its matmuls do because only the matmuls
get faster in 16 bits (Amdahl's law): this module measures how much of a step they are.

:func:`profile_trainers` runs a few steps of each Trainer, taking turns, under
``torch.profiler`` and adds each op's *self* time (its own time, without the ops it
called) to one category:

==================  =====================================================================
category            what lands there
==================  =====================================================================
forward matmuls     the ops in :data:`MATMUL_OPS` (``aten::mm``, ``addmm``, ``bmm``,
                    ``baddbmm``, convolutions, fused attention, oneDNN's linear) and all
                    they call, run by the model's forward or the loss
forward rest        every other op of forward + loss: activations, softmax, layer norm,
                    views, the loss, and the Python between ops
backward matmuls    the same matmul ops run by autograd (``AddmmBackward0``'s two ``mm``)
backward rest       every other op of backward: ``threshold_backward``, bias-gradient
                    sums, ``AccumulateGrad``, autograd's own bookkeeping
autocast casts      ``aten::to`` / ``aten::_to_copy`` (with their ``copy_``) in forward
                    or backward: autocast's 16-bit copies of weights and inputs, and the
                    gradients cast back to float32 (``ToCopyBackward0``)
optimizer           ``Optimizer.step`` and ``Optimizer.zero_grad`` (torch marks both) and
                    the GradScaler's ``scale``, ``unscale_``, ``step`` and ``update``
bookkeeping         whatever else ``Trainer.step`` runs: the exact gradient statistics
                    (zero count, L2 norm), the history record, its one ``tolist`` sync,
                    clipping when it is on, and the Python of the step itself
data                ``Dataset.batch``: drawing and gathering the batch
==================  =====================================================================

A cast inside a matmul's arguments counts as a cast (autocast casts before it
multiplies); anything inside a matmul op counts as matmul. On CUDA the times are the GPU
kernels' (each kernel counts for the op that launched it) and a ninth entry, ``GPU
idle``, holds the rest of the step's wall time, when the GPU waited for Python.

:func:`closing_runs` times the Trainer with one change at a time (the exact statistics
off, foreach or fused AdamW, ``torch.compile``), interleaved step by step in one process,
and reports each as a ratio to the Trainer as the lessons use it.

Used in 05_putting_it_together and by ``python -m amp_lessons bench --breakdown``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .precision import float32_matmul_precision, parse_precision
from .training import Trainer

CATEGORIES = ("forward matmuls", "forward rest", "backward matmuls", "backward rest",
              "autocast casts", "optimizer", "bookkeeping", "data")
IDLE = "GPU idle"

MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::_scaled_mm", "aten::_int_mm",
    "aten::convolution", "aten::_convolution", "aten::convolution_backward",
    "aten::mkldnn_convolution", "aten::cudnn_convolution", "aten::mkldnn_linear",
    "aten::mkldnn_linear_backward", "mkldnn::_linear_pointwise",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
})
CAST_OPS = frozenset({"aten::to", "aten::_to_copy"})

# record_function names this module puts around the parts of a Trainer step
_STEP, _FORWARD, _LOSS, _SCALER, _DATA = (f"amp_lessons::{n}" for n in ("step", "forward", "loss",
                                                                          "scaler", "data"))
_PHASES = {_FORWARD: "forward", _LOSS: "forward", _SCALER: "optimizer", _DATA: "data"}


def _phase_of(name: str) -> str | None:
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    return _PHASES.get(name)


def category(phase: str, cast: bool, matmul: bool) -> str:
    """The category of an op's self time, from the part of the step it ran in (``phase``:
    forward, backward, optimizer, data, bookkeeping) and whether it is, or runs inside, a
    cast or a matmul op."""
    if phase in ("forward", "backward"):
        if cast:
            return "autocast casts"
        return f"{phase} {'matmuls' if matmul else 'rest'}"
    if phase not in ("optimizer", "data", "bookkeeping"):
        raise ValueError(f"phase must be forward, backward, optimizer, data or bookkeeping; got {phase!r}")
    return phase


def _self_us(event, device_time: bool) -> float:
    if not device_time:
        return float(event.self_cpu_time_total)
    return float(getattr(event, "self_device_time_total", None)
                 or getattr(event, "self_cuda_time_total", 0.0))


def split_events(roots, device_time: bool = False) -> dict[str, float]:
    """Milliseconds per category over the event trees under ``roots`` (profiler events
    with ``name``, ``cpu_children`` and self times), walking each tree once."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    stack = [(root, _phase_of(root.name) or "bookkeeping", False, False) for root in roots]
    while stack:
        event, phase, cast, matmul = stack.pop()
        phase = _phase_of(event.name) or phase
        cast = cast or event.name in CAST_OPS
        matmul = matmul or event.name in MATMUL_OPS
        ms[category(phase, cast, matmul)] += _self_us(event, device_time) / 1e3
        stack.extend((child, phase, cast, matmul) for child in event.cpu_children)
    return ms


@dataclass
class Breakdown:
    """One Trainer step of ``model`` in ``precision``, split by category (ms, medians over
    the profiled steps; ``samples`` holds each step's sum of categories and wall time, which
    agree: the categories cover the step). ``step_ms`` is the step without the profiler, timed by the caller
    (``None`` until then); ``flops`` the step's matmul work; ``peak_gflops`` the device's
    best measured matmul rate in this precision, at size ``peak_n``."""

    model: str
    precision: str
    ms: dict[str, float]
    wall_ms: float
    steps: int
    flops: int = 0
    step_ms: float | None = None
    peak_gflops: float | None = None
    peak_n: int | None = None
    device: str = "cpu"
    samples: list[tuple[float, float]] = field(default_factory=list)  # (categories' sum, wall) per step

    @property
    def total_ms(self) -> float:
        """The categories added up: the profiled step as the categories see it."""
        return sum(self.ms.values())

    def share(self, name: str) -> float:
        return self.ms[name] / self.total_ms if self.total_ms else 0.0

    @property
    def matmul_ms(self) -> float:
        return self.ms["forward matmuls"] + self.ms["backward matmuls"]

    @property
    def matmul_share(self) -> float:
        """The matmuls' part of the step: what 16-bit matmul kernels can speed up."""
        return self.matmul_ms / self.total_ms if self.total_ms else 0.0

    @property
    def rest_ms(self) -> float:
        """Everything but the matmuls: the part 16-bit matmul kernels cannot speed up."""
        return self.total_ms - self.matmul_ms

    @property
    def coverage(self) -> float:
        """How much of each profiled step the categories account for: the median over the
        steps of their sum / the step's wall time (1.0: all of it)."""
        return statistics.median(parts / wall for parts, wall in self.samples) if self.samples else 0.0

    @property
    def reference_ms(self) -> float:
        return self.step_ms if self.step_ms else self.total_ms

    @property
    def step_gflops(self) -> float:
        """Matmul FLOPs of the step over the whole step's time (the profiler off, when known)."""
        return self.flops / (self.reference_ms * 1e-3) / 1e9 if self.reference_ms else 0.0

    @property
    def matmul_gflops(self) -> float:
        """Matmul FLOPs over the time spent inside the matmul ops only."""
        return self.flops / (self.matmul_ms * 1e-3) / 1e9 if self.matmul_ms else 0.0

    @property
    def peak_fraction(self) -> float | None:
        """The step's achieved matmul FLOP/s as a fraction of the device's measured peak."""
        return self.step_gflops / self.peak_gflops if self.peak_gflops else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total_ms=self.total_ms, matmul_share=self.matmul_share, rest_ms=self.rest_ms,
                 coverage=self.coverage, step_gflops=self.step_gflops,
                 matmul_gflops=self.matmul_gflops, peak_fraction=self.peak_fraction,
                 shares={k: self.share(k) for k in self.ms})
        return d


@dataclass(frozen=True)
class Amdahl:
    """How fast ``precision``'s step could be against fp32's, from the fp32 step's matmul share.

    - ``share``: fp32's matmul time / fp32's step (profiled);
    - ``matmul_ratio``: the device's best matmul rate in ``precision`` / in fp32 (the
      matmul block's best sizes), and ``bound``, Amdahl's law with it: the step speedup if
      only the matmuls changed, by that ratio: ``1 / ((1 - share) + share / matmul_ratio)``;
    - ``step_matmul_ratio``: fp32's matmul time / ``precision``'s, as they ran in the
      profiled steps (their shapes are not the best sizes), and ``step_bound`` with it;
    - ``free_rest``: the speedup over fp32 if everything but ``precision``'s own matmuls
      were free: fp32's step / those matmuls' time;
    - ``profiled``: fp32's profiled step / ``precision``'s (the same interleaved rounds);
      ``measured``: the same ratio of the steps timed without the profiler.

    ``profiled`` above ``step_bound`` would mean the rest of the step got faster in
    ``precision``; below, that it got slower (autocast's casts add to it).
    """

    precision: str
    share: float
    matmul_ratio: float
    bound: float
    step_matmul_ratio: float | None
    step_bound: float | None
    free_rest: float | None
    profiled: float | None
    measured: float | None

    def line(self) -> str:
        verb = "estimates the step, if nothing else changed, at"
        text = (f"{self.precision} vs fp32: matmuls are {self.share:.0%} of the fp32 step. Amdahl's law: at "
                f"{self.precision}'s peak matmul ratio {self.matmul_ratio:.2f}x (best sizes) it {verb} "
                f"{self.bound:.2f}x")
        if self.step_bound is not None:
            text += (f"; at the {self.step_matmul_ratio:.2f}x its matmuls ran in these steps, "
                     f"{self.step_bound:.2f}x")
        if self.measured is not None:
            text += f". Measured (the closing table's first rows): {self.measured:.2f}x"
        if self.free_rest is not None:
            text += f". If everything but the matmuls were free: {self.free_rest:.2f}x"
        return text + "."


def amdahl_bound(share: float, matmul_ratio: float) -> float:
    """Amdahl's law: the speedup of a step whose fraction ``share`` runs ``matmul_ratio`` times
    faster while the rest stays as it was."""
    if not 0 <= share <= 1 or matmul_ratio <= 0:
        raise ValueError(f"share must be in [0, 1] and matmul_ratio > 0; got {share}, {matmul_ratio}")
    return 1.0 / ((1.0 - share) + share / matmul_ratio)


def amdahl(fp32: Breakdown, other: Breakdown) -> Amdahl | None:
    """:class:`Amdahl` for ``other`` against ``fp32`` (``None`` without both peak rates)."""
    if not (fp32.peak_gflops and other.peak_gflops and fp32.total_ms):
        return None
    ratio = other.peak_gflops / fp32.peak_gflops
    step_ratio = fp32.matmul_ms / other.matmul_ms if other.matmul_ms and fp32.matmul_ms else None
    step_bound = amdahl_bound(fp32.matmul_share, step_ratio) if step_ratio else None
    free = fp32.reference_ms / (other.matmul_ms * other.reference_ms / other.total_ms) \
        if other.matmul_ms else None
    profiled = fp32.total_ms / other.total_ms if other.total_ms else None
    measured = fp32.step_ms / other.step_ms if fp32.step_ms and other.step_ms else None
    return Amdahl(other.precision, fp32.matmul_share, ratio, amdahl_bound(fp32.matmul_share, ratio),
                  step_ratio, step_bound, free, profiled, measured)


# -- profiling a Trainer ------------------------------------------------------------------


class _Range:
    """A ``record_function`` range opened and closed by two separate calls (module hooks)."""

    def __init__(self, name: str):
        self.name, self._open = name, []

    def enter(self, *_):
        rf = torch.autograd.profiler.record_function(self.name)
        rf.__enter__()
        self._open.append(rf)

    def exit(self, *_):
        if self._open:
            self._open.pop().__exit__(None, None, None)


def _marked(fn, name):
    def wrapper(*args, **kwargs):
        with torch.autograd.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


class _MarkedData:
    """The trainer's dataset, with ``batch`` marked as the data phase."""

    def __init__(self, data):
        self._data = data
        self.batch = _marked(data.batch, _DATA)

    def __getattr__(self, name):
        return getattr(self._data, name)


@contextlib.contextmanager
def marked(trainer):
    """Inside: ``trainer``'s forward, loss, GradScaler calls and batch fetches are named
    ranges in a profile. Everything is put back on exit."""
    rng = _Range(_FORWARD)
    handles = [trainer.model.register_forward_pre_hook(rng.enter),
               trainer.model.register_forward_hook(rng.exit)]
    scaler, saved = trainer.scaler, {}
    for name in ("scale", "unscale_", "step", "update"):
        saved[name] = scaler.__dict__.get(name)
        setattr(scaler, name, _marked(getattr(scaler, name), _SCALER))
    loss_fn, data = trainer.loss_fn, trainer.data
    trainer.loss_fn, trainer.data = _marked(loss_fn, _LOSS), _MarkedData(data)
    try:
        yield trainer
    finally:
        trainer.loss_fn, trainer.data = loss_fn, data
        for name, value in saved.items():
            if value is None:
                delattr(scaler, name)
            else:
                setattr(scaler, name, value)
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _quiet_stderr():
    """Some torch builds' profiler (Kineto) writes start/stop lines straight to file
    descriptor 2; a notebook kernel would show them as output. Silence fd 2 meanwhile."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profiler(device_type: str):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    return profile(activities=activities, acc_events=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def profile_trainers(trainers: dict, steps: int = 5, warmup: int = 1, model: str = "model") -> dict:
    """Profile ``steps`` rounds of one step of each trainer in ``trainers`` (label -> Trainer),
    taking turns as the timings do, after ``warmup`` unprofiled rounds. Returns a
    :class:`Breakdown` per label: every category's median over the steps.

    The trainers train on (their steps count), so pass ones made for measuring. The
    profiler adds a little time to every op; ``wall_ms`` is the profiled steps' median
    wall time, which the categories add up to within that overhead.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    if not trainers:
        return {}
    device = next(iter(trainers.values())).device
    cuda = device.type == "cuda"
    walls = {label: [] for label in trainers}
    with contextlib.ExitStack() as stack:
        for t in trainers.values():
            stack.enter_context(marked(t))
        for _ in range(warmup):
            for t in trainers.values():
                with float32_matmul_precision(t.precision):
                    t.step()
        _sync(device)
        prof = _profiler(device.type)
        with _quiet_stderr():
            prof.__enter__()
        try:
            for _ in range(steps):
                for label, t in trainers.items():
                    start = time.perf_counter()
                    with float32_matmul_precision(t.precision), \
                            torch.autograd.profiler.record_function(f"{_STEP}#{label}"):
                        t.step()
                        _sync(device)
                    walls[label].append((time.perf_counter() - start) * 1e3)
        finally:
            with _quiet_stderr():
                prof.__exit__(None, None, None)
    groups = _step_groups(prof.events())
    out = {}
    for label, t in trainers.items():
        per_step = [split_events(g, device_time=cuda) for g in groups.get(label, [])]
        if len(per_step) != steps:
            raise RuntimeError(f"the profile holds {len(per_step)} steps of {label}, not {steps}: was "
                               "another profiler running?")
        if cuda:
            for ms, wall in zip(per_step, walls[label]):
                ms[IDLE] = max(0.0, wall - sum(ms.values()))
        ms = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
        out[label] = Breakdown(model, t.precision, ms, statistics.median(walls[label]), steps,
                               device=str(device),
                               samples=[(sum(s.values()), w) for s, w in zip(per_step, walls[label])])
    return out


def profile_trainer(trainer, steps: int = 5, warmup: int = 1, model: str = "model") -> Breakdown:
    """:func:`profile_trainers` for one trainer."""
    return profile_trainers({trainer.precision: trainer}, steps, warmup, model)[trainer.precision]


def _step_groups(events) -> dict[str, list[list]]:
    """The event trees of each profiled step, by label: the step's range, and (CUDA) the
    backward ranges autograd ran on its own thread during it."""
    roots = [e for e in events if e.cpu_parent is None]
    steps = sorted((e for e in roots if e.name.startswith(_STEP + "#")), key=lambda e: e.time_range.start)
    trees = [[s] for s in steps]
    for e in roots:
        if not e.name.startswith("autograd::engine::evaluate_function"):
            continue
        for s, tree in zip(steps, trees):
            if s.time_range.start <= e.time_range.start <= s.time_range.end:
                tree.append(e)
                break
    groups: dict[str, list[list]] = {}
    for s, tree in zip(steps, trees):
        groups.setdefault(s.name[len(_STEP) + 1:], []).append(tree)
    return groups


# -- closing the gap: one change at a time, side by side ------------------------------------


@dataclass(frozen=True)
class Change:
    """One Trainer configuration of :func:`closing_runs` (cumulative from the first)."""

    label: str
    grad_stats: bool = True
    adamw: str = "default"   # "default" (torch's choice for the device), "foreach" or "fused"
    compile: bool = False


CHANGES = (
    Change("Trainer as in the lessons"),
    Change("grad_stats=False", grad_stats=False),
    Change("  + AdamW(foreach=True)", grad_stats=False, adamw="foreach"),
    Change("  + AdamW(fused=True)", grad_stats=False, adamw="fused"),
)
COMPILE = Change("  + fused + torch.compile", grad_stats=False, adamw="fused", compile=True)


def trainer_has_grad_stats() -> bool:
    """Whether this Trainer takes ``grad_stats=`` (the switch for its exact per-step statistics)."""
    return "grad_stats" in inspect.signature(Trainer).parameters


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend would call, or ``None`` if there is none."""
    names = [os.environ.get("CXX", "")] if os.environ.get("CXX") else []
    for name in names + ["g++", "c++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def why_not(change: Change, device) -> str | None:
    """Why ``change`` cannot run on ``device`` here, or ``None`` when it can."""
    device = torch.device(device)
    if not change.grad_stats and not trainer_has_grad_stats():
        return "this Trainer has no grad_stats switch yet"
    if change.adamw == "fused":
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        if device.type not in _get_fused_kernels_supported_devices():
            return f"torch {torch.__version__} has no fused AdamW kernel for {device.type}"
    if change.compile:
        if sys.platform == "win32" or not hasattr(torch, "compile"):
            return "torch.compile does not run on this platform"
        if device.type == "cpu" and cpp_compiler() is None:
            return "torch.compile on a CPU needs a C++ compiler (g++ or clang++); none was found"
    return None


def make_trainer(model, data, precision: str, device, change: Change = CHANGES[0], lr: float = 1e-4,
                 batch_size: int = 64):
    """A :class:`~amp_lessons.training.Trainer` configured as ``change`` says."""
    kwargs = {} if change.adamw == "default" else {change.adamw: True}

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, **kwargs)

    extra = {} if change.grad_stats and not trainer_has_grad_stats() else {"grad_stats": change.grad_stats}
    if change.compile:
        model = torch.compile(model)
    return Trainer(model, data, precision=precision, device=device, optimizer=adamw, lr=lr,
                   batch_size=batch_size, progress=False, **extra)


@dataclass
class ClosingRow:
    """One change in one precision: median ms per step over the rounds, and ratios of those
    medians, so that the ms and ratio columns of :meth:`Closing.table` agree."""

    precision: str
    label: str
    status: str = "ok"
    reason: str | None = None
    ms: float | None = None
    gain: float | None = None             # Trainer-as-in-the-lessons ms / this ms, same precision
    vs_fp32: float | None = None          # fp32 ms / this ms, same change
    first_step_s: float | None = None     # the first step (torch.compile compiles in it)


@dataclass
class Closing:
    """What each change buys, per precision, measured in interleaved rounds."""

    rows: list[ClosingRow] = field(default_factory=list)
    rounds: int = 0
    load: tuple[float, float, float] | None = None

    def table(self) -> str:
        head = f"{'precision':<10}{'change':<28}{'ms/step':>9}{'gain':>8}{'vs fp32':>9}"
        out = [head]
        for r in self.rows:
            if r.status != "ok":
                out.append(f"{r.precision:<10}{r.label:<28}{r.status}: {r.reason}")
                continue
            line = f"{r.precision:<10}{r.label:<28}{r.ms:>9.1f}{_x(r.gain):>8}{_x(r.vs_fp32):>9}"
            if r.first_step_s is not None and r.first_step_s > 5:
                line += f"   (first step {r.first_step_s:.0f} s: compiling)"
            out.append(line)
        note = (f"medians of {self.rounds} interleaved rounds; a '+' row keeps grad_stats=False and "
                "swaps the optimizer; gain = the first row's ms / this row's ms (not the row above's), "
                "same precision; vs fp32 = fp32's ms / this row's ms, same change")
        if self.load:
            note += f"; load average {self.load[0]:.1f} on {os.cpu_count()} CPUs"
        return "\n".join(out + [note])

    def row(self, precision: str, label: str) -> ClosingRow:
        for r in self.rows:
            if r.precision == parse_precision(precision) and r.label.strip() == label.strip():
                return r
        raise KeyError(f"no closing row for {precision} {label!r}")


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def load_average() -> tuple[float, float, float] | None:
    """The machine's 1, 5 and 15 minute load averages (``None`` where the OS does not say)."""
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


def closing_runs(make, precisions, device, changes=CHANGES, warmup: int = 2, repeats: int = 7,
                 on_step=None) -> tuple[Closing, dict]:
    """Time every change in ``changes`` for every precision, one step of each in turn per round.

    ``make(precision, change)`` returns a fresh trainer (same weights, same data for every
    call). Returns the :class:`Closing` table and the trainers by ``(precision, label)``,
    so that the first change's trainers can be profiled afterwards. ``on_step`` is called
    after every timed or warm-up step (a progress bar).
    """
    rows, trainers = {}, {}
    for p in precisions:
        for c in changes:
            why = why_not(c, device)
            if why is not None:
                rows[p, c.label] = ClosingRow(p, c.label, "skipped", why)
                continue
            try:
                trainers[p, c.label] = make(p, c)
                rows[p, c.label] = ClosingRow(p, c.label)
            except Exception as err:  # one change failing must not stop the others
                rows[p, c.label] = ClosingRow(p, c.label, "error", _first_line(err))
    times = {k: [] for k in trainers}

    def run(key):
        t = trainers[key]
        start = time.perf_counter()
        with float32_matmul_precision(t.precision):
            t.step()
        _sync(device)
        return time.perf_counter() - start

    for key in list(trainers):
        try:
            rows[key].first_step_s = run(key)
            for _ in range(max(0, warmup - 1)):
                run(key)
        except Exception as err:
            rows[key].status, rows[key].reason = "error", _first_line(err)
            del trainers[key], times[key]
        if on_step is not None:
            on_step()
    for _ in range(repeats):
        for key in trainers:
            times[key].append(run(key) * 1e3)
        if on_step is not None:
            on_step()
    base_label = changes[0].label
    ms = {key: statistics.median(t) for key, t in times.items()}
    for (p, label), median in ms.items():
        row = rows[p, label]
        row.ms = median
        if (p, base_label) in ms:
            row.gain = ms[p, base_label] / median
        if ("fp32", label) in ms:
            row.vs_fp32 = ms["fp32", label] / median
    ordered = [rows[p, c.label] for p in precisions for c in changes]
    return Closing(ordered, repeats, load_average()), trainers


def _first_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:200]
