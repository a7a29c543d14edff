"""The step breakdown: the op -> category mapping, its structure on real profiles, Amdahl's
bound, and the closing table. Structure only: no test reads a speed."""

import copy
from types import SimpleNamespace

import pytest
import torch

from amp_lessons import breakdown as bd
from amp_lessons.data import random_task
from amp_lessons.models import mlp


def ev(name, self_us=0.0, *children):
    return SimpleNamespace(name=name, self_cpu_time_total=self_us, cpu_children=list(children))


def test_each_op_lands_in_its_documented_category():
    step = ev("amp_lessons::step#fp16", 100,
              ev("amp_lessons::data", 5, ev("aten::index", 45)),
              ev("amp_lessons::forward", 10,
                 ev("aten::linear", 1,
                    ev("aten::to", 1, ev("aten::_to_copy", 2, ev("aten::copy_", 20))),  # weight cast
                    ev("aten::addmm", 300, ev("aten::copy_", 7))),                      # bias copy: matmul
                 ev("aten::relu", 30)),
              ev("amp_lessons::loss", 0, ev("aten::log_softmax", 40)),
              ev("amp_lessons::scaler", 3, ev("aten::mul", 4)),                          # scaler.scale
              ev("autograd::engine::evaluate_function: AddmmBackward0", 6,
                 ev("AddmmBackward0", 2, ev("aten::mm", 500), ev("aten::sum", 9))),
              ev("autograd::engine::evaluate_function: ToCopyBackward0", 1, ev("aten::to", 1, ev("aten::_to_copy", 30))),
              ev("aten::count_nonzero", 60),                                             # grad statistics
              ev("amp_lessons::scaler", 2, ev("Optimizer.step#AdamW.step", 5, ev("aten::add_", 70))),
              ev("Optimizer.zero_grad#AdamW.zero_grad", 8))
    ms = {k: round(v * 1e3, 6) for k, v in bd.split_events([step]).items()}
    assert list(ms) == list(bd.CATEGORIES)
    assert ms == {"forward matmuls": 307, "forward rest": 10 + 1 + 30 + 40, "backward matmuls": 500,
                  "backward rest": 6 + 2 + 9 + 1, "autocast casts": 1 + 2 + 20 + 1 + 30,
                  "optimizer": 3 + 4 + 2 + 5 + 70 + 8, "bookkeeping": 100 + 60, "data": 50}
    assert sum(ms.values()) == 1262  # every microsecond counted once


def test_an_unknown_phase_is_an_error():
    with pytest.raises(ValueError, match="phase must be forward, backward, optimizer, data or bookkeeping"):
        bd.category("loss", False, False)


def _trainer(precision, grad_stats=True, width=64):
    data = random_task(n=256, d_in=width)
    return bd.make_trainer(mlp(width, width, 10, depth=2), data, precision, "cpu",
                           bd.Change("t", grad_stats=grad_stats), batch_size=32)


def test_a_profiled_step_is_split_into_categories_that_add_up_to_it():
    trainers = {p: _trainer(p) for p in ("fp32", "bf16", "fp16")}
    result = bd.profile_trainers(trainers, steps=5, warmup=1, model="mlp")
    assert list(result) == ["fp32", "bf16", "fp16"]
    for p, b in result.items():
        assert (b.model, b.precision, b.steps) == ("mlp", p, 5)
        assert list(b.ms) == list(bd.CATEGORIES)
        assert len(b.samples) == 5
        # the categories cover the step: the median step's sum of categories over its wall
        # time (the median: one step interrupted between the clock and the profiler's range
        # on a busy machine does not count)
        assert b.coverage == pytest.approx(1.0, abs=0.10)
        for name in ("forward matmuls", "backward matmuls", "forward rest", "optimizer",
                     "bookkeeping", "data"):
            assert b.ms[name] > 0, (p, name)
        assert 0 < b.matmul_share < 1
        assert trainers[p].step_count == 6  # one warm-up and five profiled steps
    assert result["bf16"].ms["autocast casts"] > 0 and result["fp16"].ms["autocast casts"] > 0
    assert result["fp32"].share("autocast casts") < 0.05  # fp32 has no casts, only no-op to() calls


def test_profiling_puts_the_trainer_back_as_it_was():
    t = _trainer("fp16")
    loss_fn, data, scaler_step = t.loss_fn, t.data, t.scaler.step
    bd.profile_trainer(t, steps=1, warmup=0)
    assert t.loss_fn is loss_fn and t.data is data
    assert t.scaler.step == scaler_step and "step" not in vars(t.scaler)
    assert not t.model._forward_hooks and not t.model._forward_pre_hooks
    t.step()  # still trains


def test_amdahl_bound_by_hand():
    # issue 13's figures: matmuls 34% of the fp32 step, 3.1x faster in 16 bits -> about 1.3x
    assert bd.amdahl_bound(0.34, 3.1) == pytest.approx(1 / (0.66 + 0.34 / 3.1))
    assert bd.amdahl_bound(0.34, 3.1) == pytest.approx(1.30, abs=0.01)
    assert bd.amdahl_bound(1.0, 2.0) == 2.0 and bd.amdahl_bound(0.0, 5.0) == 1.0
    with pytest.raises(ValueError):
        bd.amdahl_bound(1.5, 2.0)


