"""The device checks of ``python -m amp_lessons selfcheck`` (``make gpu-check``): what the
lessons say about devices, as verdicts.

The instruments (:mod:`~amp_lessons.hardware`, :mod:`~amp_lessons.matmul`,
:mod:`~amp_lessons.trace`) return facts and measurements; this module turns them into
verdicts (:mod:`amp_lessons.claims`), checked for real on a CUDA device and replayed or
simulated (and labelled so) elsewhere. Lessons 06-08 keep theirs beside the lesson
(``errors.selfcheck``, ``distributed.selfcheck``, ``fp8.selfcheck``); :data:`CHECKS`
lists them all, and :func:`device_checks` runs them on one :class:`~amp_lessons.hardware.Machine`.
Lesson 02 prints :func:`simulation_verdicts` and :func:`statement_verdicts`.
"""

from __future__ import annotations

import traceback
from functools import partial

import torch

from . import claims, distributed, errors, fp8
from .blockscale import block_kernel_check
from .claims import check, measured
from .exercises import dtype_exercise
from .hardware import Machine, pick_device, resolve_machine
from .matmul import medium_levels, tf32_error, tf32_input_bits
from .precision import dtype_of
from .trace import PROBES, Trace, differences, example, probe, short, trace_model

# --- lessons 00 and 05: native bf16, TF32 and the recommendation -----------------------------


def hardware_verdicts(device=None) -> list:
    """The hardware facts lessons 00 and 05 state, checked on ``device``.

    On a CUDA GPU: native bf16 exactly from compute capability 8.0 on (a T4, 7.5, reports bf16
    only through emulation), and the recommendation that follows. On a CPU: both 16-bit
    autocast dtypes run, and TF32 is reported as absent.
    """
    machine = resolve_machine(device)
    out = []
    if machine.type == "cuda":
        cc = machine.cuda_capability
        out.append(check("this GPU's native bf16 (is_bf16_supported(including_emulation=False)) "
                         "matches compute capability >= 8.0", machine.bf16_native == (cc >= (8, 0)),
                         f"cc {cc[0]}.{cc[1]}, native {machine.bf16_native}, emulated {machine.bf16_emulated}"))
        expected = "bf16" if cc >= (8, 0) else "fp16" if cc >= (7, 0) else "fp32"
        got = machine.recommendation[0]
        out.append(check(f"the recommended precision here is {expected}", got == expected, f"recommended {got}"))
        out.append(check("TF32 is reported where compute capability >= 8.0",
                         machine.tf32_hardware == (cc >= (8, 0)), f"tf32 {machine.tf32_hardware}"))
    elif machine.type == "cpu":
        ran = []
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                ran.append((torch.ones(4, 4) @ torch.ones(4, 4)).dtype == dtype)
        out.append(check("bf16 and fp16 autocast both run matmuls in 16 bits on this CPU", all(ran),
                         f"bf16 {ran[0]}, fp16 {ran[1]}"))
        out.append(check("TF32 is reported as absent on a CPU",
                         machine.supported()["tf32"] is not None and not machine.tf32_hardware))
    return out


# --- lessons 01 and 05: TF32, "high" and "medium" ---------------------------------------------


def matmul_verdicts(device=None) -> list:
    """The matmul-precision statements of lessons 01 and 05, checked on ``device``."""
    machine = resolve_machine(device)
    err = tf32_error(256, machine)
    allowed = medium_levels(machine)
    out = [check("float32's error < TF32's (emulated) < bf16's on a 256 x 256 matmul",
                 err.fp32 < err.tf32_emulated < err.bf16,
                 f"{measured(err.fp32, '.1e')}, {measured(err.tf32_emulated, '.1e')}, {measured(err.bf16, '.1e')}"),
           check(f"set_float32_matmul_precision('medium') gives the error torch's source allows on "
                 f"{machine.type}: {' or '.join(allowed)}", err.medium_level in allowed,
                 f"here: {err.medium_level} ({measured(err.medium, '.1e')})")]
    if machine.tf32_hardware:
        how = tf32_input_bits(machine)
        out.append(check("'high' changes a float32 matmul on this GPU (TF32 tensor cores)", err.high_changes_result))
        out.append(check("TF32 keeps 10 mantissa bits of each input here", how in ("truncates", "rounds"),
                         f"it {how}"))
    else:
        out.append(check(f"'high' changes nothing on {machine.type}, which has no TF32", not err.high_changes_result))
    return out


# --- lesson 02: the simulation against the real device, and its CUDA statements -------------


def _model_cases():
    return {"card_model": lambda dev: example("card_model", dev),
            "TransformerBlock": lambda dev: example("TransformerBlock", dev),
            "the exercise's net": lambda dev: dtype_exercise(dev)}


def _real_trace(case: str, dtype, device) -> Trace:
    """One model or probe traced for real on ``device`` (the self-check's reference)."""
    if case in PROBES:
        return probe(case, dtype, device)
    model, x, y, loss_fn = _model_cases()[case](device)
    return trace_model(model, x, y, loss_fn, dtype=dtype)


