"""Gradient clipping with a GradScaler, gradient accumulation, and a check for the clipping trap.

Used in 04_clipping. With a GradScaler the gradients after ``backward()`` are multiplied by
the loss scale ``S``. A clip that runs before ``scaler.unscale_(opt)`` compares ``S`` times
the true norm with ``max_norm``: its effective threshold is ``max_norm / S``. Here:

- :func:`clip_and_unscale`: the part of one AMP step between ``backward()`` and
  ``scaler.step()``, in either order, measured (the norm the clip saw, the update applied).
- :func:`measured_thresholds`, :func:`clipping_table`: read a :class:`~amp_lessons.training.Trainer`
  history for the threshold each step really used.
- :func:`accumulate` (the recipe) and two common mistakes, and :func:`accumulation_table`
  which measures each against one large batch.
- :func:`check_clipping`: a context manager to drop into your own loop; it warns
  (:class:`ScaledClipWarning`) when ``clip_grad_norm_``/``clip_grad_value_`` runs on
  gradients that are still scaled.
- :func:`record_amp_calls`: logs every GradScaler built and every scale/unscale_/step/update
  and clip call (the exercise checker in :mod:`amp_lessons.exercises` reads it).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import statistics
import warnings
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .arguments import check_clip_order, check_data, check_lr, check_positive
from .claims import measured
from .models import mlp
from .precision import dtype_of, needs_scaler, uses_autocast


def lesson_model(hidden: int = 64, seed: int = 0):
    """The digits MLP of 04_clipping (64 -> hidden -> hidden -> 10): the same weights on every
    call, built under its own seed without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mlp(64, hidden, 10)


# -- one clip, in either order -------------------------------------------------------------


@dataclass
class ClipResult:
    """What one clip did. Norms are global L2 norms over all gradients.

    ``true_norm``/``true_max``: the unscaled norm and largest |g| before clipping.
    ``seen``: what the clip compared with its threshold (the norm for ``clip_grad_norm_``,
    the largest |g| for ``clip_grad_value_``), scaled or not depending on the order.
    ``applied_norm``/``applied_max``: the unscaled gradient the optimizer would apply.
    ``scale``: the loss scale (1.0 without a scaler).
    """

    true_norm: float
    true_max: float
    seen: float
    applied_norm: float
    applied_max: float
    scale: float


def grad_norm(params) -> float:
    """Global L2 norm of the gradients of ``params`` (those that have one)."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def grad_max(params) -> float:
    """Largest |gradient value| over ``params``."""
    return max(float(p.grad.detach().abs().max()) for p in params if p.grad is not None)


def _check_order(order: str) -> None:
    check_clip_order("order", order)


def _clip(params, max_norm, clip_value) -> float:
    if (max_norm is None) == (clip_value is None):
        raise ValueError("pass exactly one of max_norm (clip_grad_norm_) or clip_value (clip_grad_value_)")
    if max_norm is not None:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    seen = grad_max(params)
    torch.nn.utils.clip_grad_value_(params, clip_value)
    return seen


def clip_and_unscale(params, optimizer, scaler, *, max_norm=None, clip_value=None,
                     order="unscale_first") -> ClipResult:
    """Clip and unscale the (scaled) gradients of ``params``, in ``order``; measure it.

    ``order="unscale_first"`` is the recipe (``scaler.unscale_(opt)``, then clip);
    ``"before_unscale"`` is the trap. Pass ``max_norm`` for ``clip_grad_norm_`` or
    ``clip_value`` for ``clip_grad_value_``. Leaves the unscaled, clipped gradients in
    ``.grad``, ready for ``scaler.step(optimizer)``. Used in 04_clipping.
    """
    _check_order(order)
    params = [p for p in params if p.grad is not None]
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    true_norm, true_max = grad_norm(params) / scale, grad_max(params) / scale
    if order == "before_unscale":
        seen = _clip(params, max_norm, clip_value)
        scaler.unscale_(optimizer)
    else:
        scaler.unscale_(optimizer)
        seen = _clip(params, max_norm, clip_value)
    return ClipResult(true_norm, true_max, seen, grad_norm(params), grad_max(params), scale)


def one_clipped_step(model, x, y, precision="fp16", *, max_norm=None, clip_value=None,
                     order="unscale_first", init_scale=2.0**16) -> ClipResult:
    """Forward and backward on ``(x, y)`` in ``precision``, then :func:`clip_and_unscale`.

    No optimizer step is taken: the clipped, unscaled gradients stay in ``model``'s ``.grad``.
    fp16 gets a GradScaler (``init_scale``); the other precisions get none (scale 1).
    """
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=needs_scaler(precision))
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype_of(precision), enabled=uses_autocast(precision)):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
    scaler.scale(loss).backward()
    return clip_and_unscale(model.parameters(), opt, scaler, max_norm=max_norm,
                            clip_value=clip_value, order=order)


def backward_inside_autocast_matches(model, x, y, precision="fp16") -> bool:
    """Whether ``backward()`` called inside the autocast block gives the same gradients, bit
    for bit, as called outside it (true of models whose forward has no region under
    ``autocast(enabled=False)`` and no custom Function without ``custom_bwd``). Leaves ``model``'s gradients cleared. Used by the 04_clipping exercise."""
    device = next(model.parameters()).device
    grads = []
    for inside in (True, False):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype_of(precision), enabled=uses_autocast(precision)):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(*grads))


