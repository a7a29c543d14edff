"""The history of a run: its columns, rows and text table, the skips it counts, and its
round trip through plain dicts (what a checkpoint holds).

References: a run with one injected overflow (step 2), records built by hand, values
formatted by hand.
"""

import math

import pytest
import torch

from amp_lessons.data import digits
from amp_lessons.history import History, StepRecord, _fmt
from amp_lessons.models import mlp
from amp_lessons.training import Trainer


def trainer(**kwargs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mlp(64, 32, 10, depth=2)
    return Trainer(model, digits(), precision="fp16", device="cpu", optimizer="adam", lr=1e-3, batch_size=32,
                   init_scale=2.0**10, progress=False, **kwargs)


def record(step, skipped=False):
    return StepRecord(step=step, loss=1.0, scale=2.0, skipped=skipped, grad_norm=0.5, clip_seen_norm=math.nan,
                      applied_norm=0.5, zero_frac=0.0, lr=1e-3, ms=1.0)


def test_history_columns_rows_and_table():
    h = trainer(inject_nonfinite=(2,)).fit(12)
    assert History.columns == tuple(f for f in StepRecord.__dataclass_fields__)
    assert History.columns == ("step", "loss", "scale", "skipped", "grad_norm", "clip_seen_norm",
                               "applied_norm", "zero_frac", "lr", "ms")
    assert len(h) == 12 and h["step"] == list(range(12)) and isinstance(h[3], StepRecord)
    assert h[-1] is h.records[-1] and h.skipped == 1 and repr(h) == "History(12 steps, 1 skipped)"
    assert all(math.isnan(v) for v in h["clip_seen_norm"])  # no clipping asked for
    lines = h.table(every=5).splitlines()
    assert lines[0].split() == ["step", "loss", "scale", "skipped", "grad_norm", "zero_frac"]
    assert [line.split()[0] for line in lines[1:]] == ["0", "5", "10", "11"]
    assert h.table(columns=("step", "skipped")).splitlines()[3].split() == ["2", "yes"]
    assert "inf" in h.table(columns=("loss",)).splitlines()[3]
    with pytest.raises(KeyError, match="history has columns"):
        h["nope"]
    with pytest.raises(KeyError, match="history has columns"):
        h.table(columns=("step", "nope"))
    with pytest.raises(ValueError, match="every must be a positive integer"):
        h.table(every=0)


def test_trailing_skips_counts_the_last_skipped_steps_in_a_row():
    h = History([record(0, True), record(1), record(2, True), record(3, True)])
    assert h.trailing_skips() == 2 and h.skipped == 3
    assert History([record(0)]).trailing_skips() == 0 and History().trailing_skips() == 0


def test_dicts_round_trip():
    h = History([record(0), record(1, True)])
    again = History.from_dicts(h.as_dicts())
    assert again.records == h.records or all(
        repr(a) == repr(b) for a, b in zip(again.records, h.records))  # NaN != NaN, its repr is equal


@pytest.mark.parametrize(("value", "measured", "text"), [
    (65536.0, False, "65536"), (True, False, "yes"), (3, False, "3"), (math.inf, True, "inf"),
    (1.5e-5, False, "1.5e-05"), (0.25, True, "≈0.2500"), (2.5e10, False, "2.5e+10"), (2.5e6, False, "2500000"), (0.0, False, "0"),
])
def test_numbers_are_formatted_for_reading(value, measured, text):
    assert _fmt(value, measured) == text
