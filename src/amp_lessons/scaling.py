"""Loss scaling with GradScaler, measured: lesson 03's runs and the readers of their results.

Used in 03_grad_scaler. Two configurations of one digits MLP show the two ends of float16's
range:

- **small gradients** (:func:`small_loss`): the cross-entropy times ``2^-15``. Large
  networks have gradients far smaller than a 4-layer MLP's; this weight moves the MLP's
  gradients down to where theirs lie, so a laptop can show what fp16 does to them. Adam's
  steps do not depend on the size of the loss, so fp32 trains much as before, while fp16
  without a scaler flushes most gradients to zero.
- **large gradients** (:func:`summed_loss`): the cross-entropy summed over the batch, not
  averaged. Its gradients times GradScaler's first scale, 65536, overflow float16's largest
  value (65504): the first steps are skipped while the scaler halves its way down.

Readers: :func:`flush_report` (which gradients fp16 lost), :func:`optimizer_steps` (the
steps Adam really took), :func:`scale_changes` (when the scale grew or halved) and
:func:`scheduler_warnings` (the lr_scheduler warning after a skipped first step).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .claims import measured
from .data import digits
from .models import mlp
from .training import GradientRecorder, History, Trainer

LOSS_WEIGHT = 2.0**-15
LESSON_SETTINGS = {"optimizer": "adamw", "lr": 3e-3, "batch_size": 64}
SCHEDULER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def small_loss(logits, y):
    """Cross-entropy times :data:`LOSS_WEIGHT` (``2^-15``): gradients as small as a large network's."""
    return F.cross_entropy(logits, y) * LOSS_WEIGHT


def summed_loss(logits, y):
    """Cross-entropy summed over the batch: gradients ``batch_size`` times the mean's."""
    return F.cross_entropy(logits, y, reduction="sum")


def _whole(name: str, value, low: int = 0, high: int | None = None, why: str = "") -> int:
    """``value`` if it is a whole number from ``low`` (to ``high``), else a ValueError saying so."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        upto = f" to {high}" if high is not None else " up"
        raise ValueError(f"{name} must be a whole number from {low}{upto}{why}; got {value!r}")
    return int(value)


def lesson_model(seed: int = 0):
    """03's MLP (64 -> 64 -> 64 -> 64 -> 10, ReLU): the same weights on every call, built
    under its own seed without touching the global RNG."""
    seed = _whole("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mlp(64, 64, 10, depth=3)


@functools.lru_cache(maxsize=1)
def lesson_data():
    """The 8x8 digits (loaded once; nothing in the lessons changes them)."""
    return digits()


def lesson_trainer(precision="fp16", scaler=None, device=None, loss_fn=small_loss, **settings) -> Trainer:
    """A :class:`Trainer` of :func:`lesson_model` on the digits with 03's settings
    (AdamW, lr 3e-3, batch 64, ``teaching=True``); ``settings`` override or add Trainer arguments."""
    kwargs = {**LESSON_SETTINGS, "teaching": True, **settings}
    return Trainer(lesson_model(), lesson_data(), precision=precision, scaler=scaler,
                   device=device, loss_fn=loss_fn, **kwargs)


def first_step_gradients(precision, scaler=None, device=None, loss_fn=small_loss) -> torch.Tensor:
    """Every weight gradient of step 0 (unscaled, float32): the same weights and the same
    batch whatever the precision, so two precisions compare value by value."""
    recorder = GradientRecorder(steps={0})
    lesson_trainer(precision, scaler, device, loss_fn, callbacks=[recorder], progress=False).fit(1)
    return recorder.weight_grads


@dataclass(frozen=True)
class FlushReport:
    """The same gradients computed two ways: a float32 reference and another precision."""

    name: str
    total: int
    zero_reference: int
    zero_other: int
    flushed: int  # nonzero in the reference, exactly zero in the other

    @property
    def flushed_fraction(self) -> float:
        """Of the gradients float32 computed as nonzero, the fraction the other made 0."""
        return self.flushed / max(1, self.total - self.zero_reference)

    def __str__(self) -> str:
        # Which values come out as zero depends on float kernels: the shares print with ≈.
        nonzero = self.total - self.zero_reference
        return (f"{self.total:,} gradient values; exactly zero: fp32 {measured(self.zero_reference / self.total, '.1%')}, "
                f"{self.name} {measured(self.zero_other / self.total, '.1%')}; {self.name} made "
                f"{measured(self.flushed, ',')} of fp32's {measured(nonzero, ',')} nonzero values exactly zero "
                f"({measured(self.flushed_fraction, '.1%')})")


def flush_report(reference: torch.Tensor, other: torch.Tensor, name: str = "fp16") -> FlushReport:
    """Compare ``other`` with the float32 ``reference`` of the same gradients, value by value."""
    for what, t in (("reference", reference), ("other", other)):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what} must be a non-empty floating-point tensor of gradients (e.g. "
                             f"first_step_gradients(...)); got {got}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name is the other precision's label, such as 'fp16'; got {name!r}")
    if reference.shape != other.shape:
        raise ValueError(f"the two gradient sets differ in shape: {tuple(reference.shape)} vs "
                         f"{tuple(other.shape)}; record the same model at the same step")
    ref_zero, other_zero = reference == 0, other == 0
    return FlushReport(name, reference.numel(), int(ref_zero.sum()), int(other_zero.sum()),
                       int((other_zero & ~ref_zero).sum()))


def optimizer_steps(optimizer) -> int:
    """The steps the optimizer really applied, from its own counter (Adam's
    ``state[p]["step"]``): a step GradScaler skipped never reached the optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch optimizer (e.g. trainer.optimizer); got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.SGD):
        raise ValueError("SGD keeps no step count; count the steps whose scale did not drop instead")
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                return int(state["step"])
    if any(optimizer.state.values()):
        raise ValueError(f"{type(optimizer).__name__} keeps no step count; count the steps whose "
                         "scale did not drop instead")
    return 0  # no step applied yet


