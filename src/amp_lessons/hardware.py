"""Hardware truth, in one place: which device, what it can do, which precision to use.

Every hardware decision of the course lives here and nowhere else, so it can be unit
tested by simulating each device class (tests/test_hardware.py). Used in 00_start_here,
by ``python -m amp_lessons doctor`` and by every lesson that picks a device.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

from .precision import PRECISIONS, parse_precision


class DeviceUnavailableError(RuntimeError):
    """A device was asked for that this machine does not have."""


def available_devices() -> list[str]:
    """Device types torch can use here, best first (cuda > mps > cpu)."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    found.append("cpu")
    return found


def pick_device(requested=None) -> torch.device:
    """The device to run on: ``None``/``"auto"`` picks the best; a name is checked.

    Asking for a device that is not here raises :class:`DeviceUnavailableError`
    naming the devices that are (never a silent fall-back to something else).
    """
    have = available_devices()
    if requested is None or (isinstance(requested, str) and requested.strip().lower() == "auto"):
        return torch.device(have[0])
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be one of auto, {', '.join(have)}; got {requested!r}") from err
    if device.type not in have:
        raise DeviceUnavailableError(
            f"device {requested!r} was requested, but this machine has only: {', '.join(have)}. "
            "Pass device='auto' (or None) to use the best available device."
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceUnavailableError(
            f"device {requested!r} was requested, but torch sees {torch.cuda.device_count()} CUDA device(s)."
        )
    return device


def cpu_features() -> dict:
    """The CPU's name and the instruction sets that matter for 16-bit math.

    Reads torch's own CPU probe (``torch._C._cpu._get_cpu_capability``, present in recent
    releases) and falls back to /proc/cpuinfo flags on Linux.
    """
    isa = torch.backends.cpu.get_cpu_capability()
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if probe is not None:
        caps = probe()
        return {
            "name": caps.get("cpu_name") or platform.processor() or "unknown CPU",
            "isa": isa,
            "avx512_bf16": bool(caps.get("avx512_bf16")),
            "amx_bf16": bool(caps.get("amx_bf16")) and bool(caps.get("amx_tile", True)),
        }
    flags = _proc_cpuinfo_flags()
    return {
        "name": platform.processor() or "unknown CPU",
        "isa": isa,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def _proc_cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class HardwareReport:
    """What lesson 00 and ``doctor`` print. Plain data: tests build it by simulation."""

    device: str
    name: str
    torch_version: str
    cuda_capability: tuple[int, int] | None
    bf16_native: bool
    bf16_emulated: bool
    fp16: bool
    tf32_hardware: bool
    float32_matmul_precision: str
    cpu_name: str
    cpu_isa: str
    avx512_bf16: bool
    amx_bf16: bool
    recommended: str
    use_scaler: bool
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in the order lesson 00 and ``doctor`` print them."""
        cc = "n/a" if self.cuda_capability is None else "{}.{}".format(*self.cuda_capability)
        if self.bf16_native:
            bf16 = "native"
        elif self.bf16_emulated:
            bf16 = "emulated only (slow)"
        else:
            bf16 = "no"
        return [
            ("device", self.device),
            ("name", self.name),
            ("torch", self.torch_version),
            ("CUDA compute capability", cc),
            ("bfloat16", bf16),
            ("float16", "yes" if self.fp16 else "no"),
            ("TF32 tensor cores", "yes" if self.tf32_hardware else "no"),
            ("float32 matmul precision", self.float32_matmul_precision),
            ("CPU", self.cpu_name),
            ("CPU instruction set", self.cpu_isa),
            ("AVX512-BF16", "yes" if self.avx512_bf16 else "no"),
            ("AMX-BF16", "yes" if self.amx_bf16 else "no"),
            ("recommended precision", self.recommended + (" + GradScaler" if self.use_scaler else "")),
            ("why", self.reason),
        ]

    def table(self) -> str:
        """The report as an aligned two-column text table."""
        rows = self.rows()
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


# On a CPU with native bf16 (AVX512-BF16 or AMX), bf16 is recommended when a measured bf16
# matmul runs at least this much faster than float32's: a training step gains less than its
# matmuls do (lesson 05), so a small matmul gain is not worth the coarser mantissa.
CPU_BF16_MIN_SPEEDUP = 1.25


def recommend(device_type: str, cuda_capability=None, bf16_native=False,
              avx512_bf16=False, amx_bf16=False, bf16_speedup=None) -> tuple[str, bool, str]:
    """(precision, use_scaler, reason) for a device class. Pure: tests call it directly.

    ``bf16_speedup``: a measured bf16 / fp32 matmul rate ratio on this device
    (:func:`matmul_speedups`), or None. On CPUs with native bf16 it decides, and the
    reason cites it; without it, the rule for the CPU class stands.
    """
    if device_type == "cuda":
        cc = "{}.{}".format(*cuda_capability) if cuda_capability else "unknown"
        if cuda_capability and tuple(cuda_capability) >= (8, 0) and bf16_native:
            return ("bf16", False,
                    f"Ampere-or-newer GPU (compute capability {cc}): native bfloat16 tensor cores. "
                    "bf16 has float32's exponent range, so it needs no GradScaler.")
        if cuda_capability and tuple(cuda_capability) >= (7, 0):
            return ("fp16", True,
                    f"pre-Ampere GPU (compute capability {cc}): fp16 tensor cores are native, bf16 "
                    "would only be emulated (slow). fp16's narrow range needs GradScaler.")
        return ("fp32", False,
                f"GPU without tensor cores (compute capability {cc}): 16-bit math is not faster "
                "here; autocast would only save activation memory.")
    if device_type == "mps":
        return ("fp32", False,
                "Apple GPU: autocast works on MPS in recent torch, but the lessons' speed claims "
                "are not measured there; run `python -m amp_lessons bench` before switching.")
    measured = ("" if bf16_speedup is None else
                f" Measured here: a bf16 matmul ran at {bf16_speedup:.2g}x float32's rate.")
    if (amx_bf16 or avx512_bf16) and bf16_speedup is not None:
        if bf16_speedup >= CPU_BF16_MIN_SPEEDUP:
            return ("bf16", False,
                    f"CPU with native bf16 ({'AMX tile units' if amx_bf16 else 'AVX512-BF16'}) whose "
                    f"bf16 matmuls are faster than float32's.{measured} bf16 also halves the "
                    "activation memory and needs no GradScaler; lesson 05 measures whole training "
                    "steps, which gain less than their matmuls.")
        return ("fp32", False,
                f"CPU with native bf16 ({'AMX tile units' if amx_bf16 else 'AVX512-BF16'}), but its "
                f"bf16 matmuls are not at least {CPU_BF16_MIN_SPEEDUP}x faster than float32's.{measured} "
                "Choose bf16 when activation memory is the limit.")
    if amx_bf16:
        return ("bf16", False,
                "CPU with AMX-BF16 tile units: bf16 matmuls run much faster than fp32, and bf16 "
                "needs no GradScaler.")
    if avx512_bf16:
        return ("fp32", False,
                "CPU with AVX512-BF16 but no AMX: bf16 autocast halves the activation memory "
                "saved for backward, but is not expected to be reliably faster than fp32 (no "
                "16-bit matrix units; the gain depends on the model and on torch's bf16 kernels "
                "for this CPU: lesson 05 and `python -m amp_lessons bench` measure it here). "
                "Choose bf16 when memory is the limit or the bench shows a gain.")
    return ("fp32", False,
            "CPU without native bf16 instructions (no AVX512-BF16, no AMX): 16-bit math is "
            f"emulated and slower than fp32; autocast would only save activation memory.{measured}")


def matmul_speedups(device=None, n: int = 256, repeats: int = 3) -> dict[str, float]:
    """Each 16-bit precision's matmul rate over float32's on ``device``: ``{"bf16": r, "fp16": r}``.

    A quick n x n microbenchmark (well under a second where 16-bit is native). Used by
    lesson 00 and ``doctor`` to ground the recommendation in a measurement.
    """
    from .matmul import matmul_gflops

    dev = pick_device(device)
    fp32 = matmul_gflops(n, "fp32", dev, warmup=1, repeats=repeats)
    return {p: matmul_gflops(n, p, dev, warmup=1, repeats=repeats) / fp32 for p in ("bf16", "fp16")}


def _mps_bf16_native() -> bool:
    """MPS runs bfloat16 from macOS 14 on (torch >= 2.6, below the course's floor)."""
    release = platform.mac_ver()[0]
    try:
        return int(release.split(".")[0]) >= 14
    except ValueError:
        return False


def hardware_report(device=None, measure=False) -> HardwareReport:
    """Query torch about ``device`` (auto by default) and recommend a precision.

    ``measure=True`` on a CPU also times a small matmul per precision (:func:`matmul_speedups`),
    and the recommendation then follows the measured bf16 speed (lesson 00, ``doctor``);
    ``measure`` may also be the dict :func:`matmul_speedups` returned. A GPU's
    recommendation follows its compute capability.
    """
    dev = pick_device(device)
    cpu = cpu_features()
    cc = None
    bf16_native = bf16_emulated = False
    fp16 = True
    tf32_hw = False
    name = cpu["name"]
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cc = tuple(torch.cuda.get_device_capability(index))
        name = torch.cuda.get_device_name(index)
        bf16_native = _bf16_native_cuda()
        bf16_emulated = (not bf16_native) and torch.cuda.is_bf16_supported()
        tf32_hw = cc >= (8, 0)
    elif dev.type == "cpu":
        bf16_native = cpu["avx512_bf16"] or cpu["amx_bf16"]
        bf16_emulated = not bf16_native
    elif dev.type == "mps":
        name = "Apple GPU (MPS)"
        bf16_native = _mps_bf16_native()
        bf16_emulated = False
    speedup = None
    if measure is not False and measure is not None and dev.type == "cpu":
        speedup = (measure if isinstance(measure, dict) else matmul_speedups(dev))["bf16"]
    precision, scaler, reason = recommend(dev.type, cc, bf16_native, cpu["avx512_bf16"], cpu["amx_bf16"],
                                          bf16_speedup=speedup)
    return HardwareReport(
        device=str(dev), name=name, torch_version=torch.__version__, cuda_capability=cc,
        bf16_native=bf16_native, bf16_emulated=bf16_emulated, fp16=fp16, tf32_hardware=tf32_hw,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        cpu_name=cpu["name"], cpu_isa=cpu["isa"], avx512_bf16=cpu["avx512_bf16"],
        amx_bf16=cpu["amx_bf16"], recommended=precision, use_scaler=scaler, reason=reason,
    )


def _bf16_native_cuda() -> bool:
    """``is_bf16_supported(including_emulation=False)``: a T4 says True without it."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.5 has no including_emulation; its answer was the native one
        return bool(torch.cuda.is_bf16_supported())


def supported_precisions(device=None) -> dict[str, str | None]:
    """For each precision, ``None`` if this device can run it, else the reason it cannot.

    Used by ``bench`` (05) and the widgets, which offer only what runs here.
    """
    dev = pick_device(device)
    out: dict[str, str | None] = dict.fromkeys(PRECISIONS)
    if dev.type == "cuda":
        cc = tuple(torch.cuda.get_device_capability(dev))
        if cc < (8, 0):
            out["tf32"] = f"TF32 needs an Ampere-or-newer GPU; this one is compute capability {cc[0]}.{cc[1]}"
        if not _bf16_native_cuda():
            out["bf16"] = "bf16 is only emulated on this GPU (pre-Ampere); use fp16 + GradScaler"
    elif dev.type == "cpu":
        out["tf32"] = "TF32 is an NVIDIA tensor-core format; it does not exist on a CPU"
    elif dev.type == "mps":
        out["tf32"] = "TF32 is an NVIDIA tensor-core format; it does not exist on Apple GPUs"
    return out


def fp8_support(device_type: str, cuda_capability=None) -> tuple[bool, str]:
    """(fast, reason): does an fp8 matmul (``torch._scaled_mm``) run on fp8 tensor cores here?

    Pure, for 08_fp8. CUDA's ``_scaled_mm`` runs from compute capability 8.9 (Ada) and 9.0
    (Hopper) on and refuses older GPUs (aten/src/ATen/native/cuda/ScaledBlas.cpp); on a
    CPU it dequantizes and runs a float32 matmul: real numbers, no fp8 speed.
    """
    if device_type == "cuda":
        if not cuda_capability:
            return (False, "CUDA GPU of unknown compute capability: fp8 needs 8.9 or 9.0+")
        cc = tuple(cuda_capability)
        label = "{}.{}".format(*cc)
        if cc >= (9, 0):
            return (True, f"compute capability {label} (Hopper or newer): fp8 tensor cores; "
                          "_scaled_mm takes per-tensor and per-row scales")
        if cc == (8, 9):
            return (True, f"compute capability {label} (Ada): fp8 tensor cores; per-row scales "
                          "need a bf16 or fp16 output there")
        return (False, f"compute capability {label}: no fp8 tensor cores, and torch._scaled_mm "
                       "refuses to run (it needs 8.9 or 9.0+)")
    if device_type == "cpu":
        return (False, "CPU: torch._scaled_mm dequantizes to float32 and runs a float32 matmul: "
                       "the same numbers, no fp8 speed")
    return (False, f"{device_type}: no fp8 matmul kernels in torch; fp8 would only be emulated")


def check_autocast(device_type: str, dtype) -> None:
    """Raise a clear error if ``torch.autocast(device_type, dtype)`` cannot run here."""
    have = available_devices()
    if device_type not in have:
        raise DeviceUnavailableError(
            f"autocast on {device_type!r} was requested, but this machine has only: {', '.join(have)}"
        )
    ok = {torch.bfloat16, torch.float16}
    if dtype not in ok:
        raise ValueError(
            f"autocast on {device_type} supports torch.bfloat16 and torch.float16; got {dtype}. "
            f"(Precision names: {', '.join(PRECISIONS)}; fp32/tf32 run without autocast.)"
        )


def resolve(precision, device=None) -> tuple[str, torch.device]:
    """Parse a precision and pick a device together, refusing combinations that cannot run."""
    name = parse_precision(precision)
    dev = pick_device(device)
    why = supported_precisions(dev)[name]
    if why is not None and name == "tf32":
        raise ValueError(f"precision 'tf32' cannot run on {dev}: {why}. Use 'fp32' here.")
    if why is not None:
        raise ValueError(f"precision {name!r} cannot run on {dev}: {why}")
    return name, dev


def selfcheck(device=None) -> list:
    """The hardware facts lessons 00 and 05 state, checked on ``device`` (``make gpu-check``).

    On a CUDA GPU: native bf16 exactly from compute capability 8.0 on (a T4, 7.5, reports bf16
    only through emulation), and the recommendation that follows. On a CPU: both 16-bit
    autocast dtypes run, and TF32 is reported as absent.
    """
    from .claims import check

    dev = pick_device(device)
    report = hardware_report(dev)
    out = []
    if dev.type == "cuda":
        cc = report.cuda_capability
        out.append(check("this GPU's native bf16 (is_bf16_supported(including_emulation=False)) "
                         "matches compute capability >= 8.0", report.bf16_native == (cc >= (8, 0)),
                         f"cc {cc[0]}.{cc[1]}, native {report.bf16_native}, emulated {report.bf16_emulated}"))
        expected = "bf16" if cc >= (8, 0) else "fp16" if cc >= (7, 0) else "fp32"
        out.append(check(f"the recommended precision here is {expected}",
                         report.recommended == expected, f"recommended {report.recommended}"))
        out.append(check("TF32 is reported where compute capability >= 8.0",
                         report.tf32_hardware == (cc >= (8, 0)), f"tf32 {report.tf32_hardware}"))
    elif dev.type == "cpu":
        ran = []
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                ran.append((torch.ones(4, 4) @ torch.ones(4, 4)).dtype == dtype)
        out.append(check("bf16 and fp16 autocast both run matmuls in 16 bits on this CPU", all(ran),
                         f"bf16 {ran[0]}, fp16 {ran[1]}"))
        out.append(check("TF32 is reported as absent on a CPU",
                         supported_precisions(dev)["tf32"] is not None and not report.tf32_hardware))
    return out
