"""The one training loop of the course: :class:`Trainer`, one optimizer step at a time.

Lessons 01 and 03-05 train through :class:`Trainer`. :meth:`Trainer.step` reads like the
recipe, with ``enabled=`` flags instead of branches::

    with torch.autocast(device.type, dtype=dtype, enabled=use_amp):
        loss = loss_fn(model(x), y) / accum_steps
    scaler.scale(loss).backward()          # every micro-batch
    scaler.unscale_(opt)                   # once, on the stepping micro-batch
    clip_grad_norm_(params, clip_norm)     # on true (unscaled) gradients
    scaler.step(opt)                       # skipped when the gradients hold inf/NaN
    scaler.update()                        # halve on a skip, grow after growth_interval clean steps

What the lessons measure on the way (each step's gradient norms and zeros, the callbacks
such as :class:`GradientRecorder`) and the teaching variants (clipping *before*
``unscale_``, lesson 04; fp16 without a scaler and a loss made non-finite at chosen steps,
lesson 03) live in small methods off that path. A step counts as skipped when the
optimizer did not apply it (seen by a hook on the optimizer, not guessed from the scale).

Every argument is checked in :mod:`amp_lessons.arguments` before any work is done;
checkpoints (:meth:`Trainer.save`, :meth:`Trainer.load`) are :mod:`amp_lessons.checkpoints`;
the history is :mod:`amp_lessons.history`.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from . import checkpoints, progress
from .arguments import (
    check_bool,
    check_clip,
    check_data,
    check_fit_steps,
    check_lr,
    check_model,
    check_positive,
    check_scaler_settings,
    check_seed,
    check_steps,
)
from .checkpoints import tensor_digest
from .hardware import resolve
from .history import History, StepRecord
from .precision import dtype_of, float32_matmul_precision, needs_scaler, uses_autocast
from .progress import progress_enabled
from .seeding import seed_everything

__all__ = ["GradientRecorder", "History", "NonFiniteLossError", "ScaleCollapseError", "StepRecord", "Trainer"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
DEFAULT_LR = 1e-3


class NonFiniteLossError(FloatingPointError):
    """The loss became inf/NaN where no GradScaler can skip the step."""


class ScaleCollapseError(FloatingPointError):
    """GradScaler kept skipping until its scale fell below the floor: no scale can save the run."""


class GradientRecorder:
    """A callback that keeps the gradient values of chosen steps, for lesson 01's histogram.

    ``weight_grads``: every parameter's gradient (unscaled). ``activation_grads``: the
    gradients flowing between layers during backward (``grad_output`` of each Linear).
    """

    def __init__(self, steps=(0,), module_types=(torch.nn.Linear,)):
        self.steps = set(check_steps("steps", steps))
        types = module_types if isinstance(module_types, tuple) else (module_types,)
        if not types or not all(isinstance(t, type) and issubclass(t, torch.nn.Module) for t in types):
            raise TypeError(f"module_types must be module classes, e.g. (torch.nn.Linear,); got {module_types!r}")
        self.module_types = types
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



# -- the statistics a step records (off the recipe's path) ------------------------------------


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



# -- building the optimizer and the scheduler, checked -----------------------------------------


_SCHEDULER_EXAMPLE = "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)"
_OPTIMIZER_EXAMPLE = "optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"


def _is_optimizer_class(optimizer) -> bool:
    return inspect.isclass(optimizer) and issubclass(optimizer, torch.optim.Optimizer)


def make_optimizer(optimizer, model, lr):
    """The optimizer of a run on ``model`` (03-05): a name (``"sgd"``, ``"adam"``, ``"adamw"``)
    or an optimizer class, built with ``lr`` (1e-3 when None); a function of the parameters
    or an optimizer built on ``model``, whose own lr holds (``lr`` may repeat it, not
    contradict it). An optimizer over other parameters is refused: it would train nothing."""
    if isinstance(optimizer, str) and optimizer.strip().lower() in OPTIMIZERS:
        optimizer = OPTIMIZERS[optimizer.strip().lower()]
    if _is_optimizer_class(optimizer):
        built = optimizer(model.parameters(), lr=DEFAULT_LR if lr is None else lr)
    elif isinstance(optimizer, torch.optim.Optimizer):
        built = optimizer
    elif callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, e.g. {_OPTIMIZER_EXAMPLE}; "
                            f"got {type(built).__name__}")
    else:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, an optimizer class such as "
                         f"torch.optim.SGD, or a function of the parameters, e.g. {_OPTIMIZER_EXAMPLE}; "
                         f"got {optimizer!r}")
    _check_optimizer_fits(built, model, lr)
    return built


def _check_optimizer_fits(built, model, lr) -> None:
    """``built`` steps ``model``'s parameters, at the lr asked for, with a plain ``step()``."""
    mine = {id(p) for p in model.parameters()}
    held = [p for g in built.param_groups for p in g["params"]]
    foreign = sum(id(p) not in mine for p in held)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} of its {len(held)} parameters from outside this model, "
                         "so its steps would not train the model: build it on the model's parameters, e.g. "
                         f"{_OPTIMIZER_EXAMPLE} (the Trainer passes them)")
    lrs = sorted({float(_number(g["lr"])) for g in built.param_groups})
    if lr is not None and lrs != [float(lr)]:
        raise ValueError(f"the optimizer was built with lr {', '.join(f'{v:g}' for v in lrs)}, and lr={lr!r} was "
                         "passed too: give the learning rate once, either inside the optimizer (and no lr=) "
                         "or as lr= with optimizer='sgd', 'adam', 'adamw' or a class such as torch.optim.SGD")
    needs = _required_arguments(built.step)
    if needs:
        raise TypeError(f"{type(built).__name__}.step() needs {', '.join(needs)}, and the Trainer calls "
                        "optimizer.step() with no argument (through scaler.step): use an optimizer such as "
                        "torch.optim.SGD, Adam or AdamW")


