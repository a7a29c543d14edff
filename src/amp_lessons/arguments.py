"""The argument checks of the training entry points, in one place.

:class:`~amp_lessons.training.Trainer`, its ``fit``, ``save`` and ``load``, the checkpoint
validators and lesson 04's clipping functions all check their arguments here, so that one
bad value gets one message everywhere, raised before any work is done. Each message says
what was expected and gives an example. Used in 01 and 03-05 (every lesson that trains).
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

import torch

CLIP_ORDERS = ("unscale_first", "before_unscale")
SEED_LIMIT = 2**32  # NumPy's seeds are 0 .. 2**32 - 1; one range for every library
# The history keeps one record per optimizer step in memory: a million of them is about
# a gigabyte of Python objects, and far beyond any run of the course.
MAX_FIT_STEPS = 1_000_000

# GradScaler keeps the scale in a float32 tensor: a scale must be a float32 number, and a factor
# must move it by at least one float32 step. 1 - 2**-23 and 1 + 2**-23 always do, wherever the
# scale lies (a factor nearer to 1 leaves it unchanged: 1 - 1e-9 rounds to 1).
_F32 = torch.finfo(torch.float32)
_DATA_EXAMPLE = "digits(), or Dataset(x_train, y_train, x_test, y_test) from amp_lessons.data"


def is_number(value) -> bool:
    """A real number that is not a bool (``True`` is not a learning rate)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name, value, integer=False):
    """``value`` must be a positive finite number (a positive integer with ``integer=True``)."""
    ok = isinstance(value, numbers.Integral) if integer else is_number(value)
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name} must be {kind}; got {value!r}")


def check_lr(lr):
    """A learning rate: positive, and a float32 number (the optimizer multiplies float32 values by it)."""
    check_positive("lr", lr)
    if lr > _F32.max:
        raise ValueError(f"lr must be at most {_F32.max:.3g}, the largest float32 number (the optimizer "
                         f"multiplies float32 gradients by it); got {lr!r}. Lessons train with 1e-3 to 0.5")


def check_bool(name, value, meaning: str) -> bool:
    """``value`` must be True or False; ``meaning`` says what True does."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True ({meaning}) or False; got {value!r}")
    return value


def check_seed(seed) -> int:
    """``seed`` as an ``int``, or an error that says what a seed is (any integer from 0 to 2**32 - 1)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer from 0 to 2**32 - 1, e.g. seed=0; got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer from 0 to 2**32 - 1, e.g. seed=0; got {seed!r}")
    return int(seed)


def check_scale(name, value):
    """A loss scale: a positive normal float32 number (GradScaler keeps it in float32). Used in 03."""
    check_positive(name, value)
    if not _F32.tiny <= value <= _F32.max:
        raise ValueError(f"{name} must lie between {_F32.tiny:.3g} and {_F32.max:.3g}, the normal "
                         f"float32 numbers: GradScaler keeps the scale in float32; got {value!r}")


def check_factors(growth_factor, backoff_factor):
    """GradScaler's factors must move a float32 scale: growth >= 1 + 2**-23, backoff <= 1 - 2**-23."""
    if not is_number(growth_factor) or not 1.0 + _F32.eps <= growth_factor <= _F32.max:
        raise ValueError(f"growth_factor must be a finite number >= 1 + 2**-23 (the scale grows by it, "
                         f"in float32, where a factor nearer to 1 changes nothing); got {growth_factor!r}")
    if not is_number(backoff_factor) or not 0.0 < backoff_factor <= 1.0 - _F32.eps:
        raise ValueError(f"backoff_factor must be between 0 and 1 - 2**-23 (the scale shrinks by it on a "
                         f"skipped step, in float32, where a factor nearer to 1 changes nothing); "
                         f"got {backoff_factor!r}")


def check_growth_interval(value):
    """Clean steps before the scale grows: a positive integer that GradScaler's int32 counter holds."""
    check_positive("growth_interval", value, integer=True)
    if value >= 2**31:
        raise ValueError(f"growth_interval must be below 2**31 (GradScaler counts clean steps in an "
                         f"int32); got {value!r}. To never grow the scale, pass growth_factor close to 1 "
                         "and a long interval, e.g. growth_interval=10**9")


def check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale):
    """The GradScaler settings of a :class:`~amp_lessons.training.Trainer` (03_grad_scaler)."""
    check_scale("init_scale", init_scale)
    check_growth_interval(growth_interval)
    check_scale("min_scale", min_scale)
    if init_scale < min_scale:
        raise ValueError(f"init_scale ({init_scale!r}) must be at least min_scale ({min_scale!r}), the floor "
                         "below which the Trainer stops the run")
    check_factors(growth_factor, backoff_factor)


def check_steps(name, steps) -> frozenset:
    """A collection of optimizer-step numbers (integers >= 0) as a set (``inject_nonfinite``, 03)."""
    if isinstance(steps, (str, bytes)):
        raise TypeError(f"{name} must be a collection of step numbers, e.g. (3, 7); got {steps!r}")
    try:
        values = list(steps)
    except TypeError:
        raise TypeError(f"{name} must be a collection of step numbers, e.g. (3, 7); got {steps!r}") from None
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0]
    if bad:
        raise ValueError(f"{name} must hold step numbers (integers >= 0), e.g. (3, 7); got {bad[0]!r}")
    return frozenset(int(v) for v in values)


