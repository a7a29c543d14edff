"""What ``torch.set_float32_matmul_precision`` does to a float32 matmul here.

- :func:`tf32_error` shows what ``"high"`` changes: the inputs of float32 matmuls are
  rounded to TF32's 10 mantissa bits. The rounding is emulated, so the error shows on any
  device; on an NVIDIA GPU with TF32 tensor cores the real TF32 result is measured too.
  It measures ``"medium"`` as well, and :attr:`TF32Error.medium_level` names the matmul
  whose error it got: on CUDA "medium" means TF32, as "high" does; on a CPU oneDNN may run
  float32 matmuls in bfloat16 (:func:`medium_levels`).
- :func:`tf32_input_bits` and :func:`tf32_speedup`: what a GPU's TF32 does with the bits
  it drops, and how much faster it is.

The matmul rates themselves are :func:`amp_lessons.measure.matmul_gflops`. Used in
05_putting_it_together and by ``make gpu-check``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .claims import measured
from .formats import round_to_format
from .hardware import resolve_machine
from .measure import matmul_gflops
from .precision import float32_matmul_precision

# A measured error within this factor of a reference matmul's counts as that matmul's.
LEVEL_FACTOR = 3.0


@dataclass(frozen=True)
class TF32Error:
    """Relative error (Frobenius norm, against a float64 reference) of one n x n matmul."""

    n: int
    fp32: float          # float32 inputs, "highest" precision
    tf32_emulated: float  # inputs rounded to TF32, then multiplied in float32
    bf16: float          # bfloat16 inputs, for scale
    high_changes_result: bool  # did "high" change this device's float32 matmul at all?
    tf32_measured: float | None  # the device's real TF32 result (NVIDIA Ampere+), else None
    medium: float = math.nan     # this device's float32 matmul under "medium"
    highest: float = math.nan    # this device's float32 matmul under "highest"

    @property
    def medium_level(self) -> str:
        """Whose error "medium" gave: ``"float32"`` ("highest"'s), ``"tf32"`` (the TF32 matmul's:
        measured on a GPU with TF32, else emulated) or ``"bf16"`` (a bf16 matmul's), the
        nearest of the three (on a log scale) when within :data:`LEVEL_FACTOR` of it;
        ``"between"`` otherwise (another algorithm, e.g. a split into several bf16 parts)."""
        tf32 = self.tf32_measured if self.tf32_measured is not None else self.tf32_emulated
        refs = {"float32": self.highest, "tf32": tf32, "bf16": self.bf16}
        if self.medium <= refs["float32"] * LEVEL_FACTOR:
            return "float32"
        name, ref = min(refs.items(), key=lambda kv: abs(math.log(self.medium / kv[1])))
        return name if abs(math.log(self.medium / ref)) <= math.log(LEVEL_FACTOR) else "between"

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
    ``device``: a name, a torch device or a :class:`~amp_lessons.hardware.Machine`.
    """
    machine = resolve_machine(device, measure=False)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    ref = a.double() @ b.double()
    with float32_matmul_precision("fp32"):
        fp32 = a @ b
        emulated = round_to_format(a, "tf32") @ round_to_format(b, "tf32")
        a_dev, b_dev = a.to(machine.device), b.to(machine.device)
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
    return TF32Error(
        n=n, fp32=_rel_error(fp32, ref), tf32_emulated=_rel_error(emulated, ref),
        bf16=_rel_error(bf16, ref), high_changes_result=not torch.equal(high, highest),
        tf32_measured=_rel_error(high, ref) if machine.tf32_hardware else None,
        medium=_rel_error(medium, ref), highest=_rel_error(highest, ref),
    )


def medium_levels(device=None) -> tuple[str, ...]:
    """The :attr:`TF32Error.medium_level` values torch's source allows for "medium" on
    ``device`` (a name, a torch device or a :class:`~amp_lessons.hardware.Machine`).

    ``set_float32_matmul_precision("medium")`` sets cuBLAS's float32 matmuls to TF32 (PyTorch's
    CUDA backend has no bf16 mode for them) and oneDNN's to bf16 (aten/src/ATen/Context.cpp,
    ``Context::setFloat32MatmulPrecision``). So: TF32 on an NVIDIA GPU that has it, float32
    on one that does not; on a CPU, bf16 where oneDNN runs the matmul in bf16, else float32.
    MPS follows none of these flags that torch documents: any of the three.
    """
    machine = resolve_machine(device, measure=False)
    if machine.type == "cuda":
        return ("tf32",) if machine.tf32_hardware else ("float32",)
    if machine.type == "cpu":
        return ("float32", "bf16")
    return ("float32", "tf32", "bf16")


def tf32_input_bits(device="cuda") -> str | None:
    """What this GPU's TF32 matmul does with the 13 mantissa bits it drops, measured:
    ``"truncates"`` (PyTorch's notes: only the first 10 bits are read), ``"rounds"`` (to
    nearest), or ``"keeps float32"`` (TF32 not used); ``None`` where TF32 does not exist.

    A 64 x 64 matrix of 1 + 2^-11 + 2^-12 times the identity under "high": each result is
    one input as the tensor core read it, 1 (truncated) or 1 + 2^-10 (rounded). Used by
    ``make gpu-check`` (lesson 01 says the GPU decides).
    """
    machine = resolve_machine(device, measure=False)
    if not machine.tf32_hardware:
        return None
    a = torch.full((64, 64), 1 + 2.0**-11 + 2.0**-12, device=machine.device)
    eye = torch.eye(64, device=machine.device)
    with float32_matmul_precision("tf32"):
        read = (a @ eye).unique().tolist()
    return {1.0: "truncates", 1 + 2.0**-10: "rounds"}.get(read[0], "keeps float32") if len(read) == 1 else "mixed"


def tf32_speedup(n: int = 4096, device="cuda", repeats: int = 10) -> float | None:
    """fp32 matmul time / tf32 matmul time on an NVIDIA GPU with TF32; ``None`` where TF32 does not exist."""
    machine = resolve_machine(device, measure=False)
    if not machine.tf32_hardware:
        return None
    return (matmul_gflops(n, "tf32", machine.device, repeats=repeats)
            / matmul_gflops(n, "fp32", machine.device, repeats=repeats))
