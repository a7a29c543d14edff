"""Number formats: bit layouts, rounding, and which values a format flushes or overflows.

fp32, tf32, bf16, fp16 and, as a preview, the fp8 formats e4m3fn and e5m2. The figures
of every format torch has a dtype for come from ``torch.finfo``; tf32 (a float32 whose
mantissa tensor cores round to 10 bits) has no dtype, so its figures follow from its bit
layout. Used in 01_number_formats (and ``round_to_format(t, "tf32")`` in 05, ``sums_by_order``
in 00), and by :mod:`amp_lessons.fp8` in 08_fp8.

e4m3fn has no inf, and what torch's cast stores for a value too large for it depends on
the release: NaN before torch 2.13, the largest value (±448) from 2.13 on. Nothing here
assumes either: :func:`e4m3_overflow` casts ``1e6`` and ``inf`` once and reports what the
running release does, and the texts below say what it found.

Format names are parsed here, in :func:`parse_format`; the four training precisions among
them go through :func:`amp_lessons.precision.parse_precision`.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

from .precision import parse_precision

FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")

_FP8_ALIASES = {
    "fp8_e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "fp8e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}

_DTYPES = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def parse_format(name) -> str:
    """The canonical format name (one of :data:`FORMATS`) for a name, an alias or a dtype.

    ``"half"``, ``"float16"`` and ``torch.float16`` are ``"fp16"``; ``"e4m3"`` and
    ``torch.float8_e4m3fn`` are ``"fp8_e4m3"``. Anything else is a ValueError that lists
    the valid names.
    """
    if isinstance(name, torch.dtype):
        for canonical, dtype in _DTYPES.items():
            if dtype == name:
                return canonical
    elif isinstance(name, str):
        key = name.strip().lower().removeprefix("torch.").replace("-", "_")
        if key in _FP8_ALIASES:
            return _FP8_ALIASES[key]
        try:
            return parse_precision(name)
        except ValueError:
            pass
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {name!r}")


@dataclass(frozen=True)
class Format:
    """One number format's layout and limits (all values as Python floats)."""

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # the gap between 1.0 and the next value: the ulp at 1.0
    has_inf: bool
    source: str

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype values of this format are stored in (float32 for tf32)."""
        return _DTYPES.get(self.name, torch.float32)

    @property
    def flush_below(self) -> float:
        """Nonzero values with magnitude at or below this round to zero (half the smallest
        subnormal: the tie goes to the even neighbour, 0)."""
        return self.smallest_subnormal / 2

    @property
    def normal_from(self) -> float:
        """Values from here up round to a normal number (the tie just below the smallest
        normal rounds up to it)."""
        return self.smallest_normal - self.smallest_subnormal / 2

    @property
    def overflow_from(self) -> float:
        """Values from here up do not fit. With an inf, the tie max + ulp/2 already rounds to
        inf; e4m3fn has none, its tie rounds down to the max, so only larger values overflow
        (into what :attr:`overflows_to` says)."""
        top_ulp = 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)
        return self.max + top_ulp / 2

    def overflows(self, magnitude: torch.Tensor) -> torch.Tensor:
        """True where a magnitude does not fit (see :attr:`overflow_from`)."""
        return magnitude >= self.overflow_from if self.has_inf else magnitude > self.overflow_from

    @property
    def overflows_to(self) -> float:
        """What a positive value too large for this format is stored as by torch's cast:
        inf, or for e4m3fn what this torch release does (:func:`e4m3_overflow`: 448 or NaN)."""
        return math.inf if self.has_inf else e4m3_overflow().finite


def _from_finfo(name: str) -> Format:
    fi = torch.finfo(_DTYPES[name])
    mantissa = round(-math.log2(fi.eps))
    return Format(
        name=name, bits=fi.bits, exponent_bits=fi.bits - 1 - mantissa, mantissa_bits=mantissa,
        max=float(fi.max), smallest_normal=float(fi.smallest_normal),
        # torch.finfo has no smallest_subnormal: one ulp of the smallest binade
        smallest_subnormal=float(fi.smallest_normal) * float(fi.eps), eps=float(fi.eps),
        has_inf=name != "fp8_e4m3", source=f"torch.finfo({_DTYPES[name]})",
    )


def from_layout(name: str, exponent_bits: int, mantissa_bits: int) -> Format:
    """The limits of an IEEE-style layout: the top exponent is inf/NaN, the bottom subnormal.

    This is where tf32's figures come from (8 exponent bits like fp32, 10 mantissa bits
    like fp16); the tests check it against ``torch.finfo`` for fp32, bf16 and fp16.
    Exponent bits from 2 to 11 (float64's), mantissa bits from 0 to 52.
    """
    for what, value, low, high in (("exponent_bits", exponent_bits, 2, 11), ("mantissa_bits", mantissa_bits, 0, 52)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{what} must be a whole number from {low} to {high} (up to float64's "
                             f"layout); got {value!r}")
    bias = 2 ** (exponent_bits - 1) - 1
    emin, emax = 1 - bias, bias
    return Format(
        name=name, bits=1 + exponent_bits + mantissa_bits, exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits, max=(2 - 2.0**-mantissa_bits) * 2.0**emax,
        smallest_normal=2.0**emin, smallest_subnormal=2.0 ** (emin - mantissa_bits),
        eps=2.0**-mantissa_bits, has_inf=True,
        source=f"bit layout ({exponent_bits} exponent, {mantissa_bits} mantissa bits)",
    )


@dataclass(frozen=True)
class E4M3Overflow:
    """What this torch release's cast to ``float8_e4m3fn`` stores for ``1e6`` and for ``inf``.

    e4m3fn has no inf. Before torch 2.13 the cast gives NaN for both; from 2.13 on it
    saturates both to the largest value, 448 (torch/headeronly/util/Float8_e4m3fn.h).
    """

    torch_version: str
    device: str
    finite: float  # what 1e6 became
    inf: float  # what inf became

    @property
    def saturates(self) -> bool:
        """True when both came back as the largest value (448): the cast saturates."""
        top = float(torch.finfo(torch.float8_e4m3fn).max)
        return self.finite == top and self.inf == top

    @property
    def gives_nan(self) -> bool:
        """True when both came back as NaN."""
        return math.isnan(self.finite) and math.isnan(self.inf)

    def stored_as(self) -> str:
        """``"448 (saturated)"``, ``"NaN"``, or both values when they differ."""
        if self.saturates:
            return f"{self.finite:g} (saturated)"
        if self.gives_nan:
            return "NaN"
        return f"{self.finite:g} for 1e6 and {self.inf:g} for inf"

    def __str__(self) -> str:
        return (f"torch {self.torch_version} on {self.device}: a value too large for e4m3fn "
                f"(largest 448) is stored as {self.stored_as()}")


def e4m3_overflow(device="cpu") -> E4M3Overflow:
    """Probe once (per device) what this torch release's cast stores for an e4m3fn overflow.

    Casts ``1e6`` and ``inf`` to ``torch.float8_e4m3fn`` and reads them back. The answer
    differs between releases (NaN before 2.13, saturation to 448 from 2.13 on), so the
    package computes it rather than assuming it. Used in 01 and 08_fp8.
    """
    return _probe_e4m3(str(_device(device)))


def _device(device) -> torch.device:
    """``device`` as a torch.device, else a ValueError naming the accepted kinds."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda'; got {device!r}") from None