# -- reading a Trainer's history ---------------------------------------------------------------


def effective_threshold(threshold: float, scale: float, order: str) -> float:
    """The threshold a clip really applies to the true gradients: ``threshold / scale`` when
    it runs before ``unscale_``, ``threshold`` itself after it."""
    _check_order(order)
    return threshold / scale if order == "before_unscale" else threshold


def measured_thresholds(history, max_norm: float) -> list[float]:
    """Per step, the threshold the clip applied in true (unscaled) units:
    ``max_norm * true norm / norm the clip saw``. NaN where the run did not clip."""
    check_positive("max_norm", max_norm)
    return [max_norm * r.grad_norm / r.clip_seen_norm if r.clip_seen_norm > 0 else math.nan
            for r in history]


def clipped_fraction(history, max_norm: float) -> float:
    """Fraction of steps at which the clip changed the gradients."""
    thresholds = measured_thresholds(history, max_norm)
    return sum(r.grad_norm > t for r, t in zip(history, thresholds)) / max(1, len(history))


def clipping_table(runs: dict, max_norm: float, last: int = 10) -> str:
    """One line per run: loss scale, median norm the clip saw, effective threshold (median),
    steps clipped, median applied norm, and the mean loss of the ``last`` steps.

    The threshold is exact by construction (``max_norm``, or ``max_norm / scale``); the
    norms, the share clipped and the loss come out of float kernels and print with ``≈``."""
    if not isinstance(runs, dict) or not runs or not all(len(h) for h in runs.values()):
        raise ValueError("runs must map each run's name to the history of a clipped run, e.g. "
                         f"{{'fp16': trainer.fit(60)}}; got {runs!r}")
    check_positive("last", last, integer=True)
    head = (f"{'run':<26}{'scale':>8}{'clip saw':>11}{'threshold':>11}"
            f"{'clipped':>9}{'applied':>11}{'loss':>8}")
    lines = [head]
    for name, h in runs.items():
        lines.append(
            f"{name:<26}{h[-1].scale:>8g}{measured(statistics.median(h['clip_seen_norm']), '.3g'):>11}"
            f"{statistics.median(measured_thresholds(h, max_norm)):>11.3g}"
            f"{measured(clipped_fraction(h, max_norm), '.0%'):>9}"
            f"{measured(statistics.median(h['applied_norm']), '.3g'):>11}"
            f"{measured(statistics.fmean(h['loss'][-last:]), '.3f'):>8}")
    return "\n".join(lines)


