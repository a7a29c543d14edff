"""Lesson 04: clipping with a GradScaler, accumulation, the diagnostic and the exercise checker.

References: hand-set gradients with a known norm, float32 clipping of the same gradients,
a float32 run, and one large batch of the same examples.
"""

import math
import re
import warnings

import pytest
import torch

from amp_lessons import clipping
from amp_lessons.clipping import (
    ScaledClipWarning,
    accumulate,
    accumulate_stepping_every_micro_batch,
    accumulate_without_dividing,
    check_clipping,
    clip_and_unscale,
    clipping_table,
    effective_threshold,
    lesson_model,
    measured_thresholds,
    one_clipped_step,
    record_amp_calls,
    relative_difference,
    run_accumulation,
)
from amp_lessons.data import digits
from amp_lessons.exercises import broken_clipping_loop, check_clipping_loop, fixed_clipping_loop
from amp_lessons.training import Trainer

FP16_ROUNDING = 2.0**-10  # float16's spacing relative to a value (twice its unit roundoff)


@pytest.fixture(scope="module")
def data():
    return digits()


def scaled_setup(grads, scale, fp16_grads=False):
    """Parameters whose .grad holds ``grads`` times ``scale`` (optionally rounded to fp16, as
    a float16 backward would leave them), an optimizer over them, and a GradScaler at ``scale``."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        scaled = g * scale
        p.grad = scaled.half().float() if fp16_grads else scaled
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # the scaler makes its scale tensor on first use
    return params, opt, scaler


def random_grads(norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(50, 20, generator=g), torch.randn(20, generator=g)]
    total = torch.linalg.vector_norm(torch.cat([t.flatten() for t in grads]))
    return [t * (norm / total) for t in grads]


# -- the effective threshold ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.0**8, 2.0**16, 2.0**24])
def test_wrong_order_clips_at_max_norm_over_scale(scale):
    max_norm = 1.0
    threshold = max_norm / scale
    for factor in (0.5, 0.99, 1.01, 2.0, 1e3):  # true norms on both sides of max_norm / S
        params, opt, scaler = scaled_setup(random_grads(factor * threshold), scale)
        r = clip_and_unscale(params, opt, scaler, max_norm=max_norm, order="before_unscale")
        assert r.true_norm == pytest.approx(factor * threshold, rel=1e-5)
        assert r.seen == pytest.approx(factor * max_norm, rel=1e-5)  # it saw S x the true norm
        assert r.applied_norm == pytest.approx(min(factor, 1.0) * threshold, rel=1e-5)
    assert effective_threshold(max_norm, scale, "before_unscale") == threshold
    assert effective_threshold(max_norm, scale, "unscale_first") == max_norm


def test_wrong_order_clip_value_acts_at_clip_value_over_scale():
    scale, clip_value = 2.0**16, 0.01
    params, opt, scaler = scaled_setup(random_grads(1.0), scale)
    true_max = max(float(p.grad.abs().max()) for p in params) / scale
    r = clip_and_unscale(params, opt, scaler, clip_value=clip_value, order="before_unscale")
    assert r.true_max == pytest.approx(true_max, rel=1e-6)
    assert r.applied_max == pytest.approx(clip_value / scale, rel=1e-6)
    params, opt, scaler = scaled_setup(random_grads(1.0), scale)
    r = clip_and_unscale(params, opt, scaler, clip_value=clip_value, order="unscale_first")
    assert r.applied_max == pytest.approx(clip_value, rel=1e-6)


def test_trainer_history_gives_the_threshold_the_clip_really_used(data):
    max_norm = 1.0
    t = Trainer(lesson_model(), data, precision="fp16", device="cpu", optimizer="sgd", lr=0.5,
                clip_norm=max_norm, clip_order="before_unscale", teaching=True, seed=0)
    h = t.fit(4)
    for r, threshold in zip(h, measured_thresholds(h, max_norm)):
        assert threshold == pytest.approx(max_norm / r.scale, rel=1e-5)
        assert r.clip_seen_norm == pytest.approx(r.grad_norm * r.scale, rel=1e-5)
        assert r.applied_norm == pytest.approx(max_norm / r.scale, rel=1e-4)
    ref = Trainer(lesson_model(), data, precision="fp32", device="cpu", optimizer="sgd", lr=0.5,
                  clip_norm=max_norm, seed=0).fit(4)
    assert measured_thresholds(ref, max_norm) == pytest.approx([max_norm] * 4, rel=1e-6)
    assert clipping.clipped_fraction(h, max_norm) == 1.0


def test_bad_arguments_say_what_to_do():
    params, opt, scaler = scaled_setup(random_grads(1.0), 2.0**16)
    with pytest.raises(ValueError, match="unscale_first, before_unscale"):
        clip_and_unscale(params, opt, scaler, max_norm=1.0, order="clip_first")
    with pytest.raises(ValueError, match="exactly one of max_norm"):
        clip_and_unscale(params, opt, scaler, max_norm=1.0, clip_value=0.1)


# -- the right order equals float32 ------------------------------------------------------------


@pytest.mark.parametrize("norm", [0.3, 5.0])  # below and above max_norm
def test_right_order_equals_fp32_clip_of_the_same_gradients(norm):
    max_norm, scale = 1.0, 2.0**16
    grads = random_grads(norm)
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref_params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    params, opt, scaler = scaled_setup(grads, scale, fp16_grads=True)
    r = clip_and_unscale(params, opt, scaler, max_norm=max_norm, order="unscale_first")
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p.grad, ref.grad, rtol=FP16_ROUNDING, atol=1e-12)
    assert r.applied_norm == pytest.approx(min(norm, max_norm), rel=FP16_ROUNDING)
    wrong, opt, scaler = scaled_setup(grads, scale, fp16_grads=True)
    clip_and_unscale(wrong, opt, scaler, max_norm=max_norm, order="before_unscale")
    assert clipping.grad_norm(wrong) == pytest.approx(max_norm / scale, rel=1e-4)


def test_right_order_matches_an_fp32_run_on_a_real_batch(data):
    x, y = data.batch(0, 64)
    max_norm = 0.05  # below this batch's gradient norm, so every run clips
    grads = {}
    for precision, order in (("fp32", "unscale_first"), ("fp16", "unscale_first"),
                             ("fp16", "before_unscale")):
        model = lesson_model()
        r = one_clipped_step(model, x, y, precision, max_norm=max_norm, order=order)
        assert r.true_norm > max_norm
        grads[precision, order] = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref = grads["fp32", "unscale_first"]
    assert float(torch.linalg.vector_norm(ref)) == pytest.approx(max_norm, rel=1e-5)
    # float16 forward/backward, then the same clip: equal up to float16 rounding of the gradients
    assert relative_difference(grads["fp16", "unscale_first"], ref) < 1e-2
    wrong = grads["fp16", "before_unscale"]
    assert float(torch.linalg.vector_norm(wrong)) == pytest.approx(max_norm / 2**16, rel=1e-4)


def test_right_order_trainer_tracks_fp32_and_wrong_order_does_not_move(data):
    def first_update(precision, order):
        t = Trainer(lesson_model(), data, precision=precision, device="cpu", optimizer="sgd",
                    lr=0.5, clip_norm=0.05, clip_order=order, teaching=True, seed=0)
        before = torch.cat([p.detach().flatten().clone() for p in t.model.parameters()])
        t.fit(1)
        return torch.cat([p.detach().flatten() for p in t.model.parameters()]) - before

    ref = first_update("fp32", "unscale_first")
    assert float(torch.linalg.vector_norm(ref)) == pytest.approx(0.5 * 0.05, rel=1e-4)
    assert relative_difference(first_update("fp16", "unscale_first"), ref) < 1e-2
    wrong = first_update("fp16", "before_unscale")
    # lr * max_norm / S, give or take float32 rounding of weights this much larger than the step
    assert float(torch.linalg.vector_norm(wrong)) == pytest.approx(0.5 * 0.05 / 2**16, rel=0.1)


# -- gradient accumulation ---------------------------------------------------------------------


def test_accumulation_done_right_matches_one_large_batch(data):
    large = run_accumulation(accumulate, lesson_model(), data, k=1, batch_size=64)
    right = run_accumulation(accumulate, lesson_model(), data, k=4, batch_size=16)
    assert relative_difference(right.first_update, large.first_update) < 5e-3
    assert (right.optimizer_steps, right.scaler_updates) == (1, 1)


def test_trainer_accumulation_matches_one_large_batch(data):
    def first_update(batch_size, accum_steps):
        t = Trainer(lesson_model(), data, precision="fp16", device="cpu", optimizer="sgd", lr=0.5,
                    batch_size=batch_size, accum_steps=accum_steps, clip_norm=1.0, seed=0)
        before = torch.cat([p.detach().flatten().clone() for p in t.model.parameters()])
        t.fit(1)
        return torch.cat([p.detach().flatten() for p in t.model.parameters()]) - before

    large = first_update(64, 1)
    assert relative_difference(first_update(16, 4), large) < 5e-3
    ours = run_accumulation(accumulate, lesson_model(), data, k=4, batch_size=16)
    assert relative_difference(ours.first_update, large) < 5e-3


def test_the_two_accumulation_mistakes_are_measured(data):
    large = run_accumulation(accumulate, lesson_model(), data, k=1, batch_size=64)
    every = run_accumulation(accumulate_stepping_every_micro_batch, lesson_model(), data, k=4,
                             batch_size=16)
    assert (every.optimizer_steps, every.scaler_updates) == (4, 4)
    assert relative_difference(every.first_update, large.first_update) > 0.05
    undivided = run_accumulation(accumulate_without_dividing, lesson_model(), data, k=4,
                                 batch_size=16)
    size = torch.linalg.vector_norm(undivided.first_update) / torch.linalg.vector_norm(large.first_update)
    assert float(size) == pytest.approx(4.0, rel=5e-3)  # SGD, no clip reached: k x the update
    table = clipping.accumulation_table(lesson_model, data, k=4, batch_size=16)
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["one", "right", "step", "loss"]


def test_unscale_twice_raises():
    params, opt, scaler = scaled_setup(random_grads(1.0), 2.0**16)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


# -- the diagnostic ------------------------------------------------------------------------------


def make_trainer(data, order, precision="fp16"):
    return Trainer(lesson_model(), data, precision=precision, device="cpu", optimizer="sgd",
                   lr=0.5, clip_norm=1.0, clip_order=order, teaching=True, seed=0)


def test_check_clipping_warns_on_the_wrong_order(data):
    t = make_trainer(data, "before_unscale")
    with pytest.warns(ScaledClipWarning, match=r"acted as 1\.53e-05.*unscale_\(optimizer\)"):
        with check_clipping(t.scaler) as log:
            t.fit(2)
    assert len(log.clips) == 2 and len(log.scaled_clips) == 2


def test_check_clipping_is_silent_on_the_right_order_and_without_a_scaler(data):
    for precision in ("fp16", "bf16", "fp32"):
        t = make_trainer(data, "unscale_first", precision)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            with check_clipping(t.scaler) as log:
                t.fit(2)
        assert len(log.clips) == 2 and not log.scaled_clips
    t = make_trainer(data, "before_unscale", "bf16")  # nothing is scaled: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with check_clipping(t.scaler):
            t.fit(1)


def test_check_clipping_sees_clip_grad_value_in_a_hand_written_loop(data):
    model, (x, y) = lesson_model(), data.batch(0, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with check_clipping(scaler):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        with pytest.warns(ScaledClipWarning, match="clip_value=0.01 acted as"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)  # after unscale_: silent
        scaler.step(opt)
        scaler.update()


def test_patches_are_undone():
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, torch.amp.GradScaler)
    scaler = torch.amp.GradScaler("cpu")
    with check_clipping(scaler):
        assert torch.nn.utils.clip_grad_norm_ is not originals[0]
    with record_amp_calls():
        assert torch.amp.GradScaler is not originals[2]
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, torch.amp.GradScaler) == originals
    assert "unscale_" not in vars(scaler)  # the instance wrappers are gone too


# -- the exercise checker ----------------------------------------------------------------------


def bugs(verdict):
    return [f for f in verdict.findings if f.startswith("bug:")]


def broken_loop_copied(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """The exercise's loop copied as it is: only the name and this docstring differ."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler()
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                logits = model(x.to(device))
                loss = torch.nn.functional.cross_entropy(logits, y.to(device)) / accum_steps
                scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def broken_loop_wrapped(*args, **kwargs):
    broken_clipping_loop(*args, **kwargs)


