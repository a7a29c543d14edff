"""``python -m amp_lessons bench``, run with tiny sizes: structure and memory, never timing."""

import json

import pytest
import torch

from amp_lessons import bench, benchcli
from amp_lessons.__main__ import main
from amp_lessons.cli import build_parser
from amp_lessons.matmul import tf32_error
from amp_lessons.measure import matmul_flops, matmul_gflops, saved_memory
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
    assert bench.speed_verdict(2.4, "fp16") == ("fp16 ran 2.4x as fast as fp32 here: within the card's "
                                                "2-3x (which the card says of modern GPUs).")
    assert "within the card's 2-3x" in bench.speed_verdict(3.0, "fp16")
    assert bench.speed_verdict(3.5, "bf16") == "bf16 ran 3.5x as fast as fp32 here: above the card's 2-3x."
    assert "slower than fp32" in bench.speed_verdict(0.6, "bf16")
    assert "no real speedup" in bench.speed_verdict(1.02, "bf16")


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
    # a 16-wide MLP on 64 inputs: bf16's saved copy of x outweighs what its 16-wide layers save
    assert "bf16: activations 1." in fig._suptitle.get_text()
    gap = max(abs(a - b) for a, b in zip(result.runs["bf16"].losses, result.runs["fp32"].losses))
    assert "the curves overlap (largest gap to fp32's at one step" in fig.axes[0].get_title()
    assert f"≈{gap:.2g})" in fig.axes[0].get_title() or gap == 0
    mm = bench.run_bench(("mlp",), ("fp32", "bf16"), "cpu", {"mlp": bench.Sizes(16, 1, 4)},
                         warmup=0, repeats=1, matmul_sizes=(16, 32))
    title = plots.matmul_rates(mm).axes[0].get_title()
    assert "bf16" in title and "best matmul rate vs fp32's best" in title  # the ratio the reasons print
    rates = plots.matmul_rates(mm)
    rates.canvas.draw()
    legend, axes = rates.axes[0].get_legend().get_window_extent(), rates.axes[0].get_window_extent()
    assert legend.x0 >= axes.x1 - 1  # beside the bars, not on them
    fig = plots.lost_updates([1e-1, 1e-2, 1e-3], {"fp32 master": [0, 0, 0.01], "model.half()": [0.1, 0.5, 0.9]})
    assert "model.half() loses 50%" in fig.axes[0].get_title()
    fig = plots.lost_updates([1e-1, 1e-2, 1e-3], {"fp32 master": [0, 0, 0.01], "model.half()": [0.1, 0.5, 0.9]},
                             at_lr=1e-3)
    assert "lr=0.001: model.half() loses 90%" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="not one of the learning rates plotted"):
        plots.lost_updates([1e-1, 1e-2], {"fp32 master": [0, 0], "model.half()": [0, 0]}, at_lr=3e-3)
    assert all(ax.get_ylabel() for f in (fig,) for ax in f.axes)
    assert "nonzero updates" in fig.axes[0].get_ylabel()


def test_speed_reasons_read_the_matmul_share_and_amdahls_bound():
    result = bench.BenchResult(device="cpu", device_line="", sizes={})
    # fp32 step at 0.068 TFLOP/s against a 200 GFLOP/s peak: matmuls 34% of the step at peak
    result.rows = [bench.Row("mlp", "fp32", "ok", ms=10.0, tflops=0.068)]
    result.matmul = [bench.MatmulRow(256, "fp32", 150.0), bench.MatmulRow(512, "fp32", 200.0),
                     bench.MatmulRow(512, "bf16", 620.0), bench.MatmulRow(512, "fp16", 2.0)]
    reasons = bench.speed_reasons(result, "bf16")
    assert any("no tensor cores" in r for r in reasons)
    assert any("best bf16 matmul rate here is 620 GFLOP/s (n=512) against fp32's 200 (n=512): 3.10x" in r
               for r in reasons)
    share = next(r for r in reasons if "the bench mlp" in r)
    assert "34% of fp32's peak rate" in share
    assert "Amdahl's law estimates the step's gain, if nothing else changed, at 1.30x" in share  # 1 / (0.66 + 0.34 / 3.1)
    assert "even infinitely fast matmuls: 1.52x" in share and "a floor on their share, not the share" in share
    assert "weighs as much" not in share  # a rate gives a floor on the share, never a verdict on it
    fp16 = bench.speed_reasons(result, "fp16")
    assert not any("AMX" in r for r in fp16)  # the fp16 wording never borrows bf16's hardware
    assert any("0.01x: this device has no fast fp16 matmul kernel, so its fp16 matmuls, at the sizes measured, are a slowdown" in r for r in fp16)
    assert any("the step can only lose" in r for r in fp16)
    # lesson 05 prints each step's share once, with every precision's Amdahl figure on it
    assert not any("the bench mlp" in r for r in bench.speed_reasons(result, "bf16", with_shares=False))
    (once,) = bench.share_reasons(result, ["fp32", "bf16", "fp16"])
    assert "34% of fp32's peak rate" in once and "bf16 (3.10x) 1.30x, fp16 (0.01x)" in once
    assert "infinitely fast matmuls: 1.52x" in once
    (plain,) = bench.share_reasons(result, ["fp32", "bf16", "fp16"], amdahl=False)
    assert "34% of fp32's peak rate" in plain and "Amdahl" not in plain and "infinitely" not in plain
    # a profiled share wins over the rate estimate; a lesson's own step rate is read too
    cats = dict.fromkeys(bench.bd.CATEGORIES, 0.0)
    result.breakdowns = [bench.bd.Breakdown("mlp", "fp32", {**cats, "forward matmuls": 35.0,
                                                            "backward matmuls": 35.0, "optimizer": 30.0},
                                            wall_ms=100.0, steps=3)]
    reasons = bench.speed_reasons(result, "bf16", {"the digits MLP": 10.0})
    assert any("the bench mlp's fp32 step spends 70% of its time in matmuls (profiled)" in r
               and "matmul-bound" in r for r in reasons)
    assert any("the digits MLP's fp32 step did its matmul work at 5%" in r and "dominate" not in r
               and "only a profile measures it" in r for r in reasons)


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
    assert result.noise_note() is None and "note:" not in benchcli.table(result)
    result.rows[0].spread = 0.6
    assert "varied by 60% of their median" in benchcli.table(result)


