"""Block scales: e2m1 (fp4) and e8m0, one scale per block of 16, 32 or 128 values, MXFP8,
MXFP4 and NVFP4, and the block-scaled matmul. Used in 09_block_scales.

Lesson 08 scales a whole tensor (or a row) by one float32 factor. The recipes that came
after scale small **blocks** along the dimension a matmul sums over (K):

- **MXFP8** and **MXFP4** (OCP Microscaling spec v1.0): blocks of 32, elements in e4m3 or
  e2m1, one scale per block stored as **e8m0**, a bare power of two (8 exponent bits, no
  sign, no mantissa; code 255 is NaN; no zero).
- **NVFP4** (NVIDIA, Blackwell): blocks of 16 e2m1 values, each block scaled by an
  **e4m3** factor, under one float32 scale for the whole tensor.
- **1x128 / 128x128** (DeepSeek-V3, in fp8 on Hopper): e4m3 elements with float32 scales,
  1x128 tiles for activations and gradients, 128x128 blocks for weights.

Everything is emulated in float32 with integer codes, so it runs and gives the same
answer on any device and torch release: e2m1 values are rounded here (torch's
``float4_e2m1fn_x2`` is a storage dtype: two codes per byte), e8m0 scales are built from their
bit patterns, and only the e4m3 cast is torch's (:func:`amp_lessons.fp8.saturating_cast`).

Conventions: a block's **decode scale** ``X`` multiplies the stored element values back
(``x ≈ q * X``), the way the OCP spec and ``torch._scaled_mm`` write it; lesson 08's
``scale`` is ``1 / X``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F

from .formats import format_info
from .fp8 import EPS, saturating_cast
from .hardware import pick_device

# -- e2m1: the 16 values of fp4 ------------------------------------------------------------------

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; codes 8-15 are the same, negative
E2M1_MAX = 6.0
ELEMENTS = ("e4m3", "e2m1")
SCALE_FORMATS = ("fp32", "e8m0", "e4m3")
RULES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")


def e2m1_values() -> torch.Tensor:
    """The value of each of the 16 e2m1 codes, in code order (bit 3 is the sign: code 8 is -0.0)."""
    grid = torch.tensor(E2M1_GRID)
    return torch.cat([grid, -grid])


def _check_finite(x: torch.Tensor, what: str) -> None:
    if torch.isnan(x).any():
        raise ValueError(f"{what} has NaN values; e2m1 has no NaN (and a block scale from a NaN "
                         "amax is NaN): find where the NaN comes from first")


def e2m1_codes(x, rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """The e2m1 code (uint8, 0-15) of each value of ``x`` (already scaled): magnitudes above 6
    saturate to 6; ``rounding="nearest"`` rounds to the nearest value, ties to the even code
    (what a cast does); ``"stochastic"`` rounds up with probability equal to the distance from
    the value below, divided by the gap (unbiased: the mean of many draws is ``x``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}; got {rounding!r}")
    x = torch.as_tensor(x, dtype=torch.float32)
    _check_finite(x, "the input")
    grid = torch.tensor(E2M1_GRID)
    mag = x.abs().clamp(max=E2M1_MAX)
    lo = (torch.searchsorted(grid, mag.contiguous(), right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    below, above = grid[lo], grid[hi]
    gap = (above - below).clamp(min=1e-30)
    if rounding == "nearest":
        d_lo, d_hi = mag - below, above - mag
        up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    else:
        u = torch.rand(mag.shape, generator=generator)
        up = u < (mag - below) / gap
    code = torch.where(up & (hi > lo), hi, lo)
    return (code + 8 * torch.signbit(x).long()).to(torch.uint8)


def e2m1_decode(codes) -> torch.Tensor:
    """The float32 values of e2m1 codes (uint8, 0-15)."""
    codes = torch.as_tensor(codes)
    if codes.dtype != torch.uint8 or (codes > 15).any():
        raise ValueError("e2m1 codes are uint8 values 0 to 15 (as e2m1_codes gives them)")
    return e2m1_values()[codes.long()]


def round_e2m1(x, rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` rounded to e2m1 (saturating at ±6), as float32."""
    return e2m1_decode(e2m1_codes(x, rounding, generator))


def pack_fp4(codes) -> torch.Tensor:
    """Two e2m1 codes per byte, as ``torch.float4_e2m1fn_x2`` stores them: along the last
    dimension, the first of each pair in the low nibble (bits 3-0), the second in the high
    nibble (bits 7-4) (c10/util/Float4_e2m1fn_x2.h). Returns uint8, last dimension halved."""
    codes = torch.as_tensor(codes)
    if codes.dtype != torch.uint8 or (codes > 15).any():
        raise ValueError("pack_fp4 takes e2m1 codes: uint8 values 0 to 15 (e2m1_codes(x))")
    if codes.shape[-1] % 2:
        raise ValueError(f"two codes go in each byte: the last dimension must be even; got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed) -> torch.Tensor:
    """The codes :func:`pack_fp4` packed: low nibble first. Takes uint8 or ``float4_e2m1fn_x2``."""
    packed = torch.as_tensor(packed)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def as_float4_x2(packed: torch.Tensor):
    """The packed bytes viewed as ``torch.float4_e2m1fn_x2`` (no copy), or None where this
    torch release has no such dtype."""
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    return None if dtype is None else packed.view(dtype)


# -- e8m0: a power of two in one byte ------------------------------------------------------------


def e8m0_decode(codes) -> torch.Tensor:
    """The float32 value of e8m0 codes (uint8): ``2^(code - 127)``; code 255 is NaN. Built from
    float32 bit patterns, so every value is exact (2^-127 is a float32 subnormal)."""
    codes = torch.as_tensor(codes)
    if codes.dtype != torch.uint8:
        raise ValueError(f"e8m0 codes are uint8; got {codes.dtype}")
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.tensor(1 << 22, dtype=torch.int32), c << 23)
    return torch.where(c == 255, torch.tensor(math.nan), bits.view(torch.float32))


def e8m0_encode(exponent) -> torch.Tensor:
    """The e8m0 code (uint8) of ``2^exponent`` for integer exponents, clamped to e8m0's
    range 2^-127 .. 2^127."""
    e = torch.as_tensor(exponent).to(torch.int32)
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


def as_float8_e8m0(codes: torch.Tensor):
    """The codes viewed as ``torch.float8_e8m0fnu`` (no copy), or None where this release has none."""
    dtype = getattr(torch, "float8_e8m0fnu", None)
    return None if dtype is None else codes.view(dtype)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` exactly, for positive finite x (from frexp: x = m * 2^e, m in [0.5, 1))."""
    _, e = torch.frexp(x)
    return e.to(torch.int32) - 1


def mx_exponent(amax, element: str = "e4m3", rule: str = "floor") -> torch.Tensor:
    """The exponent ``e`` of a block's e8m0 decode scale ``X = 2^e``, from the block's amax.

    - ``"floor"``, the OCP MX spec v1.0: ``floor(log2(amax)) - emax``, ``emax`` the exponent
      of the element's largest value (8 for e4m3's 448, 2 for e2m1's 6). ``amax / X`` lands in
      ``[2^emax, 2^(emax+1))``, which can pass the largest value: those values saturate.
    - ``"rceil"`` (cuBLAS, torchao's RCEIL): ``ceil(log2(amax / max))``, the smallest power of
      two that saturates nothing.

    An all-zero block gets 2^-127, e8m0's smallest. Returns int32 exponents."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    amax = torch.as_tensor(amax, dtype=torch.float32)
    top = _element_max(element)
    if rule == "floor":
        e = _floor_log2(amax.clamp(min=2.0**-126)) - _floor_log2(torch.tensor(top))
    else:
        ratio = amax.double() / top
        m, ex = torch.frexp(ratio.clamp(min=2.0**-300))
        e = (ex - (m == 0.5).to(ex.dtype)).to(torch.int32)  # ceil(log2(ratio))
    return torch.where(amax > 0, e, torch.tensor(-127, dtype=torch.int32)).clamp(-127, 127)


# -- elements ----------------------------------------------------------------------------------------


def _check_element(element: str) -> str:
    if element not in ELEMENTS:
        raise ValueError(f"element must be one of {', '.join(ELEMENTS)}; got {element!r}")
    return element


def _element_max(element: str) -> float:
    return 448.0 if _check_element(element) == "e4m3" else E2M1_MAX


def saturates(magnitude: torch.Tensor, element: str) -> torch.Tensor:
    """True where a scaled magnitude is too large for the element format, so that the cast
    clamps it: above 464 for e4m3 (up to there it rounds to 448 anyway), from 7 for e2m1
    (the tie between 6 and the 8 it does not have)."""
    if _check_element(element) == "e4m3":
        return format_info("fp8_e4m3").overflows(magnitude)
    return magnitude >= 7.0


def round_element(x: torch.Tensor, element: str, rounding="nearest", generator=None) -> torch.Tensor:
    """``x`` (already scaled) rounded to the element format, saturating at its largest value."""
    if _check_element(element) == "e4m3":
        if rounding != "nearest":
            raise ValueError("stochastic rounding is emulated for e2m1 elements only here")
        return saturating_cast(x, "fp8_e4m3").float()
    return round_e2m1(x, rounding, generator)


# -- blocks -------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor, block) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` (2-D) zero-padded to whole blocks and viewed as (R, br, C, bc); and its shape."""
    rows, cols = x.shape
    br, bc = rows if block[0] is None else block[0], cols if block[1] is None else block[1]
    pr, pc = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc), (br, bc)


def _expand(per_block: torch.Tensor, size: tuple[int, int], shape) -> torch.Tensor:
    """Per-block values (R, C) repeated over each block and cropped to ``shape``."""
    full = per_block.repeat_interleave(size[0], 0).repeat_interleave(size[1], 1)
    return full[: shape[0], : shape[1]]


@dataclass(frozen=True)
class Scheme:
    """How a tensor is cut into blocks and scaled: ``block = (rows, cols)`` of each block
    (``None``: the whole dimension), the element format, and the format its scales are
    stored in; ``tensor_scale`` adds NVFP4's float32 scale over the e4m3 block scales."""

    name: str
    element: str
    block: tuple
    scale_format: str
    rule: str = "floor"
    tensor_scale: bool = False


SCHEMES = {
    "per tensor": Scheme("per tensor", "e4m3", (None, None), "fp32"),
    "per row": Scheme("per row", "e4m3", (1, None), "fp32"),
    "1x128": Scheme("1x128", "e4m3", (1, 128), "fp32"),
    "128x128": Scheme("128x128", "e4m3", (128, 128), "fp32"),
    "MXFP8": Scheme("MXFP8", "e4m3", (1, 32), "e8m0"),
    "MXFP4": Scheme("MXFP4", "e2m1", (1, 32), "e8m0"),
    "NVFP4": Scheme("NVFP4", "e2m1", (1, 16), "e4m3", tensor_scale=True),
}


def get_scheme(scheme) -> Scheme:
    """A :class:`Scheme` from its name (``"MXFP8"``, ``"NVFP4"``, ``"1x128"``, ...) or itself."""
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)} (or a Scheme); got {scheme!r}")
    return SCHEMES[scheme]


@dataclass(frozen=True)
class BlockTensor:
    """A block-quantized matrix: ``values`` (float32, each on the element grid), one decode
    scale per block (``scales``, shape (row blocks, column blocks)), and NVFP4's tensor-level
    decode scale (1.0 elsewhere): ``x ≈ values * scale of its block * tensor_scale``."""

    values: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    scheme: Scheme
    tensor_scale: float
    saturated_mask: torch.Tensor  # True where the scaled value was too large for the element
    codes: torch.Tensor | None = None  # e8m0 codes of the scales (MX schemes)

    @property
    def saturated(self) -> int:
        """How many values the element format clamped (:func:`saturates`)."""
        return int(self.saturated_mask.sum())

    def dequantize(self) -> torch.Tensor:
        """The values this tensor stands for, in float32."""
        return self.values * _expand(self.scales, self.block, self.values.shape) * self.tensor_scale


def _as_matrix(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or x.dim() != 2:
        what = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"block quantization takes a floating-point matrix (2 dims; reshape to "
                         f"(-1, K) first); got {what}")
    x = x.detach().float().cpu()
    _check_finite(x, "the tensor")
    return x


def block_amax(x, block) -> torch.Tensor:
    """The largest magnitude of each block of ``x``, shape (row blocks, column blocks)."""
    view, _ = _blocks(_as_matrix(x).abs(), block)
    return view.amax(dim=(1, 3))


def quantize(x, scheme="MXFP8", rounding: str = "nearest", generator=None, rule=None) -> BlockTensor:
    """``x`` (a matrix, blocks along its rows' K) under a :data:`SCHEMES` scheme.

    fp32 scales: ``X = amax / max`` per block. e8m0: ``X = 2^e``, ``e`` from :func:`mx_exponent`
    (``rule`` overrides the scheme's). NVFP4: a float32 tensor scale ``s = amax_tensor / (448 * 6)``,
    each block's scale ``e4m3(amax_block / 6 / s)``, so ``X = e4m3 scale * s``.
    """
    s = get_scheme(scheme)
    x = _as_matrix(x)
    top = _element_max(s.element)
    amax = block_amax(x, s.block)
    tensor_scale = 1.0
    codes = None
    if s.scale_format == "fp32":
        scales = (amax.double().clamp(min=EPS) / top).float()
    elif s.scale_format == "e8m0":
        codes = e8m0_encode(mx_exponent(amax, s.element, rule or s.rule))
        scales = e8m0_decode(codes)
    else:  # e4m3 block scales under a float32 tensor scale (NVFP4)
        whole = x.abs().amax().double().clamp(min=EPS) if x.numel() else torch.tensor(EPS, dtype=torch.float64)
        tensor_scale = float(whole / (448.0 * top)) if s.tensor_scale else 1.0
        scales = saturating_cast((amax.double() / top / tensor_scale).float(), "fp8_e4m3").float()
    size = _blocks(x, s.block)[1]
    inv = torch.where(scales > 0, 1.0 / (scales.double() * tensor_scale), torch.zeros((), dtype=torch.float64))
    scaled = (x.double() * _expand(inv, size, x.shape)).float()
    values = round_element(scaled, s.element, rounding, generator)
    return BlockTensor(values, scales, size, s, tensor_scale, saturates(scaled.abs(), s.element), codes)


# -- errors -----------------------------------------------------------------------------------------


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum x^2 / sum (x - approx)^2)``
    (inf when equal). 6.02 dB per bit of precision; a factor of 2 in error is 6.02 dB."""
    x, approx = x.double(), approx.double()
    noise = (x - approx).pow(2).sum().item()
    signal = x.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass(frozen=True)
class Error:
    """What one scheme did to one or more tensors: SQNR (dB), and counts of nonzero values
    flushed to zero and of values saturated, out of ``nonzero``."""

    scheme: str
    sqnr: float
    flushed: int
    saturated: int
    nonzero: int


def error(tensors, scheme, rule=None, leave_out=None) -> Error:
    """:class:`Error` of ``scheme`` over ``tensors`` (one matrix, or several: their noise adds
    up). ``leave_out`` (one matrix only: a bool mask, True = left out) counts only the other
    values; they are still quantized with the whole tensor."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if leave_out is not None and (len(tensors) != 1 or leave_out.shape != tensors[0].shape):
        raise ValueError("leave_out is a bool mask of the one tensor's shape (True = left out)")
    xs, qs, flushed, saturated = [], [], 0, 0
    for t in tensors:
        q = quantize(t, scheme, rule=rule)
        x, d = _as_matrix(t), q.dequantize()
        over = q.saturated_mask
        if leave_out is not None:
            x, d, over = x[~leave_out], d[~leave_out], over[~leave_out]
        flushed += int(((x != 0) & (d == 0)).sum())
        saturated += int(over.sum())
        xs.append(x.flatten())
        qs.append(d.flatten())
    x, d = torch.cat(xs), torch.cat(qs)
    return Error(get_scheme(scheme).name, sqnr_db(x, d), flushed, saturated, int((x != 0).sum()))


