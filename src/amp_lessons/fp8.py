"""fp8 with scaling: amax scales, quantize and dequantize, where a tensor's values land in
e4m3/e5m2, and a minimal fp8 linear layer written with ``torch._scaled_mm``. Used in 08_fp8.

fp8's range is too short to cast a tensor as it is (e4m3fn spans about 18 powers of two,
fp16 40). So every tensor is multiplied by a **scale** first, chosen from its largest
magnitude (``amax``) so that amax lands on the format's largest value: lesson 03's loss
scale, computed per tensor (or per row) instead of once per loss.

Conventions, the same as torchao's ``float8`` training:

- ``scale = fmt.max / amax`` (float32) multiplies the tensor before the cast; the cast
  clamps to ``±fmt.max`` first (:func:`saturating_cast`), so the result is the same on every
  torch release (a plain cast of an e4m3fn overflow gives NaN before torch 2.13,
  :func:`amp_lessons.formats.e4m3_overflow`).
- :meth:`Fp8Tensor.dequantize` multiplies the fp8 values by ``1 / scale``, the inverse
  scale ``torch._scaled_mm`` takes as ``scale_a``/``scale_b``. On a CPU, ``_scaled_mm`` is
  exactly that: it dequantizes both operands to float32 and runs a float32 matmul, except
  where torch's oneDNN is on and the CPU has AMX-INT8 (two operands of one fp8 dtype) or
  AMX-FP16 (mixed dtypes): there ``_scaled_mm_out_cpu`` (aten/src/ATen/native/Blas.cpp)
  hands the call to oneDNN, before it looks at the scales. Every number is real and only
  the speed needs fp8 tensor cores
  (:func:`amp_lessons.hardware.fp8_support`).
- "Per row" scales each row of an operand over the dimension the matmul sums over (the
  last one here): ``scale_a`` of shape (M, 1) and ``scale_b`` of shape (1, N).

The census of lesson 01 (:func:`amp_lessons.formats.census`) classifies the values the cast
sees; :func:`fp8_census` only scales them first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .claims import check, measured
from .formats import Census, census, e4m3_overflow, format_info, parse_format
from .hardware import fp8_support, hardware_report, pick_device

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
GRANULARITIES = ("tensor", "row")
EPS = 1e-12  # the amax floor: an all-zero tensor (or row) gets a finite scale, not inf


# -- scales ----------------------------------------------------------------------------------


def fp8_format(name):
    """The :class:`amp_lessons.formats.Format` of an fp8 format name (or dtype); other
    formats are a ValueError that names the two fp8 ones."""
    canonical = parse_format(name)
    if canonical not in FP8_FORMATS:
        raise ValueError(f"an fp8 format is needed here: one of {', '.join(FP8_FORMATS)}; got {name!r}")
    return format_info(canonical)


def _check_granularity(granularity) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)} (one scale for the "
                         f"tensor, or one per row); got {granularity!r}")
    return granularity


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def _as_matrix(x, what="the tensor") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} must be a floating-point tensor; got {kind}")
    return x.detach()


def amax(x, granularity="tensor") -> torch.Tensor:
    """The largest magnitude, in float32: of the whole tensor (shape ``()``), or of each
    row over the last dimension (shape ``(..., 1)``). NaN in, NaN out."""
    x = _as_matrix(x).float().abs()
    if _check_granularity(granularity) == "tensor":
        return x.amax() if x.numel() else x.new_zeros(())
    if x.dim() < 2 or (x.shape[-1] == 0 and x.shape[:-1].numel() > 0):
        raise ValueError(f"per-row scales need a matrix (2 or more dims) with rows of at least one value; "
                         f"got shape {tuple(x.shape)}")
    return x.amax(dim=-1, keepdim=True)


def scale_from_amax(a, name="fp8_e4m3", power_of_2: bool = False) -> torch.Tensor:
    """``fmt.max / amax`` as float32 (divided in float64, as torchao does), amax floored at
    :data:`EPS`. ``power_of_2`` rounds the scale down to a power of two, which makes
    scaling and unscaling exact (torchao's row-wise recipes do)."""
    fmt = fp8_format(name)
    _flag("power_of_2", power_of_2)
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        a = torch.tensor(float(a))
    a = _as_matrix(a, "amax")
    scale = (fmt.max / a.double().clamp(min=EPS)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scaled_values(x, name="fp8_e4m3", granularity=None, power_of_2: bool = False) -> torch.Tensor:
    """The float32 values a cast to ``name`` sees: ``x`` itself (``granularity=None``,
    unscaled) or ``x * scale`` with the scale from :func:`amax` per tensor or per row."""
    x = _as_matrix(x).float()
    if granularity is None:
        return x
    return x * scale_from_amax(amax(x, granularity), name, power_of_2)


# -- quantize / dequantize --------------------------------------------------------------------


def saturating_cast(x, name="fp8_e4m3") -> torch.Tensor:
    """Clamp to ``±fmt.max``, then cast: too-large values become the largest value on every
    torch release and for both formats (NaN stays NaN). A plain cast gives inf for e5m2,
    and NaN or 448 for e4m3fn depending on the release."""
    fmt = fp8_format(name)
    return _as_matrix(x).float().clamp(-fmt.max, fmt.max).to(fmt.dtype).contiguous()


@dataclass(frozen=True)
class Fp8Tensor:
    """fp8 values and the float32 scale they were multiplied by: ``data ≈ x * scale``."""

    data: torch.Tensor
    scale: torch.Tensor  # shape () per tensor, (rows, 1) per row

    @property
    def format(self) -> str:
        return parse_format(self.data.dtype)

    @property
    def granularity(self) -> str:
        return "tensor" if self.scale.numel() == 1 and self.scale.dim() == 0 else "row"

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``: what ``torch._scaled_mm`` multiplies the fp8 values by."""
        return self.scale.reciprocal()

    def dequantize(self) -> torch.Tensor:
        """The values this tensor stands for, in float32: ``data * (1 / scale)``."""
        return self.data.float() * self.inv_scale


def quantize(x, name="fp8_e4m3", granularity="tensor", power_of_2: bool = False) -> Fp8Tensor:
    """Scale ``x`` by ``fmt.max / amax`` (per tensor or per row) and cast it with
    :func:`saturating_cast`. Round-trip: ``quantize(x).dequantize()``."""
    x = _as_matrix(x).float()
    scale = scale_from_amax(amax(x, granularity), name, _flag("power_of_2", power_of_2))
    return Fp8Tensor(saturating_cast(x * scale, name), scale)


# -- the census of lesson 01, for scaled fp8 ------------------------------------------------------


def fp8_census(tensors, name="fp8_e4m3", granularity=None, power_of_2: bool = False) -> Census:
    """Lesson 01's :func:`amp_lessons.formats.census` of the values an fp8 cast sees:
    unscaled (``granularity=None``), or each tensor scaled by its own amax scale (per
    tensor or per row). ``tensors``: one tensor or several (their counts add up)."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"tensors must be a tensor or a list of tensors; got {type(tensors).__name__}")
    fmt = fp8_format(name)
    values = [scaled_values(t, fmt.name, granularity, power_of_2).flatten() for t in tensors]
    if not values:
        raise ValueError("no tensors to classify: pass a tensor or a non-empty list of tensors")
    return census(torch.cat(values), fmt.name)


def census_table(groups: dict, granularity=None, names=FP8_FORMATS) -> str:
    """:func:`fp8_census` of each group of tensors (``{"grad_output": [t, ...]}``) in each fp8
    format: shares of the nonzero values flushed to zero, subnormal and overflowing. The
    shares come from a training run's float kernels, so they print as measured (``≈``),
    except a scaled tensor's overflow: amax lands on ``fmt.max``, so it is 0 by construction."""
    if not isinstance(groups, dict) or not groups:
        raise ValueError("groups must be a non-empty dict of tensors by name, e.g. {'grad_output': [t, ...]}; "
                         f"got {groups!r:.60}")
    if granularity is not None:
        _check_granularity(granularity)
    label = {None: "unscaled", "tensor": "scaled per tensor", "row": "scaled per row"}[granularity]
    short = {n: n.removeprefix("fp8_") for n in names}
    head = f"{label:<18}" + "".join(f"{short[n] + ' ' + k:>18}" for n in names
                                    for k in ("flushed", "subnormal", "overflow"))
    lines = [head]
    for group, tensors in groups.items():
        cells = []
        for n in names:
            c = fp8_census(tensors, n, granularity)
            cells += [measured(100 * c.fraction(k), ".3f") + "%" for k in ("flushed", "subnormal")]
            cells.append("0%" if granularity is not None and c.overflow == 0 else
                         measured(100 * c.fraction("overflow"), ".3f") + "%")
        lines.append(f"{group:<18}" + "".join(f"{cell:>18}" for cell in cells))
    return "\n".join(lines)


# -- torch._scaled_mm ----------------------------------------------------------------------------


def _out_dtype(device: torch.device, granularity: str) -> torch.dtype:
    # CUDA's row-wise path through CUTLASS (below compute capability 9.0, with cuBLAS older
    # than 12.9, and on 10.0+) writes only bf16/fp16 (fp8_support); the rest asks for float32.
    return torch.bfloat16 if device.type == "cuda" and granularity == "row" else torch.float32


def _call_scaled_mm(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    out_dtype = _out_dtype(a.data.device, a.granularity)
    out = torch._scaled_mm(a.data, b.data.t(), scale_a=a.inv_scale, scale_b=b.inv_scale.t(),
                           out_dtype=out_dtype)
    return out.float()


@functools.cache
def _scaled_mm_refusal(device: str, granularity: str) -> str | None:
    try:  # the cast too: a device without fp8 dtypes (MPS) refuses it with a TypeError
        a = quantize(torch.ones(16, 16, device=device), "fp8_e4m3", granularity)
        _call_scaled_mm(a, a)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        return str(err).strip().splitlines()[0]
    return None


def scaled_mm_support(device="cpu") -> dict[str, str | None]:
    """For each granularity, ``None`` if this torch release runs ``torch._scaled_mm`` with it
    on ``device``, else torch's own reason (probed once with a 16 x 16 e4m3 matmul).
    On a CPU, torch 2.11 takes per-tensor scales only (its ``_scaled_mm_out_cpu_emulated``
    asserts "Now _scaled_mm only supports per-tensor scaling for CPU backend."); 2.13 takes
    per-row scales too."""
    dev = str(torch.device(device))
    return {g: _scaled_mm_refusal(dev, g) for g in GRANULARITIES}


def reference_mm(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """``a @ b.T`` computed as dequantize, then a float32 matmul: what ``_scaled_mm`` does on a CPU without AMX."""
    return a.dequantize() @ b.dequantize().t()


def scaled_mm(a: Fp8Tensor, b: Fp8Tensor, emulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` in float32 with ``torch._scaled_mm``, both operands scaled along their
    last dimension (the one the product sums over): a is (M, K), b is (N, K).

    ``emulate=True`` computes :func:`reference_mm` instead. Where this release refuses the
    call (per-row scales on a CPU before torch 2.13, any fp8 matmul on a GPU below compute
    capability 8.9), the error says so and names ``emulate=True``.
    """
    if not isinstance(a, Fp8Tensor) or not isinstance(b, Fp8Tensor):
        raise ValueError("scaled_mm multiplies fp8 tensors: quantize both operands first, e.g. "
                         f"scaled_mm(quantize(a), quantize(b)); got {type(a).__name__} and {type(b).__name__}")
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(f"a (M, K) and b (N, K) must be matrices; got shapes {tuple(a.data.shape)} and "
                         f"{tuple(b.data.shape)}")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must share K; got {tuple(a.data.shape)} and {tuple(b.data.shape)}")
    if a.granularity != b.granularity:
        raise ValueError(f"both operands need the same granularity; got {a.granularity} and {b.granularity}")
    if emulate:
        return reference_mm(a, b)
    refusal = scaled_mm_support(a.data.device)[a.granularity]
    if refusal is not None:
        version = torch.__version__.split("+")[0]
        raise RuntimeError(
            f"torch {version}'s _scaled_mm does not take {a.granularity}-wise scales on "
            f"{a.data.device.type} ({refusal}). torch 2.13 takes per-row scales on a CPU, and a "
            "CUDA GPU of compute capability 8.9+ does; use per-tensor scales, or emulate=True "
            "(dequantize, then a float32 matmul: the same numbers up to float32 rounding, without fp8 speed).")
    return _call_scaled_mm(a, b)


# -- a minimal fp8 linear layer ---------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """Which fp8 format and scale granularity each matmul operand gets (torchao's recipe names).

    The forward pass casts the input and the weight to e4m3 (more precision); the backward
    pass casts the gradient of the output to ``grad_format``: e5m2 in ``tensorwise`` (more
    range, for gradients), e4m3 in ``rowwise``, whose power-of-two scales per row already
    follow each row's range. ``"none"`` runs the same function with no cast (gradcheck).
    """

    name: str
    granularity: str
    grad_format: str | None
    power_of_2: bool
    forward_format: str | None = "fp8_e4m3"


RECIPES = {
    "tensorwise": Recipe("tensorwise", "tensor", "fp8_e5m2", False),
    "rowwise": Recipe("rowwise", "row", "fp8_e4m3", True),
    "none": Recipe("none", "tensor", None, False, forward_format=None),
}


def get_recipe(recipe) -> Recipe:
    """A :class:`Recipe` from its name (``"tensorwise"``, ``"rowwise"``, ``"none"``) or itself."""
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}; got {recipe!r}")
    return RECIPES[recipe]


def _mm(a, b, a_format, b_format, recipe: Recipe, emulate: bool, keep: dict | None, names):
    """``a @ b.T`` with each operand cast to its format along K (or exactly, with no format)."""
    if a_format is None:
        return a @ b.t()
    qa = quantize(a, a_format, recipe.granularity, recipe.power_of_2)
    qb = quantize(b, b_format, recipe.granularity, recipe.power_of_2)
    if keep is not None:
        keep[names[0]], keep[names[1]] = qa.scale, qb.scale
    return scaled_mm(qa, qb, emulate=emulate)


class Fp8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with every matmul in fp8, forward and backward.

    forward:      y  = x  @ W.T     x (M, K) and W (N, K) in e4m3, scaled along K
    backward:     dx = dy @ W       dy (M, N) in the recipe's grad format, W.T (K, N), along N
                  dW = dy.T @ x     dy.T (N, M) and x.T (K, M), along M (the batch)

    Each operand is scaled along the dimension its matmul sums over, so per-row scales
    are recomputed for every matmul. The float32 ``x`` and ``W`` are saved for backward.
    ``layer.scales`` (if given) keeps the last scales, for the lesson's plot.
    """

    @staticmethod
    def forward(ctx, x, weight, recipe, emulate=False, layer=None):
        ctx.recipe, ctx.emulate, ctx.layer = recipe, emulate, layer
        ctx.save_for_backward(x, weight)
        keep = None if layer is None else layer.scales
        f = recipe.forward_format
        return _mm(x, weight, f, f, recipe, emulate, keep, ("input", "weight"))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        keep = None if ctx.layer is None else ctx.layer.scales
        g, f = recipe.grad_format, recipe.forward_format
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(grad_out, weight.t(), g, f, recipe, emulate, keep, ("grad_output", "weight_t"))
        if ctx.needs_input_grad[1]:
            grad_w = _mm(grad_out.t(), x.t(), g, f, recipe, emulate, keep, ("grad_output_t", "input_t"))
        return grad_x, grad_w, None, None, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in fp8 (:class:`Fp8Matmul`); weights, bias and
    output stay float32, like the master weights of lessons 03-05. Used in 08_fp8."""

    def __init__(self, in_features, out_features, bias=True, recipe="tensorwise", emulate=False,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        self.emulate = emulate
        self.scales: dict[str, torch.Tensor] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="tensorwise", emulate=False) -> Fp8Linear:
        """An Fp8Linear that shares ``linear``'s weight and bias (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  recipe=recipe, emulate=emulate, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x):
        if x.dtype != self.weight.dtype:
            raise TypeError(f"Fp8Linear takes {self.weight.dtype} inputs (it casts to fp8 itself); "
                            f"got {x.dtype}. Run it outside autocast, or cast the input first.")
        flat = x.reshape(-1, x.shape[-1])
        y = Fp8Matmul.apply(flat, self.weight, self.recipe, self.emulate, self).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def fits_fp8(linear: nn.Module) -> bool:
    """:func:`convert_to_fp8`'s default filter, and the ``module_filter_fn`` of 08's torchao
    cell (torchao itself converts every Linear): a Linear whose both dimensions are multiples
    of 16, which CUDA's ``_scaled_mm`` requires of K and N. CUDA also requires it of the
    batch M, in the weight gradient's matmul ``dy.T @ x``; that is the caller's to keep."""
    return isinstance(linear, nn.Linear) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe="tensorwise", emulate=False, keep=fits_fp8) -> nn.Module:
    """Swap, in place, every ``nn.Linear`` for which ``keep(linear)`` is true for an
    :class:`Fp8Linear` sharing its parameters, as torchao's ``convert_to_float8_training``
    does; a 10-class head (10 is not a multiple of 16) stays as it is. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(keep):
        raise ValueError(f"keep must be a function of a Linear that says whether to convert it; got {keep!r}")
    get_recipe(recipe)
    for name, child in model.named_children():
        if type(child) is nn.Linear and keep(child):
            setattr(model, name, Fp8Linear.from_linear(child, recipe, emulate))
        else:
            convert_to_fp8(child, recipe, emulate, keep)
    return model


# -- the tensors an fp8 linear casts, from a real model ---------------------------------------------


@dataclass(frozen=True)
class Operands:
    """One Linear layer's three matmul operands: what an fp8 linear would cast."""

    layer: str
    input: torch.Tensor  # (M, K)
    weight: torch.Tensor  # (N, K)
    grad_output: torch.Tensor  # (M, N): the gradient flowing into the layer's output


def record_operands(model: nn.Module, x, y, loss_fn=F.cross_entropy) -> list[Operands]:
    """One float32 forward and backward of ``model`` on a batch; for every ``nn.Linear``, its
    input, weight and output gradient (float32, on the CPU). The model's ``.grad`` fields are
    not touched (the output gradients come from ``torch.autograd.grad``)."""
    seen = []

    def keep(module, inputs, output):
        seen.append((module, inputs[0].detach(), output))

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    hooks = [m.register_forward_hook(keep) for _, m in linears]
    try:
        loss = loss_fn(model(x), y)
    finally:
        for h in hooks:
            h.remove()
    grads = torch.autograd.grad(loss, [out for _, _, out in seen])
    names = {id(m): n for n, m in linears}
    return [Operands(names[id(m)], inp.float().cpu(), m.weight.detach().float().cpu(), g.float().cpu())
            for (m, inp, _), g in zip(seen, grads)]


# -- a layer with one outlier channel -------------------------------------------------------------


def outlier_layer(factor: float = 2.0**16, n: int = 64, k: int = 64, batch: int = 64, seed: int = 0):
    """``(x, weight, outlier)`` for a linear layer whose output channel 0 (row 0 of the
    weight) is ``factor`` times larger than the rest, built under its own seed. ``outlier``
    marks the outputs that channel produces (column 0 of ``y``), to leave them out."""
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
            and 0 < factor <= 2.0**64):
        raise ValueError(f"factor must be a positive finite number up to 2^64, e.g. 2.0**16; got {factor!r}")
    for what, value in (("n", n), ("k", k), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
            raise ValueError(f"{what} must be a whole number from 1 to 4096; got {value!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    w[0] *= factor
    outlier = torch.zeros(batch, n, dtype=torch.bool)
    outlier[:, 0] = True
    return x, w, outlier


def layer_error(x, weight, granularity, mask=None, emulate=True) -> float:
    """Relative error ``|y8 - y| / |y|`` (Frobenius) of ``x @ weight.T`` with both operands
    in e4m3 at ``granularity``, against float32; ``mask`` (True = left out) restricts it to
    the other outputs. Computed by :func:`reference_mm` unless ``emulate=False``."""
    y = x.float() @ weight.float().t()
    y8 = scaled_mm(quantize(x, "fp8_e4m3", granularity), quantize(weight, "fp8_e4m3", granularity),
                   emulate=emulate)
    keep = torch.ones_like(y, dtype=torch.bool) if mask is None else ~mask
    return ((y8 - y)[keep].norm() / y[keep].norm()).item()


def outlier_sweep(exponents=(0, 8, 12, 14, 16, 18, 20)) -> list[dict]:
    """For an outlier channel ``2^k`` times larger (:func:`outlier_layer`), the error of the
    *other* outputs per tensor and per row, and the share of the weight that per-tensor
    scaling leaves flushed to zero or subnormal in e4m3."""
    exponents = list(exponents)
    if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 64 for k in exponents):
        raise ValueError(f"exponents must be whole numbers from 0 to 64 (the outlier is 2^k times larger); "
                         f"got {exponents!r:.80}")
    rows = []
    for k in exponents:
        x, w, mask = outlier_layer(2.0**k)
        c = fp8_census(w, "fp8_e4m3", "tensor")
        rows.append({"k": k, "tensor": layer_error(x, w, "tensor", mask), "row": layer_error(x, w, "row", mask),
                     "flushed": c.fraction("flushed"), "subnormal": c.fraction("subnormal")})
    return rows


# -- training -------------------------------------------------------------------------------------


class ScaleHistory:
    """A :class:`amp_lessons.training.Trainer` callback: after every backward, the log2 of
    each Fp8Linear's last per-tensor scales (input, weight, grad_output), for 08's plot."""

    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def after_backward(self, trainer) -> None:
        row = {}
        for name, m in trainer.model.named_modules():
            if isinstance(m, Fp8Linear):
                for kind, keys in (("input", ("input",)), ("weight", ("weight",)),
                                   ("grad_output", ("grad_output", "grad_output_t"))):
                    key = next((k for k in keys if k in m.scales), None)
                    if key is not None:  # a first layer computes no grad_input: dy.T's scale
                        row[f"{name}.{kind}"] = math.log2(float(m.scales[key].float().median()))
        self.rows.append(row)

    def series(self) -> dict[str, list[float]]:
        """``{"layer.kind": [log2 scale per step]}``."""
        keys = list(self.rows[0]) if self.rows else []
        return {k: [r[k] for r in self.rows] for k in keys}


def torchao_float8():
    """torchao's ``convert_to_float8_training`` and ``Float8LinearConfig`` if torchao imports
    here, else ``(None, reason)``. torchao logs warnings about CUDA kernels it cannot load on
    import; they are silenced. Optional: ``pip install -e ".[fp8]"``."""
    import contextlib
    import io
    import logging
    import warnings

    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            try:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            finally:
                logging.disable(logging.NOTSET)
    except ImportError as err:
        return None, f"torchao is not installed ({err}); pip install -e \".[fp8]\" or pip install torchao"
    except Exception as err:  # a torchao built for another torch fails in many ways
        return None, f"torchao did not import with torch {torch.__version__}: {type(err).__name__}: {err}"
    return (convert_to_float8_training, Float8LinearConfig), None


# -- make gpu-check -----------------------------------------------------------------------------


def _refuses(fn) -> str | None:
    """The first line of the error ``fn()`` raises, or None if it runs."""
    try:
        fn()
    except (RuntimeError, ValueError, NotImplementedError) as err:
        return str(err).strip().splitlines()[0]
    return None


def selfcheck(device=None) -> list:
    """Lesson 08's statements about devices, checked on ``device`` (``make gpu-check``).

    On a CUDA GPU: the e4m3 cast there does what the CPU's does in this release;
    ``_scaled_mm`` runs exactly where :func:`amp_lessons.hardware.fp8_support` says fp8 is
    fast, equals the float32 product on exact inputs, and refuses e5m2 x e5m2 and
    dimensions that are not multiples of 16. On a CPU: ``_scaled_mm`` runs, is exact, and
    accepts what CUDA refuses (the stricter rules are CUDA's).
    """
    dev = pick_device(device)
    out = []
    a, b = ((torch.arange(16 * 32) % 9 - 4) / 4).reshape(16, 32), ((torch.arange(16 * 32) % 7 - 3) / 4).reshape(16, 32)
    a, b = a.to(dev), b.to(dev)
    qa, qb = quantize(a, power_of_2=True), quantize(b, power_of_2=True)
    e5 = quantize(a, "fp8_e5m2", power_of_2=True)
    runs = scaled_mm_support(dev)["tensor"] is None
    if dev.type == "cuda":
        cc = hardware_report(dev).cuda_capability
        fast, _ = fp8_support("cuda", cc)
        cpu, here = _e4m3_overflow_pair(dev)
        out.append(check("the e4m3 cast from float32 on this GPU stores what the CPU's does for 1e6 and "
                         "inf, or 448 where the CPU stores NaN and this is a CUDA 13 build",
                         _gpu_cast_as_told(cpu, here, torch.version.cuda), f"cpu {cpu}, cuda {here}"))
        out.append(check(f"torch._scaled_mm runs on this GPU exactly when fp8_support says fp8 is fast "
                         f"(compute capability {cc[0]}.{cc[1]})", runs == fast,
                         f"runs {runs}, fast {fast}"))
        if runs:
            out.append(check("_scaled_mm equals the float32 product exactly on exact inputs",
                             torch.equal(scaled_mm(qa, qb), a @ b.T)))
            why = _refuses(lambda: scaled_mm(e5, e5))
            out.append(check("CUDA's _scaled_mm refuses e5m2 x e5m2", why is not None, why or "it ran"))
            odd = quantize(torch.ones(16, 24, device=dev))
            why = _refuses(lambda: scaled_mm(odd, odd))
            out.append(check("CUDA's _scaled_mm refuses an inner dimension that is not a multiple of 16 (24)",
                             why is not None, why or "it ran"))
    else:
        out.append(check(f"torch._scaled_mm runs on {dev.type}", runs, str(scaled_mm_support(dev))))
        if runs:
            out.append(check(f"_scaled_mm equals the float32 product exactly on exact inputs ({dev.type})",
                             torch.equal(scaled_mm(qa, qb), a @ b.T)))
            odd = quantize(torch.ones(16, 24, device=dev))
            accepted = _refuses(lambda: scaled_mm(e5, e5)) is None and _refuses(lambda: scaled_mm(odd, odd)) is None
            out.append(check(f"{dev.type}'s _scaled_mm takes e5m2 x e5m2 and a 24-wide inner dimension "
                             "(the stricter rules are CUDA's)", accepted))
    return out


def _gpu_cast_as_told(cpu, here, cuda_version) -> bool:
    """08's rule for an e4m3 cast of ``(1e6, inf)`` from float32 (the probe's source): a GPU
    stores what the CPU does, except that some CUDA 13 builds saturate (448) where the CPU,
    before torch 2.13, gives NaN. Their Copy.cu (pull request 177870) calls CUDA's
    saturating conversion for a float32 source only; fp16 and bf16 sources keep torch's own."""
    if all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(cpu, here)):
        return True  # NaN is not == NaN: compared value by value
    major = int(str(cuda_version).split(".")[0]) if cuda_version else 0
    return major >= 13 and all(math.isnan(v) for v in cpu) and here == (448.0, 448.0)


def _e4m3_overflow_pair(device):
    """What the e4m3 cast stores for ``(1e6, inf)`` on the CPU and on ``device``."""
    cpu, here = e4m3_overflow("cpu"), e4m3_overflow(device)
    return (cpu.finite, cpu.inf), (here.finite, here.inf)
