"""Hardware truth, in one place: which device, what it can do, which precision the course recommends.

Every hardware decision of the course lives here and nowhere else, so it can be unit
tested by simulating each device class (tests/test_hardware.py). An entry point (a
command, a lesson's setup, the bench) resolves its device once, with
:func:`resolve_machine`, into a :class:`Machine`: the torch device, what it runs natively,
its measured matmul rates (measured once, when first asked for) and the one
recommendation, :func:`recommend`'s. Used in 00_start_here, by ``python -m amp_lessons
doctor`` and by every lesson that picks a device.
"""

from __future__ import annotations

import platform
import textwrap
from dataclasses import asdict, dataclass, field

import torch

from .measure import matmul_gflops
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
    if isinstance(requested, Machine):
        return requested.device
    have = available_devices()
    if requested is None or (isinstance(requested, str) and requested.strip().lower() == "auto"):
        return torch.device(have[0])
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError, ValueError, OverflowError) as err:  # 2**63 overflows its index
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
    """The CPU's name, architecture and the x86 instruction sets that matter for 16-bit math
    (AVX512-BF16, AVX512-FP16, AMX-BF16, AMX-FP16).

    Reads torch's own CPU probe (``torch._C._cpu._get_cpu_capability``, present in recent
    releases) and falls back to /proc/cpuinfo flags on Linux. The flags are x86's: on
    another architecture (``"arch"``, aarch64 say) they read False whatever the CPU has.
    """
    isa = torch.backends.cpu.get_cpu_capability()
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if probe is not None:
        caps = probe()
        tile = bool(caps.get("amx_tile", True))
        return {
            "name": caps.get("cpu_name") or platform.processor() or "unknown CPU",
            "arch": caps.get("architecture") or platform.machine() or "unknown",
            "isa": isa,
            "avx512_bf16": bool(caps.get("avx512_bf16")),
            "avx512_fp16": bool(caps.get("avx512_fp16")),
            "amx_bf16": bool(caps.get("amx_bf16")) and tile,
            "amx_fp16": bool(caps.get("amx_fp16")) and tile,
        }
    flags = _proc_cpuinfo_flags()
    return {
        "name": platform.processor() or "unknown CPU",
        "arch": platform.machine() or "unknown",
        "isa": isa,
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512_fp16": "avx512_fp16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "amx_fp16": "amx_fp16" in flags,
    }


_X86 = {"x86_64", "amd64", "x86", "i386", "i686"}


