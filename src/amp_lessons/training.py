"""The one training loop of the course, its per-step history, and its checkpoints.

Lessons 01 and 03-05 train through :class:`Trainer`. One optimizer step reads like the
recipe, with ``enabled=`` flags instead of branches::

    with torch.autocast(device.type, dtype=dtype, enabled=use_amp):
        loss = loss_fn(model(x), y) / accum_steps
    scaler.scale(loss).backward()          # every micro-batch
    scaler.unscale_(opt)                   # once, on the stepping micro-batch
    clip_grad_norm_(params, clip_norm)     # on true (unscaled) gradients
    scaler.step(opt)                       # skipped when the gradients hold inf/NaN
    scaler.update()                        # halve on a skip, grow after growth_interval clean steps

For teaching, the loop can also clip *before* ``unscale_`` (lesson 04), run fp16 without a
scaler (lesson 03) and make the loss non-finite at chosen steps (lesson 03).

A step counts as skipped when the optimizer did not apply it (seen by a hook on the
optimizer, not guessed from the scale). Checkpoints (:meth:`Trainer.save`) carry a SHA-256
digest of their contents; :meth:`Trainer.load` recomputes it and checks every value before
it changes anything.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import numbers
import random
import struct
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from . import progress
from .hardware import resolve
from .precision import dtype_of, float32_matmul_precision, needs_scaler, uses_autocast
from .progress import progress_enabled
from .seeding import check_seed, rng_state, seed_everything, set_rng_state

CHECKPOINT_FORMAT = "amp-lessons-checkpoint/2"  # /2: with a digest of its contents
CLIP_ORDERS = ("unscale_first", "before_unscale")
_CHECKPOINT_KEYS = ("precision", "signature", "step", "model", "optimizer", "scaler", "scheduler",
                    "rng", "history", "digest")


class NonFiniteLossError(FloatingPointError):
    """The loss became inf/NaN where no GradScaler can skip the step."""


class ScaleCollapseError(FloatingPointError):
    """GradScaler kept skipping until its scale fell below the floor: no scale can save the run."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (corrupt, or from another run)."""


@dataclass
class StepRecord:
    """What happened in one optimizer step (one row of :class:`History`)."""

    step: int
    loss: float
    scale: float
    skipped: bool
    grad_norm: float
    clip_seen_norm: float
    applied_norm: float
    zero_frac: float
    lr: float
    ms: float