def _number(value):
    """A one-element tensor as a Python number (an optimizer may keep its lr as a tensor)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _required_arguments(method) -> list[str]:
    """The arguments ``method`` cannot be called without (``metrics`` for ReduceLROnPlateau.step)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it needs none
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]



# -- the settings a checkpoint records: what decides a run's next steps ----------------------


def _plain(value):
    """``value`` as numbers, strings, lists and dicts (a checkpoint's settings, compared on load)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return type(value).__name__  # a function (LambdaLR's): only its kind can be compared


def callable_name(f) -> str:
    """``module.qualname`` of a function (``torch.nn.functional.cross_entropy``), with a
    partial's arguments: how a checkpoint names a run's loss function."""
    if isinstance(f, functools.partial):
        args = [repr(a) for a in f.args] + [f"{k}={v!r}" for k, v in f.keywords.items()]
        return f"{callable_name(f.func)}({', '.join(args)})"
    module = getattr(f, "__module__", None) or type(f).__module__
    return f"{module}.{getattr(f, '__qualname__', type(f).__qualname__)}"


def optimizer_settings(optimizer) -> dict:
    """The optimizer's kind and hyper-parameters, per param group (as built, before any schedule)."""
    groups = [{"parameters": len(g["params"]), **{k: _plain(v) for k, v in g.items() if k != "params"}}
              for g in optimizer.param_groups]
    return {"type": type(optimizer).__name__, "groups": groups}


def scheduler_settings(scheduler) -> dict:
    """The lr scheduler's kind and its state as built (its step size, gamma, ...)."""
    if scheduler is None:
        return {"type": None}
    return {"type": type(scheduler).__name__, "as_built": _plain(scheduler.state_dict())}


def data_settings(data) -> dict:
    """Which training data: its name, size and a digest of its examples and labels."""
    return {"name": str(getattr(data, "name", type(data).__name__)), "examples": len(data.x_train),
            "digest": tensor_digest(data.x_train, data.y_train)}


# -- one step's numbers, and whether the optimizer applied it ----------------------------------


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



@dataclass
class _Probe:
    """What one step records besides its loss, gathered in the methods around the recipe."""

    start: float
    scale: float
    params: list = field(default_factory=list)
    lr: float = math.nan
    zeros: torch.Tensor | None = None
    norm: torch.Tensor | None = None     # the true gradient norm (before the clip)
    applied: torch.Tensor | None = None  # the norm of the gradient the optimizer applies
    seen: float = math.nan               # the norm the clip compared with clip_norm
    clipped_scaled: bool = False         # clipped before unscale_ (lesson 04's trap)

    def grads(self) -> list:
        return [p.grad for p in self.params]