def check_clip(clip_norm, clip_order):
    """``clip_norm`` (None: no clipping, or a positive finite number) and its order (04_clipping)."""
    if clip_norm is not None:
        check_positive("clip_norm", clip_norm)
    check_clip_order("clip_order", clip_order)


def check_clip_order(name, order):
    """One of :data:`CLIP_ORDERS`: ``"unscale_first"`` (the recipe) or ``"before_unscale"`` (the trap)."""
    if not isinstance(order, str) or order not in CLIP_ORDERS:
        raise ValueError(f"{name} must be one of {', '.join(CLIP_ORDERS)}; got {order!r}")


def check_fit_steps(steps, done: int = 0) -> int:
    """How many optimizer steps ``fit`` runs: a positive integer, at most :data:`MAX_FIT_STEPS` in all."""
    check_positive("steps", steps, integer=True)
    if done + steps > MAX_FIT_STEPS:
        raise ValueError(f"steps must keep the run within {MAX_FIT_STEPS:,} optimizer steps (the history "
                         f"keeps one record per step in memory); this trainer has run {done:,} and got "
                         f"steps={steps!r}. Train shorter runs, or a new Trainer per run")
    return int(steps)


def check_model(model):
    """A ``torch.nn.Module`` with at least one parameter that requires a gradient."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no parameter that requires a gradient, so no step could change it: "
                         "pass a model with trainable parameters (p.requires_grad_(True))")


def _check_tensor(data, field: str, loss_is_default: bool):
    value = getattr(data, field)
    if not isinstance(value, torch.Tensor):
        hint = (f"convert it with torch.as_tensor({field}), as float32 for inputs and int64 for labels"
                if type(value).__module__.startswith("numpy") else f"build the data as {_DATA_EXAMPLE}")
        raise TypeError(f"data.{field} must be a torch.Tensor; got {type(value).__name__}: {hint}")
    if value.dim() == 0:
        raise ValueError(f"data.{field} must hold one row per example; got a 0-dim tensor")
    if field.startswith("x") and not (value.is_floating_point() or value.dtype in (
            torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"data.{field} has dtype {value.dtype}; the inputs must be numbers, e.g. float32")
    if field.startswith("y") and loss_is_default and (value.dtype == torch.bool or value.is_complex() or (
            value.is_floating_point() and value.dim() == 1)):
        raise TypeError(f"data.{field} holds {value.dtype} values, one per example: cross_entropy takes "
                        f"class numbers as int64; convert them with {field}.long()")
    if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"data.{field} holds {bad} inf/NaN value{'s' if bad > 1 else ''}: every loss that "
                         "sees one is inf/NaN. Remove or replace them before training")


def check_data(data, batch_size: int, accum_steps: int, loss_is_default: bool = True, accum_name="accum_steps"):
    """The dataset of a run, its batch size and accumulation, before any step (01, 03-05).

    An optimizer step reads ``batch_size * accum_steps`` training examples; that may be at
    most the whole training set (one epoch): beyond it, accumulation averages the same
    examples again and a single step takes as long as several epochs.
    """
    missing = [name for name in ("batch", "x_train", "y_train", "x_test", "y_test") if not hasattr(data, name)]
    if missing:
        raise TypeError(f"data must be a dataset, e.g. {_DATA_EXAMPLE}; got {type(data).__name__} "
                        f"(without {', '.join(missing)})")
    for field in ("x_train", "y_train", "x_test", "y_test"):
        _check_tensor(data, field, loss_is_default)
    for split in ("train", "test"):
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        if len(x) != len(y):
            raise ValueError(f"data.x_{split} holds {len(x)} examples and data.y_{split} {len(y)} labels; "
                             "they must match, one label per example")
    n = len(data.x_train)
    if n == 0:
        raise ValueError("data has no training examples; build it with some, e.g. digits()")
    if batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} training examples; "
                         f"use batch_size <= {n}")
    if batch_size * accum_steps > n:
        raise ValueError(
            f"{accum_name}={accum_steps} with batch_size={batch_size} makes one optimizer step read "
            f"{batch_size * accum_steps:,} examples, more than the {n:,} of the training set: it would "
            "average the same examples again, and a single step would take as long as "
            f"{math.ceil(batch_size * accum_steps / n):,} epochs. Use {accum_name} <= {n // batch_size} "
            "(one epoch per step) at this batch size")


def check_path(name, path) -> Path:
    """A checkpoint's file path (str or os.PathLike) as a :class:`~pathlib.Path`. Used in 03."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path (a str or pathlib.Path), e.g. 'run.pt'; "
                        f"got {type(path).__name__}")
    if not str(path):
        raise ValueError(f"{name} must be a file path, e.g. 'run.pt'; got an empty string")
    return Path(path)