# -- gradient accumulation: the recipe and two common mistakes -------------------------------


def accumulate(model, opt, scaler, batches, max_norm, dtype=torch.float16):
    """One optimizer step over ``len(batches)`` micro-batches: the recipe."""
    device = next(model.parameters()).device
    k = len(batches)
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y) / k  # each micro-batch carries 1/k of the mean
        scaler.scale(loss).backward()  # every micro-batch: gradients add up, all scaled by S
    scaler.unscale_(opt)  # once, after the last micro-batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def accumulate_stepping_every_micro_batch(model, opt, scaler, batches, max_norm, dtype=torch.float16):
    """Mistake: unscale_, clip, step and update on every micro-batch."""
    device = next(model.parameters()).device
    k = len(batches)
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y) / k
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # wrong: inside the micro-batch loop
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def accumulate_without_dividing(model, opt, scaler, batches, max_norm, dtype=torch.float16):
    """Mistake: the loss of each micro-batch is not divided by k."""
    device = next(model.parameters()).device
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)  # wrong: the k gradients add up to k x the mean
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


ACCUMULATION_VARIANTS = {
    "right": accumulate,
    "step every micro-batch": accumulate_stepping_every_micro_batch,
    "loss not divided by k": accumulate_without_dividing,
}


@dataclass
class AccumulationRun:
    """What :func:`run_accumulation` measured: the first update (flattened parameter change)
    and how often the optimizer stepped and the scaler updated."""

    first_update: torch.Tensor
    optimizer_steps: int = 0
    scaler_updates: int = 0


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()


_ACCUMULATION_OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def _check_accumulation(step_fn, data, k, batch_size, steps, max_norm, optimizer, lr) -> None:
    """The settings of :func:`run_accumulation`, checked before any step (04_clipping)."""
    if not callable(step_fn):
        raise TypeError(f"step_fn must be one of ACCUMULATION_VARIANTS' functions, e.g. accumulate; got {step_fn!r}")
    for name, value in (("k", k), ("batch_size", batch_size), ("steps", steps)):
        check_positive(name, value, integer=True)
    check_positive("max_norm", max_norm)
    check_lr(lr)
    if optimizer not in _ACCUMULATION_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(_ACCUMULATION_OPTIMIZERS)}; got {optimizer!r}")
    check_data(data, batch_size, k, accum_name="k")