def is_x86(arch: str) -> bool:
    """Whether ``arch`` (:func:`cpu_features`' ``"arch"``) is x86, where its flags mean something."""
    return arch.lower() in _X86


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
    cpu_arch: str
    avx512_bf16: bool
    amx_bf16: bool
    amx_fp16: bool
    recommended: str
    use_scaler: bool
    reason: str
    cpu_fp16_native: bool = False  # a CPU with AVX512-FP16 or AMX-FP16; False off a CPU
    avx512_fp16: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in the order lesson 00 and ``doctor`` print them. On a CPU the
        ``name`` is the CPU's, so no separate CPU row; off x86 the x86 flags are not shown."""
        cc = "n/a" if self.cuda_capability is None else "{}.{}".format(*self.cuda_capability)
        x86 = is_x86(self.cpu_arch)
        rows = [
            ("device", self.device),
            ("name", self.name),
            ("torch", self.torch_version),
            ("CUDA compute capability", cc),
            ("bfloat16", self._bf16_row(x86)),
            ("float16", self._fp16_row(x86)),
            ("TF32 tensor cores", "yes" if self.tf32_hardware else "no"),
            ("float32 matmul precision", self.float32_matmul_precision),
        ]
        if not self.device.startswith("cpu"):
            rows.append(("CPU", self.cpu_name))
        rows.append(("CPU instruction set", self.cpu_isa if x86 else f"{self.cpu_isa} ({self.cpu_arch})"))
        if x86:
            rows += [("AVX512-BF16", "yes" if self.avx512_bf16 else "no"),
                     ("AVX512-FP16", "yes" if self.avx512_fp16 else "no"),
                     ("AMX-BF16", "yes" if self.amx_bf16 else "no"),
                     ("AMX-FP16", "yes" if self.amx_fp16 else "no")]
        return rows + [
            ("recommended precision", self.recommended + (" + GradScaler" if self.use_scaler else "")),
            ("why", self.reason),
        ]

    def _bf16_row(self, x86: bool) -> str:
        if not self.device.startswith("cpu"):
            return "native" if self.bf16_native else "emulated only (slow)" if self.bf16_emulated else "no"
        if not x86:
            return f"instructions not probed on {self.cpu_arch} (the measured rate decides)"
        if self.bf16_native:
            return "native instructions (AVX512-BF16 or AMX-BF16)"
        return "no AVX512-BF16 or AMX-BF16 (the measured rate decides)"

    def _fp16_row(self, x86: bool) -> str:
        if not self.device.startswith("cpu"):
            return "yes" if self.fp16 else "no"
        if not x86:
            return f"instructions not probed on {self.cpu_arch} (see the measured rate)"
        if self.cpu_fp16_native:
            return "native instructions (AVX512-FP16 or AMX-FP16)"
        return "no AVX512-FP16 or AMX-FP16 (its rate is measured)"

    def table(self, width: int | None = None) -> str:
        """The report as an aligned two-column text table, one line a row (``doctor``), or with
        long values wrapped at ``width`` characters under their column (lesson 00)."""
        rows = self.rows()
        pad = max(len(label) for label, _ in rows) + 2
        if width is None:
            return "\n".join(f"{label:<{pad}}{value}" for label, value in rows)
        return "\n".join(
            textwrap.fill(str(value), width, initial_indent=f"{label:<{pad}}", subsequent_indent=" " * pad)
            for label, value in rows)


# What 16-bit autocast does to activation memory, as the recommendations say it (lesson 05).
_ACTIVATIONS = ("saves up to half the activation memory (in matmul-heavy layers; what autocast keeps "
                "in float32 is saved in float32)")


# On a CPU, bf16 is recommended when a measured bf16 matmul runs at least this much faster
# than float32's: a training step's gain is not its matmuls' (lesson 05 times steps), so a
# small matmul gain is not taken as worth the coarser mantissa.
CPU_BF16_MIN_SPEEDUP = 1.25


def _cpu_class(avx512_bf16: bool, amx_bf16: bool, arch: str = "x86_64") -> str:
    if not is_x86(arch):
        return f"{arch} CPU, whose bf16 instructions the course does not probe"
    if amx_bf16:
        return "CPU with AMX-BF16 tile units"
    if avx512_bf16:
        return "CPU with AVX512-BF16 instructions but no AMX"
    return "CPU without native bf16 instructions (no AVX512-BF16, no AMX)"


