"""Lesson 06's reproductions (amp_lessons.errors): each message exactly as torch prints
it, each fix running, the replayed and simulated CUDA answers, and 06's exercise checker."""

import inspect

import pytest
import torch

from amp_lessons import clipping, errors
from amp_lessons.exercises import check_two_model_loop, two_model_loop_as_given
from amp_lessons.lint import check_loop
from amp_lessons.show import expect_error

SCHEDULER = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def test_scheduler_warns_only_when_the_first_step_is_skipped():
    first = errors.scheduler_run(errors.train_stepping_scheduler_always, skip_at=0)
    assert len(first.warnings) == 1 and first.warnings[0].startswith(SCHEDULER)
    later = errors.scheduler_run(errors.train_stepping_scheduler_always, skip_at=2)
    assert later.warnings == []  # silent, yet the schedule is one step ahead
    for run in (first, later):
        assert (run.optimizer_steps, run.scheduler_steps, run.lr) == (3, 4, 0.01 * 0.5**4)
    for skip_at in (0, 2):
        fixed = errors.scheduler_run(errors.train_stepping_scheduler_after_real_steps, skip_at)
        assert (fixed.warnings, fixed.optimizer_steps, fixed.scheduler_steps) == ([], 3, 3)
    assert str(later) == "0 warnings; AdamW stepped 3 times, the scheduler 4 times; lr now 0.000625"


def test_a_fused_optimizer_never_warns_and_the_scale_guard_still_holds():
    fused = errors.scheduler_run(errors.train_stepping_scheduler_always, skip_at=0, fused=True)
    assert (fused.warnings, fused.optimizer_steps, fused.scheduler_steps) == ([], 3, 4)
    fixed = errors.scheduler_run(errors.train_stepping_scheduler_after_real_steps, skip_at=0, fused=True)
    assert (fixed.warnings, fixed.optimizer_steps, fixed.scheduler_steps) == ([], 3, 3)


def test_fused_sgd_keeps_a_momentum_buffer_from_a_skipped_first_step():
    """Lesson 06, section 1: only fused SGD with momentum holds a buffer after a skipped first
    step (made by torch.empty_like, never written: its values are not compared here)."""
    assert errors.state_after_a_skipped_first_step(fused=True) == ["momentum_buffer"]
    assert errors.state_after_a_skipped_first_step(fused=False) == []
    assert errors.state_after_a_skipped_first_step(fused=True, momentum=0.0) == []


def test_a_bias_free_convolution_without_onednn_words_it_as_the_native_kernel_does():
    h = torch.randn(1, 4, 6, 6, dtype=torch.bfloat16)
    before = torch.backends.mkldnn.enabled
    with errors.without_onednn():
        assert not torch.backends.mkldnn.enabled
        with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
            torch.nn.Conv2d(4, 2, 3, bias=False)(h)
    assert torch.backends.mkldnn.enabled is before


def test_accumulation_run_notes_the_micro_batches_taken_before_it_raised():
    fed = []
    with pytest.raises(RuntimeError, match="unscale_"):
        errors.accumulation_run(errors.accumulate_unscaling_every_micro_batch, fed=fed)
    assert fed == [0, 1]
    fed = []
    errors.accumulation_run(clipping.accumulate, fed=fed)
    assert fed == [0, 1, 2, 3]


def test_unscale_twice_raises_and_the_recipe_runs(capsys):
    with expect_error(RuntimeError):
        errors.accumulation_run(errors.accumulate_unscaling_every_micro_batch)
    assert capsys.readouterr().out == ("RuntimeError: unscale_() has already been called on this "
                                       "optimizer since the last update().\n")
    assert errors.accumulation_run(clipping.accumulate) == (
        "4 micro-batches, one step: weights changed True, scale 65536")


