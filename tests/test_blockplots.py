"""Lesson 09's figures: each returns a Figure with labelled axes and a computed title."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from amp_lessons import blockplots  # noqa: E402
from amp_lessons.blockscale import error_table, exact_values  # noqa: E402
from amp_lessons.delayed import run_current, run_delayed, spike_sequence  # noqa: E402


def test_scheme_bars():
    table = error_table({"a": [exact_values((4, 64))], "b": [torch.randn(4, 64)]})
    fig = blockplots.scheme_bars(table)
    ax = fig.axes[0]
    assert "dB" in ax.get_ylabel() and len(ax.patches) == 2 * 7
    assert "e4m3 elements keep" in fig._suptitle.get_text()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "MXFP8 (OCP floor rule)" in labels and "NVFP4" in labels  # e8m0 scales name their rule


def test_delayed_scaling_plot_marks_saturation():
    seq = spike_sequence(steps=8, spike_at=4, n=64)
    fig = blockplots.delayed_scaling({"current": run_current(seq), "delayed": run_delayed(seq, 4)}, spike_at=4)
    left, right = fig.axes
    assert left.get_xlabel() == "step" and "flushed" in right.get_ylabel()
    assert len(left.collections) == 2  # one scatter of saturated steps per run
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["current", "delayed"]


def test_block_training_titles_the_largest_gap():
    h = {"step": list(range(30)), "loss": [1.0] * 30}
    g = {"step": h["step"], "loss": [1.5] * 30}
    fig = blockplots.block_training({"bf16": h, "mxfp8": g})
    title = fig._suptitle.get_text()
    assert "every run ends within 50% of bf16's loss" in title
    left, right = fig.axes
    assert len(left.lines) == 2 and "bf16" in right.get_ylabel()
    assert list(right.lines[0].get_ydata()) == [0.5] * 30  # the gap to the baseline, smoothed


def test_running_mean_averages_what_is_there_at_the_start():
    assert blockplots._running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