class History:
    """The per-step records of a run: a column by name, a row by index, a text table."""

    columns = tuple(f.name for f in fields(StepRecord))

    def __init__(self, records=()):
        self.records: list[StepRecord] = list(records)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.columns:
                raise KeyError(f"history has columns {', '.join(self.columns)}; got {key!r}")
            return [getattr(r, key) for r in self.records]
        return self.records[key]

    @property
    def skipped(self) -> int:
        """How many steps the optimizer did not apply (GradScaler found inf/NaN gradients)."""
        return sum(r.skipped for r in self.records)

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def table(self, every: int = 1, columns=("step", "loss", "scale", "skipped", "grad_norm", "zero_frac")) -> str:
        """Every ``every``-th row (and the last) as aligned text, numbers rounded for reading."""
        _check_positive("every", every, integer=True)
        unknown = [c for c in columns if c not in self.columns]
        if unknown:
            raise KeyError(f"history has columns {', '.join(self.columns)}; got {unknown}")
        rows = [r for i, r in enumerate(self.records) if i % every == 0 or i == len(self.records) - 1]
        cells = [[_fmt(getattr(r, c), c in MEASURED_COLUMNS) for c in columns] for r in rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"History({len(self)} steps, {self.skipped} skipped)"


# Columns whose values come out of float kernels: another CPU, thread count or torch release
# prints other digits, so the table marks them with amp_lessons.claims.measured (``≈``).
MEASURED_COLUMNS = frozenset({"loss", "grad_norm", "clip_seen_norm", "applied_norm", "zero_frac", "ms"})


def _fmt(v, measured_value: bool = False) -> str:
    if measured_value and isinstance(v, float) and math.isfinite(v):
        return "≈" + _fmt(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e9:  # a loss scale: 65536, not 6.55e+04
        return str(int(v))
    if isinstance(v, float) and v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


class GradientRecorder:
    """A callback that keeps the gradient values of chosen steps, for lesson 01's histogram.

    ``weight_grads``: every parameter's gradient (unscaled). ``activation_grads``: the
    gradients flowing between layers during backward (``grad_output`` of each Linear).
    """

    def __init__(self, steps=(0,), module_types=(torch.nn.Linear,)):
        self.steps = set(steps)
        self.module_types = module_types
        self._weights: list[torch.Tensor] = []
        self._activations: list[torch.Tensor] = []
        self._handles = []
        self._armed = False

    def attach(self, trainer: Trainer) -> None:
        for m in trainer.model.modules():
            if isinstance(m, self.module_types):
                self._handles.append(m.register_forward_hook(self._on_forward))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def before_step(self, trainer: Trainer) -> None:
        self._armed = trainer.step_count in self.steps

    def _on_forward(self, module, inputs, output):
        # A tensor hook on the output sees the gradient flowing into the layer from above
        # (its grad_output), also for a first layer whose input needs no gradient.
        if self._armed and output.requires_grad:
            output.register_hook(self._on_grad)

    def _on_grad(self, grad):
        self._activations.append(grad.detach().float().flatten().cpu())

    def after_backward(self, trainer: Trainer) -> None:
        if not self._armed:
            return
        scale = trainer.current_scale()
        for p in trainer.model.parameters():
            if p.grad is not None:
                self._weights.append((p.grad.detach().float() / scale).flatten().cpu())
        if scale != 1.0:  # activation gradients were scaled too
            n = sum(1 for _ in self._handles)
            self._activations[-n * trainer.accum_steps:] = [
                a / scale for a in self._activations[-n * trainer.accum_steps:]
            ]
        self._armed = False

    @property
    def weight_grads(self) -> torch.Tensor:
        return torch.cat(self._weights) if self._weights else torch.empty(0)

    @property
    def activation_grads(self) -> torch.Tensor:
        return torch.cat(self._activations) if self._activations else torch.empty(0)


def _rng_for_checkpoint() -> dict:
    """:func:`rng_state` with NumPy's key array as an int64 tensor: ``torch.load(weights_only=True)``
    reads it, and no torch release has to know the uint32 dtype NumPy keeps it in."""
    rng = rng_state()
    np_state = rng["numpy"]
    rng["numpy"] = (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])
    return rng


def _rng_from_checkpoint(rng) -> dict:
    """The inverse of :func:`_rng_for_checkpoint`: NumPy's key array back as uint32."""
    rng = dict(rng)
    np_state = rng["numpy"]
    rng["numpy"] = (np_state[0], np_state[1].cpu().numpy().astype(np.uint32), *np_state[2:])
    return rng


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive(name, value, integer=False):
    ok = (isinstance(value, numbers.Integral) if integer else _is_number(value)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name} must be {kind}; got {value!r}")


# GradScaler keeps the scale in a float32 tensor: a scale must be a float32 number, and a factor
# must move it by at least one float32 step. 1 - 2**-23 and 1 + 2**-23 always do, wherever the
# scale lies (a factor nearer to 1 leaves it unchanged: 1 - 1e-9 rounds to 1).
_F32 = torch.finfo(torch.float32)


def _check_scale(name, value):
    _check_positive(name, value)
    if not _F32.tiny <= value <= _F32.max:
        raise ValueError(f"{name} must lie between {_F32.tiny:.3g} and {_F32.max:.3g}, the normal "
                         f"float32 numbers: GradScaler keeps the scale in float32; got {value!r}")


def _check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale):
    _check_scale("init_scale", init_scale)
    _check_positive("growth_interval", growth_interval, integer=True)
    _check_scale("min_scale", min_scale)
    if init_scale < min_scale:
        raise ValueError(f"init_scale ({init_scale!r}) must be at least min_scale ({min_scale!r}), the floor "
                         "below which the Trainer stops the run")
    _check_factors(growth_factor, backoff_factor)


def _check_factors(growth_factor, backoff_factor):
    if not _is_number(growth_factor) or not 1.0 + _F32.eps <= growth_factor <= _F32.max:
        raise ValueError(f"growth_factor must be a finite number >= 1 + 2**-23 (the scale grows by it, "
                         f"in float32, where a factor nearer to 1 changes nothing); got {growth_factor!r}")
    if not _is_number(backoff_factor) or not 0.0 < backoff_factor <= 1.0 - _F32.eps:
        raise ValueError(f"backoff_factor must be between 0 and 1 - 2**-23 (the scale shrinks by it on a "
                         f"skipped step, in float32, where a factor nearer to 1 changes nothing); "
                         f"got {backoff_factor!r}")


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _global_norm(grads) -> torch.Tensor:
    """The L2 norm of all the gradients together, as ``clip_grad_norm_`` computes it.

    On a CPU, a BLAS dot product per float32 gradient reads it once on every core: about
    twice as fast there as ``torch._foreach_norm``, and equal to float32 rounding (both
    overflow to inf where the squares exceed float32, beyond |g| ~ 1e19).
    """
    if not grads:
        return torch.zeros(())
    if all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads):
        return torch.stack([torch.dot(f, f) for f in (g.reshape(-1) for g in grads)]).sum().sqrt()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())