def recommend(device_type: str, cuda_capability=None, bf16_native=False,
              avx512_bf16=False, amx_bf16=False, bf16_speedup=None,
              cpu_arch: str = "x86_64") -> tuple[str, bool, str]:
    """(precision, use_scaler, reason) for a device class: the one rule every lesson's report
    and ``doctor`` apply (through :attr:`Machine.recommendation`). Pure: tests and lesson 00's
    table call it directly.

    A GPU's answer follows its compute capability, which does not say whether a 7.x GPU
    has tensor cores (a T4 has, a GTX 1660 of the same 7.5 has not), so no reason claims
    them there. A CPU's follows ``bf16_speedup``, a
    measured bf16 / fp32 matmul rate ratio (:func:`matmul_speedups`): bf16 where it is at
    least :data:`CPU_BF16_MIN_SPEEDUP`, whatever the CPU's instruction sets (``cpu_arch``
    only names the CPU's class in the reason); without a measurement, fp32, and the reason
    says it was not measured.
    """
    if device_type == "cuda":
        cc = "{}.{}".format(*cuda_capability) if cuda_capability else "unknown"
        if cuda_capability and tuple(cuda_capability) >= (8, 0) and bf16_native:
            return ("bf16", False,
                    f"Ampere-or-newer GPU (compute capability {cc}): native bfloat16 tensor cores. "
                    "bf16 has float32's exponent range, so it needs no GradScaler.")
        if cuda_capability and tuple(cuda_capability) >= (7, 0):
            return ("fp16", True,
                    f"GPU of compute capability {cc}: bf16 tensor cores start at compute capability "
                    "8.0 (Ampere), so bf16 is only emulated here and the course uses fp16. fp16's narrow "
                    "range underflows small gradients to zero, so the course pairs it with GradScaler.")
        return ("fp32", False,
                f"GPU of compute capability {cc}, below 7.0 (Volta): whether 16-bit math is faster "
                "depends on the model, and the course does not measure GPUs this old; autocast "
                "would save activation memory (up to half, in matmul-heavy layers).")
    if device_type == "mps":
        return ("fp32", False,
                "Apple GPU: autocast works on MPS in recent torch, but the lessons' speed claims "
                "are not measured there; run `python -m amp_lessons bench` before switching.")
    what = _cpu_class(avx512_bf16, amx_bf16, cpu_arch)
    if bf16_speedup is None:
        return ("fp32", False,
                f"{what}, not measured: on a CPU the course recommends bf16 only where a bf16 matmul "
                f"measures at least {CPU_BF16_MIN_SPEEDUP}x float32's rate (`python -m amp_lessons "
                "doctor` measures it).")
    # ≈ marks a float-kernel figure, as claims.measured does (an instrument imports no verdicts);
    # three figures and the threshold's verdict in words, so a rate near it reads as decided
    fast = bf16_speedup >= CPU_BF16_MIN_SPEEDUP
    measured = (f" Measured here: a bf16 matmul ran at ≈{bf16_speedup:.3g}x float32's rate, "
                f"{'at least' if fast else 'below'} the {CPU_BF16_MIN_SPEEDUP}x the course asks of bf16.")
    if fast:
        return ("bf16", False,
                f"{what}.{measured} bf16 needs no GradScaler and {_ACTIVATIONS}. That rate is one "
                "matmul's: lesson 05 times whole training steps.")
    return ("fp32", False,
            f"{what}.{measured} Choose bf16 when activation memory is the limit: autocast "
            f"{_ACTIVATIONS}, as lesson 05 measures.")


# The size of :func:`matmul_speedups`' matmul: 256 on a CPU, where it runs at every entry
# point and must stay quick; 4096 on a GPU, whose tensor cores would do a 256 x 256 fp16
# matmul (34 MFLOP) in about 0.1 us at an A100's 312 TFLOPS, less than a kernel launch.
SPEEDUP_MATMUL_N = {"cpu": 256}
SPEEDUP_MATMUL_N_GPU = 4096


def matmul_speedups(device=None, n: int | None = None, repeats: int = 3) -> dict[str, float]:
    """Each 16-bit precision's matmul rate over float32's on ``device``: ``{"bf16": r, "fp16": r}``.

    A quick n x n microbenchmark, ``n`` by default from :data:`SPEEDUP_MATMUL_N` (a GPU:
    :data:`SPEEDUP_MATMUL_N_GPU`). A :class:`Machine` runs it once, when its recommendation
    or rates are first asked for; only a CPU's recommendation uses it.
    """
    dev = pick_device(device)
    n = SPEEDUP_MATMUL_N.get(dev.type, SPEEDUP_MATMUL_N_GPU) if n is None else n
    fp32 = matmul_gflops(n, "fp32", dev, warmup=1, repeats=repeats)
    return {p: matmul_gflops(n, p, dev, warmup=1, repeats=repeats) / fp32 for p in ("bf16", "fp16")}