def test_update_per_optimizer_unscales_the_second_model_wrongly():
    wrong = errors.two_optimizer_run(errors.step_two_optimizers_updating_each)
    right = errors.two_optimizer_run(errors.step_two_optimizers)
    assert [r[2] for r in wrong] == [[1.0, 0.5]] * 3  # the scale doubled between the two steps
    assert [r[2] for r in right] == [[1.0, 1.0]] * 3
    assert [(s, a) for s, a, _ in right] == [(1024, 2048), (2048, 4096), (4096, 8192)]
    assert [(s, a) for s, a, _ in wrong] == [(1024, 4096), (4096, 16384), (16384, 65536)]
    assert "model 2 x0.5" in errors.describe_two_optimizer_run(wrong)


def test_update_per_optimizer_at_an_overflow_doubles_the_second_models_step():
    default = {"steps": 1, "growth_interval": 2000}
    wrong = errors.two_optimizer_run(errors.step_two_optimizers_updating_each, overflow=(0,), **default)
    assert wrong == [(1024, 512, [None, 2.0])]  # model 1 skipped; model 2 unscaled by 512
    both = errors.two_optimizer_run(errors.step_two_optimizers_updating_each, overflow=(0, 1), **default)
    assert both == [(1024, 256, [None, None])]  # both skipped, the scale down 4x
    right = errors.two_optimizer_run(errors.step_two_optimizers, overflow=(0,), **default)
    assert right == [(1024, 512, [None, 1.0])]
    assert "model 1 skipped, model 2 x2" in errors.describe_two_optimizer_run(wrong)
    # the lesson's run of the fix: the scale drops though model 2 stepped, then grows again
    assert errors.two_optimizer_run(errors.step_two_optimizers, overflow=(0,)) == [
        (1024, 512, [None, 1.0]), (512, 1024, [1.0, 1.0]), (1024, 2048, [1.0, 1.0])]


def test_half_model_with_a_scaler_raises_and_the_recipe_runs():
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
        errors.train_half_model(errors.tiny_model(), errors.tiny_batches())
    model = errors.tiny_model()
    opt, scaler = errors.train_recipe(model, errors.tiny_batches())
    assert scaler.is_enabled() and all(p.dtype == torch.float32 for p in model.parameters())


def test_a_fused_optimizer_trains_a_half_model_until_unscale_is_called():
    """Lesson 06, section 4: step does not call unscale_ for fused=True; an explicit one raises."""
    model = errors.tiny_model().half()
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1, fused=True), torch.amp.GradScaler("cpu")
    for x, y in errors.tiny_batches():
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x.half()), y)).backward()
        scaler.step(opt)
        scaler.update()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "BFloat16"), (torch.float16, "Half")])
def test_autocast_edge(dtype, name):
    body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    head = torch.nn.Linear(16, 4)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError) as err:
        errors.head_outside_autocast(body, head, x, dtype)
    assert str(err.value) == f"mat1 and mat2 must have the same dtype, but got {name} and Float"
    assert errors.head_inside_autocast(body, head, x, dtype).dtype == dtype


def test_fp16_overflow_and_its_fixes():
    q = torch.full((4, 512), 16.0)
    scores, _, _ = errors.attention(q, q, q, torch.bfloat16)  # divided by sqrt(d) after the matmul
    assert torch.allclose(scores.float(), torch.full((4, 4), 16.0 * 16.0 * 512 / 512**0.5), rtol=1e-2)
    assert errors.overflow_report(*errors.attention(q, q, q, torch.float16)) == (
        "torch.float16: scores inf 16 of 16; weights NaN 16 of 16; loss finite: False")
    for dtype, scale_first in ((torch.bfloat16, False), (torch.float16, True)):
        report = errors.overflow_report(*errors.attention(q, q, q, dtype, scale_first))
        assert report.endswith("scores inf 0 of 16; weights NaN 0 of 16; loss finite: True")


def test_deprecated_spellings_warn_and_torch_amp_does_not():
    said = dict(errors.deprecated_spellings())
    assert said == {
        "torch.cuda.amp.autocast()": "`torch.cuda.amp.autocast(args...)` is deprecated. Please use "
                                     "`torch.amp.autocast('cuda', args...)` instead.",
        "torch.cuda.amp.GradScaler()": "`torch.cuda.amp.GradScaler(args...)` is deprecated. Please use "
                                       "`torch.amp.GradScaler('cuda', args...)` instead.",
        "torch.cpu.amp.autocast()": "`torch.cpu.amp.autocast(args...)` is deprecated. Please use "
                                    "`torch.amp.autocast('cpu', args...)` instead.",
    }
    assert errors.current_spellings_warnings() == []