def _simulated_trace(case: str, dtype, device_type: str) -> Trace:
    if case in PROBES:
        return probe(case, dtype, device_type, simulate=True)
    model, x, y, loss_fn = _model_cases()[case]("cpu")
    return trace_model(model, x, y, loss_fn, dtype=dtype, device=device_type, simulate=True)


def _ops(tr: Trace) -> list[tuple[str, torch.dtype]]:
    return [(r.op, r.dtype) for r in tr.rows()]


def cuda_statements(dtype, cuda_trace, cpu_trace) -> list:
    """02's statements about CUDA autocast, each a verdict on traces of :data:`PROBES`.

    ``cuda_trace(name)`` traces a probe on CUDA (real or simulated); ``cpu_trace(name)`` on
    the CPU, for the statements that contrast the two. Each claim starts with where it was
    checked (``"cuda"`` or ``"cuda (simulated)"``) and the dtype.
    """
    low, f32 = short(dtype), torch.float32
    cu = {n: cuda_trace(n) for n in PROBES}
    cp = {n: cpu_trace(n) for n in ("softmax(x)", "log_softmax(x)", "layer_norm(x)",
                                   "group_norm(x)", "cross_entropy(x, y)", "sum(x)", "mean(x)")}
    where = cu["softmax(x)"].where
    out = []

    def say(claim, holds, *names):
        figures = "; ".join(f"{n}: {cu[n].oneline()}" + (f" (cpu: {cp[n].oneline()})" if n in cp else "")
                            for n in names)
        out.append(check(f"{where}, {low}: {claim}", holds, figures))

    def ops(name):
        return [(r.op, r.dtype) for r in cu[name].rows()]

    for n in ("softmax(x)", "log_softmax(x)", "layer_norm(x)", "group_norm(x)"):
        say(f"{n.split('(')[0]} of a 16-bit input produces float32, where the CPU keeps it 16-bit",
            cu[n].result.dtype == f32 and cp[n].result.dtype == dtype, n)
    if dtype == torch.float16:
        say("softmax and log_softmax take the float16 input straight to a float32 result, "
            "with no separate cast",
            ops("softmax(x)") == [("_softmax", f32)] and ops("log_softmax(x)") == [("_log_softmax", f32)],
            "softmax(x)", "log_softmax(x)")
    else:
        say("softmax and log_softmax get their input cast to float32 first (a _to_copy)",
            ops("softmax(x)")[0] == ("_to_copy", f32) and ops("log_softmax(x)")[0] == ("_to_copy", f32),
            "softmax(x)", "log_softmax(x)")
    say("layer_norm and group_norm get their input cast to float32 first (a _to_copy)",
        ops("layer_norm(x)")[0] == ("_to_copy", f32) and ops("group_norm(x)")[0] == ("_to_copy", f32),
        "layer_norm(x)", "group_norm(x)")
    say("cross_entropy runs _log_softmax in 16-bit (it passes dtype=x.dtype), then casts to "
        "float32 for nll_loss_forward; the CPU runs both halves in float32",
        ops("cross_entropy(x, y)") == [("_log_softmax", dtype), ("_to_copy", f32),
                                       ("nll_loss_forward", f32)]
        and cp["cross_entropy(x, y)"].dtype_of("_log_softmax") == f32, "cross_entropy(x, y)")
    say("sum of a 16-bit input produces float32, mean stays 16-bit; on the CPU both stay 16-bit",
        cu["sum(x)"].result.dtype == f32 and cu["mean(x)"].result.dtype == dtype
        and cp["sum(x)"].result.dtype == cp["mean(x)"].result.dtype == dtype, "sum(x)", "mean(x)")
    say("softmax with an explicit dtype=x.dtype stays 16-bit: autocast leaves explicit dtype= alone",
        cu["softmax(x, dtype=x.dtype)"].result.dtype == dtype, "softmax(x, dtype=x.dtype)")
    say("exp runs in float32, but in-place x.exp_() stays 16-bit: autocast skips in-place ops",
        cu["exp(x)"].result.dtype == f32 and cu["x.exp_()"].result.dtype == dtype,
        "exp(x)", "x.exp_()")
    say("mm of float32 inputs runs 16-bit, but not with out=, in place (addmm_) or on float64",
        cu["mm(a, b)"].result.dtype == dtype and cu["mm(a, b, out=c)"].result.dtype == f32
        and cu["c.addmm_(a, b)"].result.dtype == f32
        and cu["mm(a64, b64)"].result.dtype == torch.float64,
        "mm(a, b)", "mm(a, b, out=c)", "c.addmm_(a, b)", "mm(a64, b64)")
    say("relu (on no list) follows its 16-bit input", cu["relu(x)"].result.dtype == dtype, "relu(x)")
    return out


def _dtypes_on(device: torch.device, dtypes) -> tuple[torch.dtype, ...]:
    if dtypes is not None:
        return tuple(dtype_of(d) if isinstance(d, str) else d for d in dtypes)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (torch.float16,)
    return (torch.bfloat16, torch.float16)


