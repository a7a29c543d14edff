"""Every device class a learner may be on, simulated by patching torch's own queries."""

import json

import pytest
import torch

from amp_lessons import hardware, parse_precision
from amp_lessons.__main__ import main
from amp_lessons.hardware import DeviceUnavailableError, hardware_report, pick_device
from amp_lessons.precision import dtype_of, float32_matmul_precision, needs_scaler, uses_autocast

CPU_BASE = {"cpu_name": "Simulated CPU", "architecture": "x86_64", "avx512_bf16": False, "amx_bf16": False,
            "amx_fp16": False, "amx_tile": False, "avx512_fp16": False}


# What a quick bf16 / fp16 matmul measures on each simulated CPU class (lesson 00's figures
# are this machine's): AMX several times float32's rate, an AVX512-BF16 EPYC 2.2x, AVX2
# only a fraction (emulated).
SIMULATED_SPEEDUPS = {"amx": {"bf16": 5.4, "fp16": 0.4}, "avx512_bf16": {"bf16": 2.2, "fp16": 0.02},
                      "avx2": {"bf16": 0.3, "fp16": 0.02}}


def simulate_cpu(monkeypatch, *, avx512_bf16=False, amx=False, isa="AVX2", speedups=None, arch="x86_64",
                 amx_fp16=False, avx512_fp16=False):
    """A CPU of that class, its quick matmul measuring ``speedups`` (default: the class's)."""
    caps = dict(CPU_BASE, architecture=arch, avx512_bf16=avx512_bf16, amx_bf16=amx, amx_fp16=amx_fp16,
                amx_tile=amx or amx_fp16, avx512_fp16=avx512_fp16)
    kind = "amx" if amx else "avx512_bf16" if avx512_bf16 else "avx2"
    measured = dict(speedups or SIMULATED_SPEEDUPS[kind])
    monkeypatch.setattr(hardware, "matmul_speedups", lambda device=None, **_: dict(measured))
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: caps, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def simulate_gpu(monkeypatch, name, cc):
    simulate_cpu(monkeypatch, isa="AVX2")
    native = cc >= (8, 0)

    def is_bf16_supported(including_emulation=True):
        return True if including_emulation else native  # a T4 says True by emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.mark.parametrize(
    "avx512_bf16, amx, precision, words",
    [
        (True, True, "bf16", "AMX"),
        (True, False, "bf16", "AVX512-BF16 instructions but no AMX"),
        (False, False, "fp32", "no AVX512-BF16, no AMX"),
    ],
    ids=["cpu-amx", "cpu-avx512bf16", "cpu-plain"],
)
def test_cpu_classes(monkeypatch, avx512_bf16, amx, precision, words):
    simulate_cpu(monkeypatch, avx512_bf16=avx512_bf16, amx=amx, isa="AVX512" if avx512_bf16 else "AVX2")
    report = hardware_report()
    assert report.device == "cpu"
    assert report.recommended == precision
    assert report.use_scaler is False
    assert words in report.reason
    assert report.bf16_native == (avx512_bf16 or amx)
    assert report.amx_bf16 == amx and report.avx512_bf16 == avx512_bf16
    assert report.cuda_capability is None and report.tf32_hardware is False
    assert "Measured here" in report.reason  # the recommendation cites the measurement
    if precision == "fp32":
        assert "memory" in report.reason  # what mixed precision still gives here


@pytest.mark.parametrize(
    "name, cc, precision, scaler, native",
    [
        ("Tesla T4", (7, 5), "fp16", True, False),
        ("Tesla V100-SXM2-16GB", (7, 0), "fp16", True, False),
        ("NVIDIA A100-SXM4-40GB", (8, 0), "bf16", False, True),
        ("NVIDIA H100 80GB HBM3", (9, 0), "bf16", False, True),
    ],
    ids=["T4", "V100", "A100", "H100"],
)
def test_gpu_classes(monkeypatch, name, cc, precision, scaler, native):
    simulate_gpu(monkeypatch, name, cc)
    report = hardware_report()
    assert report.device == "cuda"
    assert report.name == name
    assert report.cuda_capability == cc
    assert report.recommended == precision and report.use_scaler is scaler
    assert report.bf16_native is native
    assert report.bf16_emulated is (not native)  # the T4/V100 trap: "supported", but emulated
    assert report.tf32_hardware is (cc >= (8, 0))
    assert f"compute capability {cc[0]}.{cc[1]}" in report.reason
    if scaler:
        assert "emulated" in report.reason and "GradScaler" in report.reason
    else:
        assert "no GradScaler" in report.reason


