"""Lesson 03's configuration and readers (amp_lessons.scaling), its plots and its exercise.

References: torch's own cross-entropy, hand-built gradient sets, an fp32 run of the same
steps, the optimizer's step counter.
"""

import math

import matplotlib.figure
import pytest
import torch
from torch.nn import functional as F

from amp_lessons.exercises import amp_step_as_given, check_amp_step
from amp_lessons.plots import loss_curves, scale_plot
from amp_lessons.scaling import (
    LOSS_WEIGHT,
    SCHEDULER_WARNING,
    describe_scale_changes,
    first_step_gradients,
    flush_report,
    lesson_data,
    lesson_model,
    lesson_trainer,
    optimizer_steps,
    scale_changes,
    scale_run,
    scheduler_warnings,
    small_loss,
    summed_loss,
)
from amp_lessons.training import History, StepRecord


def test_the_lessons_losses_against_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(64, 10, generator=g), torch.randint(0, 10, (64,), generator=g)
    assert small_loss(logits, y) == F.cross_entropy(logits, y) * 2.0**-15
    assert summed_loss(logits, y) == pytest.approx(64 * F.cross_entropy(logits, y).item(), rel=1e-6)
    assert LOSS_WEIGHT == 2.0**-15


def test_lesson_model_is_the_same_every_call_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = lesson_model(), lesson_model()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert [m.out_features for m in a if isinstance(m, torch.nn.Linear)] == [64, 64, 64, 10]


def test_flush_report_counts_values_lost_against_the_reference():
    ref = torch.tensor([0.0, 1e-9, -2e-9, 3.0, 0.0, 5.0])
    other = torch.tensor([0.0, 0.0, -0.0, 3.0, 1.0, 5.0])
    r = flush_report(ref, other, "fp16")
    assert (r.total, r.zero_reference, r.zero_other, r.flushed) == (6, 2, 3, 2)
    assert r.flushed_fraction == pytest.approx(2 / 4)
    assert str(r) == (
        "6 gradient values; exactly zero: fp32 ≈33.3%, fp16 ≈50.0%; fp16 made ≈2 of fp32's ≈4 "
        "nonzero values exactly zero (≈50.0%)"
    )
    with pytest.raises(ValueError, match="differ in shape"):
        flush_report(ref, other[:3])


def test_flush_report_against_a_direct_fp16_cast_of_the_fp32_gradients():
    """What fp16 flushes in the backward pass is at least what a cast of fp32's values would."""
    fp32 = first_step_gradients("fp32", device="cpu")
    cast = fp32.to(torch.float16).float()
    by_cast = flush_report(fp32, cast)
    by_backward = flush_report(fp32, first_step_gradients("fp16", scaler=False, device="cpu"))
    assert by_cast.flushed_fraction > 0.5
    assert by_backward.flushed_fraction >= by_cast.flushed_fraction - 0.05


def test_fp16_without_a_scaler_lags_and_with_one_follows_fp32():
    runs = {}
    for name, precision, scaler in (
        ("fp32", "fp32", None),
        ("fp16", "fp16", False),
        ("scaled", "fp16", True),
    ):
        runs[name] = lesson_trainer(precision, scaler, "cpu", progress=False).fit(60)
    end = {k: sum(h["loss"][-10:]) / 10 / LOSS_WEIGHT for k, h in runs.items()}
    assert end["fp16"] > 1.5 * end["fp32"]
    assert end["scaled"] == pytest.approx(end["fp32"], rel=0.05)
    assert runs["scaled"].skipped == 0


def test_optimizer_steps_reads_adams_counter_and_refuses_sgd():
    t = lesson_trainer("fp16", device="cpu", inject_nonfinite=(1,), progress=False)
    assert optimizer_steps(t.optimizer) == 0
    t.fit(4)
    assert optimizer_steps(t.optimizer) == 3 == int(t.optimizer.state[t.model[0].weight]["step"])
    sgd = torch.optim.SGD(lesson_model().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="SGD keeps no step count"):
        optimizer_steps(sgd)


def history_of(scales, skipped=()):
    return History(
        StepRecord(
            i,
            math.inf if i in skipped else 1.0,
            s,
            i in skipped,
            1.0,
            math.nan,
            1.0,
            0.0,
            1e-3,
            1.0,
        )
        for i, s in enumerate(scales)
    )


def test_scale_changes_reads_growth_and_halving_between_steps():
    h = history_of([8.0, 8.0, 16.0, 16.0, 8.0, 8.0], skipped=(3,))
    assert scale_changes(h, final_scale=16.0) == [
        (1, "grew", 8.0, 16.0),
        (3, "halved", 16.0, 8.0),
        (5, "grew", 8.0, 16.0),
    ]
    assert scale_changes(h) == scale_changes(h, 8.0)[:2]
    assert describe_scale_changes(h, 16.0).splitlines()[-1] == "1 of 6 steps skipped"


