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
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch.nn import functional as F

from . import progress
from .hardware import resolve
from .precision import dtype_of, float32_matmul_precision, needs_scaler, uses_autocast
from .progress import progress_enabled
from .seeding import rng_state, seed_everything, set_rng_state

CHECKPOINT_FORMAT = "amp-lessons-checkpoint/1"
CLIP_ORDERS = ("unscale_first", "before_unscale")
_CHECKPOINT_KEYS = ("precision", "signature", "step", "model", "optimizer", "scaler", "scheduler",
                    "rng", "history")


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
        """How many optimizer steps GradScaler skipped."""
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
        cells = [[_fmt(getattr(r, c)) for c in columns] for r in rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"History({len(self)} steps, {self.skipped} skipped)"


def _fmt(v) -> str:
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
    """:func:`rng_state` with NumPy's key array as a tensor (``torch.load(weights_only=True)`` reads it)."""
    rng = rng_state()
    np_state = rng["numpy"]
    rng["numpy"] = (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:])
    return rng


def _check_positive(name, value, integer=False):
    ok = isinstance(value, int) and not isinstance(value, bool) if integer else isinstance(value, (int, float))
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name} must be {kind}; got {value!r}")


def _check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale):
    _check_positive("init_scale", init_scale)
    _check_positive("growth_interval", growth_interval, integer=True)
    _check_positive("min_scale", min_scale)
    if not isinstance(growth_factor, (int, float)) or not 1.0 < growth_factor < math.inf:
        raise ValueError(f"growth_factor must be a finite number > 1 (the scale grows by it); got {growth_factor!r}")
    if not isinstance(backoff_factor, (int, float)) or not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be between 0 and 1 (the scale shrinks by it on a "
                         f"skipped step); got {backoff_factor!r}")


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
        _check_positive("lr", lr)
        _check_positive("batch_size", batch_size, integer=True)
        _check_positive("accum_steps", accum_steps, integer=True)
        if clip_norm is not None:
            _check_positive("clip_norm", clip_norm)
        if clip_order not in CLIP_ORDERS:
            raise ValueError(f"clip_order must be one of {', '.join(CLIP_ORDERS)}; got {clip_order!r}")
        _check_scaler_settings(init_scale, growth_interval, growth_factor, backoff_factor, min_scale)
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
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=use_scaler)
        self.min_scale = min_scale
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.step_scheduler_on_skip = step_scheduler_on_skip
        self.inject_nonfinite = {int(s) for s in inject_nonfinite}
        self.loss_fn = loss_fn
        self.seed = seed
        if not isinstance(grad_stats, bool):
            raise TypeError(f"grad_stats must be True (record zero_frac and grad_norm every step) or "
                            f"False (skip them, for speed); got {grad_stats!r}")
        self.grad_stats = grad_stats
        self.progress = progress_enabled(progress)
        self.callbacks = list(callbacks)
        self.step_count = 0
        self.history = History()
        seed_everything(seed)
        for cb in self.callbacks:
            getattr(cb, "attach", lambda t: None)(self)

    def _make_optimizer(self, optimizer, lr):
        params = self.model.parameters()
        makers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
        if callable(optimizer):
            return optimizer(params)
        if optimizer not in makers:
            raise ValueError(f"optimizer must be one of {', '.join(makers)} or a callable; got {optimizer!r}")
        return makers[optimizer](params, lr=lr)

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
                loss = self.loss_fn(self.model(x), y)
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
            seen = float(torch.nn.utils.clip_grad_norm_(params, self.clip_norm))
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
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = self.scaler.is_enabled() and self.current_scale() < scale
        if self.scheduler is not None and (not skipped or self.step_scheduler_on_skip):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # One transfer for the numbers (one sync on a GPU, also ending the step's work).
        loss_v, norm_v, applied_v, zeros_v = _as_floats(loss, norm, applied, zeros)
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

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy on the test split, computed under the same autocast as training."""
        self.model.eval()
        x = self.data.x_test.to(self.device)
        y = self.data.y_test.to(self.device)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.use_amp):
            pred = self.model(x).argmax(dim=-1)
        self.model.train()
        return (pred == y).float().mean().item()

    # -- checkpoints -----------------------------------------------------------------------

    def _signature(self) -> dict:
        return {k: list(v.shape) for k, v in self.model.state_dict().items()}

    def save(self, path) -> Path:
        """Save model, optimizer, scaler, scheduler, step, RNG state and history."""
        state = {
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
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)  # never leave a half-written checkpoint under the real name
        return path

    def load(self, path) -> Trainer:
        """Restore a checkpoint saved by :meth:`save` from a run of this same model.

        Everything is checked before anything is changed: a corrupt file or a checkpoint of
        another model or precision raises :class:`CheckpointError` and leaves this trainer as it was.
        """
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as err:  # a truncated file, not a checkpoint at all, unsafe pickles
            raise CheckpointError(f"{path} is not a readable amp-lessons checkpoint ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''})") from err
        self._validate(state, path)
        before = self._snapshot()
        try:
            self._restore(state)
        except Exception as err:  # e.g. optimizer state of another shape: put everything back
            self._restore(before)
            raise CheckpointError(f"{path} could not be loaded into this trainer ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}); nothing was "
                                  "changed.") from err
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
        rng = dict(state["rng"])
        np_state = rng["numpy"]
        rng["numpy"] = (np_state[0], np_state[1].numpy(), *np_state[2:])
        set_rng_state(rng)
        self.step_count, self.history = step, history

    def _validate(self, state, path) -> None:
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not an amp-lessons checkpoint (no {CHECKPOINT_FORMAT!r} marker)")
        missing_keys = [k for k in _CHECKPOINT_KEYS if k not in state]
        if missing_keys:
            raise CheckpointError(f"{path} is an incomplete amp-lessons checkpoint: no {missing_keys}")
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
