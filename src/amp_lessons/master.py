"""Why the weights stay float32: what ``model.half()`` does to an optimizer step.

The card says: keep the model's weights in float32, do not call ``model.half()`` for
training. Two measured reasons, both on the same gradients:

- an update smaller than half the spacing of a weight's format rounds back to the same
  weight: in fp16 (10 mantissa bits) a weight of 0.05 ignores any update below ~1.5e-5,
  which is most of what SGD applies. :func:`lost_updates` counts the weights one step
  failed to change, on fp32 master weights and on a ``.half()`` copy.
- Adam's ``eps=1e-8`` is 0 in fp16 (:func:`eps_in`), and after its first step the second
  moment ``v = (1 - beta2) * g**2 = 0.001 * g**2`` underflows to 0 wherever ``|g|`` is
  below ~5.5e-3, so the for-loop and foreach kernels' ``m / (sqrt(v) + eps)`` divide by
  zero: weights become inf/NaN. The fused kernel keeps eps and its arithmetic in float32,
  but stores ``v`` back in fp16, zeroed: from the second step on, ``m`` remembers past
  gradients that ``v`` forgot, and the steps grow far past ``lr`` (:func:`half_adam`).

Used in 05_putting_it_together.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .claims import measured
from .precision import dtype_of, parse_precision, uses_autocast

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def eps_in(dtype, eps: float = 1e-8) -> float:
    """The value Adam's ``eps`` takes when stored in ``dtype`` (0.0 in fp16: below its smallest subnormal)."""
    dtype = _float_dtype(dtype)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, such as Adam's 1e-8; got {eps!r}")
    return torch.tensor(eps, dtype=dtype).item()