def test_amdahl_against_fp32_reads_both_breakdowns():
    cats = dict.fromkeys(bd.CATEGORIES, 0.0)
    fp32 = bd.Breakdown("mlp", "fp32", {**cats, "forward matmuls": 20.0, "backward matmuls": 40.0,
                                        "optimizer": 40.0}, wall_ms=100.0, steps=3, step_ms=100.0,
                        peak_gflops=100.0, peak_n=512, flops=3 * 10**9)
    bf16 = bd.Breakdown("mlp", "bf16", {**cats, "forward matmuls": 10.0, "backward matmuls": 20.0,
                                        "optimizer": 50.0}, wall_ms=80.0, steps=3, step_ms=80.0,
                        peak_gflops=300.0, peak_n=1024, flops=3 * 10**9)
    a = bd.amdahl(fp32, bf16)
    assert (a.share, a.matmul_ratio) == (0.6, 3.0)
    assert a.bound == pytest.approx(1 / (0.4 + 0.2))
    assert a.measured == a.profiled == pytest.approx(100 / 80)
    assert a.step_matmul_ratio == 2.0 and a.step_bound == pytest.approx(1 / (0.4 + 0.3))
    assert a.free_rest == pytest.approx(100 / 30)  # fp32's step over bf16's matmuls alone
    assert a.line() == ("bf16 vs fp32: matmuls are 60% of the fp32 step. Amdahl's law: at bf16's peak "
                        "matmul ratio 3.00x (best sizes) it estimates the step, if nothing else changed, at 1.67x; at the 2.00x "
                        "its matmuls ran in these steps, 1.43x. Measured (the closing table's first rows): "
                        "1.25x. If everything but the matmuls were free: 3.33x.")
    assert fp32.step_gflops == pytest.approx(30.0) and fp32.peak_fraction == pytest.approx(0.3)
    assert fp32.matmul_gflops == pytest.approx(50.0)


def test_closing_runs_time_each_change_side_by_side(monkeypatch):
    monkeypatch.setattr(bd, "cpp_compiler", lambda: None)
    data = random_task(n=128, d_in=32)
    base = mlp(32, 32, 10, depth=1)
    ticks = []

    def make(p, change):
        return bd.make_trainer(copy.deepcopy(base), data, p, "cpu", change, batch_size=16)

    closing, trainers = bd.closing_runs(make, ["fp32", "bf16"], "cpu", (*bd.CHANGES, bd.COMPILE),
                                        warmup=1, repeats=3, on_step=lambda: ticks.append(1))
    assert len(closing.rows) == 2 * 5 and closing.rounds == 3
    compiled = closing.row("bf16", bd.COMPILE.label)
    assert compiled.status == "skipped" and "needs a C++ compiler" in compiled.reason
    for p in ("fp32", "bf16"):
        first = closing.row(p, bd.CHANGES[0].label)
        assert first.gain == 1.0
        for change in bd.CHANGES:
            row = closing.row(p, change.label)
            assert row.status == "ok" and row.ms > 0
            # the ratio columns are ratios of the ms column, so the table reconciles
            assert row.gain == pytest.approx(first.ms / row.ms)
            assert row.vs_fp32 == pytest.approx(closing.row("fp32", change.label).ms / row.ms)
            assert trainers[p, change.label].step_count == 1 + 3
    assert closing.row("fp32", "grad_stats=False").vs_fp32 == 1.0
    assert trainers["fp32", "grad_stats=False"].grad_stats is False
    assert trainers["fp32", "  + AdamW(fused=True)"].optimizer.defaults["fused"] is True
    assert len(ticks) == 2 * 4 + 3  # a warm-up per trainer, then one per round
    text = closing.table()
    assert "grad_stats=False" in text and "medians of 3 interleaved rounds" in text


def test_every_change_runs_on_this_cpu_but_compile_needs_a_compiler(monkeypatch):
    for change in bd.CHANGES:
        assert bd.why_not(change, "cpu") is None
    monkeypatch.setattr(bd, "cpp_compiler", lambda: "/usr/bin/g++")
    assert bd.why_not(bd.COMPILE, "cpu") is None
    monkeypatch.setattr(bd, "cpp_compiler", lambda: None)
    assert "C++ compiler" in bd.why_not(bd.COMPILE, "cpu")


def test_a_change_that_fails_is_reported_not_raised():
    def make(p, change):
        if change.adamw == "foreach":
            raise RuntimeError("no foreach here\nsecond line")
        return bd.make_trainer(mlp(8, 8, 10, depth=1), random_task(n=64, d_in=8), p, "cpu", change,
                               batch_size=8)

    closing, _ = bd.closing_runs(make, ["fp32"], "cpu", bd.CHANGES[:3], warmup=0, repeats=1)
    row = closing.row("fp32", "  + AdamW(foreach=True)")
    assert (row.status, row.reason) == ("error", "RuntimeError: no foreach here")
    assert "error: RuntimeError: no foreach here" in closing.table()


def test_load_average_is_three_numbers_or_none():
    load = bd.load_average()
    assert load is None or (len(load) == 3 and all(v >= 0 for v in load))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: device times and the GPU idle share")
def test_a_cuda_step_has_the_same_categories_and_its_idle_time():
    data = random_task(n=256, d_in=64)
    t = bd.make_trainer(mlp(64, 64, 10, depth=2), data, "bf16", "cuda", batch_size=32)
    b = bd.profile_trainer(t, steps=3)
    assert list(b.ms) == [*bd.CATEGORIES, bd.IDLE]
    assert b.ms["forward matmuls"] > 0 and b.ms["backward matmuls"] > 0
    assert b.coverage == pytest.approx(1.0, abs=0.10)