def exact_values(shape, lo: int = -8, hi: int = 0, seed: int = 0) -> torch.Tensor:
    """Values ``±(1 + k/8) * 2^e`` with ``e`` from ``lo`` to ``hi``, drawn from integers under
    their own seed: every device and release gets the same numbers, exact in float32."""
    g = torch.Generator().manual_seed(seed)
    mant = 1 + torch.randint(0, 8, shape, generator=g).float() / 8
    exp = torch.randint(lo, hi + 1, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return sign * mant * e8m0_decode((exp + 127).to(torch.uint8))


def outlier_features(rows: int = 64, k: int = 256, column: int = 5, factor: float = 2.0**12, seed: int = 0):
    """``(x, mask)``: activations of :func:`exact_values` whose input feature ``column`` is
    ``factor`` times larger in every row (an outlier feature, as large language models grow);
    ``mask`` marks that column, to leave it out of the error."""
    x = exact_values((rows, k), seed=seed)
    x[:, column] *= factor
    mask = torch.zeros(rows, k, dtype=torch.bool)
    mask[:, column] = True
    return x, mask


def with_scales(scheme, scale_format: str, rule: str = "floor") -> Scheme:
    """``scheme`` with its scales stored another way (``"fp32"``: exact; ``"e8m0"`` with ``rule``)."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {', '.join(SCALE_FORMATS)}; got {scale_format!r}")
    s = get_scheme(scheme)
    label = f"{s.name}, {scale_format} scales" + (f" ({rule})" if scale_format == "e8m0" else "")
    return replace(s, name=label, scale_format=scale_format, rule=rule, tensor_scale=False)


def error_table(groups: dict, schemes=tuple(SCHEMES)) -> dict:
    """``{kind: {scheme: Error}}`` for each group of tensors (``{"weight": [w1, w2], ...}``)."""
    return {kind: {s: error(ts, s) for s in schemes} for kind, ts in groups.items()}


# -- block-scaled matmul --------------------------------------------------------------------------


def reference_mm(a: BlockTensor, b: BlockTensor) -> torch.Tensor:
    """``a @ b.T`` as dequantize, then a float32 matmul: the reference."""
    return a.dequantize() @ b.dequantize().t()


def block_mm(a: BlockTensor, b: BlockTensor) -> torch.Tensor:
    """``a @ b.T`` the way a block-scaled kernel computes it: for each block of K, the product
    of the element values, times the two blocks' scales, summed over the blocks in float32;
    then the tensor scales. a is (M, K), b is (N, K), both blocked along K the same way."""
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must share K; got {tuple(a.values.shape)} and {tuple(b.values.shape)}")
    bk = a.block[1]
    if b.block[1] != bk:
        raise ValueError(f"both operands need the same block size along K; got {a.block[1]} and {b.block[1]}")
    k = a.values.shape[1]
    out = torch.zeros(a.values.shape[0], b.values.shape[0])
    for j in range(math.ceil(k / bk)):
        cols = slice(j * bk, (j + 1) * bk)
        part = a.values[:, cols] @ b.values[:, cols].t()
        sa = a.scales[:, j].repeat_interleave(a.block[0])[: a.values.shape[0]]
        sb = b.scales[:, j].repeat_interleave(b.block[0])[: b.values.shape[0]]
        out = out + part * sa[:, None] * sb[None, :]
    return out * (a.tensor_scale * b.tensor_scale)


def accumulation_bound(a: BlockTensor, b: BlockTensor) -> torch.Tensor:
    """How far :func:`block_mm` and :func:`reference_mm` may differ, elementwise: each is a sum
    of K float32 products, within ``γ_n |A| |B|^T`` of the exact sum, ``γ_n = nu / (1 - nu)``
    with u = 2^-24 and n = K + 4 roundings (the scales' products counted; Higham, section
    3.1), so they are within twice that of each other."""
    nu = (a.values.shape[1] + 4) * 2.0**-24
    mags = a.dequantize().abs().double() @ b.dequantize().abs().double().t()
    return (2 * nu / (1 - nu) * mags).float()


# -- the real kernel (make gpu-check) ------------------------------------------------------------------


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """An (M, K/32) scale matrix in the layout cuBLAS reads for block scales
    (``SwizzleType.SWIZZLE_32_4_4``): padded to 128 x 4 tiles, each tile stored as 32 x 16."""
    rows, cols = scales.shape
    pr, pc = -rows % 128, -cols % 4
    padded = torch.nn.functional.pad(scales, (0, pc, 0, pr))
    r, c = padded.shape[0] // 128, padded.shape[1] // 4
    tiles = padded.view(r, 128, c, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _mxfp8_operands(device):
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (128, 64), generator=g).float() * 2.0 ** torch.randint(-6, 6, (128, 1), generator=g)
    b = torch.randint(-8, 9, (128, 64), generator=g).float() * 2.0 ** torch.randint(-6, 6, (128, 1), generator=g)
    qa, qb = quantize(a, "MXFP8"), quantize(b, "MXFP8")
    return qa, qb


def _kernel_mxfp8(qa: BlockTensor, qb: BlockTensor, device) -> torch.Tensor:
    """The real MXFP8 kernel: ``F.scaled_mm`` with 1x32 e8m0 block scales, swizzled for cuBLAS."""
    a8 = qa.values.to(device).to(torch.float8_e4m3fn)
    b8 = qb.values.to(device).to(torch.float8_e4m3fn)
    sa = as_float8_e8m0(to_blocked(qa.codes)).to(device)
    sb = as_float8_e8m0(to_blocked(qb.codes)).to(device)
    kind, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(a8, b8.t(), sa, kind, sb, kind, swizzle, swizzle, output_dtype=torch.float32).float().cpu()


def block_kernel_skip(device) -> str | None:
    """Why the real MXFP8 kernel cannot run on ``device`` here, or None if it can: MX and
    NVFP4 block scales (1x32, 1x16) need a CUDA GPU of compute capability 10.0+ (Blackwell),
    ``F.scaled_mm`` and the e8m0 dtype (this torch release). (1x128 and 128x128 scales run on
    Hopper instead: :data:`HARDWARE`.) The check is written for CUDA; on ROCm it is not run."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"this check runs torch's MXFP8 kernel on an NVIDIA GPU of compute capability 10.0+ (Blackwell); "
                f"this is {dev.type}")
    if torch.version.hip is not None:
        return "this check is written for CUDA's MXFP8 kernel; on ROCm it is not run"
    cc = torch.cuda.get_device_capability(dev)
    if cc < (10, 0):
        return (f"this check runs torch's MXFP8 kernel on compute capability 10.0+ (Blackwell); this GPU is "
                f"{cc[0]}.{cc[1]}")
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType") or as_float8_e8m0(torch.zeros(1, dtype=torch.uint8)) is None:
        return f"torch {torch.__version__} has no F.scaled_mm with block scales (or no float8_e8m0fnu)"
    return None