@pytest.mark.parametrize("loop", [broken_clipping_loop, broken_loop_copied])
def test_checker_counts_the_bugs_of_the_loop_as_given_without_the_fixes(loop):
    v = check_clipping_loop(loop)
    assert not v.passed
    head, question = v.findings
    assert head.startswith("bugs: 3 of 3 remain, in how the GradScaler is built; where the clip runs; "
                           "how often unscale_, step and update run.")
    assert question.startswith("question:")
    for fix in ("device", "unscale_(opt)", "24", "once per", "after", "before", "weights"):
        assert fix not in head, fix


def test_checker_names_every_bug_once_the_loop_is_changed():
    v = check_clipping_loop(broken_loop_wrapped, backward_in_autocast_is_a_bug=False)
    assert not v.passed
    text = "\n".join(bugs(v))
    assert "GradScaler() was built without a device" in text
    assert "A bug off CUDA only" in text
    assert "clips ran before scaler.unscale_(opt)" in text
    assert "unscale_ 24x, step 24x, update 24x for 6 optimizer steps" in text
    assert "right: in this loop it is not a bug" in str(v)


def test_checker_passes_the_fixed_loop_only_with_the_right_answer():
    v = check_clipping_loop(fixed_clipping_loop, backward_in_autocast_is_a_bug=False)
    assert v.passed, str(v)
    assert not bugs(v)
    assert "identical bit for bit" in str(v)
    wrong = check_clipping_loop(fixed_clipping_loop, backward_in_autocast_is_a_bug=True)
    assert not wrong.passed
    (said,) = [f for f in wrong.findings if f.startswith("question, think again:")]
    assert "identical bit for bit" in said and "autocast(enabled=False)" in said
    assert "not a bug" not in said and "is_a_bug=" not in said  # the reasons, not the answer
    v = check_clipping_loop(fixed_clipping_loop)
    assert not v.passed and "question:" in str(v)