def test_arm_cpu_is_not_called_emulated_by_x86_flags(monkeypatch):
    # torch's x86 flags all read False on an Arm CPU, whatever bf16 instructions it has.
    simulate_cpu(monkeypatch, arch="aarch64", isa="DEFAULT", speedups={"bf16": 3.0, "fp16": 0.5})
    report = hardware_report()
    rows = dict(report.rows())
    assert report.recommended == "bf16" and report.cpu_arch == "aarch64"
    assert report.bf16_native is False and report.bf16_emulated is False
    assert rows["bfloat16"] == "instructions not probed on aarch64 (the measured rate decides)"
    assert rows["CPU instruction set"] == "DEFAULT (aarch64)"
    assert not {"AVX512-BF16", "AVX512-FP16", "AMX-BF16", "AMX-FP16"} & set(rows)
    assert rows["float16"] == "instructions not probed on aarch64 (see the measured rate)"
    assert report.reason.startswith("aarch64 CPU, whose bf16 instructions the course does not probe")
    assert "without native bf16" not in report.reason and "3x float32's rate" in report.reason


def test_the_bench_does_not_say_an_arm_cpu_converts_bf16_in_software(monkeypatch):
    from amp_lessons import bench

    simulate_cpu(monkeypatch, arch="aarch64", isa="DEFAULT", speedups={"bf16": 3.0, "fp16": 0.5})
    result = bench.BenchResult(device="cpu", device_line="", sizes={})
    result.machine = hardware.resolve_machine("cpu", measure=False)
    (reason,) = bench.speed_reasons(result, "bf16")
    assert "software" not in reason and "AVX512" not in reason and "AMX" not in reason
    assert "does not probe the bf16 instructions of this aarch64 CPU" in reason
    simulate_cpu(monkeypatch, isa="AVX2")  # an x86 CPU without bf16 instructions keeps its reason
    result.machine = hardware.resolve_machine("cpu", measure=False)
    assert "neither AMX nor AVX512-BF16" in bench.speed_reasons(result, "bf16")[0]


@pytest.mark.parametrize("avx512_bf16, amx, row", [
    (False, False, "no AVX512-BF16 or AMX-BF16 (the measured rate decides)"),
    (True, False, "native instructions (AVX512-BF16 or AMX-BF16)"),
    (True, True, "native instructions (AVX512-BF16 or AMX-BF16)")])
def test_x86_cpu_rows(monkeypatch, avx512_bf16, amx, row):
    simulate_cpu(monkeypatch, avx512_bf16=avx512_bf16, amx=amx, amx_fp16=amx)
    rows = dict(hardware_report().rows())
    assert rows["bfloat16"] == row and "emulated only" not in rows["bfloat16"]
    assert rows["AMX-BF16"] == rows["AMX-FP16"] == ("yes" if amx else "no")
    assert rows["float16"] == ("native instructions (AVX512-FP16 or AMX-FP16)" if amx
                               else "no AVX512-FP16 or AMX-FP16 (its rate is measured)")
    assert "CPU" not in rows  # on a CPU the name row already names it


def test_a_gpu_report_names_its_cpu(monkeypatch):
    simulate_gpu(monkeypatch, "Tesla T4", (7, 5))
    rows = dict(hardware_report().rows())
    assert rows["CPU"] == "Simulated CPU" and rows["bfloat16"] == "emulated only (slow)"


def test_table_wraps_long_values_under_their_column(monkeypatch):
    simulate_cpu(monkeypatch)
    report = hardware_report()
    assert report.reason in report.table().splitlines()[-1]  # unwrapped: one line a row (doctor)
    lines = report.table(width=80).splitlines()
    assert max(len(line) for line in lines) <= 80
    why = next(i for i, line in enumerate(lines) if line.startswith("why "))
    pad = lines[why].index(report.reason[:12])  # where the value column starts
    assert lines[0].index(report.device) == pad and len(lines) > why + 1
    assert all(line.startswith(" " * pad) and line[pad] != " " for line in lines[why + 1:])
    assert " ".join(line[pad:] for line in lines[why:]) == report.reason