def run_accumulation(step_fn, model, data, *, k=4, batch_size=32, steps=1, max_norm=1.0,
                     optimizer="sgd", lr=0.5, precision="fp16", seed=0) -> AccumulationRun:
    """Train ``model`` for ``steps`` optimizer steps of ``k`` micro-batches with ``step_fn``
    (one of :data:`ACCUMULATION_VARIANTS`); ``k=1`` with ``k`` times the batch size is the
    large-batch reference. Micro-batch ``i`` of step ``s`` is ``data.batch(s * k + i)``, so
    the k micro-batches of a step hold exactly the examples of the large batch."""
    _check_accumulation(step_fn, data, k, batch_size, steps, max_norm, optimizer, lr)
    device = next(model.parameters()).device
    opt = _ACCUMULATION_OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_scaler(precision))
    run = AccumulationRun(first_update=torch.empty(0))
    counts = {"step": 0, "update": 0}
    opt.register_step_post_hook(lambda *_: counts.__setitem__("step", counts["step"] + 1))
    real_update = scaler.update

    def counted_update(*args, **kwargs):
        counts["update"] += 1
        return real_update(*args, **kwargs)

    scaler.update = counted_update
    for s in range(steps):
        before = _flat(model)
        batches = [tuple(t.to(device) for t in data.batch(s * k + i, batch_size, seed)) for i in range(k)]
        step_fn(model, opt, scaler, batches, max_norm, dtype_of(precision))
        if s == 0:
            run.first_update = _flat(model) - before
    run.optimizer_steps, run.scaler_updates = counts["step"], counts["update"]
    return run


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (L2 norms)."""
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@dataclass(frozen=True)
class AccumulationRow:
    """One accumulation variant against one large batch: how far its first update is off
    (relative), its size (x the large batch's), and the optimizer steps and scaler updates."""

    name: str
    off: float
    size: float
    optimizer_steps: int
    scaler_updates: int


def accumulation_rows(make_model, data, *, k=4, batch_size=32, steps=1, max_norm=1.0,
                      optimizer="sgd", lr=0.5, precision="fp16") -> list[AccumulationRow]:
    """Each variant of :data:`ACCUMULATION_VARIANTS` beside one large batch of ``k * batch_size``
    (same examples, same initial weights from ``make_model()``), as :class:`AccumulationRow`."""
    common = dict(steps=steps, max_norm=max_norm, optimizer=optimizer, lr=lr, precision=precision)
    ref = run_accumulation(accumulate, make_model(), data, k=1, batch_size=k * batch_size, **common)
    ref_size = float(torch.linalg.vector_norm(ref.first_update))
    runs = [("one large batch", ref)]
    runs += [(name, run_accumulation(fn, make_model(), data, k=k, batch_size=batch_size, **common))
             for name, fn in ACCUMULATION_VARIANTS.items()]
    return [AccumulationRow(name, relative_difference(run.first_update, ref.first_update),
                            float(torch.linalg.vector_norm(run.first_update)) / ref_size,
                            run.optimizer_steps, run.scaler_updates) for name, run in runs]


def accumulation_table(rows_or_model, data=None, **settings) -> str:
    """:func:`accumulation_rows` as text (pass the rows, or ``make_model, data, **settings``).
    The update's error and size come out of float kernels (``≈``); the counts are exact."""
    rows = rows_or_model if isinstance(rows_or_model, list) else accumulation_rows(rows_or_model, data, **settings)
    lines = [f"{'':<24}{'1st update':>11}{'its size':>10}{'optimizer':>11}{'scaler':>9}",
             f"{'':<24}{'off by':>11}{'x large':>10}{'steps':>11}{'updates':>9}"]
    for r in rows:
        lines.append(f"{r.name:<24}{measured(r.off, '.1%'):>11}{measured(r.size, '.2f'):>10}"
                     f"{r.optimizer_steps:>11}{r.scaler_updates:>9}")
    return "\n".join(lines)


# -- watching a loop: which AMP calls ran, and in which order ---------------------------------


class ScaledClipWarning(UserWarning):
    """A clip ran on gradients that were still multiplied by the loss scale."""


class _Tracker:
    """Follows one GradScaler through a step: 'clean' -> 'scaled' (scale) -> 'unscaled'
    (unscale_ or step) -> 'clean' (update), by wrapping the instance's methods. With several
    optimizers on one scaler (lesson 06), ``unscaled`` holds the ids of the parameters whose
    optimizer was unscaled since the last update: the others' gradients are still scaled."""

    def __init__(self, scaler, log):
        self.scaler, self.log, self.state = scaler, log, "clean"
        self.unscaled: set[int] = set()
        self._wrapped, self._depth = [], 0  # depth > 0: a call made by another (step's unscale_)
        for name in ("scale", "unscale_", "step", "update"):
            self._wrap(name)

    def _wrap(self, name):
        real = getattr(self.scaler, name)

        def wrapper(*args, **kwargs):
            self.log.add(name, state_before=self.state, inner=self._depth > 0,
                         in_autocast=torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))
            self._depth += 1
            try:
                out = real(*args, **kwargs)
            finally:
                self._depth -= 1
            if name == "scale":
                self.state = "scaled" if self.state != "unscaled" else "mixed"
            elif name in ("unscale_", "step"):
                optimizer = args[0] if args else kwargs.get("optimizer")
                self.unscaled.update(id(p) for group in getattr(optimizer, "param_groups", ())
                                     for p in group["params"])
                if self.state in ("scaled", "mixed"):
                    self.state = "unscaled"
            elif name == "update":
                self.state, self.unscaled = "clean", set()
            return out

        setattr(self.scaler, name, wrapper)
        self._wrapped.append(name)

    def unwrap(self):
        for name in self._wrapped:
            with contextlib.suppress(AttributeError):
                delattr(self.scaler, name)
        self._wrapped.clear()

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def still_scaled(self, parameters) -> bool:
        """Whether a clip of ``parameters`` now sees gradients this scaler has not unscaled."""
        if self.state in ("scaled", "mixed"):
            return True
        return self.state == "unscaled" and any(p.grad is not None and id(p) not in self.unscaled
                                                 for p in parameters)


