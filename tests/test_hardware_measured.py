"""The recommendation grounded in a measured matmul (lesson 00, doctor), and MPS's bf16."""

import pytest
import torch

from amp_lessons import hardware
from amp_lessons.__main__ import main
from amp_lessons.hardware import CPU_BF16_MIN_SPEEDUP, recommend


@pytest.mark.parametrize("avx512_bf16, amx, speedup, precision", [
    (True, False, 2.5, "bf16"),                       # AVX512-BF16 whose bf16 kernels are fast
    (True, False, 0.6, "fp32"),                       # AVX512-BF16 at half of fp32's rate
    (True, True, 5.4, "bf16"),                        # AMX
    (True, True, 1.0, "fp32"),                        # AMX capped away (e.g. ONEDNN_MAX_CPU_ISA)
    (False, False, 0.01, "fp32"),                     # AVX2 only: emulated
    (False, False, 3.0, "bf16"),                      # the measurement decides on every CPU
])
def test_cpu_recommendation_follows_the_measured_bf16_speed(avx512_bf16, amx, speedup, precision):
    got, scaler, reason = recommend("cpu", None, avx512_bf16 or amx, avx512_bf16, amx, bf16_speedup=speedup)
    assert (got, scaler) == (precision, False)
    # A measured figure, so it carries claims' ≈ (the notebooks' sanitize rule masks it).
    assert f"ran at ≈{speedup:.3g}x float32's rate" in reason


def test_the_threshold_is_inclusive():
    assert recommend("cpu", None, True, True, False, bf16_speedup=CPU_BF16_MIN_SPEEDUP)[0] == "bf16"
    assert recommend("cpu", None, True, True, False, bf16_speedup=CPU_BF16_MIN_SPEEDUP - 0.01)[0] == "fp32"


@pytest.mark.parametrize("speedup, precision, verdict", [
    (CPU_BF16_MIN_SPEEDUP, "bf16", "at least"),
    (CPU_BF16_MIN_SPEEDUP - 0.001, "fp32", "below"),  # prints as the threshold: the words decide
    (1.24, "fp32", "below"),  # three figures: not ≈1.2x beside a 1.25x threshold
])
def test_a_rate_near_the_threshold_reads_as_the_decision_it_made(speedup, precision, verdict):
    got, _, reason = recommend("cpu", None, True, True, False, bf16_speedup=speedup)
    assert got == precision
    assert f"≈{speedup:.3g}x float32's rate, {verdict} the {CPU_BF16_MIN_SPEEDUP}x" in reason


def test_without_a_measurement_a_cpu_gets_fp32_and_is_told_why():
    for amx in (True, False):
        precision, _, reason = recommend("cpu", None, True, True, amx)
        assert precision == "fp32" and "not measured" in reason and "doctor" in reason
    assert recommend("cuda", (8, 0), True, bf16_speedup=0.5)[0] == "bf16"  # GPUs: by capability


def test_matmul_speedups_are_ratios_to_fp32():
    speedups = hardware.matmul_speedups("cpu", n=64, repeats=1)
    assert set(speedups) == {"bf16", "fp16"} and all(v > 0 for v in speedups.values())


@pytest.mark.parametrize("release, native", [("14.2", True), ("13.6.1", False), ("", False)])
def test_mps_bf16_needs_macos_14(monkeypatch, release, native):
    monkeypatch.setattr(hardware.platform, "mac_ver", lambda: (release, ("", "", ""), ""))
    assert hardware._mps_bf16_native() is native


def test_doctor_measures_once_unless_told_not_to(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(hardware, "matmul_speedups", lambda device=None: calls.append(1) or {"bf16": 9.0, "fp16": 0.1})
    assert main(["doctor", "--device", "cpu"]) == 0
    assert calls == [1] and "9x float32's rate" in capsys.readouterr().out
    calls.clear()
    assert main(["doctor", "--device", "cpu", "--no-measure"]) == 0 and not calls
    assert "not measured" in capsys.readouterr().out


def test_a_measurement_can_be_passed_in(monkeypatch):
    monkeypatch.setattr(hardware, "matmul_speedups", lambda device=None: pytest.fail("measured again"))
    report = hardware.hardware_report("cpu", measure={"bf16": 7.0, "fp16": 0.1})
    assert report.recommended == "bf16" and "7x float32's rate" in report.reason


def test_a_machine_measures_once_and_is_passed_down(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "matmul_speedups", lambda device=None: calls.append(1) or {"bf16": 2.0, "fp16": 0.1})
    machine = hardware.resolve_machine("cpu")
    assert not calls  # nothing is measured until asked for
    assert machine.recommendation == machine.recommendation and machine.speedups["bf16"] == 2.0
    assert hardware.resolve_machine(machine) is machine and hardware.pick_device(machine) == torch.device("cpu")
    assert hardware.hardware_report(machine).recommended == "bf16" and calls == [1]