def test_amx_fp16_is_read_from_torchs_probe(monkeypatch):
    simulate_cpu(monkeypatch, amx_fp16=True)
    assert hardware.cpu_features()["amx_fp16"] is True and hardware_report().amx_fp16 is True


def test_t4_never_recommends_emulated_bf16(monkeypatch):
    simulate_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert torch.cuda.is_bf16_supported()  # what the naive check says
    assert hardware.supported_precisions()["bf16"] is not None
    assert hardware.supported_precisions()["tf32"] is not None
    assert hardware_report().recommended == "fp16"


def test_t4_bf16_is_the_courses_choice_not_a_limit(monkeypatch):
    # torch.autocast("cuda", torch.bfloat16) runs on a T4 (is_bf16_supported() is True there);
    # the course leaves it out, and says so.
    from amp_lessons.widgets import describe_precision

    simulate_gpu(monkeypatch, "Tesla T4", (7, 5))
    why = hardware.supported_precisions()["bf16"]
    assert why.startswith("bf16 autocast runs on this GPU only by emulation") and "fp16 + GradScaler" in why
    with pytest.raises(ValueError, match="the course does not run precision 'bf16' on cuda: bf16 autocast runs"):
        hardware.resolve("bf16", "cuda")
    assert describe_precision("bf16", "cuda").splitlines()[-1] == f"used on cuda   no: {why}"


@pytest.mark.parametrize("name, cc", [
    ("Tesla T4", (7, 5)), ("NVIDIA GeForce GTX 1660", (7, 5)), ("Tesla V100-SXM2-16GB", (7, 0)),
    ("NVIDIA A100-SXM4-40GB", (8, 0)), ("NVIDIA H100 80GB HBM3", (9, 0)), ("Tesla P100-PCIE-16GB", (6, 0))],
    ids=["T4", "GTX1660", "V100", "A100", "H100", "P100"])
def test_gpu_reasons_claim_tensor_cores_only_where_the_capability_implies_them(monkeypatch, name, cc):
    # A GTX 1660 (TU116, no tensor cores) has a T4's compute capability 7.5: the reason,
    # drawn from the capability alone, must read true for both.
    simulate_gpu(monkeypatch, name, cc)
    reason = hardware_report().reason
    if cc >= (8, 0):
        assert "bfloat16 tensor cores" in reason
    else:
        assert "its tensor cores" not in reason and "without tensor cores" not in reason
    if (7, 0) <= cc < (8, 0):
        assert "bf16 tensor cores start at compute capability 8.0" in reason and "GradScaler" in reason
    if cc == (7, 5):
        assert reason == hardware.recommend("cuda", (7, 5), bf16_native=False)[2]  # T4 = GTX 1660


def test_cpu_reasons_name_no_tensor_cores(monkeypatch):
    for flags in ((False, False), (True, False), (True, True)):
        simulate_cpu(monkeypatch, avx512_bf16=flags[0], amx=flags[1])
        assert "tensor core" not in hardware_report().reason


def test_pre_volta_gpu_is_not_said_to_gain_nothing(monkeypatch):
    simulate_gpu(monkeypatch, "Tesla P100-PCIE-16GB", (6, 0))
    report = hardware_report()
    assert report.recommended == "fp32" and report.use_scaler is False
    assert "not faster" not in report.reason and "does not measure" in report.reason


def test_speedup_matmul_is_sized_for_the_device(monkeypatch):
    sizes, speedups = [], hardware.matmul_speedups  # the real one: the simulation replaces it
    monkeypatch.setattr(hardware, "matmul_gflops", lambda n, p, dev, **_: sizes.append((dev.type, n)) or 1.0)
    simulate_gpu(monkeypatch, "NVIDIA A100", (8, 0))
    assert speedups("cpu") == {"bf16": 1.0, "fp16": 1.0}
    speedups("cuda")
    speedups("cuda", n=64)
    assert sizes == [("cpu", 256)] * 3 + [("cuda", 4096)] * 3 + [("cuda", 64)] * 3