def _mps_bf16_native() -> bool:
    """MPS runs bfloat16 from macOS 14 on (torch >= 2.6, below the course's floor)."""
    release = platform.mac_ver()[0]
    try:
        return int(release.split(".")[0]) >= 14
    except ValueError:
        return False


def _bf16_native_cuda(device=None) -> bool:
    """``is_bf16_supported(including_emulation=False)``: a T4 says True without it. (On a ROCm
    build torch answers True before it reads the argument.)"""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.5 has no including_emulation; its answer was the native one
        return bool(torch.cuda.is_bf16_supported())


@dataclass(frozen=True)
class Machine:
    """One device, resolved once at an entry point (a command, a lesson's setup, the bench)
    and passed down: what it is, what it runs natively, its measured matmul rates (measured
    once, when first asked for) and the recommendation drawn from them.

    Build it with :func:`resolve_machine`; every function that takes ``device=`` accepts
    one and asks it instead of torch.
    """

    device: torch.device
    name: str
    cuda_capability: tuple[int, int] | None
    bf16_native: bool
    bf16_emulated: bool
    fp16: bool
    tf32_hardware: bool
    cpu_name: str
    cpu_isa: str
    avx512_bf16: bool
    amx_bf16: bool
    amx_fp16: bool = False
    cpu_arch: str = "x86_64"
    avx512_fp16: bool = False
    cpu_fp16_native: bool = False  # a CPU with AVX512-FP16 or AMX-FP16; False off a CPU
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def type(self) -> str:
        return self.device.type

    @property
    def speedups(self) -> dict[str, float] | None:
        """bf16's and fp16's matmul rate over float32's here (:func:`matmul_speedups`), measured
        on first use and kept; ``None`` when built with ``measure=False``."""
        if "speedups" not in self._cache:
            self._cache["speedups"] = matmul_speedups(self.device)
        return self._cache["speedups"]

    @property
    def recommendation(self) -> tuple[str, bool, str]:
        """(precision, use_scaler, reason): :func:`recommend` on this machine's facts and, on a
        CPU, its measured bf16 matmul rate. Every lesson's report and ``doctor`` print this one."""
        if "recommendation" not in self._cache:
            speedup = self.speedups["bf16"] if self.type == "cpu" and self.speedups else None
            self._cache["recommendation"] = recommend(self.type, self.cuda_capability, self.bf16_native,
                                                      self.avx512_bf16, self.amx_bf16, bf16_speedup=speedup,
                                                      cpu_arch=self.cpu_arch)
        return self._cache["recommendation"]

    def supported(self) -> dict[str, str | None]:
        """For each precision, ``None`` if the course runs it on this device, else why not. On a
        GPU what torch would only emulate (bf16 before Ampere) is left out; on a CPU every
        precision autocast runs is kept, fast or not (the measured rates say which), and only
        tf32 is refused."""
        out: dict[str, str | None] = dict.fromkeys(PRECISIONS)
        if self.type == "cuda":
            cc = self.cuda_capability
            if not self.tf32_hardware:
                out["tf32"] = f"TF32 needs an Ampere-or-newer GPU; this one is compute capability {cc[0]}.{cc[1]}"
            if not self.bf16_native:
                out["bf16"] = ("bf16 autocast runs on this GPU only by emulation (pre-Ampere: no bf16 tensor "
                               "cores), so the course uses fp16 + GradScaler here")
        elif self.type == "cpu":
            out["tf32"] = ("TF32 training runs only on Ampere-or-newer NVIDIA GPUs in this course; on a "
                           "CPU, 'high' reaches oneDNN's tf32 path only with AMX-FP16 (lesson 00)")
        elif self.type == "mps":
            out["tf32"] = "TF32 training runs only on Ampere-or-newer NVIDIA GPUs in this course, not on Apple GPUs"
        return out

    def usage(self, name) -> str:
        """Lesson 00's widget line: ``"yes"``, ``"no: <why>"`` (:meth:`supported`), or on a CPU,
        for a 16-bit precision, a yes that says its speed is the measured rate's business."""
        name = parse_precision(name)
        why = self.supported()[name]
        if why is not None:
            return "no: " + why
        if self.type == "cpu" and name in ("bf16", "fp16"):
            return "yes: CPU autocast runs it, fast or slow (a measured matmul rate says which: lesson 00 prints them)"
        return "yes"

    def report(self) -> HardwareReport:
        """What lesson 00 and ``doctor`` print, the recommendation included."""
        precision, scaler, reason = self.recommendation
        return HardwareReport(
            device=str(self.device), name=self.name, torch_version=torch.__version__,
            cuda_capability=self.cuda_capability, bf16_native=self.bf16_native,
            bf16_emulated=self.bf16_emulated, fp16=self.fp16, tf32_hardware=self.tf32_hardware,
            float32_matmul_precision=torch.get_float32_matmul_precision(), cpu_name=self.cpu_name,
            cpu_isa=self.cpu_isa, cpu_arch=self.cpu_arch, avx512_bf16=self.avx512_bf16,
            amx_bf16=self.amx_bf16, amx_fp16=self.amx_fp16, recommended=precision, use_scaler=scaler, reason=reason,
            cpu_fp16_native=self.cpu_fp16_native, avx512_fp16=self.avx512_fp16)