def test_default_scaler_without_cuda():
    real = torch.cuda.is_available
    assert errors.default_scaler_report() == (
        "warning: torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.\n"
        "enabled: False; get_scale(): 1; scale(loss) is loss: True")
    assert torch.cuda.is_available is real  # restored


def test_default_scaler_is_off_even_where_torch_xla_is_installed(monkeypatch):
    """With torch_xla installed, torch keeps GradScaler("cuda") on without CUDA; the lesson's
    cell hides torch_xla too, so that it prints the same there."""
    common = torch.cuda.amp.common
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "find_spec", lambda name, *a: object() if name == "torch_xla" else None)
    assert torch.amp.GradScaler().is_enabled()  # torch's own rule: torch_xla keeps it on
    pretend = common.find_spec
    assert "enabled: False" in errors.default_scaler_report()
    assert common.find_spec is pretend  # restored


def test_gradient_penalty_needs_unscaled_gradients():
    right = errors.penalty_run(unscale=True)
    wrong = errors.penalty_run(unscale=False)
    assert len(right.steps) == len(wrong.steps) == 24
    assert wrong.steps[0].times_too_large == pytest.approx(65536, rel=1e-3)
    assert right.skipped() == [] and all(s.scale == 65536.0 for s in right.steps)
    assert all(s.times_too_large == pytest.approx(1, rel=1e-2) for s in right.steps)
    # forgotten: the first steps are skipped, each halving the scale, then steps go through
    first = wrong.first_taken()
    assert wrong.skipped()[:first - 1] == list(range(1, first)) and 3 < first < 24
    assert [s.scale for s in wrong.steps[:first]] == [65536.0 / 2**i for i in range(first)]
    taken = [s for s in wrong.steps if not s.skipped]
    assert all(s.times_too_large == pytest.approx(s.scale, rel=0.05) for s in taken)
    assert wrong.final_loss > 5 * right.final_loss


def test_masked_fill_overflows_float16_and_finfo_min_does_not():
    q = torch.randn(4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(RuntimeError, match=r"^value cannot be converted to type c10::Half without overflow$"):
        errors.masked_scores(q, q, causal)
    fixed = errors.masked_scores_fixed(q, q, causal)
    assert fixed.dtype == torch.float16 and int((fixed == torch.finfo(torch.float16).min).sum()) == 6


def test_conv_outside_autocast_names_the_bias():
    body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with pytest.raises(RuntimeError, match=r"^Input type \(c10::BFloat16\) and bias type \(float\) should be the same$"):
        errors.head_outside_autocast(body, torch.nn.Conv2d(4, 2, 3), torch.randn(1, 3, 8, 8))


def test_stepping_an_optimizer_without_gradients():
    with pytest.raises(AssertionError, match=r"^No inf checks were recorded for this optimizer\.$"):
        errors.alternating_run(errors.train_alternating_stepping_both)
    assert errors.alternating_run(errors.train_alternating) == (
        "4 iterations: model 1 stepped 2 times, model 2 2 times")


def test_bf16_model_with_float32_class_weights():
    x, y = errors.tiny_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"^expected scalar type BFloat16 but found Float$"):
        errors.weighted_loss_of_bf16_model(errors.tiny_model(), x, y, torch.ones(4))
    assert errors.weighted_loss_under_autocast(errors.tiny_model(), x, y, torch.ones(4)).dtype == torch.float32


def test_bf16_cuda_autocast_on_a_simulated_gpu_without_bf16():
    real = torch.cuda.is_available
    with pytest.raises(RuntimeError, match=r"^Current CUDA Device does not support bfloat16\. Please switch"):
        errors.bf16_autocast_on_gpu_without_bf16()
    assert torch.cuda.is_available is real  # restored