def _float_dtype(dtype) -> torch.dtype:
    """A floating-point torch dtype, from a dtype or a precision name; else a ValueError."""
    if not isinstance(dtype, torch.dtype):
        dtype = dtype_of(dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype such as torch.float16; got {dtype}")
    return dtype


def _positive(name: str, value) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return float(value)


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor; got {type(value).__name__} (torch.as_tensor converts one)")
    return value


def spacing(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between ``w`` (rounded to ``dtype``) and the next value of ``dtype``, in float64.

    For |w| in [2**(e-1), 2**e) the gap is 2**(e-1) * eps; below the smallest normal it is
    the smallest subnormal.
    """
    dtype = _float_dtype(dtype)
    info = torch.finfo(dtype)
    w = _tensor("w", w).to(dtype).double().abs()
    _, e = torch.frexp(w)
    gap = torch.ldexp(torch.full_like(w, info.eps), e - 1)
    return torch.clamp(gap, min=info.smallest_normal * info.eps)


@dataclass(frozen=True)
class LostUpdates:
    """One optimizer step applied to weights stored in one dtype, against the exact update.

    - ``meant``: weights whose exact (float64) update is nonzero;
    - ``unchanged``: of those, weights the step left exactly as they were;
    - ``predicted``: of those, weights whose exact update is below half their spacing in
      this dtype (the rule that says which updates round away);
    - ``nonfinite``: weights the step made inf or NaN.
    """

    label: str
    dtype: str
    meant: int
    unchanged: int
    predicted: int
    nonfinite: int

    @property
    def fraction(self) -> float:
        """Fraction of the meant updates that did not happen."""
        return self.unchanged / self.meant if self.meant else 0.0

    def line(self) -> str:
        # The gradients come from a trained model: the counts are figures from float kernels.
        return (f"{self.label:<22} {self.dtype:<9} unchanged {measured(self.unchanged, ','):>8} of "
                f"{measured(self.meant, ','):>8} ({measured(self.fraction, '.1%')})  predicted "
                f"{measured(self.predicted, ','):>8}  inf/NaN {measured(self.nonfinite, ','):>8}")


def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision="fp32",
              loss_fn=F.cross_entropy) -> list[torch.Tensor]:
    """float32 gradients of one batch, computed as mixed precision does: float32 weights,
    forward + loss under autocast in ``precision``, backward outside it. The model is not changed."""
    name = parse_precision(precision)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    _tensor("x", x), _tensor("y", y)
    model = copy.deepcopy(model).float()
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype_of(name), enabled=uses_autocast(name)):
        loss = loss_fn(model(x), y)
    loss.backward()
    return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


def _one_step(params: list[torch.Tensor], grads: list[torch.Tensor], optimizer: str, lr: float,
              eps: float) -> list[torch.Tensor]:
    """Apply one ``optimizer`` step to copies of ``params`` with ``grads``; return the new values."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    leaves = [nn.Parameter(p.detach().clone()) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g.to(leaf.dtype)
    kwargs = {"lr": lr} if optimizer == "sgd" else {"lr": lr, "eps": eps}
    # foreach=False: the for-loop kernels (torch's default on a CPU; CUDA's is foreach),
    # the same arithmetic in every dtype, float64 included
    OPTIMIZERS[optimizer](leaves, foreach=False, **kwargs).step()
    return [leaf.detach() for leaf in leaves]


def lost_updates(model: nn.Module, grads: list[torch.Tensor], lr: float, optimizer: str = "sgd",
                 eps: float = 1e-8) -> dict[str, LostUpdates]:
    """One step with the same gradients on fp32 master weights and on ``model.half()``.

    The step is the optimizer's for-loop implementation (``foreach=False``). The exact update comes from the same optimizer run in float64. Keys: ``"fp32 master"``
    and ``"model.half()"``. The model is not changed.
    """
    params = [p.detach().float() for p in model.parameters()]
    if len(params) != len(grads):
        raise ValueError(f"got {len(grads)} gradients for {len(params)} parameters")
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape:
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"gradient {i} must be a tensor of its parameter's shape {tuple(p.shape)}; "
                             f"got {got}: pass gradients(model, x, y)")
    _positive("lr", lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    _positive("eps", eps)
    exact_new = _one_step([p.double() for p in params], [g.double() for g in grads], optimizer, lr, eps)
    updates = [n - p.double() for n, p in zip(exact_new, params)]
    out = {}
    for label, dtype in (("fp32 master", torch.float32), ("model.half()", torch.float16)):
        start = [p.to(dtype) for p in params]
        new = _one_step(start, grads, optimizer, lr, eps)
        meant = unchanged = predicted = nonfinite = 0
        for s, n, u in zip(start, new, updates):
            moved = u != 0
            meant += int(moved.sum())
            unchanged += int((moved & (n == s)).sum())
            predicted += int((moved & (u.abs() < spacing(s, dtype) / 2)).sum())
            nonfinite += int((~torch.isfinite(n)).sum())
        out[label] = LostUpdates(label, str(dtype).removeprefix("torch."), meant, unchanged,
                                 predicted, nonfinite)
    return out


def lost_fraction_by_lr(model: nn.Module, grads: list[torch.Tensor], lrs, optimizer: str = "sgd"
                        ) -> dict[str, list[float]]:
    """:func:`lost_updates`' fraction for each learning rate in ``lrs``: the figure of lesson 05."""
    if isinstance(lrs, (int, float, str)) or not hasattr(lrs, "__iter__"):
        raise ValueError(f"lrs must be a list of learning rates, e.g. [1e-4, 1e-3]; got {lrs!r}")
    out: dict[str, list[float]] = {"fp32 master": [], "model.half()": []}
    for lr in lrs:
        for label, result in lost_updates(model, grads, lr, optimizer).items():
            out[label].append(result.fraction)
    return out


# Adam's three implementations in torch, by the keyword that selects each.
ADAM_IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@dataclass(frozen=True)
class HalfAdam:
    """Adam steps on a ``.half()`` copy of a model, one implementation (:func:`half_adam`).

    Per step: ``losses`` (before the step), ``nonfinite`` (weights inf/NaN after it) and
    ``largest_change`` (the largest change of one weight that stayed finite, 0 if none did); ``v_zero`` counts the
    weights whose first gradient was nonzero but whose ``exp_avg_sq``, stored in float16,
    is exactly 0 after step 1, of ``nonzero_grads``; ``finite_with_gradient`` counts the weights
    still finite after the last step that had a nonzero (or inf/NaN) gradient at some step: 0
    means the only finite weights left are ones no step moved. ``error`` says why no step ran.
    """

    implementation: str
    lr: float
    n_weights: int
    losses: tuple[float, ...] = ()
    nonfinite: tuple[int, ...] = ()
    largest_change: tuple[float, ...] = ()
    v_zero: int = 0
    nonzero_grads: int = 0
    finite_with_gradient: int = 0
    error: str | None = None

    def line(self) -> str:
        """Inf/NaN weights and the largest finite weight change after each step (float16
        kernels' figures, marked ``≈``; ``nan`` where no weight is finite)."""
        if self.error:
            return f"{self.implementation:<9} not run: {self.error}"
        bad = " ".join(f"{measured(v, ','):>7}" for v in self.nonfinite)
        # where every weight is inf/NaN there is no finite change: nan, not a measured figure
        moved = " ".join(f"{'nan' if bad == self.n_weights else measured(v, '.2g'):>7}"
                         for v, bad in zip(self.largest_change, self.nonfinite))
        return f"{self.implementation:<9} inf/NaN {bad}   largest change {moved}"


def half_adam(model: nn.Module, data, implementation: str, steps: int = 5, lr: float = 1e-3,
              batch_size: int = 64, device=None) -> HalfAdam:
    """``steps`` steps of ``torch.optim.Adam`` (default eps) on a ``.half()`` copy of ``model``,
    in one of :data:`ADAM_IMPLEMENTATIONS`, on the batches of ``data`` (a
    :class:`~amp_lessons.data.Dataset`). The model is not changed. Used in 05."""
    if implementation not in ADAM_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(ADAM_IMPLEMENTATIONS)}; got {implementation!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an int >= 2 (step 2 is where the fused kernel goes wrong); got {steps!r}")
    _positive("lr", lr)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    half = copy.deepcopy(model).to(device).half()
    params = list(half.parameters())
    n_weights = sum(p.numel() for p in params)
    try:
        opt = torch.optim.Adam(params, lr=lr, **ADAM_IMPLEMENTATIONS[implementation])
    except RuntimeError as err:  # a torch without this kernel for the device
        return HalfAdam(implementation, lr, n_weights, error=str(err).splitlines()[0])
    losses, nonfinite, largest, v_zero, nonzero = [], [], [], 0, 0
    touched = [torch.zeros_like(p, dtype=torch.bool) for p in params]  # a nonzero gradient at some step
    for i in range(steps):
        x, y = (t.to(device) for t in data.batch(i, batch_size))
        loss = F.cross_entropy(half(x.half()).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = [p.detach().clone() for p in params]
        try:
            opt.step()
        except RuntimeError as err:
            return HalfAdam(implementation, lr, n_weights, error=str(err).splitlines()[0])
        losses.append(loss.item())
        for t, p in zip(touched, params):
            t |= p.grad != 0  # NaN != 0 too
        nonfinite.append(sum(int((~torch.isfinite(p)).sum()) for p in params))
        changes = [(p.detach().float() - b.float()).abs() for p, b in zip(params, before)]
        largest.append(max(float(torch.where(torch.isfinite(c), c, 0.0).max()) for c in changes))
        if i == 0:
            for p in params:
                moved = p.grad != 0
                nonzero += int(moved.sum())
                v_zero += int((moved & (opt.state[p]["exp_avg_sq"] == 0)).sum())
    finite_touched = sum(int((torch.isfinite(p) & t).sum()) for p, t in zip(params, touched))
    return HalfAdam(implementation, lr, n_weights, tuple(losses), tuple(nonfinite), tuple(largest),
                    v_zero, nonzero, finite_touched)