def _integer_inputs_message(model, x, said) -> str:
    """Why a model of floating-point weights refused integer inputs, and the fix (01-05)."""
    weights = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                      if p.is_floating_point()}) or ["floating point"]
    return (f"the model got inputs of dtype {str(x.dtype).removeprefix('torch.')}, but its weights are "
            f"{' and '.join(weights)}: it computes in floating point and expects floating-point "
            f"inputs (torch said: {said}). Convert the inputs when you build the data, e.g. "
            "Dataset(x_train.float(), y_train, x_test.float(), y_test); autocast casts floating-point "
            "inputs only.")


_CALLBACK_METHODS = ("attach", "before_step", "after_backward")


def _check_callbacks(callbacks) -> list:
    """A list of objects with ``before_step(trainer)`` and/or ``after_backward(trainer)`` (01)."""
    try:
        found = list(callbacks)
    except TypeError:
        raise TypeError(f"callbacks must be a list of callback objects, e.g. callbacks=[GradientRecorder()]; "
                        f"got {callbacks!r}") from None
    for cb in found:
        if not any(callable(getattr(cb, name, None)) for name in _CALLBACK_METHODS):
            raise TypeError(f"each callback needs a method before_step(trainer) or after_backward(trainer) (and "
                            f"may have attach(trainer)), like GradientRecorder; got {cb!r}")
    return found