SMALL = ["--device", "cpu", "--model", "mlp", "--width", "64", "--depth", "2", "--batch", "32",
         "--warmup", "1", "--repeats", "3", "--matmul-sizes", "64,128", "--precisions", "fp32,bf16"]


def test_breakdown_json_splits_every_precision_and_bounds_it(capsys):
    code, out, err = run_cli(capsys, *SMALL, "--breakdown", "--json")
    assert code == 0 and err == ""
    result = json.loads(out)
    bds = {b["precision"]: b for b in result["breakdowns"]}
    assert list(bds) == ["fp32", "bf16"]
    for b in bds.values():
        assert list(b["ms"]) == list(bench.bd.CATEGORIES)
        assert sum(b["shares"].values()) == pytest.approx(1.0)
        assert b["total_ms"] == pytest.approx(sum(b["ms"].values()))
        assert len(b["samples"]) == 5
        assert b["coverage"] == pytest.approx(1.0, abs=0.10)  # the categories add up to the step
        assert b["step_ms"] > 0 and b["flops"] > 0
        assert b["peak_gflops"] == max(m["gflops"] for m in result["matmul"]
                                       if m["precision"] == b["precision"])
        assert b["peak_fraction"] == pytest.approx(b["step_gflops"] / b["peak_gflops"])
    (amdahl,) = result["amdahl"]
    assert amdahl["precision"] == "bf16" and amdahl["share"] == pytest.approx(bds["fp32"]["matmul_share"])
    assert amdahl["measured"] == pytest.approx(bds["fp32"]["step_ms"] / bds["bf16"]["step_ms"])
    rows = result["closing"]["mlp"]["rows"]
    assert [(r["precision"], r["label"].strip()) for r in rows] == [
        (p, c.label.strip()) for p in ("fp32", "bf16") for c in bench.bd.CHANGES]
    assert all(r["status"] == "ok" for r in rows)


def test_breakdown_table_names_categories_peak_and_amdahl(capsys, tmp_path):
    plot = tmp_path / "breakdown.png"
    code, out, _ = run_cli(capsys, *SMALL, "--breakdown", "--plot", str(plot))
    assert code == 0
    assert "where one Trainer step's time goes: the mlp at width 64, depth 2, batch 32" in out
    for name in bench.bd.CATEGORIES:
        assert name in out
    assert "of this device's measured fp32 peak" in out and "of this device's measured bf16 peak" in out
    assert "fp32: if everything but the matmuls were free" in out
    assert "bf16 vs fp32: matmuls are" in out and "Amdahl's law" in out
    assert "what closes part of the gap" in out and "grad_stats=False" in out
    assert plot.stat().st_size > 0
    result = benchcli.result_from_args(build_parser().parse_args(["bench", *SMALL, "--breakdown"]))
    short = benchcli.table(result, breakdown=False)
    assert "where one Trainer step" not in short and benchcli.table(result).startswith(short + "\n\nwhere one")
    without = "\n".join(benchcli.breakdown_lines(result, "mlp", amdahl=False))
    assert "Amdahl" not in without and "if everything but the matmuls were free" not in without
    assert "of this device's measured bf16 peak" in without and "what closes part of the gap" in without