def resolve_machine(device=None, speedups=None, measure: bool = True) -> Machine:
    """The :class:`Machine` for ``device`` (auto by default), from torch's own queries.

    A :class:`Machine` is returned as it is (nothing is asked again). ``speedups``: a
    measurement already made (the dict :func:`matmul_speedups` returns), kept instead of
    measuring; ``measure=False``: never measure (the CPU recommendation then says so).
    """
    if isinstance(device, Machine):
        return device
    dev = pick_device(device)
    cpu = cpu_features()
    facts = dict(name=cpu["name"], cuda_capability=None, bf16_native=False, bf16_emulated=False,
                 fp16=True, tf32_hardware=False)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cc = tuple(torch.cuda.get_device_capability(index))
        native = _bf16_native_cuda()
        facts.update(name=torch.cuda.get_device_name(index), cuda_capability=cc, bf16_native=native,
                     bf16_emulated=(not native) and torch.cuda.is_bf16_supported(), tf32_hardware=cc >= (8, 0))
    elif dev.type == "cpu":
        native = cpu["avx512_bf16"] or cpu["amx_bf16"]
        x86 = is_x86(cpu["arch"])  # elsewhere the x86 flags say nothing either way
        facts.update(bf16_native=native, bf16_emulated=x86 and not native,
                     cpu_fp16_native=cpu["avx512_fp16"] or cpu["amx_fp16"])
    elif dev.type == "mps":
        facts.update(name="Apple GPU (MPS)", bf16_native=_mps_bf16_native())
    machine = Machine(device=dev, cpu_name=cpu["name"], cpu_isa=cpu["isa"], avx512_bf16=cpu["avx512_bf16"],
                      amx_bf16=cpu["amx_bf16"], amx_fp16=cpu["amx_fp16"], avx512_fp16=cpu["avx512_fp16"],
                      cpu_arch=cpu["arch"], **facts)
    if speedups is not None or not measure:
        machine._cache["speedups"] = None if speedups is None else dict(speedups)
    return machine


def hardware_report(device=None, measure=True) -> HardwareReport:
    """:meth:`Machine.report` for ``device`` (auto by default): the facts and the recommendation.

    On a CPU the recommendation follows a measured bf16 matmul (:func:`matmul_speedups`,
    run once); ``measure`` may be that measurement (a dict) already made, or ``False`` to
    skip it. Used by every lesson's setup and ``doctor``.
    """
    if isinstance(measure, dict):
        return resolve_machine(device, speedups=measure).report()
    return resolve_machine(device, measure=bool(measure)).report()