@dataclass(frozen=True)
class KernelCheck:
    """The real block-scaled kernel against :func:`reference_mm`; ``skipped`` says why not."""

    skipped: str | None
    equal: bool | None = None
    within_bound: bool | None = None
    max_diff: float | None = None


def block_kernel_check(device=None, kernel=_kernel_mxfp8) -> KernelCheck:
    """On a Blackwell GPU, MXFP8 ``F.scaled_mm`` on exact inputs against dequantize-then-matmul;
    elsewhere the reason it was skipped (:func:`block_kernel_skip`). Used by ``make gpu-check``."""
    dev = pick_device(device)
    why = block_kernel_skip(dev)
    if why is not None:
        return KernelCheck(why)
    qa, qb = _mxfp8_operands(dev)
    ref = reference_mm(qa, qb)
    try:
        out = kernel(qa, qb, dev)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        return KernelCheck(f"torch refused the call: {str(err).strip().splitlines()[0]}")
    diff = (out - ref).abs()
    return KernelCheck(None, torch.equal(out, ref), bool((diff <= accumulation_bound(qa, qb)).all()),
                       float(diff.max()))


def cpu_block_refusal() -> str | None:
    """What this torch release's ``F.scaled_mm`` says, on the CPU, to 1x32 e8m0 block scales
    (None if it runs them): its message, without the line that lists the arguments it got."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__.split('+')[0]} has no torch.nn.functional.scaled_mm"
    if as_float8_e8m0(torch.zeros(1, dtype=torch.uint8)) is None:
        return f"torch {torch.__version__.split('+')[0]} has no float8_e8m0fnu"
    a = torch.ones(32, 32).to(torch.float8_e4m3fn)
    s = as_float8_e8m0(torch.full((32, 1), 127, dtype=torch.uint8))
    kind = F.ScalingType.BlockWise1x32
    try:
        F.scaled_mm(a, a.t(), s, kind, s, kind, output_dtype=torch.float32)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        lines = str(err).strip().splitlines()
        return "\n".join([lines[0]] + [line for line in lines[1:] if not line.startswith("Got ")])
    return None


# -- which hardware runs what (a lookup) ---------------------------------------------------------------

HARDWARE = (
    ("a CPU", "no block scales in torch's scaled_mm (the cell below asks this release; lesson 08 covers its "
     "fp8 paths): every block scheme here is emulated"),
    ("Turing, Ampere (T4, A100: sm_75, sm_80)", "no fp8 tensor cores: torch's CUDA _scaled_mm refuses "
     "compute capability below 8.9 (lesson 08), so every scheme here is emulated"),
    ("Ada (L4: sm_89)", "fp8 tensor cores, scales per tensor or per row; no block scales in torch's "
     "scaled_mm (_check_deepseek_support wants compute capability 9.x)"),
    ("Hopper (H100, H800: sm_90)", "fp8 tensor cores, scales per tensor or per row; 1x128 and 128x128 "
     "float32 block scales through cuBLAS: torch 2.13's scaled_mm takes them only on compute capability 9.x "
     "with cuBLASLt 12.9+ (ScaledBlas.cpp's _check_deepseek_support, NotImplementedError otherwise); "
     "DeepSeek-V3 ran those scales in its own kernels on H800s, applying them while accumulating"),
    ("Blackwell (B200: sm_100)", "MXFP8, MXFP4 and NVFP4 natively: the tensor cores read the block "
     "scales (e8m0, or e4m3 for NVFP4) themselves"),
)


def hardware_table(width: int = 92) -> str:
    """Which devices run which scaling natively: a lookup from the sources the lesson names,
    not a measurement. Each row wrapped to ``width`` characters, under its device."""
    import textwrap

    return "\n".join(textwrap.fill(what, width, initial_indent=f"{device}: ", subsequent_indent="    ")
                     for device, what in HARDWARE)