def _count_zeros(grads) -> torch.Tensor:
    """How many gradient values are exactly zero, -0.0 included (a flushed negative value).

    On a CPU, ``count_nonzero`` over the bits seen as integers reads each gradient once,
    writes nothing, and is several times faster than ``(g == 0).sum()``: +0.0 is the
    integer 0, and -0.0 the smallest integer, counted apart only where a gradient holds one.
    With the norm, this read of every gradient is most of what the Trainer adds to a step:
    a cost that grows with the parameters, not the batch (benchmarks/loop_overhead.py).
    """
    if not grads:
        return torch.zeros((), dtype=torch.int64)
    total = sum(g.numel() for g in grads)
    size = grads[0].element_size()
    if any(g.device.type != "cpu" or g.element_size() != size or g.numel() == 0 for g in grads) \
            or size not in _BITS:
        return total - torch.stack([torch.count_nonzero(g) for g in grads]).sum()  # -0.0 == 0
    bits = [g.view(_BITS[size]) for g in grads]
    smallest = torch.iinfo(_BITS[size]).min
    nonzero = torch.stack([torch.count_nonzero(b) for b in bits]).sum()
    if bool((torch.stack([b.amin() for b in bits]) == smallest).any()):  # a -0.0 somewhere
        nonzero = nonzero - torch.stack([torch.count_nonzero(b == smallest) for b in bits]).sum()
    return total - nonzero


_SCHEDULER_EXAMPLE = "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)"