def scale_changes(history, final_scale=None) -> list[tuple[int, str, float, float]]:
    """``(step, "halved" | "grew", before, after)`` for every step after which the scale
    changed. The scale after the last step is ``final_scale`` (``trainer.current_scale()``)."""
    _check_history(history, final_scale)
    scales = [*history["scale"], final_scale if final_scale is not None else history[-1].scale]
    out = []
    for step, before, after in zip(history["step"], scales, scales[1:]):
        if after != before:
            out.append((step, "halved" if after < before else "grew", before, after))
    return out


def describe_scale_changes(history, final_scale=None) -> str:
    """:func:`scale_changes` as lines of text, then the count of skipped steps."""
    lines = [f"step {s:>3}: {kind:<6} {b:>9g} -> {a:g}"
             for s, kind, b, a in scale_changes(history, final_scale)]
    lines.append(f"{history.skipped} of {len(history)} steps skipped")
    return "\n".join(lines)


def _check_history(history, final_scale) -> None:
    if not isinstance(history, History) or not len(history):
        raise ValueError("history must be what trainer.fit(...) returned, with at least one step; got "
                         f"{history!r:.60}")
    if final_scale is not None and not (isinstance(final_scale, numbers.Real) and not isinstance(final_scale, bool)
                                        and math.isfinite(final_scale) and final_scale > 0):
        raise ValueError(f"final_scale must be the scale after the last step, a positive number "
                         f"(trainer.current_scale()), or None; got {final_scale!r}")


def scale_run(init_scale=2.0**16, growth_interval=10, inject_at=None, steps=40, device=None, **settings):
    """A short fp16 run with the large-gradient loss (:func:`summed_loss`), for the scale
    plot and its widget: returns ``(history, scale after the last step)``. ``settings`` go to
    the Trainer (the widget passes ``grad_stats=False``: its plot draws no gradient statistics).
    ``inject_at``: a step of the run (0 to ``steps - 1``) whose loss is made inf; None or -1: none."""
    steps = _whole("steps", steps, 1)
    if inject_at is not None:
        inject_at = _whole("inject_at", inject_at, -1, steps - 1,
                           " (-1 or None: no inf; else a step of the run, counted from 0)")
    trainer = lesson_trainer("fp16", device=device, loss_fn=summed_loss, init_scale=init_scale,
                             growth_interval=growth_interval, progress=False,
                             inject_nonfinite=() if inject_at is None or inject_at < 0 else (inject_at,),
                             **settings)
    history = trainer.fit(steps)
    return history, trainer.current_scale()


def scheduler_warnings(step_scheduler_on_skip: bool, steps: int = 3, device=None):
    """Run the large-gradient fp16 loop (its first step is skipped) with an lr scheduler;
    return ``(warning messages, trainer)``.

    ``step_scheduler_on_skip=True`` is the common loop that calls ``scheduler.step()``
    every iteration; ``False`` steps it only when the optimizer stepped (the fix).
    """
    if not isinstance(step_scheduler_on_skip, bool):
        raise ValueError("step_scheduler_on_skip must be True (the common loop) or False (the fix); "
                         f"got {step_scheduler_on_skip!r}")
    trainer = lesson_trainer("fp16", device=device, loss_fn=summed_loss, progress=False,
                             scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10, 0.5),
                             step_scheduler_on_skip=step_scheduler_on_skip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(steps)
    return [str(w.message) for w in caught], trainer