@functools.cache
def _probe_e4m3(device: str) -> E4M3Overflow:
    probe = torch.tensor([1e6, math.inf], device=device).to(torch.float8_e4m3fn)
    finite, inf = probe.to(torch.float32).cpu().tolist()
    return E4M3Overflow(torch.__version__.split("+")[0], device, finite, inf)


def format_info(name) -> Format:
    """The :class:`Format` of ``name`` (any alias :func:`parse_format` accepts)."""
    name = parse_format(name)
    return from_layout("tf32", 8, 10) if name == "tf32" else _from_finfo(name)


def _pow2(x: float) -> str:
    e = math.log2(x)
    return f"2^{e:.0f}" if e == round(e) else f"~2^{e:.2f}"


def formats_table(names=FORMATS) -> str:
    """The formats side by side: bits, largest, smallest normal and subnormal, eps."""
    head = (f"{'format':<9}{'bits':>5}{'exp':>5}{'mant':>5}  {'largest':>11}  "
            f"{'smallest normal':>20}  {'smallest subnormal':>20}  {'eps (ulp at 1)':>18}")
    lines = [head]
    for n in [names] if isinstance(names, (str, torch.dtype)) else names:  # one name, or several
        f = format_info(n)
        lines.append(
            f"{f.name:<9}{f.bits:>5}{f.exponent_bits:>5}{f.mantissa_bits:>5}  {f.max:>11.6g}  "
            f"{f'{f.smallest_normal:.3g} ({_pow2(f.smallest_normal)})':>20}  "
            f"{f'{f.smallest_subnormal:.3g} ({_pow2(f.smallest_subnormal)})':>20}  "
            f"{f'{f.eps:.3g} ({_pow2(f.eps)})':>18}")
    return "\n".join(lines)


