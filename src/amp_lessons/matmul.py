"""Matrix multiplication per precision: how fast it runs here, and what TF32 does to it.

- :func:`matmul_gflops` measures achieved GFLOP/s of an n x n matmul in fp32, tf32, bf16
  or fp16: the number that decides whether mixed precision is faster on a device (on a
  GPU's tensor cores 16-bit is many times faster; on a CPU without AMX it need not be).
- :func:`tf32_error` shows what ``torch.set_float32_matmul_precision("high")`` changes:
  the inputs of float32 matmuls are rounded to TF32's 10 mantissa bits. The rounding is
  emulated, so the error shows on any device; on an NVIDIA GPU with TF32 tensor cores the
  real TF32 result is measured too.

Used in 05_putting_it_together and by ``python -m amp_lessons bench``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .claims import measured
from .formats import round_to_format
from .measure import time_step
from .precision import dtype_of, float32_matmul_precision, parse_precision


def matmul_flops(n: int, m: int | None = None, k: int | None = None) -> int:
    """Floating-point operations of an (n x k) @ (k x m) matmul: one multiply + one add each."""
    m = n if m is None else m
    k = n if k is None else k
    return 2 * n * m * k


def matmul_gflops(n: int, precision="fp32", device="cpu", warmup: int = 2, repeats: int = 5) -> float:
    """Achieved GFLOP/s of an n x n matmul in ``precision`` on ``device``: the fastest of ``repeats``.

    A microbenchmark asks what rate the kernel *can* reach, so it keeps the best run:
    anything else running on the machine only ever adds time. (Training steps, which
    include more than one kernel, are read as medians instead.) tf32 is float32 tensors
    under ``set_float32_matmul_precision("high")``; check ``hardware.supported_precisions``
    first: on a CPU tf32 runs as plain fp32.
    """
    name = parse_precision(precision)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype_of(name))
    b = torch.randn(n, n, device=device, generator=g).to(dtype_of(name))
    with float32_matmul_precision(name):
        timing = time_step(lambda: a @ b, device, warmup=warmup, repeats=repeats)
    return matmul_flops(n) / (timing.min_ms * 1e-3) / 1e9


@dataclass(frozen=True)
class TF32Error:
    """Relative error (Frobenius norm, against a float64 reference) of one n x n matmul."""

    n: int
    fp32: float          # float32 inputs, "highest" precision
    tf32_emulated: float  # inputs rounded to TF32, then multiplied in float32
    bf16: float          # bfloat16 inputs, for scale
    high_changes_result: bool  # did "high" change this device's float32 matmul at all?
    tf32_measured: float | None  # the device's real TF32 result (NVIDIA Ampere+), else None
    medium: float = math.nan     # this device's float32 matmul under "medium" (bf16 allowed)
    highest: float = math.nan    # this device's float32 matmul under "highest"

    @property
    def medium_level(self) -> str:
        """Where "medium" landed: ``"float32"`` (within 10x of "highest"'s error), ``"bf16"``
        (within 10x of a bf16 matmul's, as on an AMX CPU or an Ampere+ GPU), or ``"between"``."""
        if self.medium <= 10 * self.highest:
            return "float32"
        return "bf16" if self.bf16 / 10 <= self.medium <= 10 * self.bf16 else "between"

    def table(self) -> str:
        rows = [
            ("fp32 (highest)", self.fp32),
            ("tf32 (emulated: inputs rounded to 10 bits)", self.tf32_emulated),
            ("bf16 inputs (7 bits), for comparison", self.bf16),
        ]
        if self.tf32_measured is not None:
            rows.append(("tf32 measured on this GPU (\"high\")", self.tf32_measured))
        width = max(len(r[0]) for r in rows)
        lines = [f"{label:<{width}}  {measured(err, '.1e')}" for label, err in rows]  # float kernels
        lines.append(f"set_float32_matmul_precision('high') changes this device's result: "
                     f"{self.high_changes_result}")
        return "\n".join(lines)


def _rel_error(c: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(c.double() - ref) / torch.linalg.matrix_norm(ref)).item()


def tf32_error(n: int = 256, device="cpu", seed: int = 0) -> TF32Error:
    """How far an n x n float32 matmul lands from the exact product, in each precision.

    The TF32 row rounds the inputs as TF32 tensor cores do and multiplies them in float32,
    so it is the same on every machine. ``high_changes_result`` compares this device's
    float32 matmul under "high" and "highest": False on a CPU, where "high" changes nothing.
    """
    from .hardware import supported_precisions

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    ref = a.double() @ b.double()
    with float32_matmul_precision("fp32"):
        fp32 = a @ b
        emulated = round_to_format(a, "tf32") @ round_to_format(b, "tf32")
        a_dev, b_dev = a.to(device), b.to(device)
        highest = (a_dev @ b_dev).cpu()
    with float32_matmul_precision("tf32"):
        high = (a_dev @ b_dev).cpu()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        medium = (a_dev @ b_dev).cpu()
    finally:
        torch.set_float32_matmul_precision(before)
    bf16 = (a.bfloat16().float() @ b.bfloat16().float())
    measured = None
    if supported_precisions(device)["tf32"] is None:
        measured = _rel_error(high, ref)
    return TF32Error(
        n=n, fp32=_rel_error(fp32, ref), tf32_emulated=_rel_error(emulated, ref),
        bf16=_rel_error(bf16, ref), high_changes_result=not torch.equal(high, highest),
        tf32_measured=measured, medium=_rel_error(medium, ref), highest=_rel_error(highest, ref),
    )


def tf32_input_bits(device="cuda") -> str | None:
    """What this GPU's TF32 matmul does with the 13 mantissa bits it drops, measured:
    ``"truncates"`` (PyTorch's notes: only the first 10 bits are read), ``"rounds"`` (to
    nearest), or ``"keeps float32"`` (TF32 not used); ``None`` where TF32 does not exist.

    A 64 x 64 matrix of 1 + 2^-11 + 2^-12 times the identity under "high": each result is
    one input as the tensor core read it, 1 (truncated) or 1 + 2^-10 (rounded). Used by
    ``make gpu-check`` (lesson 01 says the GPU decides).
    """
    from .hardware import supported_precisions

    device = torch.device(device)
    if supported_precisions(device)["tf32"] is not None:
        return None
    a = torch.full((64, 64), 1 + 2.0**-11 + 2.0**-12, device=device)
    eye = torch.eye(64, device=device)
    with float32_matmul_precision("tf32"):
        read = (a @ eye).unique().tolist()
    return {1.0: "truncates", 1 + 2.0**-10: "rounds"}.get(read[0], "keeps float32") if len(read) == 1 else "mixed"


def selfcheck(device=None) -> list:
    """The matmul-precision statements of lessons 01 and 05, checked on ``device`` (``make gpu-check``)."""
    from .claims import check
    from .hardware import pick_device, supported_precisions

    dev = pick_device(device)
    err = tf32_error(256, dev)
    out = [check("float32's error < TF32's (emulated) < bf16's on a 256 x 256 matmul",
                 err.fp32 < err.tf32_emulated < err.bf16,
                 f"{measured(err.fp32, '.1e')}, {measured(err.tf32_emulated, '.1e')}, {measured(err.bf16, '.1e')}"),
           check("set_float32_matmul_precision('medium') gives float32's error or bf16's, nothing between",
                 err.medium_level in ("float32", "bf16"), f"here: {err.medium_level}")]
    if supported_precisions(dev)["tf32"] is None:
        how = tf32_input_bits(dev)
        out.append(check("'high' changes a float32 matmul on this GPU (TF32 tensor cores)", err.high_changes_result))
        out.append(check("TF32 keeps 10 mantissa bits of each input here", how in ("truncates", "rounds"),
                         f"it {how}"))
    else:
        out.append(check(f"'high' changes nothing on {dev.type}, which has no TF32", not err.high_changes_result))
    return out


def tf32_speedup(n: int = 4096, device="cuda", repeats: int = 10) -> float | None:
    """fp32 matmul time / tf32 matmul time on an NVIDIA GPU with TF32; ``None`` where TF32 does not exist."""
    from .hardware import supported_precisions

    device = torch.device(device)
    if supported_precisions(device)["tf32"] is not None:
        return None
    return (matmul_gflops(n, "tf32", device, repeats=repeats)
            / matmul_gflops(n, "fp32", device, repeats=repeats))