class Trainer:
    """Train ``model`` on ``data`` in one precision, one optimizer step at a time.

    Used in 01 (gradients to histogram), 03 (GradScaler), 04 (clipping, accumulation)
    and 05 (precisions side by side). See the module docstring for the step itself.

    ``optimizer``: ``"sgd"``, ``"adam"``, ``"adamw"`` or an optimizer class, built with
    ``lr`` (1e-3 when not given), or a function of the parameters (or an optimizer built
    on ``model``) that sets its own lr.

    ``grad_stats``: with ``True`` (the default) every step records two exact statistics
    of the gradients: ``zero_frac``, the share of gradient values that are exactly zero
    (what fp16 flushed, lesson 03), and ``grad_norm``, the L2 norm of all of them together
    (lesson 04). Both read every gradient once more, a cost that grows with the number of
    parameters. ``False`` skips that read when only speed matters (``bench``): then
    ``zero_frac``, ``grad_norm`` and ``applied_norm`` are NaN, except that with
    ``clip_norm`` set, ``grad_norm`` and ``applied_norm`` are still recorded, because the
    clip computes the norm anyway.
    """

    def __init__(self, model, data, precision="fp32", device=None, optimizer="adamw", lr=None,
                 batch_size=64, accum_steps=1, clip_norm=None, clip_order="unscale_first",
                 scaler=None, init_scale=2.0**16, growth_interval=2000, growth_factor=2.0,
                 backoff_factor=0.5, min_scale=2.0**-14, scheduler=None,
                 step_scheduler_on_skip=False, inject_nonfinite=(), loss_fn=F.cross_entropy,
                 seed=0, progress=None, callbacks=(), teaching=False, grad_stats=True):
        self.precision, self.device = resolve(precision, device)
        check_model(model)
        if lr is not None:
            check_lr(lr)
        check_positive("batch_size", batch_size, integer=True)
        check_positive("accum_steps", accum_steps, integer=True)
        check_data(data, batch_size, accum_steps, loss_is_default=loss_fn is F.cross_entropy)
        check_clip(clip_norm, clip_order)
        check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale)
        self._check_functions(loss_fn, scheduler)
        self.grad_stats = check_bool("grad_stats", grad_stats, "record zero_frac and grad_norm every step")
        self.step_scheduler_on_skip = check_bool("step_scheduler_on_skip", step_scheduler_on_skip,
                                                 "step the lr scheduler on skipped steps too, lesson 03's mistake")
        teaching = check_bool("teaching", teaching, "allow the lessons' wrong settings without a warning")
        if progress is not None:
            check_bool("progress", progress, "show a progress bar")
        self.seed = check_seed(seed)
        self.inject_nonfinite = check_steps("inject_nonfinite", inject_nonfinite)
        self.callbacks = _check_callbacks(callbacks)
        use_scaler = needs_scaler(self.precision) if scaler is None else check_bool(
            "scaler", scaler, "use a GradScaler; None: only for fp16")
        self._warn_teaching(use_scaler, clip_order, teaching)
        self.model = model.to(self.device)
        self.data = data
        self.batch_size, self.accum_steps = int(batch_size), int(accum_steps)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.clip_order = clip_order
        self.dtype = dtype_of(self.precision)
        self.use_amp = uses_autocast(self.precision)
        self.optimizer = make_optimizer(optimizer, self.model, None if lr is None else float(lr))
        self.lr = float(_number(self.optimizer.param_groups[0]["lr"]))
        self._optimizer_settings = optimizer_settings(self.optimizer)
        self._applied = _StepWatch(self.optimizer)
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=float(init_scale), growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor), growth_interval=int(growth_interval), enabled=use_scaler)
        self.min_scale = float(min_scale)
        self.scheduler = self._make_scheduler(scheduler)
        self._scheduler_settings = scheduler_settings(self.scheduler)
        self.loss_fn = loss_fn
        self.progress = progress_enabled(progress)
        self.step_count = 0
        self.history = History()
        self._labels_checked = False
        seed_everything(self.seed)
        for cb in self.callbacks:
            getattr(cb, "attach", lambda t: None)(self)

    @staticmethod
    def _check_functions(loss_fn, scheduler) -> None:
        if not callable(loss_fn):
            raise TypeError("loss_fn must be a function of (logits, labels) that returns the loss, "
                            f"e.g. torch.nn.functional.cross_entropy (the default); got {loss_fn!r}")
        if scheduler is not None and not callable(scheduler):
            raise TypeError(f"scheduler must be a function that takes the optimizer and returns an lr "
                            f"scheduler, e.g. scheduler={_SCHEDULER_EXAMPLE}; got {scheduler!r}")


    def _warn_teaching(self, use_scaler, clip_order, teaching) -> None:
        """The lessons' wrong settings warn unless ``teaching=True`` (03, 04)."""
        if needs_scaler(self.precision) and not use_scaler and not teaching:
            warnings.warn("fp16 without a GradScaler: small gradients flush to zero and training "
                          "stalls (lesson 03). Pass teaching=True if that is what you want to show.",
                          UserWarning, stacklevel=3)
        if clip_order == "before_unscale" and not teaching:
            warnings.warn("clip_order='before_unscale' clips still-scaled gradients: the effective "
                          "threshold becomes clip_norm/scale (lesson 04). Pass teaching=True to show it.",
                          UserWarning, stacklevel=3)

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

    # -- one optimizer step: the recipe ------------------------------------------------------

    def step(self) -> StepRecord:
        """One optimizer step (``accum_steps`` micro-batches); returns its record. Used in 01, 03-05.

        The recipe, top to bottom. What the lessons measure on the way and lesson 04's wrong
        clip order happen in the methods named here, not between its lines."""
        probe = self._begin_step()                  # callbacks; the scale this step uses
        loss = self._forward_backward()             # autocast forward, scaler.scale(loss).backward()
        self._after_backward(probe)                 # callbacks; the zeros that backward left
        self._clip_before_unscale(probe)            # lesson 04's trap, only with clip_order="before_unscale"
        self.scaler.unscale_(self.optimizer)        # the true gradients, once per step
        self._clip(probe)                           # clip_grad_norm_(params, clip_norm), when clip_norm is set
        self.scaler.step(self.optimizer)            # skipped when the gradients hold inf/NaN
        self.scaler.update()                        # halve on a skip, grow after growth_interval clean steps
        self.optimizer.zero_grad(set_to_none=True)
        return self._end_step(loss, probe)          # the record, the scheduler, the scale's floor

    def _forward_backward(self) -> torch.Tensor:
        """Forward + loss under autocast and a scaled backward, for every micro-batch; returns
        the step's loss (the sum of the divided micro-batch losses: their mean)."""
        total = None
        for micro in range(self.accum_steps):
            x, y = self._micro_batch(micro)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.use_amp):
                loss = self._loss(self._model_output(x), y)
                if self.accum_steps > 1:  # (dividing by 1 would change nothing but cost an op)
                    loss = loss / self.accum_steps
            self.scaler.scale(loss).backward()
            part = loss.detach().float()
            total = part if total is None else total + part
        self._stop_if_not_finite(total)
        return total

    def _micro_batch(self, micro: int):
        """The batch of micro-batch ``micro`` of this step, on the device: every step draws new
        ones, in the order the seed fixes (a resumed run draws the same)."""
        x, y = self.data.batch(self.step_count * self.accum_steps + micro, self.batch_size, self.seed)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _loss(self, output, y) -> torch.Tensor:
        """``loss_fn(output, y)``, checked to be one number; inf at the steps in
        ``inject_nonfinite`` (lesson 03's overflow, on purpose)."""
        if not self._labels_checked:
            self._check_labels(output)
        loss = self.loss_fn(output, y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"a tensor of shape {list(loss.shape)} and dtype {loss.dtype}" if isinstance(
                loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return the loss as one floating-point number (a 0-dim tensor, "
                            f"e.g. cross_entropy with reduction='mean'); got {got}. No step was taken.")
        if self.step_count in self.inject_nonfinite:
            loss = loss * float("inf")
        return loss

    def _stop_if_not_finite(self, total) -> None:
        """Without a scaler no step can be skipped: an inf/NaN loss stops the run before the update.
        Checked once, after the last backward (one sync per step)."""
        if not self.scaler.is_enabled() and not torch.isfinite(total):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"the loss is {total.item()} at step {self.step_count} ({self.precision}, no "
                "GradScaler); no parameters were changed by this step. Lower the learning rate, "
                "check the data for inf/NaN, or clip gradients; in fp16 use a GradScaler.")

    # -- around the recipe: the callbacks and the statistics ---------------------------------

    def _begin_step(self) -> _Probe:
        start = time.perf_counter()
        for cb in self.callbacks:
            getattr(cb, "before_step", lambda t: None)(self)
        self._applied.reset()
        return _Probe(start=start, scale=self.current_scale())

    def _after_backward(self, probe: _Probe) -> None:
        """Callbacks see the gradients as backward left them; so does the zero count
        (unscaling by a power of two makes no value 0 that float32 can hold)."""
        for cb in self.callbacks:
            getattr(cb, "after_backward", lambda t: None)(self)
        probe.params = [p for p in self.model.parameters() if p.grad is not None]
        probe.zeros = _count_zeros(probe.grads()) if self.grad_stats else None
        probe.lr = float(self.optimizer.param_groups[0]["lr"])

    def _clip_before_unscale(self, probe: _Probe) -> None:
        """Lesson 04's trap (``teaching=True``): the clip sees norm * scale, so it clips by
        clip_norm / scale. Does nothing in the recipe's order."""
        if self.clip_norm is not None and self.clip_order == "before_unscale":
            probe.seen = float(torch.nn.utils.clip_grad_norm_(probe.params, self.clip_norm))  # amp-lint: ignore[clip-before-unscale]
            probe.clipped_scaled = True

    def _clip(self, probe: _Probe) -> None:
        """After ``unscale_``: clip the true gradients (when ``clip_norm`` is set) and keep the
        norms the history records: the true one, the one the clip saw, the one applied (04)."""
        if probe.clipped_scaled:  # the norm it saw, divided by the scale: the true norm
            probe.norm = torch.tensor(probe.seen / probe.scale, dtype=torch.float32)
            probe.applied = _global_norm(probe.grads()) if self.grad_stats else None
        elif self.clip_norm is not None:  # the clip computes the norm anyway: the one it clipped by
            probe.norm = torch.nn.utils.clip_grad_norm_(probe.params, self.clip_norm)
            probe.seen = float(probe.norm)
            probe.applied = probe.norm * min(1.0, self.clip_norm / (probe.seen + 1e-6))
        elif self.grad_stats:
            probe.norm = probe.applied = _global_norm(probe.grads())

    def _end_step(self, loss, probe: _Probe) -> StepRecord:
        """The step's record, from one transfer of its numbers (one sync on a GPU); the lr
        scheduler follows the steps the optimizer applied; the scale's floor (03)."""
        found_inf = self._applied.found_inf
        loss_v, norm_v, applied_v, zeros_v, found_v = _as_floats(loss, probe.norm, probe.applied,
                                                                 probe.zeros, found_inf)
        # From the optimizer, not from the scale: a factor may leave the scale where it was.
        skipped = not self._applied.called or (found_inf is not None and found_v != 0)
        if self.scheduler is not None and (not skipped or self.step_scheduler_on_skip):
            self.scheduler.step()
        record = StepRecord(
            step=self.step_count, loss=loss_v, scale=probe.scale, skipped=bool(skipped),
            grad_norm=norm_v, clip_seen_norm=probe.seen, applied_norm=applied_v,
            zero_frac=zeros_v / max(1, sum(p.numel() for p in probe.params)), lr=probe.lr,
            ms=(time.perf_counter() - probe.start) * 1e3)
        self.history.append(record)
        self.step_count += 1
        self._stop_if_collapsed(record)
        return record

    def _stop_if_collapsed(self, record) -> None:
        if self.scaler.is_enabled() and self.current_scale() < self.min_scale:
            raise ScaleCollapseError(
                f"the loss scale fell to {self.current_scale():.3g} (below the floor {self.min_scale:.3g}) "
                f"at step {record.step} after {self.history.trailing_skips()} skipped steps in a row: the "
                "loss or its gradients are most likely inf/NaN at any scale. The parameters are "
                "unchanged by the skipped steps. Check the data for inf/NaN and lower the learning "
                f"rate; if the scale was still falling into range, lower min_scale ({self.min_scale:g}).")

    # -- runs, evaluation, checkpoints -------------------------------------------------------

    def fit(self, steps: int) -> History:
        """Run ``steps`` more optimizer steps; returns the (cumulative) history."""
        steps = check_fit_steps(steps, self.step_count)
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
        """``self.model(x)``; inputs that the model cannot take get an error that says why."""
        try:
            return self.model(x)
        except RuntimeError as err:
            said = str(err).splitlines()[0] if str(err) else type(err).__name__
            if not (x.is_floating_point() or x.is_complex()):
                raise TypeError(_integer_inputs_message(self.model, x, said)) from err
            if "shape" in said or "size" in said:
                raise ValueError(
                    f"the model cannot take this data's inputs of shape {list(x.shape)} (torch said: {said}). "
                    f"Each example has shape {list(x.shape[1:])}: build the model for it (e.g. "
                    f"mlp({x[0].numel()}, ...) for flat examples), or the data for the model.") from err
            raise

    def _check_labels(self, output) -> None:
        """Once, at the first forward: class numbers that cross_entropy can take for this
        model's number of outputs (-100, its ignore_index, included)."""
        self._labels_checked = True
        y = self.data.y_train
        if self.loss_fn is not F.cross_entropy or y.is_floating_point() or output.dim() < 2:
            return
        classes = output.shape[1]
        bad = (y >= classes) | ((y < 0) & (y != -100))
        if bool(bad.any()):
            first = int(y[bad][0])
            raise ValueError(f"data.y_train holds the class number {first}, but the model gives {classes} scores per "
                             f"example: cross_entropy takes class numbers from 0 to {classes - 1}. Build the model "
                             f"with {int(y.max()) + 1} outputs, or number the classes from 0. No step was taken.")

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

    def run_settings(self) -> dict:
        """Everything but the state that decides this run's next steps: a checkpoint records it,
        and :meth:`load` refuses a checkpoint whose settings differ, naming each (03)."""
        return {
            "precision": self.precision, "seed": self.seed, "batch_size": self.batch_size,
            "accum_steps": self.accum_steps, "clip_norm": self.clip_norm, "clip_order": self.clip_order,
            "loss_fn": callable_name(self.loss_fn), "inject_nonfinite": sorted(self.inject_nonfinite),
            "step_scheduler_on_skip": self.step_scheduler_on_skip, "min_scale": self.min_scale,
            "scaler": {"enabled": self.scaler.is_enabled(), **self._scaler_factors()},
            "optimizer": self._optimizer_settings, "scheduler": self._scheduler_settings,
            "data": data_settings(self.data),
        }

    def _scaler_factors(self) -> dict:
        if not self.scaler.is_enabled():
            return {}
        return {"growth_factor": float(self.scaler.get_growth_factor()),
                "backoff_factor": float(self.scaler.get_backoff_factor()),
                "growth_interval": int(self.scaler.get_growth_interval())}

    def save(self, path) -> Path:
        """Save model, optimizer, scaler, scheduler, step, RNG state, history and the run's
        settings, with a SHA-256 digest of all of it (:func:`amp_lessons.checkpoints.save`).
        A state that could not be resumed, or a path that is a directory, writes nothing."""
        return checkpoints.save(self, path)

    def load(self, path) -> Trainer:
        """Restore a checkpoint that :meth:`save` wrote from a run built like this one
        (:func:`amp_lessons.checkpoints.load`): exact, or refused with a
        :class:`~amp_lessons.checkpoints.CheckpointError` that names what differs or what is
        wrong and leaves this trainer exactly as it was."""
        return checkpoints.load(self, path)