# -- rounding ------------------------------------------------------------------------------


def _as_float_tensor(x, what: str = "the input") -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if not torch.is_floating_point(x):
            raise ValueError(f"{what} must be a floating-point tensor; got dtype {x.dtype} "
                             "(convert it first, e.g. t.float())")
        return x.detach()
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    raise ValueError(f"{what} must be a floating-point tensor or a number; got {type(x).__name__}")


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest value with a 10-bit mantissa, ties to even, on the bit pattern.

    Adding 0xFFF plus the lowest kept bit, then clearing the 13 dropped bits, rounds the
    magnitude to nearest-even; a carry walks into the exponent exactly as rounding should
    (the largest values carry into the inf pattern). NaNs are left as they are.
    """
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    rounded = (mag + 0xFFF + ((mag >> 13) & 1)) & ~0x1FFF
    out = sign | rounded
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def _to_float32_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded to odd: an inexact value gets the neighbour whose last
    mantissa bit is 1. Rounding that to a format with at least 2 mantissa bits fewer (all
    but fp32) to nearest-even gives the value rounded once from float64, where two
    round-to-nearest steps can differ (65519.9999 is 65520 in float32, an fp16 tie that goes
    to inf; rounded once it is 65504). Boldo and Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", IEEE Trans. Computers, 2008.
    """
    f = x.to(torch.float32)
    inexact = (f.double() != x) & ~torch.isnan(x)
    even = (f.view(torch.int32) & 1) == 0
    toward = torch.where(f.double() < x, math.inf, -math.inf).to(torch.float32)
    return torch.where(inexact & even, torch.nextafter(f, toward), f)


def round_to_format(tensor, name) -> torch.Tensor:
    """The values ``tensor`` holds once stored in format ``name``, as a float32 tensor.

    fp32, bf16, fp16 and fp8 are a cast (``tensor.to(dtype)``); tf32 rounds the float32
    value's mantissa to 10 bits, round-to-nearest-even, as a tensor core reads its inputs
    (hardware may break exact ties differently). Too large: inf; fp8 e4m3fn has no inf, and
    there the cast gives what :func:`e4m3_overflow` reports for this torch release (448 or
    NaN). A float64 input is rounded once, to nearest-even, as :func:`census` classifies it
    (torch's own CPU cast from float64 to 16 bits rounds to float32 on the way, which can
    differ by one step: :func:`_to_float32_odd`). Used in 01, 05 and 08.
    """
    fmt = parse_format(name)
    x = _as_float_tensor(tensor, "the tensor to round")
    x = _to_float32_odd(x) if x.dtype == torch.float64 and fmt != "fp32" else x.to(torch.float32)
    if fmt == "tf32":
        return _round_tf32(x)
    return x.to(_DTYPES[fmt]).to(torch.float32)


def rounding_error(tensor, name) -> torch.Tensor:
    """|stored - value| / |value| for every nonzero value of ``tensor`` stored in ``name``
    (float64; 1.0 where a value flushed to zero, inf where it overflowed)."""
    x = _as_float_tensor(tensor, "the tensor").flatten().double()
    x = x[x != 0]
    return (round_to_format(x, name).double() - x).abs() / x.abs()


# -- what a sum adds in --------------------------------------------------------------------


def sums_by_order(values) -> dict[str, float]:
    """A 1-D float32, bfloat16 or float16 tensor summed four ways, each result in its own dtype
    (lesson 00): torch's ``sum``; one element at a time and pairwise (a tree), both rounding
    to the dtype after every addition; and in float64, rounded once at the end
    (:func:`round_to_format`). Which one torch's sum matches shows what it added in."""
    x = _as_float_tensor(values, "the values to sum")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"the values to sum must be a non-empty 1-D float32, bfloat16 or float16 tensor; "
                         f"got shape {tuple(x.shape)}, dtype {x.dtype} (e.g. t.flatten().to(torch.bfloat16))")
    one_at_a_time = x[0]
    for v in x[1:]:
        one_at_a_time = one_at_a_time + v
    tree = x
    while tree.numel() > 1:
        if tree.numel() % 2:
            tree = torch.cat([tree, tree.new_zeros(1)])
        tree = tree[0::2] + tree[1::2]
    once = round_to_format(x.double().sum(), parse_format(x.dtype))
    return {"torch's sum": x.sum().item(), "one at a time": one_at_a_time.item(),
            "pairwise": tree.item(), "float64, rounded once": once.item()}