def test_the_first_steps_of_the_summed_loss_overflow_at_65536():
    g = first_step_gradients("fp32", device="cpu", loss_fn=summed_loss)
    assert g.abs().max().item() * 2.0**16 > torch.finfo(torch.float16).max
    h = lesson_trainer("fp16", device="cpu", loss_fn=summed_loss, progress=False).fit(3)
    assert h[0].skipped and h["scale"][:2] == [65536.0, 32768.0]


def test_loss_curves_title_names_the_lagging_run_and_leaves_gaps_for_skips():
    runs = {"fast": history_of([1.0] * 20), "slow": history_of([1.0] * 20, skipped=(5,))}
    for r in runs["fast"]:
        r.loss = 0.5 * LOSS_WEIGHT
    for r in runs["slow"]:
        r.loss = math.inf if r.skipped else 2.0 * LOSS_WEIGHT
    fig = loss_curves(runs, LOSS_WEIGHT)
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    assert ax.get_title() == "after 20 steps, slow lags; mean loss of the last 10 steps: slow 2.00, fast 0.50"
    assert "2^-15" in ax.get_ylabel() and ax.get_xlabel() == "optimizer step"
    assert math.isnan(ax.lines[1].get_ydata()[5])


def test_loss_curves_title_says_other_for_two_close_runs_and_rest_for_more():
    runs = {name: history_of([1.0] * 12) for name in ("a", "b", "c")}
    for i, name in enumerate(runs):
        for r in runs[name]:
            r.loss = (1.0 + 0.01 * i) * LOSS_WEIGHT
    two = loss_curves({k: runs[k] for k in ("a", "b")}, LOSS_WEIGHT, tail=3).axes[0].get_title()
    assert two == "after 12 steps, b ends close to the other; mean loss of the last 3 steps: b 1.01, a 1.00"
    assert "c ends close to the rest" in loss_curves(runs, LOSS_WEIGHT).axes[0].get_title()
    runs["b"][-1].loss = 1.5 * LOSS_WEIGHT  # the last step alone, as lesson 07 reads it
    last = loss_curves({k: runs[k] for k in ("a", "b")}, LOSS_WEIGHT, tail=1).axes[0].get_title()
    assert last == "after 12 steps, b lags; loss at the last step: b 1.50, a 1.00"
    given = loss_curves({k: runs[k] for k in ("a", "b")}, LOSS_WEIGHT, tail=1, title="a or b").axes[0]
    assert given.get_title() == "a or b" and [line.get_label() for line in given.lines] == ["a", "b"]


def test_scale_plot_marks_each_skipped_step():
    h = history_of([4.0, 4.0, 8.0, 8.0, 4.0], skipped=(3,))
    fig = scale_plot(h, final_scale=4.0, growth_interval=2, injected=(3,))
    ax = fig.axes[0]
    assert ax.get_title() == (
        "1 of 5 steps skipped, each halving the scale; it grew 1 times "
        "(every 2 clean steps); now 2^2"
    )
    marks = [line for line in ax.lines if line.get_marker() == "x"]
    assert (
        len(marks) == 1
        and list(marks[0].get_xdata()) == [3]
        and list(marks[0].get_ydata()) == [8.0]
    )
    assert ax.get_yscale() == "log" and "loss scale" in ax.get_ylabel()


def test_the_exercise_as_given_fails_on_both_wrong_lines():
    v = check_amp_step(amp_step_as_given, "cpu")
    assert not v.passed
    text = str(v)
    assert "returns True on steps [], but the skipped steps were [0, 3, 5]" in text
    assert "the scheduler stepped 7 times for 4 applied optimizer steps and warned" in text