def device_only_fixed(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
                scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def order_fixed_still_every_micro_batch(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5,
                                        batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def unscale_inside_the_micro_loop(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5,
                                  batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def fixed_but_not_divided(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def test_checker_names_what_remains_in_a_partly_fixed_loop():
    v = check_clipping_loop(device_only_fixed, backward_in_autocast_is_a_bug=False)
    assert not v.passed
    assert any(f.startswith("fixed: the GradScaler") for f in v.findings)
    text = "\n".join(bugs(v))
    assert "GradScaler" not in text
    assert "clips ran before scaler.unscale_(opt)" in text and "update 24x" in text

    v = check_clipping_loop(order_fixed_still_every_micro_batch, backward_in_autocast_is_a_bug=False)
    assert not v.passed
    assert any(f.startswith("fixed: every clip runs after") for f in v.findings)
    assert [b for b in bugs(v) if "update 24x" in b]
    (weights,) = [b for b in bugs(v) if "weights moved" in b]
    assert "the steps taken per micro-batch" in weights and "divided by accum_steps" not in weights
    assert not [b for b in bugs(v) if "clips ran before" in b]


def test_checker_explains_unscale_called_twice():
    v = check_clipping_loop(unscale_inside_the_micro_loop, backward_in_autocast_is_a_bug=False)
    assert not v.passed
    (raised,) = [b for b in bugs(v) if "raised RuntimeError: unscale_() has already been called" in b]
    assert "once per optimizer step" in raised and "after the last micro-batch" not in raised


def test_checker_catches_a_loss_not_divided_by_k():
    v = check_clipping_loop(fixed_but_not_divided, backward_in_autocast_is_a_bug=False)
    assert not v.passed
    (only,) = bugs(v)
    assert "divided by accum_steps" in only and "are in place" in only


def test_backward_inside_autocast_gives_the_same_gradients(data):
    assert clipping.backward_inside_autocast_matches(lesson_model(), *data.batch(0, 32))


def test_clipping_figure(data):
    from amp_lessons.plots import clipping_runs

    runs = {label: make_trainer(data, order, precision).fit(3) for label, precision, order in (
        ("fp32", "fp32", "unscale_first"), ("wrong", "fp16", "before_unscale"))}
    fig = clipping_runs(runs, 1.0)
    assert len(fig.axes) == 3
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
    assert fig._suptitle.get_text().startswith("wrong: updates")
    assert not math.isnan(fig.axes[1].get_lines()[0].get_ydata()[0])
    thresholds = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert thresholds == ["1: fp32", f"{1 / 65536:.3g}: wrong"]  # each once, with the runs that apply it


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"k": 0}, ValueError, "k must be a positive integer; got 0"),
    ({"k": 10**7}, ValueError, "k=10000000 with batch_size=32 makes one optimizer step read"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive integer; got 0"),
    ({"steps": -1}, ValueError, "steps must be a positive integer; got -1"),
    ({"max_norm": math.nan}, ValueError, "max_norm must be a positive finite number; got nan"),
    ({"lr": 1e300}, ValueError, "lr must be at most 3.4e+38"),
    ({"optimizer": "adam"}, ValueError, "optimizer must be one of sgd, adamw; got 'adam'"),
    ({"step_fn": "accumulate"}, TypeError, "step_fn must be one of ACCUMULATION_VARIANTS' functions"),
])
def test_run_accumulation_refuses_bad_settings_before_any_step(kwargs, error, message):
    model = lesson_model()
    before = [p.detach().clone() for p in model.parameters()]
    step_fn = kwargs.pop("step_fn", accumulate)
    with pytest.raises(error, match=re.escape(message)):
        run_accumulation(step_fn, model, digits(), **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_reading_a_history_wants_a_threshold_and_runs():
    h = Trainer(lesson_model(), digits(), device="cpu", clip_norm=1.0, progress=False).fit(2)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number; got 0"):
        measured_thresholds(h, 0)
    with pytest.raises(ValueError, match="runs must map each run's name to the history of a clipped run"):
        clipping_table({}, 1.0)
    assert len(clipping_table({"fp32": h}, 1.0).splitlines()) == 2


def test_check_clipping_follows_each_optimizer_of_one_scaler(data):
    (x, y) = data.batch(0, 32)
    a, b = lesson_model(), lesson_model()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with check_clipping(scaler):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(a(x), y) + torch.nn.functional.cross_entropy(b(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt_a)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)  # a's gradients are unscaled: silent
        with pytest.warns(ScaledClipWarning, match="max_norm=1"):
            torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)  # b's are still scaled
        scaler.unscale_(opt_b)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()


def fixed_but_no_device(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler()  # 'cuda': disabled on the CPU
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def test_checker_does_not_blame_the_weights_on_a_disabled_scaler():
    v = check_clipping_loop(fixed_but_no_device, backward_in_autocast_is_a_bug=False)
    (only,) = bugs(v)
    assert "built without a device" in only
    assert "fixed: the weights end where the reference loop's do" in v.findings
    broken = "\n".join(bugs(check_clipping_loop(broken_loop_wrapped, backward_in_autocast_is_a_bug=False)))
    assert "disabled GradScaler" not in broken and "once it is on, those gradients are multiplied" in broken


def clip_after_step(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # too late: the step is taken
        scaler.update()
        opt.zero_grad(set_to_none=True)


def hard_coded_scaler(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def test_checker_catches_a_clip_after_the_step_and_a_hard_coded_device():
    v = check_clipping_loop(clip_after_step, backward_in_autocast_is_a_bug=False)
    late, weights = bugs(v)  # the reference's clip binds on some steps: a clip after the step moves the weights
    assert "24" not in late and "6 of 6 clips ran after scaler.step(opt)" in late
    assert "weights moved" in weights and "(the clips after scaler.step(opt))" in weights
    v = check_clipping_loop(hard_coded_scaler, backward_in_autocast_is_a_bug=False)
    (only,) = bugs(v)
    assert "GradScaler('cpu') names its device" in only


@pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"), reason="torch 2.6+ only")
def test_check_clipping_sees_the_split_api(data):
    model, (x, y) = lesson_model(), data.batch(0, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with check_clipping(scaler) as log:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        with pytest.warns(ScaledClipWarning, match="clip_grads_with_norm_ ran on gradients still multiplied"):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
        scaler.unscale_(opt)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
        scaler.step(opt)
        scaler.update()
    assert [c.info["scaled"] for c in log.clips] == [True, False]


def scaler_from_a_device_object(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device if torch.cuda.is_available() else "cpu")  # a torch.device, or the literal
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def scaler_from_a_torch_device(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("loop", [scaler_from_a_device_object, scaler_from_a_torch_device])
def test_checker_accepts_a_scaler_built_from_the_device(loop):
    v = check_clipping_loop(loop, backward_in_autocast_is_a_bug=False)
    assert v.passed, str(v)


def test_checker_wants_a_bool_for_the_question():
    v = check_clipping_loop(fixed_clipping_loop, backward_in_autocast_is_a_bug="False")
    assert not v.passed and "got 'False', a str" in str(v)


def clipping_with(clip):
    """The fixed loop with its clip replaced by ``clip(model, max_norm)``."""
    def loop(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
        device = next(model.parameters()).device
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(device.type)
        for step in range(steps):
            for micro in range(accum_steps):
                x, y = data.batch(step * accum_steps + micro, batch_size)
                with torch.autocast(device.type, dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            clip(model, max_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return loop


def test_the_checkers_max_norm_lies_between_the_true_norms_of_its_steps():
    from amp_lessons.exercises import CHECK_MAX_NORM, _run_clipping_loop

    _, _, log, _, error = _run_clipping_loop(fixed_clipping_loop, 6, 4, 0.5, 32)
    seen = [c.info["seen"] for c in log.clips]
    assert error is None and len(seen) == 6
    assert min(seen) < CHECK_MAX_NORM < max(seen), seen  # the reference clips some steps, not all


@pytest.mark.parametrize("clip", [
    lambda model, max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9),
    lambda model, max_norm: torch.nn.utils.clip_grad_value_(model.parameters(), max_norm),
], ids=["a clip that never binds", "clip_grad_value_"])
def test_checker_refuses_a_clip_other_than_the_given_one(clip):
    v = check_clipping_loop(clipping_with(clip), backward_in_autocast_is_a_bug=False)
    assert not v.passed
    (only,) = bugs(v)
    assert "weights moved" in only and "the clip is not the given one" in only


def scaler_per_step(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """The fixed loop, but a new GradScaler every optimizer step: its scale never carries."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        scaler = torch.amp.GradScaler(device.type)
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)) / accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def no_explicit_unscale(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """No scaler.unscale_: step() unscales by itself, after the clip has seen scaled gradients."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)) / accum_steps
            scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def zero_grad_before_step(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """The step calls moved out of the micro-batch loop, but after a zero_grad."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)) / accum_steps
            scaler.scale(loss).backward()
        opt.zero_grad(set_to_none=True)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()


def test_checker_refuses_a_scaler_per_step_and_counts_only_the_loop_s_own_calls():
    text = str(check_clipping_loop(scaler_per_step, False))
    assert "a GradScaler was built 6 times: build one before the loop" in text
    text = str(check_clipping_loop(no_explicit_unscale, False))
    assert "unscale_ 0x, step 6x, update 6x" in text and "fixed: unscale_" not in text


def test_checker_blames_a_zero_grad_before_step_not_a_missing_step():
    text = str(check_clipping_loop(zero_grad_before_step, False))
    assert "No inf checks were recorded for this optimizer" in text
    assert "did zero_grad run between the backward passes and step?" in text
    assert "update() needs a step() before it" not in text