def _probes_on(device: torch.device) -> tuple[str, ...]:
    """The probes that can run for real on ``device`` (MPS has no float64: the probes of
    ``a64`` and ``b64`` are left out there)."""
    if device.type == "mps":
        return tuple(n for n in PROBES if "64" not in n)
    return PROBES


def simulation_verdicts(device=None, dtypes=None) -> list:
    """Does the simulation of ``device``'s autocast match the real thing? One verdict per
    lesson model (:data:`EXAMPLES` and the exercise's net) and one for all :data:`PROBES`,
    per dtype: the same ops in the same dtypes, in the same order (views left out).

    On a CUDA GPU this checks the CUDA simulation the lessons show CPU learners; on a CPU it
    checks the simulation machinery itself against the real CPU autocast.
    """
    dev = pick_device(device)
    out = []
    for dtype in _dtypes_on(dev, dtypes):
        for case in (*_model_cases(), "probes"):
            names = _probes_on(dev) if case == "probes" else (case,)
            diffs = []
            for name in names:
                real, sim = _real_trace(name, dtype, dev), _simulated_trace(name, dtype, dev.type)
                diffs += [f"{name}: {d}" for d in differences(real, sim, layout=False)]
            what = f"all {len(names)} single calls" if case == "probes" else case
            out.append(check(f"{dev.type}, {short(dtype)}: the simulation of {dev.type} autocast "
                             f"ran the same ops in the same dtypes as the real trace ({what})",
                             not diffs, "; ".join(diffs[:4]) or "no difference"))
    return out


def statement_verdicts(device=None, dtypes=None) -> list:
    """:func:`cuda_statements` on real CUDA traces when ``device`` is a CUDA GPU, else on
    simulated ones (each claim then says "cuda (simulated)"), for each dtype."""
    dev = pick_device(device)
    out = []
    for dtype in _dtypes_on(dev, dtypes):
        if dev.type == "cuda":
            cuda = partial(_real_trace, dtype=dtype, device=dev)
        else:
            cuda = partial(_simulated_trace, dtype=dtype, device_type="cuda")
        out += cuda_statements(dtype, cuda, partial(_real_trace, dtype=dtype, device="cpu"))
    return out


def compare_simulated(device=None, dtypes=None) -> list:
    """The simulation checked against ``device``, then lesson 02's CUDA statements, as verdicts.

    On a CUDA device: :func:`simulation_verdicts` (real CUDA traces against simulated ones,
    for every lesson model and probe), then :func:`statement_verdicts` on the real CUDA
    traces. Elsewhere (a CPU, MPS): the same match between this device's real and
    simulated traces, which checks the simulation itself, then the CUDA statements on
    simulated CUDA traces, each claim saying "cuda (simulated)". ``dtypes``: default both
    16-bit dtypes (only float16 on a GPU without bfloat16). Used by
    ``python -m amp_lessons selfcheck`` and 02_autocast.
    """
    return simulation_verdicts(device, dtypes) + statement_verdicts(device, dtypes)


# --- every device check, by topic ----------------------------------------------------------

# --- lesson 09: the real block-scaled kernel ------------------------------------------------------


def blockscale_verdicts(device=None) -> list:
    """Lesson 09's device statement, checked on ``device``: where a GPU runs block scales, the
    real MXFP8 kernel equals dequantize-then-matmul on exact inputs; elsewhere one verdict says
    what was skipped and why."""
    result = block_kernel_check(device)
    if result.skipped is not None:
        return [check("the real MXFP8 block-scaled kernel was skipped here (the lesson emulates it)",
                      True, result.skipped)]
    return [check("the real MXFP8 kernel (F.scaled_mm, 1x32 e8m0 scales) equals dequantize-then-matmul "
                  "on exact inputs", bool(result.equal), f"largest difference {result.max_diff:g}"),
            check("and is within the float32 accumulation bound", bool(result.within_bound))]


CHECKS = (
    ("hardware", hardware_verdicts),
    ("matmul precision (lessons 01, 05)", matmul_verdicts),
    ("autocast lists (lesson 02)", compare_simulated),
    ("error messages (lesson 06)", errors.selfcheck),
    ("torch.distributed (lesson 07)", distributed.selfcheck),
    ("fp8 (lesson 08)", fp8.selfcheck),
    ("block scales (lesson 09)", blockscale_verdicts),
)


def device_checks(machine: Machine, checks=None) -> list[tuple[str, list]]:
    """``(topic, verdicts)`` for each of ``checks`` (default :data:`CHECKS`) run on
    ``machine``; a check that crashes is one failed verdict naming the error."""
    found = []
    for topic, run in CHECKS if checks is None else checks:
        first = len(claims.RECORDED)
        try:
            returned = run(machine)
        except Exception as err:  # noqa: BLE001 - a crashing check is a failed verdict
            returned = [check(f"{topic}: the device check ran", False,
                              "".join(traceback.format_exception_only(err)).strip())]
        found.append((topic, list(returned or []) or claims.RECORDED[first:]))
    return found