def test_bce_cpu_runs_in_float32_and_cuda_refuses_it_replayed():
    assert errors.bce_under_autocast() == "probabilities torch.bfloat16, loss torch.float32"
    refused = errors.cuda_bce("bce")
    assert refused.startswith("RuntimeError: torch.nn.functional.binary_cross_entropy and "
                              "torch.nn.BCELoss are unsafe to autocast.")
    assert errors.cuda_bce("logits") == "ran: loss torch.float32"
    assert not torch.is_autocast_enabled("cuda")  # the replay restored CUDA autocast's state
    with pytest.raises(ValueError, match="loss must be 'bce' or 'logits'"):
        errors.cuda_bce("mse")


def test_simulated_t4():
    real = torch.cuda.is_available
    assert errors.t4_bf16_answers() == {
        "torch.cuda.is_bf16_supported()": True,
        "torch.cuda.is_bf16_supported(including_emulation=False)": False,
        "report: bfloat16": "emulated only (slow)",
        "report: recommended precision": "fp16 + GradScaler",
    }
    assert torch.cuda.is_available is real


@pytest.mark.skipif(torch.cuda.is_available(), reason="the labels below are the CPU-only ones")
def test_selfcheck_on_cpu_replays_and_simulates():
    verdicts = errors.selfcheck("cpu")
    assert [v.holds for v in verdicts] == [True, True, True]
    assert "replayed on fake CUDA tensors" in verdicts[0].figures
    assert "simulated T4" in verdicts[1].figures


# --- 06's exercise ----------------------------------------------------------------------------


