"""The benchmarks run and compare like with like (their timings are reported, never asserted)."""

import functools
import importlib.util
from pathlib import Path

import torch

from amp_lessons.data import random_task
from amp_lessons.models import mlp
from amp_lessons.training import Trainer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


loop_overhead = load("loop_overhead")


def test_the_hand_loop_trains_the_trainers_model_with_its_optimizer():
    data = random_task(n=256, d_in=16, classes=10)
    trainer = Trainer(mlp(16, 16, 10), data, precision="bf16", device="cpu", optimizer="adamw",
                      lr=1e-2, batch_size=8, progress=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    hand = loop_overhead.hand_loop(trainer.model, trainer.optimizer, trainer.scaler, data, "bf16",
                                   torch.device("cpu"), 8)
    hand(0, 3)
    assert all(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    state = trainer.optimizer.state[next(trainer.model.parameters())]
    assert int(state["step"]) == 3
    assert all(p.grad is None for p in trainer.model.parameters())  # zero_grad(set_to_none=True)


def test_the_two_trainers_share_the_model_optimizer_and_scaler():
    data = random_task(n=256, d_in=16, classes=10)
    on, off = loop_overhead.trainers(mlp(16, 16, 10), data, "fp16", torch.device("cpu"), 8, 1e-3)
    assert off.model is on.model and off.optimizer is on.optimizer and off.scaler is on.scaler
    assert (on.grad_stats, off.grad_stats) == (True, False)
    on.fit(1)
    off.fit(1)
    assert int(on.optimizer.state[next(on.model.parameters())]["step"]) == 2
    assert on.history["zero_frac"][0] >= 0 and off.history["zero_frac"][0] != off.history["zero_frac"][0]


def test_compare_interleaves_three_loops_and_reports_medians():
    row = loop_overhead.compare("fp32", torch.device("cpu"), depth=1, width=16, batch_size=8,
                                seconds=0.05, block_s=0.005, min_pairs=3)
    assert row["rounds"] >= 3 and row["steps"] >= 1 and row["batch"] == 8
    assert row["hand_ms"] > 0 and row["off_ms"] > 0 and row["on_ms"] > 0
    for key in ("off", "on"):
        low, high = row[f"{key}_quartiles"]
        assert low <= row[f"{key}_ratio"] <= high
    assert row["skipped"] == 0 and "stats_ms" in row and row["stats_alone_ms"] > 0


def test_the_table_has_a_row_per_batch_and_precision(capsys, monkeypatch):
    quick = functools.partial(loop_overhead.compare, block_s=0.005, min_pairs=3)
    monkeypatch.setattr(loop_overhead, "compare", quick)
    assert loop_overhead.main(["--width", "16", "--depth", "1", "--batch", "8", "16", "--seconds", "0.05",
                               "--precisions", "fp32", "tf32"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert [(r[0], r[1]) for r in rows] == [("8", "fp32"), ("8", "tf32"), ("16", "fp32"), ("16", "tf32")]
    assert "skipped: TF32" in out  # no TF32 on a CPU: said, not timed
    assert "stats off" in out and "stats on" in out and "stats +ms" in out
    assert "worst ratio with statistics off" in out