# -- bits of one value -------------------------------------------------------------------


@dataclass(frozen=True)
class Bits:
    """One value stored in one format: its sign, exponent and mantissa bits."""

    format: str
    value: float
    stored: float
    sign: str
    exponent: str
    mantissa: str
    kind: str  # zero, subnormal, normal, inf, nan

    @property
    def rel_error(self) -> float:
        """|stored - value| / |value| (0 for an exact value, inf when it overflowed)."""
        if math.isnan(self.value) or math.isnan(self.stored):
            return math.nan
        if self.stored == self.value:
            return 0.0
        if self.value == 0 or math.isinf(self.stored) or math.isinf(self.value):
            return math.inf
        return abs(self.stored - self.value) / abs(self.value)

    def _meaning(self) -> str:
        f = format_info(self.format)
        bias = 2 ** (f.exponent_bits - 1) - 1
        s = "-" if self.sign == "1" else "+"
        e = int(self.exponent, 2)
        if not f.has_inf and not math.isnan(self.value) and abs(self.value) > f.overflow_from:
            release = f"torch {torch.__version__.split('+')[0]}'s cast"
            if self.kind == "nan":
                return (f"too large: {release} stores NaN ({f.name} has no inf; torch 2.13 and "
                        f"later saturate to {f.max:g} instead)")
            return f"too large: {release} saturates it to the largest value, {s}{f.max:g} ({f.name} has no inf)"
        if self.kind == "normal":
            return f"normal: {s}1.{self.mantissa} (binary) x 2^({e} - {bias}) = {s}{abs(self.stored):.10g}"
        if self.kind == "subnormal":
            return (f"subnormal: {s}0.{self.mantissa} (binary) x 2^{1 - bias}: fewer significant "
                    f"bits, so less precision")
        if self.kind == "zero":
            return "zero" + (" (the value was too small: flushed to zero)" if self.value != 0 else "")
        return self.kind

    def __str__(self) -> str:
        return "\n".join([
            f"{self.format}: {self.value!r} is stored as {self.stored!r}",
            f"  sign {self.sign} | exponent {self.exponent} | mantissa {self.mantissa}",
            f"  {self._meaning()}",
            f"  relative error {self.rel_error:.3g}",
        ])


_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits_of(value, name) -> Bits:
    """Split ``value`` (a number) as stored in format ``name`` into sign/exponent/mantissa.
    The number is rounded once, from float64 (:func:`round_to_format`)."""
    f = format_info(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"value must be a number; got {value!r}")
    if isinstance(value, int) and abs(value) > sys.float_info.max:
        raise ValueError(f"value (about 2^{abs(value).bit_length() - 1}) is beyond float64's largest (about 1.8e308): pass a number "
                         "up to 1.8e308, or math.inf")
    x = torch.tensor(float(value), dtype=torch.float64)
    stored = round_to_format(x, f.name).reshape(1)  # rounded once, as census classifies it
    if f.name == "tf32":
        pattern = (int(stored.view(torch.int32).item()) & 0xFFFFFFFF) >> 13
    else:
        stored = stored.to(f.dtype)  # exact: the value is one of the format's
        width = stored.element_size()
        pattern = int(stored.view(_INT_VIEW[width]).item()) & ((1 << (8 * width)) - 1)
    text = format(pattern, f"0{f.bits}b")
    sign, exponent, mantissa = text[0], text[1:1 + f.exponent_bits], text[1 + f.exponent_bits:]
    top = exponent == "1" * f.exponent_bits
    if f.has_inf and top:
        kind = "nan" if "1" in mantissa else "inf"
    elif not f.has_inf and top and mantissa == "1" * f.mantissa_bits:
        kind = "nan"
    elif "1" not in exponent:
        kind = "subnormal" if "1" in mantissa else "zero"
    else:
        kind = "normal"
    return Bits(f.name, float(value), float(stored.to(torch.float64).item()), sign, exponent,
                mantissa, kind)


# -- classifying many values -------------------------------------------------------------

KINDS = ("flushed", "subnormal", "normal", "overflow")