def solved(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    ran = set()
    for opt in optimizers:
        opt.register_step_post_hook(lambda opt, args, kwargs: ran.add(opt))
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        ran.clear()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if opt in ran:  # its own step ran
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def guarding_on_the_scale(models, optimizers, schedulers, batches):
    """Right with one optimizer: with two, one model's overflow drops the scale for both."""
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if scaler.get_scale() >= scale:  # not skipped
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def guarding_on_the_batch(models, optimizers, schedulers, batches):
    """Misses every overflow the batch does not hold."""
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if torch.isfinite(x).all():
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def device_fixed_only(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for opt, scheduler in zip(optimizers, schedulers):
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_as_given():
    verdict = check_two_model_loop(two_model_loop_as_given)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: the GradScaler was built without a device" in text
    assert "bug: scaler.update() ran 8 times for 4 batches" in text
    assert "not seen yet: no step was skipped" in text
    # three lines wrong, three bugs: the weights' inf/NaN is told as the disabled scaler's doing
    assert "(section 8), and the batches with an inf reached the weights (they now hold inf/NaN)" in text
    assert sum(line.strip().startswith("- bug:") for line in text.splitlines()) == 2
    assert sum(line.strip().startswith("- check_loop: a mistake") for line in text.splitlines()) == 3
    # the kind of mistake and where the lesson shows it, not the code to write nor its line
    for fix in ("GradScaler('cpu')", "GradScaler(\"cpu\")", "then scaler.update() once", "line "):
        assert fix not in text


def test_exercise_fixing_the_device_reveals_the_scheduler():
    text = str(check_two_model_loop(device_fixed_only))
    assert "fixed: the GradScaler is built for the cpu and is on" in text
    assert "bug: the schedulers stepped [4, 4] times for [1, 2] AdamW steps, and PyTorch warned" in text
    assert "bug: the weights" not in text and "inf/NaN" not in text


def test_exercise_solved():
    verdict = check_two_model_loop(solved)
    assert verdict.passed, str(verdict)
    assert "fixed: the schedulers stepped [1, 2] times, once per step of their own AdamW" in str(verdict)
    assert "skipped both at batches 0 and 2, model 1's alone at batch 3" in str(verdict)
    assert "check_loop finds nothing in your function" in str(verdict)


def test_exercise_refuses_a_guard_on_the_shared_scale():
    verdict = check_two_model_loop(guarding_on_the_scale)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: the schedulers stepped [1, 1] times for [1, 2] AdamW steps: scheduler 2 missed steps" in text
    assert "At batch 3 only model 1 overflowed" in text


def test_exercise_refuses_a_guard_on_the_batch():
    verdict = check_two_model_loop(guarding_on_the_batch)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: the schedulers stepped [2, 2] times for [1, 2] AdamW steps" in text
    assert "moved on for a step GradScaler skipped (section 1) (at batch 3 the checker put an inf in model 1's gradient alone)" in text


def solved_but_not_clearing_gradients(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for scheduler in schedulers:
            if scaler.get_scale() >= scale:  # not skipped
                scheduler.step()


def skipping_the_inf_batch_by_hand(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        if not torch.isfinite(x).all():
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_requires_the_steps_of_the_clean_batches():
    verdict = check_two_model_loop(solved_but_not_clearing_gradients)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: AdamW stepped [0, 0] times where the batches your loop trained on allow [1, 2]" in text
    assert "fixed: the schedulers" not in text


def test_exercise_describes_a_loop_that_skips_the_inf_batch_itself():
    verdict = check_two_model_loop(skipping_the_inf_batch_by_hand)
    text = str(verdict)
    assert not verdict.passed
    assert ("fixed: scaler.update() ran once per batch, after its last scaler.step (2 times for the 2 "
            "batches your loop scaled)") in text
    # model 1's overflow at batch 3 still reaches GradScaler, and the unguarded schedulers step past it
    assert "bug: the schedulers stepped [2, 2] times for [1, 2] AdamW steps" in text


def skipping_the_inf_batch_by_hand_guarded(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    ran = set()
    for opt in optimizers:
        opt.register_step_post_hook(lambda opt, args, kwargs: ran.add(opt))
    for x, y in batches:
        if not torch.isfinite(x).all():
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        ran.clear()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if opt in ran:
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_describes_a_guarded_loop_that_skips_the_inf_batches_itself():
    verdict = check_two_model_loop(skipping_the_inf_batch_by_hand_guarded)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: GradScaler never saw batch 0 (the one with the inf): your loop kept it from the scaler" in text


def updating_between_the_steps(models, optimizers, schedulers, batches):
    """Hook guards right, but update() between the two scaler.step calls."""
    scaler = torch.amp.GradScaler("cpu")
    ran = set()
    for opt in optimizers:
        opt.register_step_post_hook(lambda opt, args, kwargs: ran.add(opt))
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        ran.clear()
        scaler.step(optimizers[0])
        scaler.update()
        scaler.step(optimizers[1])
        for opt, scheduler in zip(optimizers, schedulers):
            if opt in ran:
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_refuses_an_update_between_the_steps():
    verdict = check_two_model_loop(updating_between_the_steps)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: in 4 of 4 batches a scaler.update() ran between that batch's scaler.scale and its last" in text
    assert "check_loop: a mistake of the kind lesson 06 shows: update-per-optimizer" in text
    rows = errors.two_optimizer_run(errors.step_two_optimizers, steps=1, growth_interval=2000, overflow=(0,))
    assert rows[0][2] == [None, 1.0]  # one update after both steps: model 2 at its true gradient


def guarding_on_the_step_counts(models, optimizers, schedulers, batches):
    """Right: each scheduler steps when its optimizer's step count moved."""
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        counts = [sum(float(s["step"]) for s in o.state.values()) for o in optimizers]
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler, old in zip(optimizers, schedulers, counts):
            if sum(float(s["step"]) for s in opt.state.values()) > old:
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def guarding_on_the_step_counts_unread(models, optimizers, schedulers, batches):
    """Right at run time, with a guard check_loop cannot read (a helper's name)."""
    scaler = torch.amp.GradScaler("cpu")

    def count(o):
        return sum(float(s["step"]) for s in o.state.values())

    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        counts = [count(o) for o in optimizers]
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler, old in zip(optimizers, schedulers, counts):
            if count(opt) > old:
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_accepts_a_guard_on_the_step_counts():
    verdict = check_two_model_loop(guarding_on_the_step_counts)
    assert verdict.passed, str(verdict)
    assert "check_loop finds nothing in your function" in str(verdict)


def test_exercise_lets_the_run_decide_over_check_loops_reading():
    verdict = check_two_model_loop(guarding_on_the_step_counts_unread)
    text = str(verdict)
    assert verdict.passed, text
    assert "check_loop: a note (the run above shows the loop right) of the kind lesson 03 shows: " \
           "scheduler-guard-unread (scheduler.step() may run after a step GradScaler skipped)" in text
    assert "scheduler-unguarded" not in text


def _two_model_loop_in_order(order):
    """Every scheduler guarded by its optimizer's step count, the scheduler stepped and the
    optimizers given to scaler.step in ``order`` ("step first", "scheduler first", "model 1 only")."""
    def loop(models, optimizers, schedulers, batches):
        scaler = torch.amp.GradScaler("cpu")
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
            scaler.scale(loss).backward()
            stepping = optimizers[:1] if order == "model 1 only" else optimizers
            for opt, scheduler in zip(stepping, schedulers):
                old = sum(float(s["step"]) for s in opt.state.values())
                if order == "scheduler first":
                    scheduler.step()
                scaler.step(opt)
                if order != "scheduler first" and sum(float(s["step"]) for s in opt.state.values()) > old:
                    scheduler.step()
            scaler.update()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
    return loop


def test_exercise_names_a_scheduler_stepped_before_its_optimizer():
    verdict = check_two_model_loop(_two_model_loop_in_order("scheduler first"))
    text = str(verdict)
    assert not verdict.passed
    assert "bug: schedulers 1 and 2 stepped before their optimizers' scaler.step" in text
    assert "GradScaler skipped (section 1)" not in text


def test_exercise_names_an_optimizer_never_stepped():
    verdict = check_two_model_loop(_two_model_loop_in_order("model 1 only"))
    text = str(verdict)
    assert not verdict.passed
    assert "bug: optimizer 2 never went through scaler.step" in text
    assert "GradScaler skipped" not in text and "later steps were skipped too" not in text


def test_exercise_passes_the_same_loop_in_the_right_order():
    verdict = check_two_model_loop(_two_model_loop_in_order("step first"))
    assert verdict.passed, str(verdict)
    assert "stepped before" not in str(verdict) and "never went through" not in str(verdict)


def test_exercise_reports_a_crashing_loop():
    def crashing(models, optimizers, schedulers, batches):
        raise KeyError("oops")

    verdict = check_two_model_loop(crashing)
    assert not verdict.passed and "bug: the loop raised KeyError: 'oops'" in str(verdict)
    assert inspect.getsource(crashing)  # its source was readable: the checker read it too


def stepping_some_schedulers(which):
    """The solved loop, stepping only the schedulers whose index is in ``which``."""

    def loop(models, optimizers, schedulers, batches):
        scaler = torch.amp.GradScaler("cpu")
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
            for i, (opt, scheduler) in enumerate(zip(optimizers, schedulers)):
                if i in which and scaler.get_scale() >= scale:
                    scheduler.step()
                opt.zero_grad(set_to_none=True)

    return loop


@pytest.mark.parametrize(("which", "stepped", "said"), [
    ((), "[0, 0]", "schedulers 1 and 2 never stepped, so the lr stayed where it started"),
    ((0,), "[1, 0]", "scheduler 2 never stepped, so the lr stayed where it started"),
])
def test_exercise_tells_schedulers_that_never_step_from_ones_that_step_too_often(which, stepped, said):
    verdict = check_two_model_loop(stepping_some_schedulers(which))
    text = str(verdict)
    assert not verdict.passed
    assert f"bug: the schedulers stepped {stepped} times for [1, 2] AdamW steps: {said}" in text
    assert "moved on for a step GradScaler skipped" not in text
    assert "fixed: the schedulers" not in text


def guarding_the_schedulers_by_batch_number(models, optimizers, schedulers, batches):
    """Right for an inf in the first batch only: the guard knows where the skip was, not that it was."""
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if i > 0:
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_exercise_refuses_a_guard_that_only_knows_the_first_skip():
    verdict = check_two_model_loop(guarding_the_schedulers_by_batch_number)
    assert not verdict.passed
    assert "moved on for a step GradScaler skipped" in str(verdict)


def _guarded_two_model_loop(make_scaler, update_at_top=False, scalers_per_model=False):
    """A right loop (schedulers guarded by step post-hooks), with the scaler built by ``make_scaler``."""
    def loop(models, optimizers, schedulers, batches):
        scalers = [make_scaler() for _ in models] if scalers_per_model else [make_scaler()] * len(models)
        ran = set()
        for opt in optimizers:
            opt.register_step_post_hook(lambda opt, args, kwargs: ran.add(opt))
        for i, (x, y) in enumerate(batches):
            if update_at_top and i:
                scalers[0].update()
            with torch.autocast("cpu", dtype=torch.float16):
                losses = [torch.nn.functional.cross_entropy(m(x), y) for m in models]
            if scalers_per_model:
                for scaler, loss in zip(scalers, losses):
                    scaler.scale(loss).backward()
            else:
                scalers[0].scale(sum(losses)).backward()
            ran.clear()
            for scaler, opt in zip(scalers, optimizers):
                scaler.step(opt)
            if scalers_per_model:
                for scaler in scalers:
                    scaler.update()
            elif not update_at_top:
                scalers[0].update()
            for opt, scheduler in zip(optimizers, schedulers):
                if opt in ran:
                    scheduler.step()
                opt.zero_grad(set_to_none=True)
        if update_at_top:
            scalers[0].update()
    return loop


def test_exercise_records_a_gradscaler_imported_by_name():
    from torch.amp import GradScaler

    verdict = check_two_model_loop(_guarded_two_model_loop(lambda: GradScaler("cpu")))
    assert verdict.passed, str(verdict)
    assert "fixed: the GradScaler is built for the cpu and is on" in str(verdict)


def test_exercise_catches_a_scaler_imported_by_name_without_a_device():
    from torch.amp import GradScaler

    verdict = check_two_model_loop(_guarded_two_model_loop(GradScaler))
    assert not verdict.passed
    assert "bug: the GradScaler was built without a device" in str(verdict)


def test_exercise_accepts_update_at_the_top_of_the_next_iteration():
    verdict = check_two_model_loop(_guarded_two_model_loop(lambda: torch.amp.GradScaler("cpu"), update_at_top=True))
    assert verdict.passed, str(verdict)
    assert "fixed: scaler.update() ran once per batch, after its last scaler.step (4 times for 4 batches)" \
        in str(verdict)


def test_exercise_accepts_one_scaler_per_model():
    verdict = check_two_model_loop(_guarded_two_model_loop(lambda: torch.amp.GradScaler("cpu"),
                                                           scalers_per_model=True))
    text = str(verdict)
    assert verdict.passed, text
    assert "fixed: the 2 GradScalers are built for the cpu and are on" in text
    assert "fixed: scaler.update() ran once per batch, after its last scaler.step ([4, 4] times" in text


def test_exercise_accepts_a_scaler_per_model_updated_in_the_loop_over_them():
    """Section 3's other fix: each model its own loss, backward, GradScaler and update, in one
    loop over (model, optimizer, scheduler, scaler); check_loop tells the scalers apart."""
    def loop(models, optimizers, schedulers, batches):
        scalers = [torch.amp.GradScaler("cpu") for _ in models]
        scales = [s.get_scale() for s in scalers]
        for x, y in batches:
            for k, (model, opt, sched, scaler) in enumerate(zip(models, optimizers, schedulers, scalers)):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                new = scaler.get_scale()
                if new >= scales[k]:
                    sched.step()
                scales[k] = new
                opt.zero_grad(set_to_none=True)

    verdict = check_two_model_loop(loop)
    assert verdict.passed, str(verdict)
    assert "check_loop finds nothing in your function" in str(verdict)


def test_exercise_catches_a_second_scaler_built_without_a_device():
    made = []

    def make():
        made.append(torch.amp.GradScaler("cpu") if not made else torch.amp.GradScaler())
        return made[-1]

    verdict = check_two_model_loop(_guarded_two_model_loop(make, scalers_per_model=True))
    assert not verdict.passed
    assert "bug: the GradScaler was built without a device" in str(verdict)


def test_exercise_catches_a_missing_update_after_a_batch():
    def loop(models, optimizers, schedulers, batches):
        scaler = torch.amp.GradScaler("cpu")
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
            scaler.scale(loss).backward()
            for opt, scheduler in zip(optimizers, schedulers):
                scaler.step(opt)
                scheduler.step()
                opt.zero_grad(set_to_none=True)
            scaler.update()
            if i == 1:
                scaler.update()  # twice after batch 1, never after batch 3
                break

    text = str(check_two_model_loop(loop))
    assert "bug: scaler.update() ran 3 times for the 2 batches your loop scaled" in text


def test_exercise_says_there_is_no_scaler_in_a_scaler_free_loop():
    def bf16_loop(models, optimizers, schedulers, batches):
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
            loss.backward()
            for opt, scheduler in zip(optimizers, schedulers):
                opt.step()
                scheduler.step()
                opt.zero_grad(set_to_none=True)

    verdict = check_two_model_loop(bf16_loop)
    text = str(verdict)
    assert not verdict.passed
    assert "bug: no GradScaler was built in the loop: the exercise trains in float16" in text
    assert "kept it from the scaler" not in text and "scaler.update() ran" not in text
    assert "not seen yet: without a GradScaler no step is skipped" in text


def test_schedulers_on_the_shared_scale_fall_behind_unseen_by_check_loop():
    assert not check_loop(errors.schedule_two_optimizers_on_the_scale)
    verdict = check_two_model_loop(errors.schedule_two_optimizers_on_the_scale)
    assert not verdict.passed
    assert "scheduler 2 missed steps its optimizer took" in str(verdict)


def test_caught_warnings_leaves_out_a_kernel_thread_s_warning():
    import warnings as W

    from amp_lessons import errors as E

    def run():
        W.warn_explicit("housekeeping", ResourceWarning, "/x/site-packages/ipykernel/iostream.py", 1)
        W.warn("from the run", UserWarning, stacklevel=1)
        return 7

    caught, result = E.caught_warnings(run)
    assert result == 7 and [str(w.message) for w in caught] == ["from the run"]


def test_caught_warnings_counts_a_torch_warning_filed_under_its_caller():
    # torch warns with stacklevel=2, so the warning's filename is the caller's, not torch's:
    # lesson 03 counts every warning a skipped step raised, never only those filed under torch.
    import torch as T

    from amp_lessons import errors as E
    from amp_lessons.scaling import SCHEDULER_WARNING, lesson_trainer

    trainer = lesson_trainer("fp16", device="cpu", inject_nonfinite=(0,), step_scheduler_on_skip=True,
                             scheduler=lambda opt: T.optim.lr_scheduler.StepLR(opt, 10, 0.5))
    caught, record = E.caught_warnings(trainer.step)
    assert record.skipped and [SCHEDULER_WARNING in str(w.message) for w in caught] == [True]
    assert "/torch/" not in caught[0].filename.replace("\\", "/")


def _double_step(models, optimizers, schedulers, batches):
    """Steps each optimizer twice when GradScaler let it step: every update applied twice."""
    stepped = [0] * len(optimizers)
    for i, opt in enumerate(optimizers):
        opt.register_step_post_hook(lambda *_, i=i: stepped.__setitem__(i, stepped[i] + 1))
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for i, opt in enumerate(optimizers):
            stepped[i] = 0
            scaler.step(opt)
            if stepped[i]:
                opt.step()
        scaler.update()
        for i, (opt, scheduler) in enumerate(zip(optimizers, schedulers)):
            for _ in range(stepped[i]):
                scheduler.step()
            opt.zero_grad(set_to_none=True)


def test_the_two_model_exercise_refuses_an_optimizer_stepped_twice_per_batch():
    from amp_lessons.exercises import check_two_model_loop

    verdict = check_two_model_loop(_double_step)
    assert not verdict.passed
    assert "AdamW stepped [2, 4] times where the batches your loop trained on allow [1, 2]" in str(verdict)
