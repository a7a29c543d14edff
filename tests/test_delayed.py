"""Lesson 09's delayed scaling, against Transformer Engine's documented recipe, step by step."""

import pytest
import torch

from amp_lessons.delayed import DelayedScaling, cast_step, run_current, run_delayed, spike_sequence


def test_the_first_step_casts_with_scale_one_then_from_the_history():
    d = DelayedScaling(history_len=3)
    assert d.scale == 1.0
    d.update(2.0)
    assert d.scale == 448 / 2
    d.update(8.0)
    d.update(1.0)
    assert d.scale == 448 / 8  # the largest of the last 3
    d.update(1.0)
    d.update(1.0)
    assert d.scale == 448 / 1  # 8 has left the history


def test_margin_and_most_recent():
    d = DelayedScaling(history_len=4, margin=2, algo="most_recent")
    for a in (8.0, 1.0):
        d.update(a)
    assert d.scale == 448 / 1 / 4


def test_a_zero_or_infinite_amax_keeps_the_scale():
    d = DelayedScaling(history_len=1)
    d.update(4.0)
    d.update(0.0)
    assert d.scale == 448 / 4
    d.update(float("inf"))
    assert d.scale == 448 / 4


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(history_len=0), "history_len must be"), (dict(margin=-1), "margin must be"),
    (dict(margin=1.5), "margin must be"), (dict(algo="mean"), "algo must be one of max, most_recent"),
    (dict(name="fp16"), "an fp8 format is needed"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedScaling(**kwargs)


def test_a_spike_saturates_on_its_step_and_shrinks_the_next_scales():
    seq = [torch.ones(8), torch.ones(8), torch.full((8,), 100.0), torch.ones(8), torch.ones(8)]
    steps = run_delayed(seq, history_len=2)
    assert [s.scale for s in steps] == [1.0, 448.0, 448.0, 4.48, 4.48]
    assert [s.saturated for s in steps] == [0, 0, 8, 0, 0]
    assert run_delayed(seq, history_len=2)[-1].scaled_amax == pytest.approx(4.48)
    assert [s.saturated for s in run_current(seq)] == [0] * 5


def test_cast_step_counts_flushed_values_exactly():
    x = torch.tensor([1.0, 2.0**-12, 0.0])
    s = cast_step(x, 1.0, 0)  # 2^-12 is below half of e4m3's smallest subnormal 2^-9
    assert (s.flushed, s.saturated) == (1, 0)


def test_spike_sequence_is_exact_and_spikes_once():
    seq = spike_sequence(steps=6, spike_at=3, factor=16, n=64)
    assert torch.equal(seq[0], spike_sequence(steps=6, spike_at=3, factor=16, n=64)[0])
    amaxes = [t.abs().max().item() for t in seq]
    assert amaxes[3] == 32.0 and max(amaxes[:3] + amaxes[4:]) < 2
    assert all(torch.equal(t, t.bfloat16().float()) for t in seq)  # 4 significant bits: exact in bf16