@dataclass(frozen=True)
class Census:
    """Where the values of a tensor land in one format.

    Counts of ``zero`` (exactly 0 already, not a loss), ``flushed`` (nonzero, rounds to 0),
    ``subnormal`` (kept, with fewer significant bits), ``normal``, ``overflow`` (too large to
    fit, whatever the cast then stores: inf, or for e4m3fn 448 or NaN depending on the torch
    release, :attr:`Format.overflows_to`) and ``nan`` (NaN already). Fractions are of the
    nonzero values. The classes are the same on every torch release.
    """

    format: str
    scale: float
    total: int
    zero: int
    flushed: int
    subnormal: int
    normal: int
    overflow: int
    nan: int
    measured: bool = False  # values from a training run: its text marks figures with ≈ (claims)

    @property
    def nonzero(self) -> int:
        return self.total - self.zero

    def fraction(self, kind: str) -> float:
        """``count / nonzero`` for one of flushed, subnormal, normal, overflow, nan."""
        if kind not in (*KINDS, "nan"):
            raise ValueError(f"kind must be one of {', '.join((*KINDS, 'nan'))}; got {kind!r}")
        return getattr(self, kind) / self.nonzero if self.nonzero else 0.0

    def __str__(self) -> str:
        mark = "≈" if self.measured else ""
        parts = ", ".join(f"{k} {mark}{self.fraction(k):.3%}" for k in KINDS)
        return f"{self.format} x {self.scale:g}: {parts} of {mark}{self.nonzero:,} nonzero values"


def census(tensor, name, measured: bool = False) -> Census:
    """Classify every value of ``tensor`` for format ``name`` (exact thresholds, no rounding).

    ``measured=True`` for values that came out of float kernels (a training run's
    gradients): the census's text then marks its figures with ``≈`` (:mod:`amp_lessons.claims`).
    """
    return _census(tensor, name, 1.0, measured)


def check_scale(scale) -> float:
    """A loss scale as a float: a positive finite number, else a ValueError saying so."""
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        hint = ": take its value with float(...)" if isinstance(scale, torch.Tensor) else ""
        raise ValueError(f"the loss scale must be a positive finite number, given as a Python int or "
                         f"float such as 2.0**16; a {type(scale).__name__} is refused{hint}; got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"the loss scale must be a positive finite number such as 2.0**16; got {scale!r}")
    return float(scale)


def scaled_census(tensor, name, scale, measured: bool = False) -> Census:
    """:func:`census` of ``tensor * scale``, multiplied in float64 (exact for powers of
    two): where the gradients land once the loss was multiplied by ``scale``."""
    return _census(tensor, name, check_scale(scale), measured)


def _census(tensor, name, scale: float, measured: bool = False) -> Census:
    f = format_info(name)
    a = _as_float_tensor(tensor, "the tensor to classify").cpu().to(torch.float64).abs().flatten() * scale
    nan = torch.isnan(a)
    over = f.overflows(a)
    normal = (a >= f.normal_from) & ~over
    flushed = (a > 0) & (a <= f.flush_below)
    sub = (a > f.flush_below) & (a < f.normal_from)

    def n(mask):
        return int(mask.sum())

    return Census(f.name, scale, a.numel(), n(a == 0), n(flushed), n(sub), n(normal & ~nan),
                  n(over), n(nan), measured)


def scale_table(tensor, scale, names=("fp16", "bf16"), measured: bool = False) -> str:
    """What a loss scale does to these values in each format, as percentages (01's slider).
    ``measured=True`` marks the figures with ``≈`` (values from a training run)."""
    scale = check_scale(scale)
    names = [names] if isinstance(names, (str, torch.dtype)) else list(names)
    if not names:
        raise ValueError("names must hold at least one format, e.g. ('fp16', 'bf16')")
    rows = [scaled_census(tensor, n, scale) for n in names]
    mark = "≈" if measured else ""
    k = math.log2(scale)
    label = f"2^{k:.0f}" if k == round(k) else f"{scale:g}"
    lines = [f"loss scale {label} = {scale:g}",
             f"{'format':<8}{'flushed to 0':>14}{'subnormal':>12}{'normal':>10}{'overflow':>10}"]
    for c in rows:
        lines.append(f"{c.format:<8}" + "".join(
            f"{mark + format(c.fraction(kind), '.3%'):>{w}}" for kind, w in zip(KINDS, (14, 12, 10, 10))))
    lines.append(f"(of {mark}{rows[0].nonzero:,} nonzero values; {mark}{rows[0].zero:,} exact zeros left out)")
    return "\n".join(lines)