def test_a100_supports_everything(monkeypatch):
    simulate_gpu(monkeypatch, "NVIDIA A100", (8, 0))
    assert all(v is None for v in hardware.supported_precisions().values())


def test_no_cuda_picks_cpu_and_refuses_cuda(monkeypatch):
    simulate_cpu(monkeypatch)
    assert pick_device() == torch.device("cpu")
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match=r"only: cpu.*device='auto'"):
        pick_device("cuda")
    with pytest.raises(DeviceUnavailableError, match="only: cpu"):
        hardware_report("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu; got 9223372036854775808"):
        pick_device(2**63)  # torch.device's own overflow, said in the course's words


def test_gpu_preferred_and_index_checked(monkeypatch):
    simulate_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert pick_device().type == "cuda"
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="1 CUDA device"):
        pick_device("cuda:3")


def test_unknown_device_name():
    with pytest.raises(ValueError, match="device must be one of auto"):
        pick_device("gpu0")


def test_tf32_is_refused_on_cpu(monkeypatch):
    simulate_cpu(monkeypatch)
    with pytest.raises(ValueError, match="course does not run precision 'tf32' on cpu: TF32 training runs only"):
        hardware.resolve("tf32", "cpu")
    assert hardware.resolve("half", "cpu") == ("fp16", torch.device("cpu"))


@pytest.mark.parametrize(
    "name, canonical",
    [("fp32", "fp32"), ("float32", "fp32"), ("torch.float32", "fp32"), (torch.float32, "fp32"),
     ("TF32", "tf32"), ("bf16", "bf16"), ("bfloat16", "bf16"), (torch.bfloat16, "bf16"),
     ("fp16", "fp16"), ("float16", "fp16"), ("torch.float16", "fp16"), ("half", "fp16"),
     (torch.float16, "fp16"), (" Float16 ", "fp16")],
)
def test_precision_aliases(name, canonical):
    assert parse_precision(name) == canonical


@pytest.mark.parametrize("bad", ["fp61", "", "int8", None, 16, torch.float64, torch.int32])
def test_bad_precision_names_list_the_valid_ones(bad):
    with pytest.raises(ValueError, match="precision must be one of fp32, tf32, bf16, fp16"):
        parse_precision(bad)


def test_precision_properties():
    assert [dtype_of(p) for p in ("fp32", "tf32", "bf16", "fp16")] == [
        torch.float32, torch.float32, torch.bfloat16, torch.float16]
    assert [uses_autocast(p) for p in ("fp32", "tf32", "bf16", "fp16")] == [False, False, True, True]
    assert [needs_scaler(p) for p in ("fp32", "tf32", "bf16", "fp16")] == [False, False, False, True]


def test_matmul_precision_is_restored_even_after_an_error():
    before = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError), float32_matmul_precision("tf32"):
        assert torch.get_float32_matmul_precision() == "high"
        raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == before


def test_check_autocast_errors():
    with pytest.raises(ValueError, match="supports torch.bfloat16 and torch.float16; got torch.float64"):
        hardware.check_autocast("cpu", torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="only: cpu"):
            hardware.check_autocast("cuda", torch.float16)


def test_doctor_prints_the_report(capsys):
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    for label in ("device", "bfloat16", "TF32 tensor cores", "CPU instruction set",
                  "recommended precision", "why"):
        assert label in out
    assert hardware_report(measure=False).reason in out


def test_doctor_json_and_simulated_t4(monkeypatch, capsys):
    simulate_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["name"] == "Tesla T4" and data["recommended"] == "fp16" and data["use_scaler"]
    assert data["bf16_emulated"] is True and data["bf16_native"] is False


def test_doctor_refuses_missing_cuda(monkeypatch, capsys):
    simulate_cpu(monkeypatch)
    assert main(["doctor", "--device", "cuda"]) == 2
    assert "only: cpu" in capsys.readouterr().err


# -- every function that takes a precision parses it in one place -------------------------------


def _digits_batch():
    from amp_lessons.data import digits

    return digits().batch(0, 16)