def fixed_step(model, opt, scaler, scheduler, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale
    if not skipped:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return skipped


def test_a_fixed_step_passes():
    v = check_amp_step(fixed_step, "cpu")
    assert v.passed, v
    assert "it applied the other 4" in str(v) and "skipped steps [0, 3, 5]" in str(v)


def test_a_step_without_the_scaler_fails_and_a_crash_is_reported():
    def unscaled(model, opt, scaler, scheduler, x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        return False

    v = check_amp_step(unscaled, "cpu")
    assert not v.passed and "the weights now hold inf/NaN" in str(v)

    def broken(model, opt, scaler, scheduler, x, y):
        raise RuntimeError("oops")

    v = check_amp_step(broken, "cpu")
    assert not v.passed and v.findings == ["step 0 raised RuntimeError: oops"]


def test_lesson_data_is_loaded_once():
    assert lesson_data() is lesson_data()


def test_scale_run_injects_at_the_step_asked_and_refuses_one_past_the_run():
    history, final = scale_run(init_scale=2.0**8, growth_interval=2, inject_at=2, steps=4)
    assert [r.skipped for r in history] == [False, False, True, False]
    assert history["scale"] == [256.0, 256.0, 512.0, 256.0] and final == 256.0
    assert scale_run(init_scale=2.0**8, inject_at=-1, steps=2)[0].skipped == 0
    with pytest.raises(ValueError, match=r"inject_at must be a whole number from -1 to 3 \(-1 or None: no inf"):
        scale_run(inject_at=4, steps=4)


def test_describe_scale_changes_lists_each_change_then_the_skips():
    h = history_of([8.0, 8.0, 16.0, 16.0, 8.0], skipped=(3,))
    assert describe_scale_changes(h, 8.0) == ("step   1: grew           8 -> 16\n"
                                              "step   3: halved        16 -> 8\n"
                                              "1 of 5 steps skipped")


def test_flush_report_counts_and_its_text():
    ref = torch.tensor([0.0, 1e-8, 2e-8, 1.0])
    other = torch.tensor([0.0, 0.0, 2e-8, 0.0])
    r = flush_report(ref, other, "fp16")
    assert (r.total, r.zero_reference, r.zero_other, r.flushed) == (4, 1, 3, 2)
    assert r.flushed_fraction == 2 / 3
    assert str(r) == ("4 gradient values; exactly zero: fp32 ≈25.0%, fp16 ≈75.0%; fp16 made "
                      "≈2 of fp32's ≈3 nonzero values exactly zero (≈66.7%)")
    assert flush_report(torch.zeros(2), torch.zeros(2)).flushed_fraction == 0.0


BAD_SCALING = [
    (lambda: flush_report(torch.ones(3), torch.ones(4)), "differ in shape"),
    (lambda: flush_report(torch.ones(2, 3), torch.ones(3, 2)), "differ in shape"),
    (lambda: flush_report([1.0], [0.0]), "reference must be a non-empty floating-point tensor"),
    (lambda: flush_report(torch.ones(2), torch.arange(2)), r"other must be a non-empty floating-point tensor .*; got torch.int64 of shape \(2,\)$"),
    (lambda: flush_report(torch.ones(2), [0.0]), "other must be .*; got list$"),
    (lambda: flush_report(torch.tensor([]), torch.tensor([])), "non-empty"),
    (lambda: flush_report(torch.ones(2), torch.ones(2), name=3), "name is the other precision's label"),
    (lambda: optimizer_steps(None), "optimizer must be a torch optimizer"),
    (lambda: optimizer_steps(torch.nn.Linear(2, 2)), r"^optimizer must be a torch optimizer \(e.g. trainer.optimizer\); got Linear$"),
    (lambda: describe_scale_changes(history_of([8.0]), final_scale=-1.0), "final_scale must be"),
    (lambda: scale_changes({}), r"history must be what trainer.fit\(...\) returned"),
    (lambda: scale_changes(History()), "with at least one step"),
    (lambda: scale_changes(history_of([8.0]), final_scale=float("nan")), "final_scale must be"),
    (lambda: describe_scale_changes([], None), "history must be"),
    (lambda: scale_run(inject_at="1", steps=2), "inject_at must be a whole number"),
    (lambda: scale_run(inject_at=99, steps=2), "inject_at must be a whole number from -1 to 1"),
    (lambda: scale_run(inject_at=-2, steps=2), "inject_at must be a whole number"),
    (lambda: scale_run(steps=0), "^steps must be a whole number from 1 up; got 0$"),
    (lambda: scale_run(inject_at=2, steps=2.5), "^steps must be a whole number from 1 up; got 2.5$"),
    (lambda: scale_run(init_scale=float("nan"), steps=2), "init_scale must be a positive finite number"),
    (lambda: lesson_model("a"), "^seed must be a whole number from 0 up; got 'a'$"),
    (lambda: lesson_model(-1), "seed must be a whole number from 0 up"),
    (lambda: scheduler_warnings("yes", steps=1), r"^step_scheduler_on_skip must be True \(the common loop\)"),
]


@pytest.mark.parametrize("call, says", BAD_SCALING, ids=[f"{i}: {s}" for i, (_, s) in enumerate(BAD_SCALING)])
def test_a_bad_argument_is_refused_with_what_to_pass(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_the_defaults_are_lesson_03s():
    assert lesson_trainer(progress=False).precision == "fp16"
    assert flush_report(torch.ones(2), torch.ones(2)).name == "fp16"
    same = [torch.equal(a, b) for a, b in zip(lesson_model().state_dict().values(),
                                               lesson_model(0).state_dict().values())]
    other = [torch.equal(a, b) for a, b in zip(lesson_model().state_dict().values(),
                                                lesson_model(1).state_dict().values())]
    assert all(same) and not any(other)


def test_first_step_gradients_prints_no_progress_bar(capfd, monkeypatch):
    monkeypatch.delenv("AMP_LESSONS_PROGRESS", raising=False)  # progress=False, not the environment, keeps it quiet
    first_step_gradients("fp32", device="cpu")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_the_scale_after_the_last_step_defaults_to_the_last_steps():
    h = history_of([8.0, 16.0, 32.0])
    assert scale_changes(h) == [(0, "grew", 8.0, 16.0), (1, "grew", 16.0, 32.0)]
    assert describe_scale_changes(history_of([8.0, 8.0]), 16.0).splitlines()[0] == "step   1: grew           8 -> 16"


def test_an_optimizer_without_a_step_count_is_named():
    model = lesson_model()
    lbfgs = torch.optim.LBFGS(model.parameters())
    x, y = lesson_data().x_train[:8], lesson_data().y_train[:8]

    def closure():
        lbfgs.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    lbfgs.step(closure)
    with pytest.raises(ValueError, match="^LBFGS keeps no step count; count the steps whose scale did not drop instead$"):
        optimizer_steps(lbfgs)
    with pytest.raises(ValueError, match="^SGD keeps no step count; count the steps whose scale did not drop instead$"):
        optimizer_steps(torch.optim.SGD(model.parameters(), lr=0.1))


def test_scheduler_warnings_records_the_warning_of_the_common_loop_only():
    wrong, t = scheduler_warnings(True, steps=10)
    right, u = scheduler_warnings(False, steps=10)
    assert any(SCHEDULER_WARNING in m for m in wrong) and not any(SCHEDULER_WARNING in m for m in right)
    assert all(isinstance(m, str) for m in wrong)
    assert t.precision == "fp16" and len(t.history) == 10 and t.history[0].skipped  # summed loss: step 0 overflows
    assert t.scheduler.get_last_lr() == [3e-3 * 0.5]  # StepLR(10, 0.5), stepped on all 10 iterations
    assert u.scheduler.get_last_lr() == [3e-3]  # stepped only on the steps taken, fewer than 10
    assert len(scheduler_warnings(False)[1].history) == 3


def test_scale_run_by_default_is_40_steps_growing_every_10():
    history, final = scale_run()
    assert len(history) == 40 and history[0].skipped
    changes = scale_changes(history, final)
    grew = [(before[0], step) for before, (step, kind, *_) in zip(changes, changes[1:]) if kind == "grew"]
    assert grew and all(step - previous == 10 for previous, step in grew)  # 10 clean steps, then it grows
    assert scale_run(inject_at=0, steps=2)[0][0].skipped and not scale_run(init_scale=1.0, inject_at=None, steps=1)[0][0].skipped


class WiredTrainer:
    """Stands in for the Trainer: keeps the arguments lesson 03's functions build it with."""

    built: list = []

    def __init__(self, model, data, **kwargs):
        self.kwargs = kwargs
        self.fitted = None
        WiredTrainer.built.append(self)

    def fit(self, steps):
        self.fitted = steps
        return history_of([8.0] * steps)

    def current_scale(self):
        return 8.0


def test_the_runs_are_built_with_the_device_and_settings_asked_for(monkeypatch):
    import amp_lessons.scaling as scaling

    monkeypatch.setattr(scaling, "Trainer", WiredTrainer)
    WiredTrainer.built = []
    scaling.lesson_trainer(device="cuda:7", lr=0.5)
    scaling.first_step_gradients("bf16", device="cuda:7")
    scaling.scale_run(2.0**4, 3, 0, 5, "cuda:7", grad_stats=False)
    scaling.scale_run(steps=2, device="cuda:7")
    trainer, first, run, plain = (t.kwargs for t in WiredTrainer.built)
    assert trainer["device"] == first["device"] == run["device"] == "cuda:7"
    assert trainer["precision"] == "fp16" and trainer["lr"] == 0.5 and trainer["teaching"] is True
    assert first["precision"] == "bf16" and first["progress"] is False and WiredTrainer.built[1].fitted == 1
    assert (run["precision"], run["loss_fn"], run["init_scale"], run["growth_interval"]) == ("fp16", summed_loss, 16.0, 3)
    assert run["inject_nonfinite"] == (0,) and run["grad_stats"] is False and run["progress"] is False
    assert WiredTrainer.built[2].fitted == 5 and plain["inject_nonfinite"] == () and "grad_stats" not in plain


def test_the_last_step_may_be_the_inf_step():
    history, _ = scale_run(init_scale=2.0**4, inject_at=1, steps=2)
    assert [r.skipped for r in history] == [False, True]