def _required_arguments(method) -> list[str]:
    """The arguments ``method`` cannot be called without (``metrics`` for ReduceLROnPlateau.step)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it needs none
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_steps(name, steps) -> frozenset:
    """A collection of optimizer-step numbers (integers >= 0) as a set."""
    try:
        values = list(steps)
    except TypeError:
        raise TypeError(f"{name} must be a collection of step numbers, e.g. (3, 7); got {steps!r}") from None
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0]
    if bad:
        raise ValueError(f"{name} must hold step numbers (integers >= 0), e.g. (3, 7); got {bad[0]!r}")
    return frozenset(int(v) for v in values)


class _StepWatch:
    """Whether the optimizer really applied its last step, seen from the optimizer itself.

    ``GradScaler.step`` skips ``optimizer.step()`` when the gradients hold inf/NaN; a post-hook
    (``register_step_post_hook``, public since torch 2.0) sees every step that ran, for any
    optimizer, SGD without state included. An optimizer that handles the scaler itself
    (``fused=True``) is always called: GradScaler hands it ``found_inf`` for that call, and
    the fused kernel skips the update when it is nonzero; it is kept here, to be read with
    the step's other numbers.
    """

    def __init__(self, optimizer):
        self.called, self.found_inf = False, None
        self.handle = optimizer.register_step_post_hook(self._after_step)

    def reset(self) -> None:
        self.called, self.found_inf = False, None

    def _after_step(self, optimizer, args, kwargs):
        self.called = True
        self.found_inf = getattr(optimizer, "found_inf", None)


def _as_floats(*values) -> list[float]:
    """The given 0-dim tensors as Python floats in one transfer; ``None`` becomes NaN."""
    present = [v.detach() for v in values if v is not None]
    present = [v.to(present[0].device, torch.float64) for v in present]
    got = iter(torch.stack(present).tolist() if present else [])
    return [math.nan if v is None else next(got) for v in values]


class Trainer:
    """Train ``model`` on ``data`` in one precision, one optimizer step at a time.

    Used in 01 (gradients to histogram), 03 (GradScaler), 04 (clipping, accumulation)
    and 05 (precisions side by side). See the module docstring for the step itself.

    ``grad_stats``: with ``True`` (the default) every step records two exact statistics
    of the gradients: ``zero_frac``, the share of gradient values that are exactly zero
    (what fp16 flushed, lessons 01 and 03), and ``grad_norm``, the L2 norm of all of them
    together. Both read every gradient once more, a cost that grows with the number of
    parameters. ``False`` skips that read when only speed matters (``bench``): then
    ``zero_frac``, ``grad_norm`` and ``applied_norm`` are NaN, except that with
    ``clip_norm`` set, ``grad_norm`` and ``applied_norm`` are still recorded, because the
    clip computes the norm anyway.
    """

    def __init__(self, model, data, precision="fp32", device=None, optimizer="adamw", lr=1e-3,
                 batch_size=64, accum_steps=1, clip_norm=None, clip_order="unscale_first",
                 scaler=None, init_scale=2.0**16, growth_interval=2000, growth_factor=2.0,
                 backoff_factor=0.5, min_scale=2.0**-14, scheduler=None,
                 step_scheduler_on_skip=False, inject_nonfinite=(), loss_fn=F.cross_entropy,
                 seed=0, progress=None, callbacks=(), teaching=False, grad_stats=True):
        self.precision, self.device = resolve(precision, device)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        _check_positive("lr", lr)
        _check_positive("batch_size", batch_size, integer=True)
        _check_positive("accum_steps", accum_steps, integer=True)
        if clip_norm is not None:
            _check_positive("clip_norm", clip_norm)
        if clip_order not in CLIP_ORDERS:
            raise ValueError(f"clip_order must be one of {', '.join(CLIP_ORDERS)}; got {clip_order!r}")
        _check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale)
        if not callable(loss_fn):
            raise TypeError("loss_fn must be a function of (logits, labels) that returns the loss, "
                            f"e.g. torch.nn.functional.cross_entropy (the default); got {loss_fn!r}")
        if scheduler is not None and not callable(scheduler):
            raise TypeError(f"scheduler must be a function that takes the optimizer and returns an lr "
                            f"scheduler, e.g. scheduler={_SCHEDULER_EXAMPLE}; got {scheduler!r}")
        if not isinstance(grad_stats, bool):
            raise TypeError(f"grad_stats must be True (record zero_frac and grad_norm every step) or "
                            f"False (skip them, for speed); got {grad_stats!r}")
        self.seed = check_seed(seed)
        self.inject_nonfinite = _check_steps("inject_nonfinite", inject_nonfinite)
        use_scaler = needs_scaler(self.precision) if scaler is None else bool(scaler)
        if needs_scaler(self.precision) and not use_scaler and not teaching:
            warnings.warn("fp16 without a GradScaler: small gradients flush to zero and training "
                          "stalls (lesson 03). Pass teaching=True if that is what you want to show.",
                          UserWarning, stacklevel=2)
        if clip_order == "before_unscale" and not teaching:
            warnings.warn("clip_order='before_unscale' clips still-scaled gradients: the effective "
                          "threshold becomes clip_norm/scale (lesson 04). Pass teaching=True to show it.",
                          UserWarning, stacklevel=2)
        self.model = model.to(self.device)
        self.data = data
        self.lr, self.batch_size, self.accum_steps = lr, batch_size, accum_steps
        self.clip_norm, self.clip_order = clip_norm, clip_order
        self.dtype = dtype_of(self.precision)
        self.use_amp = uses_autocast(self.precision)
        self.optimizer = self._make_optimizer(optimizer, lr)
        self._applied = _StepWatch(self.optimizer)
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=use_scaler)
        self.min_scale = min_scale
        self.scheduler = self._make_scheduler(scheduler)
        self.step_scheduler_on_skip = step_scheduler_on_skip
        self.loss_fn = loss_fn
        self.grad_stats = grad_stats
        self.progress = progress_enabled(progress)
        self.callbacks = list(callbacks)
        self.step_count = 0
        self.history = History()
        seed_everything(self.seed)
        for cb in self.callbacks:
            getattr(cb, "attach", lambda t: None)(self)

    def _make_optimizer(self, optimizer, lr):
        params = self.model.parameters()
        makers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
        if callable(optimizer):
            built = optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, e.g. optimizer="
                                f"lambda params: torch.optim.SGD(params, lr=0.1); got {type(built).__name__}")
            return built
        if optimizer not in makers:
            raise ValueError(f"optimizer must be one of {', '.join(makers)} or a callable; got {optimizer!r}")
        return makers[optimizer](params, lr=lr)

    def _make_scheduler(self, scheduler):
        """``scheduler(self.optimizer)``, checked: the Trainer calls its ``step()`` with no argument."""
        if scheduler is None:
            return None
        try:
            built = scheduler(self.optimizer)
        except TypeError as err:  # e.g. the class itself, whose other arguments are missing
            raise TypeError(f"scheduler(optimizer) raised TypeError: {err}. Pass a function of the "
                            f"optimizer alone, e.g. scheduler={_SCHEDULER_EXAMPLE}") from err
        missing = [name for name in ("step", "state_dict", "load_state_dict") if not hasattr(built, name)]
        if missing:
            raise TypeError(f"scheduler(optimizer) must return an lr scheduler (with step, state_dict "
                            f"and load_state_dict); got a {type(built).__name__} without {', '.join(missing)}")
        needs = _required_arguments(built.step)
        if needs:
            name = type(built).__name__
            raise TypeError(
                f"{name}.step() needs {', '.join(needs)}, and the Trainer steps its scheduler after "
                f"every optimizer step with no argument. {name} waits for a measured value (the "
                "test accuracy, say): step it yourself between calls to fit(), e.g. "
                f"sched = torch.optim.lr_scheduler.{name}(trainer.optimizer, mode='max'), then "
                "repeat trainer.fit(100); sched.step(trainer.evaluate()).")
        return built

    def current_scale(self) -> float:
        """The loss scale now (1.0 when the scaler is off)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    # -- one optimizer step ------------------------------------------------------------

    def _forward_backward(self) -> torch.Tensor:
        """Forward + loss under autocast and a scaled backward, for every micro-batch."""
        total = None
        for micro in range(self.accum_steps):
            x, y = self.data.batch(self.step_count * self.accum_steps + micro, self.batch_size, self.seed)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.use_amp):
                loss = self.loss_fn(self._model_output(x), y)
                if self.accum_steps > 1:  # (dividing by 1 would change nothing but cost an op)
                    loss = loss / self.accum_steps
            if self.step_count in self.inject_nonfinite:
                loss = loss * float("inf")
            self.scaler.scale(loss).backward()
            part = loss.detach().float()
            total = part if total is None else total + part
        # Checked once, after the last backward and before any update (one sync per step).
        if not self.scaler.is_enabled() and not torch.isfinite(total):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"the loss is {total.item()} at step {self.step_count} ({self.precision}, no "
                "GradScaler); no parameters were changed by this step. Lower the learning rate, "
                "check the data for inf/NaN, or clip gradients; in fp16 use a GradScaler.")
        return total

    def step(self) -> StepRecord:
        """One optimizer step (``accum_steps`` micro-batches); returns its record."""
        start = time.perf_counter()
        for cb in self.callbacks:
            getattr(cb, "before_step", lambda t: None)(self)
        scale = self.current_scale()
        loss = self._forward_backward()
        for cb in self.callbacks:
            getattr(cb, "after_backward", lambda t: None)(self)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        # Counted as backward left them (unscaling by a power of two makes no value 0 that
        # float32 can hold), before a clip can change them.
        zeros = _count_zeros(grads) if self.grad_stats else None
        seen = math.nan
        norm = applied = None  # stay None (NaN in the record) when not computed
        if self.clip_norm is not None and self.clip_order == "before_unscale":
            # The trap (lesson 04): the clip sees norm * scale, so it clips by clip_norm / scale.
            seen = float(torch.nn.utils.clip_grad_norm_(params, self.clip_norm))  # amp-lint: ignore[clip-before-unscale]
            self.scaler.unscale_(self.optimizer)
            norm = loss.new_tensor(seen / scale)
            if self.grad_stats:
                applied = _global_norm(grads)
        else:
            self.scaler.unscale_(self.optimizer)
            if self.clip_norm is not None:  # the clip computes the norm anyway: the one it clipped by
                norm = torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
                seen = float(norm)
                applied = norm * min(1.0, self.clip_norm / (seen + 1e-6))
            elif self.grad_stats:
                norm = applied = _global_norm(grads)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._applied.reset()
        self.scaler.step(self.optimizer)  # calls optimizer.step() only on finite gradients
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        found_inf = self._applied.found_inf
        # One transfer for the numbers (one sync on a GPU, also ending the step's work).
        loss_v, norm_v, applied_v, zeros_v, found_v = _as_floats(loss, norm, applied, zeros, found_inf)
        # From the optimizer, not from the scale: a factor may leave the scale where it was.
        skipped = not self._applied.called or (found_inf is not None and found_v != 0)
        if self.scheduler is not None and (not skipped or self.step_scheduler_on_skip):
            self.scheduler.step()
        record = StepRecord(
            step=self.step_count, loss=loss_v, scale=scale, skipped=bool(skipped),
            grad_norm=norm_v, clip_seen_norm=seen, applied_norm=applied_v,
            zero_frac=zeros_v / max(1, sum(p.numel() for p in params)), lr=lr,
            ms=(time.perf_counter() - start) * 1e3)
        self.history.append(record)
        self.step_count += 1
        if self.scaler.is_enabled() and self.current_scale() < self.min_scale:
            raise ScaleCollapseError(
                f"the loss scale fell to {self.current_scale():.3g} (below the floor {self.min_scale:.3g}) "
                f"at step {record.step} after {self._trailing_skips()} skipped steps in a row: the "
                "loss or gradients stay inf/NaN at any scale, so no scaler can save this run. The "
                "parameters are unchanged by the skipped steps. Check the data for inf/NaN and "
                "lower the learning rate.")
        return record

    def _trailing_skips(self) -> int:
        n = 0
        for r in reversed(self.history.records):
            if not r.skipped:
                break
            n += 1
        return n

    def fit(self, steps: int) -> History:
        """Run ``steps`` more optimizer steps; returns the (cumulative) history."""
        _check_positive("steps", steps, integer=True)
        bar = progress.bar(steps, f"{self.precision} on {self.device.type}", self.progress)
        try:
            with float32_matmul_precision(self.precision):
                for i in range(steps):
                    record = self.step()
                    if bar is not None:
                        bar.update(1)
                        if i % 10 == 0 or i == steps - 1:
                            bar.set_postfix(loss=f"{record.loss:.4f}", scale=f"{record.scale:g}")
        finally:
            if bar is not None:
                bar.close()
        return self.history

    def _model_output(self, x):
        """``self.model(x)``; integer inputs that the model cannot take get an error that says why."""
        try:
            return self.model(x)
        except RuntimeError as err:
            if x.is_floating_point() or x.is_complex():
                raise
            weights = sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters()
                              if p.is_floating_point()}) or ["floating point"]
            raise TypeError(
                f"the model got inputs of dtype {str(x.dtype).removeprefix('torch.')}, but its weights are "
                f"{' and '.join(weights)}: it computes in floating point and expects floating-point "
                f"inputs (torch said: {str(err).splitlines()[0]}). Convert the inputs when you build "
                "the data, e.g. Dataset(x_train.float(), y_train, x_test.float(), y_test); autocast "
                "casts floating-point inputs only.") from err

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy on the test split, computed under the same autocast as training."""
        if len(self.data.x_test) == 0:
            raise ValueError(f"the test split of {getattr(self.data, 'name', 'the data')} is empty, so there "
                             "is no accuracy to measure; build the data with test examples, e.g. "
                             "digits(test_fraction=0.2)")
        self.model.eval()
        try:
            x = self.data.x_test.to(self.device)
            y = self.data.y_test.to(self.device)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.use_amp):
                pred = self._model_output(x).argmax(dim=-1)
        finally:
            self.model.train()
        return (pred == y).float().mean().item()

    # -- checkpoints -----------------------------------------------------------------------

    def _signature(self) -> dict:
        return {k: list(v.shape) for k, v in self.model.state_dict().items()}

    def _checkpoint(self) -> dict:
        """What :meth:`save` writes, but the digest (references to the live tensors, not copies)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "precision": self.precision,
            "optimizer_type": type(self.optimizer).__name__,
            "signature": self._signature(),
            "step": self.step_count,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": _rng_for_checkpoint(),
            "history": self.history.as_dicts(),
        }

    def save(self, path) -> Path:
        """Save model, optimizer, scaler, scheduler, step, RNG state and history, with a SHA-256
        digest of all of it, which :meth:`load` recomputes: a file whose bytes changed is refused.

        A state that could not be resumed (inf/NaN weights or optimizer state: a run that
        diverged) raises :class:`CheckpointError` and writes nothing.
        """
        state = self._checkpoint()
        try:
            self._check_values(state)
        except CheckpointError as err:
            raise CheckpointError(f"refusing to save: {err}. Nothing was written.") from None
        state["digest"] = checkpoint_digest(state)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)  # never leave a half-written checkpoint under the real name
        return path

    def load(self, path) -> Trainer:
        """Restore a checkpoint saved by :meth:`save` from a run of this same model.

        Everything is checked before anything is changed: the digest (a damaged file), the
        model, optimizer, precision and scaler (a checkpoint of another run) and every value
        (finite tensors, lr, step, loss scale). Any failure raises :class:`CheckpointError`,
        which says what is wrong, and leaves this trainer exactly as it was.
        """
        try:  # on the CPU: load_state_dict moves each tensor to where its parameter lives
            with warnings.catch_warnings():
                # A damaged file can make torch warn (about a pickle protocol, say) and still
                # load: the digest and the checks below decide whether it is used, not a warning.
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated file, not a checkpoint at all, unsafe pickles
            raise CheckpointError(f"{path} is not a readable amp-lessons checkpoint ({type(err).__name__}: "
                                  f"{_first_line(err)})") from err
        self._validate(state, path)
        before = self._snapshot()
        try:
            self._restore(state)
        except Exception as err:  # e.g. optimizer state of another shape: put everything back
            self._restore(before)
            raise CheckpointError(f"{path} could not be loaded into this trainer ({type(err).__name__}: "
                                  f"{_first_line(err)}); nothing was changed.") from err
        return self

    def _snapshot(self) -> dict:
        """This trainer's state as :meth:`_restore` takes it (copies, not references)."""
        return copy.deepcopy({
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": _rng_for_checkpoint(), "step": self.step_count, "history": self.history.as_dicts(),
        })

    def _restore(self, state) -> None:
        history = History(StepRecord(**r) for r in state["history"])
        step = int(state["step"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(_rng_from_checkpoint(state["rng"]))
        self.step_count, self.history = step, history

    def _validate(self, state, path) -> None:
        """Raise :class:`CheckpointError` unless ``state`` is an intact checkpoint of this run."""
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else None
            if isinstance(found, str) and found.startswith("amp-lessons-checkpoint/"):
                raise CheckpointError(f"{path} is an amp-lessons checkpoint of another format ({found!r}; "
                                      f"this version reads {CHECKPOINT_FORMAT!r}, which carries a digest "
                                      "of its contents). Train again and save it with this version.")
            raise CheckpointError(f"{path} is not an amp-lessons checkpoint (no {CHECKPOINT_FORMAT!r} marker)")
        missing_keys = [k for k in _CHECKPOINT_KEYS if k not in state]
        if missing_keys:
            raise CheckpointError(f"{path} is an incomplete amp-lessons checkpoint: no {missing_keys}")
        try:
            intact = state["digest"] == checkpoint_digest(state)
        except TypeError:  # a value of a type save() never writes
            intact = False
        if not intact:
            raise CheckpointError(f"{path} is corrupt: its contents do not match the SHA-256 digest saved "
                                  "with them (the file was changed or damaged after it was written). "
                                  "Load an intact copy; nothing was changed.")
        try:
            self._check_compatible(state, path)
            self._check_values(state)
        except CheckpointError as err:
            if str(err).startswith(str(path)):  # about this trainer: the message says what to do
                raise
            raise CheckpointError(f"{path} cannot be resumed: {err}. Nothing was changed.") from None
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:
            raise CheckpointError(f"{path} holds a malformed checkpoint ({type(err).__name__}: "
                                  f"{_first_line(err)}); nothing was changed.") from err

    def _check_compatible(self, state, path) -> None:
        """Is ``state`` from a run like this one (model, precision, optimizer, scaler, scheduler)?"""
        mine, theirs = self._signature(), state["signature"]
        if mine != theirs:
            missing = sorted(set(mine) - set(theirs))[:3]
            extra = sorted(set(theirs) - set(mine))[:3]
            shapes = [k for k in set(mine) & set(theirs) if mine[k] != theirs[k]][:3]
            raise CheckpointError(
                f"{path} holds another model: missing {missing}, unexpected {extra}, "
                f"different shapes {shapes}. Load it into the model it was saved from.")
        if state["precision"] != self.precision:
            raise CheckpointError(f"{path} was saved by a {state['precision']} run; this trainer "
                                  f"runs {self.precision}. Create the Trainer with precision="
                                  f"{state['precision']!r} to resume it.")
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise CheckpointError(f"{path} was saved {'without' if state['scheduler'] is None else 'with'} "
                                  "an lr scheduler; create the Trainer the same way to resume it.")
        groups = self.optimizer.state_dict()["param_groups"]
        theirs_groups = state["optimizer"]["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in theirs_groups]:
            raise CheckpointError(f"{path} holds the state of a different optimizer setup.")
        kind = state.get("optimizer_type", type(self.optimizer).__name__)
        if kind != type(self.optimizer).__name__:
            raise CheckpointError(f"{path} holds the state of a {kind} optimizer; this trainer uses "
                                  f"{type(self.optimizer).__name__}. Create the Trainer with the same optimizer.")
        if bool(state["scaler"]) != self.scaler.is_enabled():
            saved = "with" if state["scaler"] else "without"
            raise CheckpointError(f"{path} was saved {saved} a GradScaler and this trainer runs "
                                  f"{'with' if self.scaler.is_enabled() else 'without'} one; its loss "
                                  "scale could not be resumed. Create the Trainer the same way (scaler=...).")
        scale = state["scaler"].get("scale") if state["scaler"] else None
        if _is_number(scale) and 0 < scale < self.min_scale:
            raise CheckpointError(f"{path} holds a loss scale of {scale:.3g}, below this trainer's floor "
                                  f"min_scale={self.min_scale:.3g}: its run had collapsed, and resuming it "
                                  "would stop at the first step. Create the Trainer with a lower min_scale "
                                  "to look at it anyway.")

    def _check_values(self, state) -> None:
        """Raise :class:`CheckpointError` naming the first value a run could not hold."""
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"its step count is {step!r}; it must be an integer >= 0")
        _check_history(state["history"], step)
        _check_model(state["model"], self.model.state_dict())
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        _check_optimizer(state["optimizer"], params, with_scheduler=self.scheduler is not None)
        if self.scaler.is_enabled():
            _check_scaler_state(state["scaler"])
        if self.scheduler is not None:
            _check_scheduler_state(state["scheduler"])
        _check_rng(state["rng"])


# -- checkpoints: the digest, and the values a run can hold -----------------------------------


def _first_line(err) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def checkpoint_digest(state: dict) -> str:
    """The SHA-256 of everything in ``state`` but its ``"digest"`` entry: every tensor's dtype,
    shape and bytes, every number, string and container, in order. :meth:`Trainer.save`
    stores it; :meth:`Trainer.load` recomputes it from what ``torch.load`` returned, which
    reads tensor bytes without a checksum of its own."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "digest"})
    return h.hexdigest()


def _feed(h, obj) -> None:
    """Add ``obj`` to the hash ``h``, each value tagged with its type (1, 1.0 and True differ)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value)
    elif obj is None or isinstance(obj, bool):
        h.update(f"B{obj}:".encode())
    elif isinstance(obj, int):
        h.update(f"I{obj}:".encode())
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        h.update(f"S{len(obj)}:{obj}".encode())
    else:
        raise TypeError(f"a checkpoint holds only tensors, numbers, strings and containers; got {type(obj).__name__}")


def _check_finite(what, value) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise CheckpointError(f"{what} holds {bad} inf/NaN value{'s' if bad > 1 else ''}")
    elif not _is_number(value) or not math.isfinite(value):
        raise CheckpointError(f"{what} is {value!r}; it must be a finite number")


def _number(value):
    """A one-element tensor as a Python number (an optimizer may keep its lr as a tensor)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _check_history(history, step) -> None:
    names = [f.name for f in fields(StepRecord)]
    if not isinstance(history, list) or len(history) != step:
        got = len(history) if isinstance(history, list) else type(history).__name__
        raise CheckpointError(f"its history holds {got} records for {step} steps; a run records one per step")
    for i, record in enumerate(history):
        if not isinstance(record, dict) or list(record) != names:
            raise CheckpointError(f"history record {i} does not have the columns {', '.join(names)}")
        if type(record["step"]) is not int or record["step"] != i or not isinstance(record["skipped"], bool) \
                or not all(_is_number(record[n]) for n in names if n != "skipped"):
            raise CheckpointError(f"history record {i} is malformed: {record}")
        if not (math.isfinite(record["scale"]) and record["scale"] > 0):
            raise CheckpointError(f"history record {i} has a loss scale of {record['scale']!r}; a scale is > 0")


def _check_model(saved, mine) -> None:
    if not isinstance(saved, dict) or list(saved) != list(mine):
        raise CheckpointError("its model weights do not name this model's tensors")
    for name, ref in mine.items():
        t = saved[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"model tensor {name!r} is {got}; the model's is {ref.dtype} of shape "
                                  f"{list(ref.shape)}")
        _check_finite(f"model tensor {name!r}", t)


_NONNEGATIVE = ("eps", "weight_decay", "momentum", "dampening")


def _check_hyperparameter(what, key, value, with_scheduler) -> None:
    value = _number(value)
    if value is None or isinstance(value, (bool, str)):
        return
    if key == "betas":
        if not isinstance(value, (tuple, list)) or not all(_is_number(_number(b)) and 0 <= _number(b) < 1
                                                         for b in value):
            raise CheckpointError(f"{what} is {value!r}; each beta must lie in [0, 1)")
        return
    if isinstance(value, (tuple, list)):
        for v in value:
            _check_finite(what, _number(v))
        return
    _check_finite(what, value)
    if key in ("lr", "initial_lr"):
        # A schedule may end at lr 0 (CosineAnnealingLR with eta_min=0); without one, lr > 0.
        if value < 0 or (value == 0 and (key == "initial_lr" or not with_scheduler)):
            raise CheckpointError(f"{what} is {value!r}; a learning rate must be > 0")
    elif key in _NONNEGATIVE and value < 0:
        raise CheckpointError(f"{what} is {value!r}; it must be >= 0")


def _check_optimizer(saved, params, with_scheduler) -> None:
    groups, state = saved["param_groups"], saved["state"]
    ids = [i for g in groups for i in g["params"]]
    if len(ids) != len(params) or len(set(ids)) != len(ids):
        raise CheckpointError("its optimizer state holds another set of parameters")
    shapes = {i: p.shape for i, p in zip(ids, params)}
    for k, group in enumerate(groups):
        for key, value in group.items():
            if key != "params":
                _check_hyperparameter(f"the optimizer's {key} (param group {k})", key, value, with_scheduler)
    for pid, entry in state.items():
        if pid not in shapes:
            raise CheckpointError(f"its optimizer state names parameter {pid!r}, which no param group holds")
        for key, value in entry.items():
            what = f"the optimizer's {key!r} of parameter {pid}"
            value = _number(value) if key == "step" else value
            if value is None or isinstance(value, bool):
                continue
            _check_finite(what, value)
            if key == "step" and (value < 0 or value != int(value)):
                raise CheckpointError(f"{what} is {value!r}; a step count is an integer >= 0")
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shapes[pid]:
                raise CheckpointError(f"{what} has shape {list(value.shape)}; its parameter has "
                                      f"{list(shapes[pid])}")
            if key in ("exp_avg_sq", "max_exp_avg_sq") and bool((value < 0).any()):
                raise CheckpointError(f"{what} holds negative values; a mean of squares is >= 0")


def _check_scaler_state(saved) -> None:
    try:
        _check_scale("the loss scale", saved["scale"])
        _check_factors(saved["growth_factor"], saved["backoff_factor"])
        _check_positive("growth_interval", saved["growth_interval"], integer=True)
        tracker = saved["_growth_tracker"]
        if not isinstance(tracker, int) or not 0 <= tracker < saved["growth_interval"]:
            raise ValueError(f"its count of clean steps is {tracker!r}; it must be an integer from 0 "
                             f"to growth_interval - 1 ({saved['growth_interval'] - 1})")
    except ValueError as err:
        raise CheckpointError(f"its GradScaler state is invalid: {err}") from None


def _check_scheduler_state(saved) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError("its lr scheduler state is not a dict")

    def walk(what, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{what}[{k!r}]", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{what}[{i}]", v)
        elif isinstance(value, (float, torch.Tensor)):
            _check_finite(what, value)

    walk("its lr scheduler state", saved)
    if "last_epoch" in saved and (not isinstance(saved["last_epoch"], int) or saved["last_epoch"] < 0):
        raise CheckpointError(f"its lr scheduler's last_epoch is {saved['last_epoch']!r}; it must be >= 0")
    for key in ("base_lrs", "_last_lr"):
        for lr in saved.get(key) or ():
            if not _is_number(_number(lr)) or _number(lr) < 0 or (key == "base_lrs" and _number(lr) == 0):
                raise CheckpointError(f"its lr scheduler's {key} holds {lr!r}; a learning rate must be > 0")


def _check_rng(rng) -> None:
    """Try each saved state on a scratch generator: the global ones stay untouched."""
    try:
        random.Random().setstate(rng["python"])
        key = rng["numpy"][1]
        if not isinstance(key, torch.Tensor) or key.dim() != 1 or not bool(((key >= 0) & (key < 2**32)).all()):
            raise ValueError("NumPy's key is not 32-bit words")
        np.random.RandomState().set_state(_rng_from_checkpoint(rng)["numpy"])
        torch.Generator().set_state(rng["torch"])
        for state in rng.get("cuda", ()):
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise ValueError("a CUDA generator state is not a byte tensor")
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
        raise CheckpointError(f"its random number generator states are invalid ({_first_line(err)})") from None