def test_compile_and_plot_need_the_breakdown(capsys):
    code, _, err = run_cli(capsys, *SMALL, "--compile")
    assert code == 2 and "--compile adds a row to the breakdown's closing table: add --breakdown" in err


def test_an_empty_precision_list_is_an_error(capsys):
    for arg in ("", ",", " , "):
        code, out, err = run_cli(capsys, *TINY, "--precisions", arg)
        assert code == 2 and out == ""
        assert "--precisions needs at least one of fp32, tf32, bf16, fp16" in err
    with pytest.raises(ValueError, match="at least one"):
        bench.run_bench(("mlp",), (), "cpu")


def _never_built(monkeypatch, free=8 * 2**30):
    """Sizes are refused before any model is built: a real build fails the test."""
    real = bench.build

    def build(kind, sizes, device, seed=0):
        assert torch.device(device).type == "meta", "a model was built before the sizes were checked"
        return real(kind, sizes, device, seed)

    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setattr(bench, "available_memory", lambda device: free)


@pytest.mark.parametrize("flag, value", [("--depth", 1_000_000), ("--width", 10**9), ("--batch", 10**9)])
def test_any_size_too_large_is_refused_before_building_with_one_that_fits(monkeypatch, capsys, flag, value):
    _never_built(monkeypatch)
    code, out, err = run_cli(capsys, "--device", "cpu", "--model", "mlp", flag, str(value))
    assert code == 2 and out == ""
    assert "only 8.0 GiB is free" in err or "larger than torch can describe" in err
    suggested = int(err.split(f"e.g. {flag} ")[1].split(".")[0].split(",")[0])
    assert 1 <= suggested < value
    sizes = bench.Sizes(**{**bench.asdict(bench.default_sizes("mlp", "cpu")), flag[2:]: suggested})
    copies = 3  # fp32, bf16, fp16 run here
    assert bench.estimate("mlp", sizes).total_bytes(copies) <= 0.8 * 8 * 2**30  # it would fit
    bigger = bench.Sizes(**{**bench.asdict(sizes), flag[2:]: suggested + 1})
    assert bench.estimate("mlp", bigger).total_bytes(copies) > 0.8 * 8 * 2**30  # and is the largest


def test_a_width_torch_cannot_describe_is_refused_naming_one_that_fits(monkeypatch, capsys):
    _never_built(monkeypatch)
    code, out, err = run_cli(capsys, "--device", "cpu", "--model", "transformer", "--width", str(10**9))
    assert code == 2 and out == ""
    assert "holds tensors larger than torch can describe" in err and "e.g. --width " in err
    width = int(err.split("e.g. --width ")[1].rstrip(".\n"))
    assert 4 <= width < 10**9 and width % 4 == 0  # a multiple of the heads


def test_a_long_transformer_sequence_is_refused_naming_a_shorter_one(monkeypatch, capsys):
    _never_built(monkeypatch)
    code, _, err = run_cli(capsys, "--device", "cpu", "--model", "transformer", "--seq", "1000000")
    assert code == 2 and "e.g. --seq " in err


def test_sizes_too_slow_in_every_precision_are_refused(monkeypatch, capsys):
    _never_built(monkeypatch)
    code, out, err = run_cli(capsys, *TINY, "--model", "mlp", "--max-step-seconds", "1e-12")
    assert code == 2 and out == ""
    assert "one step is" in err and "FLOPs" in err and "Use smaller sizes" in err
    assert "or raise --max-step-seconds" in err


def test_a_precision_too_slow_here_is_skipped_and_says_why(monkeypatch):
    monkeypatch.setattr(bench, "_rate", lambda result, p, dev: 1e-3 if p == "fp16" else 1e3)
    result = bench.run_bench(("mlp",), ("fp32", "fp16"), "cpu", {"mlp": bench.Sizes(256, 1, 64)},
                             warmup=0, repeats=1, matmul_sizes=())
    fp16 = result.row("mlp", "fp16")
    assert fp16.status == "too slow" and "0.001 GFLOP/s fp16 matmuls reach here" in fp16.reason
    assert fp16.ms is None and fp16.speedup is None
    fp32 = result.row("mlp", "fp32")
    assert fp32.status == "ok"
    # its memory is still measured (extrapolated from one and two examples: exact)
    model, x, y = bench.build("mlp", bench.Sizes(256, 1, 64), "cpu")
    exact = saved_memory(model, x, y, "fp16")
    assert fp16.activation_mb == exact.activation_bytes / 2**20
    assert fp16.weight_copy_mb == exact.weight_copy_bytes / 2**20
    assert fp16.activation_ratio == fp16.activation_mb / fp32.activation_mb
    assert "too slow: one step is" in benchcli.table(result)
    assert bench.speed_verdict(fp16.speedup, "fp16") == "fp16 was not timed here: the bench's table says why."
    assert bench.speed_verdict(fp16.speedup, "fp16", fp16) == f"fp16 was not timed here (too slow): {fp16.reason}"