@dataclass
class AmpCall:
    """One call seen by :func:`record_amp_calls`: its name and what was true when it ran."""

    name: str
    info: dict


class AmpCallLog:
    """The calls seen, in order. ``count(name)``; ``clips``; ``scaled_clips`` (clips that ran
    on still-scaled gradients); ``scalers`` (one dict per GradScaler built)."""

    def __init__(self):
        self.calls: list[AmpCall] = []
        self.scalers: list[dict] = []
        self.trackers: list[_Tracker] = []

    def add(self, name, **info):
        self.calls.append(AmpCall(name, info))

    def count(self, name) -> int:
        return sum(c.name == name for c in self.calls)

    def count_called(self, name) -> int:
        """Like :meth:`count`, without the calls a scaler makes itself (``step``'s own
        ``unscale_``): what the loop called."""
        return sum(c.name == name and not c.info.get("inner") for c in self.calls)

    @property
    def clips(self) -> list[AmpCall]:
        return [c for c in self.calls if c.name.startswith("clip_grad")]

    @property
    def scaled_clips(self) -> list[AmpCall]:
        return [c for c in self.clips if c.info["scaled"]]


def _clip_wrappers(log, trackers, on_scaled=None):
    """Wrappers for clip_grad_norm_ and clip_grad_value_ that log each call; ``on_scaled`` is
    called (name, seen, threshold, scale) when the gradients were still scaled."""
    utils = torch.nn.utils
    real_norm, real_value = utils.clip_grad_norm_, utils.clip_grad_value_

    def scaled_tracker(parameters):
        return next((t for t in trackers if t.still_scaled(parameters)), None)

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        tracker = scaled_tracker(parameters)
        seen = real_norm(parameters, max_norm, *args, **kwargs)
        log.add("clip_grad_norm_", scaled=tracker is not None, seen=float(seen), threshold=max_norm)
        if tracker is not None and on_scaled is not None:
            on_scaled("clip_grad_norm_", float(seen), max_norm, tracker.scale)
        return seen

    def clip_grad_value_(parameters, clip_value, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        tracker = scaled_tracker(parameters)
        seen = grad_max(parameters) if any(p.grad is not None for p in parameters) else 0.0
        out = real_value(parameters, clip_value, *args, **kwargs)
        log.add("clip_grad_value_", scaled=tracker is not None, seen=seen, threshold=clip_value)
        if tracker is not None and on_scaled is not None:
            on_scaled("clip_grad_value_", seen, clip_value, tracker.scale)
        return out

    wrappers = {"clip_grad_norm_": clip_grad_norm_, "clip_grad_value_": clip_grad_value_}
    real_with_norm = getattr(utils, "clip_grads_with_norm_", None)  # torch 2.6+: get_total_norm, then this
    if real_with_norm is not None:
        def clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            tracker = scaled_tracker(parameters)
            out = real_with_norm(parameters, max_norm, total_norm, *args, **kwargs)
            seen = float(total_norm)
            log.add("clip_grad_norm_", scaled=tracker is not None, seen=seen, threshold=max_norm)
            if tracker is not None and on_scaled is not None:
                on_scaled("clip_grads_with_norm_", seen, max_norm, tracker.scale)
            return out

        wrappers["clip_grads_with_norm_"] = clip_grads_with_norm_
    return wrappers


@contextlib.contextmanager
def _patched(targets: dict):
    """Set ``{(obj, attr): value}`` for the duration; restore the originals after."""
    saved = {key: getattr(*key) for key in targets}
    try:
        for (obj, attr), value in targets.items():
            setattr(obj, attr, value)
        yield
    finally:
        for (obj, attr), value in saved.items():
            setattr(obj, attr, value)


def _clip_targets(wrappers) -> dict:
    return {(mod, name): fn for name, fn in wrappers.items()
            for mod in (torch.nn.utils, torch.nn.utils.clip_grad) if hasattr(mod, name)}


def _warn_scaled(name, seen, threshold, scale):
    by_norm = name in ("clip_grad_norm_", "clip_grads_with_norm_")
    what = "norm" if by_norm else "largest |gradient|"
    arg = "max_norm" if by_norm else "clip_value"
    warnings.warn(
        f"{name} ran on gradients still multiplied by the loss scale ({scale:g}): it saw a {what} "
        f"of {measured(seen, '.3g')} (true {measured(seen / scale, '.3g')}), so {arg}={threshold:g} acted as "
        f"{threshold / scale:.3g}. Call scaler.unscale_(optimizer) before clipping.",
        ScaledClipWarning, stacklevel=3)


@contextlib.contextmanager
def check_clipping(scaler):
    """Warn when a clip runs on gradients that ``scaler`` has scaled and not yet unscaled.

    Wrap your training loop (or one step) in it::

        with check_clipping(scaler):
            ...  # scaler.scale(loss).backward(); clip_grad_norm_(...); scaler.step(opt) ...

    Each ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` call that comes after
    ``scaler.scale(...)`` but before ``scaler.unscale_(opt)`` raises a
    :class:`ScaledClipWarning` that gives the threshold it really applied and the fix.
    Silent for a disabled scaler (bf16, fp32: nothing is scaled). Yields the
    :class:`AmpCallLog`. (A clip function imported by name before entering, e.g. ``from
    torch.nn.utils import clip_grad_norm_``, is not seen.) Used in 04_clipping.
    """
    log = AmpCallLog()
    tracker = _Tracker(scaler, log)
    log.trackers.append(tracker)
    live = [tracker] if scaler.is_enabled() else []
    try:
        with _patched(_clip_targets(_clip_wrappers(log, live, on_scaled=_warn_scaled))):
            yield log
    finally:
        tracker.unwrap()


# GradScaler's device when none is given ("cuda" in torch 2.11-2.14), read from its signature.
_DEFAULT_SCALER_DEVICE = inspect.signature(torch.amp.GradScaler.__init__).parameters["device"].default


@contextlib.contextmanager
def record_amp_calls():
    """Log every ``torch.amp.GradScaler`` built inside (whether a device was passed, and
    whether it ended up enabled), every scale/unscale_/step/update call on it, and every clip
    (with whether it ran before unscale_, by call order, even on a disabled scaler).
    Yields the :class:`AmpCallLog`. Used by the 04_clipping exercise checker."""
    log = AmpCallLog()
    real_class = torch.amp.GradScaler

    class RecordingGradScaler(real_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            given = args[0] if args else kwargs.get("device", _DEFAULT_SCALER_DEVICE)
            log.scalers.append({"device_given": bool(args) or "device" in kwargs,
                                "device": str(getattr(self, "_device", given)), "enabled": self.is_enabled()})
            log.trackers.append(_Tracker(self, log))

    targets = _clip_targets(_clip_wrappers(log, log.trackers))
    targets[(torch.amp, "GradScaler")] = RecordingGradScaler
    try:
        with _patched(targets):
            yield log
    finally:
        for t in log.trackers:
            t.unwrap()