def _precision_calls():
    """One call per public function (of the modules below) that takes a ``precision``; each
    returns something that shows which precision it ran."""
    from amp_lessons import clipping, master, scaling, training

    x, y = _digits_batch()

    def accumulation(p):
        from amp_lessons.data import digits

        return clipping.run_accumulation(clipping.accumulate, clipping.lesson_model(), digits(), k=2,
                                         batch_size=8, precision=p).optimizer_steps

    return {
        "amp_lessons.precision.dtype_of": dtype_of,
        "amp_lessons.precision.uses_autocast": uses_autocast,
        "amp_lessons.precision.needs_scaler": needs_scaler,
        "amp_lessons.precision.parse_precision": parse_precision,
        "amp_lessons.precision.float32_matmul_precision": lambda p: float32_matmul_precision(p).__enter__(),
        "amp_lessons.training.Trainer": lambda p: training.Trainer(
            clipping.lesson_model(), scaling.lesson_data(), precision=p, device="cpu").precision,
        "amp_lessons.scaling.lesson_trainer": lambda p: scaling.lesson_trainer(p, device="cpu").precision,
        "amp_lessons.scaling.first_step_gradients": lambda p: scaling.first_step_gradients(p, True, "cpu").sum(),
        "amp_lessons.clipping.one_clipped_step": lambda p: clipping.one_clipped_step(
            clipping.lesson_model(), x, y, precision=p, max_norm=1.0).scale,
        "amp_lessons.clipping.backward_inside_autocast_matches": lambda p: clipping.backward_inside_autocast_matches(
            clipping.lesson_model(), x, y, p),
        "amp_lessons.clipping.run_accumulation": accumulation,
        "amp_lessons.clipping.accumulation_rows": lambda p: clipping.accumulation_rows(
            clipping.lesson_model, scaling.lesson_data(), k=2, batch_size=8, precision=p)[1].optimizer_steps,
        "amp_lessons.master.gradients": lambda p: [g.sum() for g in master.gradients(clipping.lesson_model(), x, y, p)],
        "amp_lessons.master.eps_in": master.eps_in,
    }


def test_every_function_that_takes_a_precision_is_listed_here():
    import inspect

    from amp_lessons import clipping, data, master, models, precision, scaling, seeding, training

    takes = {f"{m.__name__}.{name}" for m in (precision, training, scaling, clipping, master, data, models, seeding)
             for name, f in inspect.getmembers(m, lambda f: inspect.isfunction(f) or inspect.isclass(f))
             if f.__module__ == m.__name__ and not name.startswith("_")
             and ("precision" in _parameters(f) or name in ("parse_precision", "eps_in"))}
    assert takes == set(_precision_calls())


def _parameters(f):
    import inspect

    try:
        return inspect.signature(f).parameters
    except (TypeError, ValueError):
        return {}


@pytest.mark.parametrize("name", sorted(_precision_calls()))
def test_every_function_that_takes_a_precision_parses_it(name):
    call = _precision_calls()[name]
    with float32_matmul_precision("fp32"):  # undoes the context manager's __enter__ above
        reference = call("fp16")
        for alias in ("half", " Float16 ", torch.float16):
            got = call(alias)
            assert str(got) == str(reference), (name, alias)
        with pytest.raises(ValueError, match="precision must be one of fp32, tf32, bf16, fp16; got 'fp61'"):
            call("fp61")


# Each device class a learner may be on: its bfloat16 / float16 report rows, and the widget's
# "used on" line for bf16 and fp16 (lesson 00). A CPU runs both 16-bit types, fast or not.
CPU_RUNS = "yes: CPU autocast runs it, fast or slow (a measured matmul rate says which: lesson 00 prints them)"
CPU_NO_BF16, CPU_NATIVE_BF16 = "no AVX512-BF16 or AMX-BF16 (the measured rate decides)", \
    "native instructions (AVX512-BF16 or AMX-BF16)"
CPU_NO_FP16, CPU_NATIVE_FP16 = "no AVX512-FP16 or AMX-FP16 (its rate is measured)", \
    "native instructions (AVX512-FP16 or AMX-FP16)"
EMULATED = ("no: bf16 autocast runs on this GPU only by emulation (pre-Ampere: no bf16 tensor cores), "
            "so the course uses fp16 + GradScaler here")