def test_a_slow_matmul_size_is_skipped_not_run(monkeypatch):
    calls = []

    def slow(n, precision, device, **kwargs):
        calls.append(n)
        return 0.01  # GFLOP/s: n=256 would take minutes

    monkeypatch.setattr(bench, "matmul_gflops", slow)
    rows = bench._matmul_rows((32, 256, 512), "fp16", None, torch.device("cpu"))
    assert calls == [32]
    assert [r.gflops for r in rows] == [0.01, None, None]
    assert rows[1].reason.startswith("skipped: about 3.4 s per call at the 0.01 GFLOP/s")


def test_heads_that_do_not_divide_the_width_are_a_clear_error(capsys):
    code, _, err = run_cli(capsys, *TINY, "--model", "transformer", "--width", "30", "--heads", "4")
    assert code == 2
    assert "the transformer's --width (30) must be a multiple of --heads (4); e.g. --width 28" in err


def test_size_classes_pick_the_documented_tables(capsys):
    assert bench.default_sizes("mlp", "cpu", "small") == bench.SIZES["cpu"]["small"]["mlp"]
    assert bench.default_sizes("mlp", "cpu") == bench.SIZES["cpu"]["large"]["mlp"]  # matmul-bound
    assert bench.default_sizes("transformer", "cpu") == bench.SIZES["cpu"]["small"]["transformer"]
    assert bench.default_sizes("transformer", "cpu", "large") == bench.SIZES["cpu"]["large"]["transformer"]
    with pytest.raises(ValueError, match="size must be one of default, small, large"):
        bench.default_sizes("mlp", "cpu", "huge")
    with pytest.raises(SystemExit):
        main(["bench", "--size", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err


@pytest.mark.parametrize("kind, sizes", [("mlp", bench.Sizes(48, 4, 8)),
                                         ("transformer", bench.Sizes(32, 3, 2, seq=6, heads=4))])
def test_the_estimate_extrapolated_in_depth_equals_the_full_model(kind, sizes):
    assert bench.estimate(kind, sizes) == bench._estimate_meta(kind, sizes)


def test_the_breakdown_plot_states_the_fp32_matmul_share():
    cats = dict.fromkeys(bench.bd.CATEGORIES, 0.0)
    result = bench.BenchResult(device="cpu", device_line="", sizes={})
    result.breakdowns = [
        bench.bd.Breakdown("mlp", "fp32", {**cats, "forward matmuls": 30.0, "optimizer": 70.0}, 100.0, 3,
                           step_ms=100.0, peak_gflops=100.0),
        bench.bd.Breakdown("mlp", "bf16", {**cats, "forward matmuls": 10.0, "optimizer": 70.0}, 80.0, 3,
                           step_ms=50.0, peak_gflops=300.0)]
    from amp_lessons import plots

    fig = plots.step_breakdown(result, "mlp")  # profiled bars 100 and 80 ms; timed 100 and 50 ms
    # the title states only what the bars show: a speedup timed elsewhere would not match them
    assert fig.axes[0].get_title() == "mlp: matmuls are 30% of the fp32 step"
    assert fig.axes[0].get_xlabel().startswith("ms per Trainer step")
    with pytest.raises(ValueError, match="breakdown=True"):
        plots.step_breakdown(result, "transformer")


@pytest.mark.parametrize("cc, words", [
    ((7, 5), "compute capability 7.5 does not say whether this GPU has tensor cores"),
    ((7, 0), "compute capability 7.0 does not say whether this GPU has tensor cores"),
    ((8, 0), "this GPU (compute capability 8.0) has tensor cores for fp16"),
    ((6, 0), "this GPU (compute capability 6.0) has no tensor cores")], ids=["T4-or-GTX1660", "V100", "A100", "P100"])
def test_gpu_speed_reasons_claim_tensor_cores_only_from_8_0(cc, words):
    from amp_lessons.hardware import Machine

    machine = Machine(device=torch.device("cuda"), name="Simulated GPU", cuda_capability=cc,
                      bf16_native=cc >= (8, 0), bf16_emulated=cc < (8, 0), fp16=True,
                      tf32_hardware=cc >= (8, 0), cpu_name="Simulated CPU", cpu_isa="AVX2",
                      avx512_bf16=False, amx_bf16=False)
    assert bench._hardware_reason(machine, "fp16").startswith(words)
