"""``python -m amp_lessons bench``, run with tiny sizes: structure and memory, never timing."""

import json

import pytest
import torch

from amp_lessons import bench
from amp_lessons.__main__ import main
from amp_lessons.matmul import matmul_flops, matmul_gflops, tf32_error
from amp_lessons.precision import PRECISIONS

TINY = ["--device", "cpu", "--width", "64", "--depth", "2", "--batch", "16", "--seq", "8",
        "--warmup", "0", "--repeats", "1", "--matmul-sizes", "32"]


def run_cli(capsys, *args):
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_json_has_one_row_per_precision(capsys):
    code, out, err = run_cli(capsys, *TINY, "--model", "mlp", "--json")
    assert code == 0
    result = json.loads(out)
    rows = result["rows"]
    assert [r["precision"] for r in rows] == list(PRECISIONS)
    by = {r["precision"]: r for r in rows}
    for p in ("fp32", "bf16", "fp16"):
        assert by[p]["status"] == "ok" and by[p]["ms"] > 0 and by[p]["activation_mb"] > 0
    assert by["tf32"]["status"] == "unsupported" and "CPU" in by["tf32"]["reason"]
    assert 0.45 <= by["bf16"]["activation_ratio"] <= 0.55
    assert by["fp32"]["activation_ratio"] == 1.0 and by["fp32"]["speedup"] == 1.0
    assert by["fp32"]["weight_copy_mb"] == 0 and by["bf16"]["weight_copy_mb"] > 0
    assert "AVX512-BF16" in result["device_line"]
    assert {(m["n"], m["precision"]) for m in result["matmul"]} == {(32, p) for p in PRECISIONS}
    assert err == ""  # progress bars are off under AMP_LESSONS_PROGRESS=0


def test_bench_table_names_every_precision_and_the_matmul_block(capsys):
    code, out, _ = run_cli(capsys, *TINY, "--model", "transformer", "--precisions", "fp32,bf16,tf32")
    assert code == 0
    assert "device cpu" in out and "matmul GFLOP/s" in out
    assert "transformer  tf32         unsupported: TF32" in out
    for p in ("fp32", "bf16"):
        assert f"transformer  {p}" in out


def test_a_bad_precision_name_says_which_names_exist(capsys):
    code, _, err = run_cli(capsys, *TINY, "--precisions", "fp61")
    assert code == 2
    assert "precision must be one of fp32, tf32, bf16, fp16; got 'fp61'" in err


def test_sizes_that_cannot_fit_fail_with_a_clear_message(capsys):
    code, out, err = run_cli(capsys, "--device", "cpu", "--model", "mlp", "--width", "400000",
                             "--depth", "4", "--batch", "8")
    assert code == 2 and out == ""
    assert "GiB" in err and "Use smaller sizes: e.g. --width " in err
    width = int(err.split("--width ")[1].split(".")[0])
    assert 8 <= width < 20000  # weights dominate: a width that would fit is suggested


def test_check_fits_against_a_given_budget():
    bench.check_fits(10 * 2**30, None, "x", "y")  # unknown free memory: no check
    bench.check_fits(1 * 2**30, 2 * 2**30, "x", "y")
    with pytest.raises(bench.BenchMemoryError, match=r"needs about 3.0 GiB .* only 2.0 GiB is free"):
        bench.check_fits(3 * 2**30, 2 * 2**30, "the mlp", "--batch 2")


@pytest.mark.parametrize("err, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ... out of memory"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
])
def test_out_of_memory_is_recognised(err, oom):
    assert bench._is_oom(err) is oom


def test_an_oom_in_one_precision_leaves_the_others_running(monkeypatch):
    real = bench.saved_memory

    def failing(model, x, y, precision):
        if precision == "bf16":
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(model, x, y, precision)

    monkeypatch.setattr(bench, "saved_memory", failing)
    sizes = {"mlp": bench.Sizes(width=32, depth=1, batch=8)}
    result = bench.run_bench(("mlp",), ("fp32", "bf16", "fp16"), "cpu", sizes, warmup=0, repeats=1,
                             matmul_sizes=())
    status = {r.precision: r.status for r in result.rows}
    assert status == {"fp32": "ok", "bf16": "out of memory", "fp16": "ok"}
    assert "smaller --batch" in result.row("mlp", "bf16").reason


def test_estimate_counts_parameters_and_flops_by_hand():
    sizes = bench.Sizes(width=32, depth=2, batch=8)
    est = bench.estimate("mlp", sizes)
    model, _, _ = bench.build("mlp", sizes, "cpu")
    assert est.parameters == sum(p.numel() for p in model.parameters())
    layers = [(32, 32), (32, 32), (32, 10)]
    # forward 2BNK per layer, backward 4BNK, except the first layer's input needs no gradient
    expected = sum(6 * 8 * i * o for i, o in layers) - 2 * 8 * 32 * 32
    assert est.flops == expected
    # input, two hidden activations, log-softmax of the logits (float32); labels (int64); a scalar
    assert est.saved_fp32_bytes == (8 * 32 + 2 * 8 * 32 + 8 * 10) * 4 + 8 * 8 + 4


def test_matmul_flops_and_rate():
    assert matmul_flops(3) == 54 and matmul_flops(2, 3, 4) == 48
    rate = matmul_gflops(32, "bf16", "cpu", warmup=0, repeats=1)
    assert rate > 0 and rate == rate  # finite and positive: the speed itself is not tested