def supported_precisions(device=None) -> dict[str, str | None]:
    """For each precision, ``None`` if the course runs it on ``device``, else why not
    (:meth:`Machine.supported`). Used by ``bench`` (05) and the widgets, which offer only
    what runs here."""
    return resolve_machine(device, measure=False).supported()


def usage(name, device=None) -> str:
    """:meth:`Machine.usage` for ``device``: the line lesson 00's precision widget prints."""
    return resolve_machine(device, measure=False).usage(name)


def fp8_support(device_type: str, cuda_capability=None) -> tuple[bool, str]:
    """(fast, reason): does an fp8 matmul (``torch._scaled_mm``) run on fp8 tensor cores here?

    Pure, for 08_fp8. The table is NVIDIA's: CUDA's ``_scaled_mm`` runs from compute
    capability 8.9 (Ada) and 9.0 (Hopper) on and refuses older GPUs
    (aten/src/ATen/native/cuda/ScaledBlas.cpp, whose message also names ROCm MI300+, which
    this table does not cover). With per-row scales, ScaledBlas.cpp sends the call to
    CUTLASS below 9.0, with cuBLAS older than 12.9, and on 10.0+ (non-scalar scales), and
    that path writes only bf16 or fp16 ("Only bf16 and fp16 high precision output types are
    supported for row-wise scaling.", read in torch 2.11's libtorch_cuda.so; pull request
    187569 adds fp32). On a CPU ``_scaled_mm`` runs (aten/src/ATen/native/Blas.cpp), without
    fp8 tensor cores.
    """
    if device_type == "cuda":
        if not cuda_capability:
            return (False, "CUDA GPU of unknown compute capability: fp8 needs 8.9 or 9.0+")
        cc = tuple(cuda_capability)
        label = "{}.{}".format(*cc)
        row, release = "per-row scales need a bf16 or fp16 output", " (read in torch 2.11)"
        if cc >= (10, 0):
            return (True, f"compute capability {label} (Blackwell or newer): fp8 tensor cores; {row}{release}")
        if cc >= (9, 0):
            return (True, f"compute capability {label} (Hopper): fp8 tensor cores; {row} below cuBLAS 12.9{release}")
        if cc == (8, 9):
            return (True, f"compute capability {label} (Ada): fp8 tensor cores; {row}{release}")
        return (False, f"compute capability {label}: no fp8 tensor cores, and torch._scaled_mm "
                       "refuses to run (it needs 8.9 or 9.0+)")
    if device_type == "cpu":
        return (False, "CPU: no fp8 tensor cores; torch._scaled_mm runs (Blas.cpp)")
    return (False, f"{device_type}: no fp8 matmul kernels in torch; fp8 would only be emulated")


def fp8_device(requested=None) -> torch.device:
    """The device 08_fp8 runs on: :func:`pick_device`'s, except that Apple's GPU (MPS) gives
    way to the CPU. torch's MPS backend has no ``float8_e5m2`` (pytorch/pytorch#132624), and
    ``float8_e4m3fn`` only from pull request 194074 (2026). Asking for ``"mps"`` by name is a
    ValueError that says so."""
    device = pick_device(requested)
    if device.type != "mps":
        return device
    if requested is not None and not (isinstance(requested, str) and requested.strip().lower() == "auto"):
        raise ValueError("lesson 08 cannot run on 'mps': torch's MPS backend has no float8_e5m2 "
                         "(pytorch/pytorch#132624). Use device='cpu', or 'auto', which picks the CPU on a Mac.")
    return torch.device("cpu")


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
    machine = resolve_machine(device, measure=False)
    why = machine.supported()[name]
    if why is not None and name == "tf32":
        raise ValueError(f"the course does not run precision 'tf32' on {machine.device}: {why}. Use 'fp32' here.")
    if why is not None:
        raise ValueError(f"the course does not run precision {name!r} on {machine.device}: {why}")
    return name, machine.device