DEVICE_CLASSES = {  # id: (simulate, bfloat16 row, float16 row, bf16 used, fp16 used, recommended)
    "cpu-no-avx512bf16": (lambda mp: simulate_cpu(mp), CPU_NO_BF16, CPU_NO_FP16, CPU_RUNS, CPU_RUNS, "fp32"),
    "cpu-avx512bf16": (lambda mp: simulate_cpu(mp, avx512_bf16=True, isa="AVX512"),
                       CPU_NATIVE_BF16, CPU_NO_FP16, CPU_RUNS, CPU_RUNS, "bf16"),
    "cpu-amx": (lambda mp: simulate_cpu(mp, avx512_bf16=True, amx=True, amx_fp16=True, isa="AVX512"),
                CPU_NATIVE_BF16, CPU_NATIVE_FP16, CPU_RUNS, CPU_RUNS, "bf16"),
    "cpu-avx512fp16": (lambda mp: simulate_cpu(mp, avx512_bf16=True, avx512_fp16=True, isa="AVX512"),
                       CPU_NATIVE_BF16, CPU_NATIVE_FP16, CPU_RUNS, CPU_RUNS, "bf16"),
    "cpu-aarch64": (lambda mp: simulate_cpu(mp, arch="aarch64", isa="DEFAULT", speedups={"bf16": 3.0, "fp16": 0.5}),
                    "instructions not probed on aarch64 (the measured rate decides)",
                    "instructions not probed on aarch64 (see the measured rate)", CPU_RUNS, CPU_RUNS, "bf16"),
    "T4": (lambda mp: simulate_gpu(mp, "Tesla T4", (7, 5)), "emulated only (slow)", "yes", EMULATED, "yes",
           "fp16"),
    "P100": (lambda mp: simulate_gpu(mp, "Tesla P100-PCIE-16GB", (6, 0)), "emulated only (slow)", "yes",
             EMULATED, "yes", "fp32"),
    "A100": (lambda mp: simulate_gpu(mp, "NVIDIA A100-SXM4-40GB", (8, 0)), "native", "yes", "yes", "yes", "bf16"),
    "H100": (lambda mp: simulate_gpu(mp, "NVIDIA H100 80GB HBM3", (9, 0)), "native", "yes", "yes", "yes", "bf16"),
}


@pytest.mark.parametrize("kind", DEVICE_CLASSES)
def test_each_device_class_reports_and_uses_16_bit_types_alike(monkeypatch, kind):
    from amp_lessons.widgets import describe_precision

    simulate, bf16_row, fp16_row, bf16_used, fp16_used, precision = DEVICE_CLASSES[kind]
    simulate(monkeypatch)
    report = hardware_report()
    rows = dict(report.rows())
    assert (rows["bfloat16"], rows["float16"]) == (bf16_row, fp16_row)
    assert (hardware.usage("bf16"), hardware.usage("fp16")) == (bf16_used, fp16_used)
    assert describe_precision("fp16").splitlines()[-1].split(None, 3)[3] == fp16_used
    assert report.recommended == precision
    # the activation memory is scoped wherever it is named: never a flat "halves"
    assert "halves" not in report.reason
    if "activation memory" in report.reason:
        assert "up to half" in report.reason
    x86 = report.cpu_arch == "x86_64"  # a GPU's report lists its host CPU's flags too
    assert ("AVX512-FP16" in rows) is x86
    if x86:
        assert rows["AVX512-FP16"] == ("yes" if kind == "cpu-avx512fp16" else "no")
    assert report.cpu_fp16_native is (fp16_row == CPU_NATIVE_FP16)


def test_avx512_fp16_is_read_from_torchs_probe(monkeypatch):
    simulate_cpu(monkeypatch, avx512_fp16=True)
    assert hardware.cpu_features()["avx512_fp16"] is True
    assert hardware_report().avx512_fp16 is True and hardware_report().cpu_fp16_native is True


@pytest.mark.parametrize("speedup", [hardware.CPU_BF16_MIN_SPEEDUP, hardware.CPU_BF16_MIN_SPEEDUP - 0.01, None])
def test_cpu_recommendations_scope_the_activation_memory(speedup):
    reason = hardware.recommend("cpu", bf16_speedup=speedup)[2]
    if speedup is None:
        assert "not measured" in reason and "memory" not in reason
    else:
        assert "up to half the activation memory (in matmul-heavy layers;" in reason and "lesson 05" in reason