def test_tf32_error_sits_between_fp32_and_bf16_and_high_changes_nothing_on_cpu():
    err = tf32_error(64, "cpu")
    assert err.fp32 < 1e-6 < err.tf32_emulated < err.bf16
    # 10 mantissa bits: relative rounding of each input is at most 2**-11
    assert err.tf32_emulated < 2.0**-11
    assert err.high_changes_result is False and err.tf32_measured is None
    assert "does not" not in err.table() and "False" in err.table()


def test_verdicts_read_the_measured_ratio():
    assert "holds" in bench.speed_verdict(2.4, "fp16")
    assert "slower than fp32" in bench.speed_verdict(0.6, "bf16")
    assert "no real speedup" in bench.speed_verdict(1.02, "bf16")
    assert "holds" in bench.memory_verdict(0.50, "bf16")
    assert "not half" in bench.memory_verdict(0.7, "bf16")


def test_train_side_by_side_starts_every_precision_from_the_same_weights():
    from amp_lessons.data import digits
    from amp_lessons.models import mlp

    result = bench.train_side_by_side(lambda: mlp(64, 32, 10), digits(), steps=3, device="cpu",
                                      lr=1e-3, batch_size=32)
    assert list(result.runs) == ["fp32", "bf16", "fp16"]  # tf32 does not run on a CPU
    first = {p: r.losses[0] for p, r in result.runs.items()}
    assert first["bf16"] == pytest.approx(first["fp32"], abs=0.05)
    assert first["fp16"] == pytest.approx(first["fp32"], abs=0.01)
    assert 0.45 <= result.memory_ratio("bf16") <= 0.6
    assert result.runs["fp32"].weight_copy_mb == 0 and result.runs["bf16"].weight_copy_mb > 0
    assert "fp16 +scaler" in result.quality_table() and "speed vs fp32" in result.speed_table()


def test_lesson_figures_have_titles_from_the_data():
    import matplotlib

    from amp_lessons import plots
    from amp_lessons.data import digits
    from amp_lessons.models import mlp

    result = bench.train_side_by_side(lambda: mlp(64, 16, 10), digits(), steps=2, device="cpu")
    fig = plots.side_by_side(result)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert "activations 0." in fig._suptitle.get_text()
    mm = bench.run_bench(("mlp",), ("fp32", "bf16"), "cpu", {"mlp": bench.Sizes(16, 1, 4)},
                         warmup=0, repeats=1, matmul_sizes=(16, 32))
    assert "bf16" in plots.matmul_rates(mm).axes[0].get_title()
    fig = plots.lost_updates([1e-1, 1e-2, 1e-3], {"fp32 master": [0, 0, 0.01], "model.half()": [0.1, 0.5, 0.9]})
    assert "model.half() loses 50%" in fig.axes[0].get_title()
    assert all(ax.get_ylabel() for f in (fig,) for ax in f.axes)


def test_speed_reasons_read_the_matmul_block_and_the_model_rate():
    result = bench.BenchResult(device="cpu", device_line="", sizes={})
    result.rows = [bench.Row("mlp", "fp32", "ok", ms=10.0, tflops=0.01)]
    result.matmul = [bench.MatmulRow(512, "fp32", 200.0), bench.MatmulRow(512, "bf16", 100.0)]
    reasons = bench.speed_reasons(result, "bf16")
    assert any("no tensor cores" in r for r in reasons)
    assert any("100 GFLOP/s in bf16 and 200 in fp32 (0.50x)" in r for r in reasons)
    assert any("5% of fp32's matmul rate" in r and "compute-bound" in r for r in reasons)


def test_building_a_model_leaves_the_callers_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, _, _ = bench.build("mlp", bench.Sizes(8, 1, 2), "cpu", seed=0)
    assert torch.equal(torch.rand(3), expected)
    b, _, _ = bench.build("mlp", bench.Sizes(8, 1, 2), "cpu", seed=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_memory_estimate_counts_every_model_copy_but_one_step():
    est = bench.Estimate(parameters=1000, saved_fp32_bytes=500, flops=0)
    assert est.total_bytes(3) == 3 * 16 * 1000 + 2 * 500


def test_a_model_that_cannot_be_allocated_is_a_clear_error(monkeypatch, capsys):
    real = bench.build

    def build(kind, sizes, device, seed=0):
        if torch.device(device).type != "meta":
            raise MemoryError()
        return real(kind, sizes, device, seed)

    monkeypatch.setattr(bench, "build", build)
    code, out, err = run_cli(capsys, *TINY, "--model", "mlp")
    assert code == 2 and out == ""
    assert "does not fit on cpu: use smaller --batch or --width" in err


def test_a_noisy_run_is_flagged_in_the_table():
    result = bench.BenchResult(device="cpu", device_line="", sizes={})
    result.rows = [bench.Row("mlp", "fp32", "ok", ms=10.0, spread=0.1, speedup=1.0, activation_mb=1.0,
                             activation_ratio=1.0, weight_copy_mb=0.0, tflops=0.1)]
    assert result.noise_note() is None and "note:" not in result.table()
    result.rows[0].spread = 0.6
    assert "varied by 60% of their median" in result.table()
