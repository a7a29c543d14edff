"""The exercise checkers of lessons 03-05 give consistent, precise feedback."""

import warnings

import torch

from amp_lessons.exercises import (
    amp_step_as_given,
    check_amp_step,
    check_clipping_loop,
    check_setup,
)
from amp_lessons.models import mlp


def _skip_by_scale(model, opt, scaler, scheduler, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale
    if not skipped:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return skipped


def _skip_by_loss(model, opt, scaler, scheduler, x, y):
    """Checks the loss, not the scaler: it misses a skip whose loss is finite (an overflow)."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    if not torch.isfinite(loss):
        opt.zero_grad(set_to_none=True)
        return True
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    return False


def test_the_scale_check_passes():
    verdict = check_amp_step(_skip_by_scale, "cpu")
    assert verdict.passed, str(verdict)
    text = str(verdict)
    assert "scale the loss" not in text and "skipped steps [0, 3, 5]" in text and "applied the other 4" in text


def _skip_when_the_scale_changed(model, opt, scaler, scheduler, x, y):
    """Reads any change of the scale as a skip: a growth looks like one too."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() != scale
    if not skipped:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return skipped


def test_a_changed_scale_is_not_a_skip():
    verdict = check_amp_step(_skip_when_the_scale_changed, "cpu")
    assert not verdict.passed
    assert "but the skipped steps were [0, 3, 5]" in str(verdict)


def test_checking_the_loss_misses_the_overflow_with_a_finite_loss():
    verdict = check_amp_step(_skip_by_loss, "cpu")
    assert not verdict.passed
    text = str(verdict)
    assert "returns True on steps [0, 3], but the skipped steps were [0, 3, 5]" in text
    assert "the loss of step 5 was finite" in text and "scheduler stepped 5 times for 4" in text
    assert "get_scale" not in text  # the kind of mistake, not the fix


def _skip_below_the_starting_scale(model, opt, scaler, scheduler, x, y):
    """Reads a scale below its start as a skip: true after a skip, and on clean steps after it too."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < 65536
    if not skipped:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return skipped


def test_a_threshold_on_the_scale_hears_which_clean_steps_it_flagged():
    verdict = check_amp_step(_skip_below_the_starting_scale, "cpu")
    assert not verdict.passed
    text = str(verdict)
    assert "returns True on steps [0, 1, 3, 4], but the skipped steps were [0, 3, 5]" in text
    assert "steps [1, 4] were applied (AdamW's step count moved), yet it returns True on them" in text
    assert "the loss of step 5 was finite" not in text  # it is no check of the loss


def _no_zero_grad(model, opt, scaler, scheduler, x, y):
    """Never clears .grad: step 0's inf stays in the gradients of every later step."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale
    if not skipped:
        scheduler.step()
    return skipped


def test_a_step_without_zero_grad_hears_why_clean_steps_were_skipped():
    text = str(check_amp_step(_no_zero_grad, "cpu"))
    assert "steps [1, 2, 4, 6] were skipped although their batches were clean" in text
    assert "the gradients entering step 1 already held inf/NaN from an earlier step" in text
    assert "opt.zero_grad()" in text
    # a step that clears .grad never hears it
    assert "already held inf/NaN" not in str(check_amp_step(_skip_by_loss, "cpu"))


def test_the_given_step_is_refused_for_its_two_bugs():
    verdict = check_amp_step(amp_step_as_given, "cpu")
    assert not verdict.passed
    assert "returns True on steps []" in str(verdict) and "scheduler stepped 7 times for 4" in str(verdict)


def test_a_step_that_lets_an_inf_through_is_named():
    def no_scaler(model, opt, scaler, scheduler, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        return False

    verdict = check_amp_step(no_scaler, "cpu")
    assert not verdict.passed and "steps [0, 3, 5] should have been skipped" in str(verdict)


def _unscale_every_micro_batch(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)
    for step in range(steps):
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


def test_a_loop_that_raises_gets_no_findings_about_what_never_ran():
    verdict = check_clipping_loop(_unscale_every_micro_batch, False)
    text = str(verdict)
    assert not verdict.passed and "unscale_() has already been called" in text
    assert "no longer clips" not in text and "for 6 optimizer steps" not in text and "weights moved" not in text
    assert "fixed: the GradScaler is built for the model's device" in text


def test_setup_checker_explains_half_with_a_scaler_and_a_scaler_without_device():
    def half_with_scaler(device_type):
        model = mlp(64, 64, 10).to(device_type).half()
        return model, torch.optim.Adam(model.parameters(), eps=1e-4), torch.amp.GradScaler(device_type), torch.float16

    def no_device(device_type):
        model = mlp(64, 64, 10).to(device_type)
        return model, torch.optim.Adam(model.parameters()), torch.amp.GradScaler(), torch.float16

    text = str(check_setup(half_with_scaler, "cpu"))
    assert "Attempting to unscale FP16 gradients" in text and "which dtype are these weights" in text
    assert "model.half()" not in text  # a question, not the answer
    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = str(check_setup(no_device, "cpu"))
        assert "built for 'cuda' (what torch.amp.GradScaler() means when no device is given)" in text
        assert "GradScaler that does not scale" not in text


def test_setup_checker_refuses_a_scaler_whose_scale_lifts_nothing():
    def never_scales(device_type, growth_interval=10**9):
        model = mlp(64, 64, 10).to(device_type)
        scaler = torch.amp.GradScaler(device_type, init_scale=1.0, growth_interval=growth_interval)
        return model, torch.optim.Adam(model.parameters()), scaler, torch.float16

    for interval in (10**9, 2000):
        verdict = check_setup(lambda d, n=interval: never_scales(d, n), "cpu", steps=2)
        text = str(verdict)
        assert not verdict.passed and "starts at scale 1: a loss multiplied by at most 1" in text
        assert f"only after {interval:,} steps" in text and "Keep the default init_scale" in text
        assert "right: float16 with a GradScaler" not in text


def test_setup_checker_asks_for_a_scale_that_lifts_subnormals():
    def scaled_by(init_scale):
        def setup(device_type):
            model = mlp(64, 64, 10).to(device_type)
            return (model, torch.optim.Adam(model.parameters()),
                    torch.amp.GradScaler(device_type, init_scale=init_scale), torch.float16)
        return setup

    low = check_setup(scaled_by(1.5), "cpu", steps=2)
    assert not low.passed and "starts at scale 1.5, below 2**10" in str(low)
    assert "stays below its smallest normal, 2^-14" in str(low) and "only after 2,000 steps" in str(low)
    enough = check_setup(scaled_by(2.0**10), "cpu", steps=2)
    assert enough.passed and "right: float16 with a GradScaler" in str(enough)


def test_setup_checker_names_an_optimizer_built_on_another_model():
    def other_params(device_type):
        model = mlp(64, 64, 10).to(device_type)
        return (model, torch.optim.Adam(mlp(64, 64, 10).parameters()), torch.amp.GradScaler(device_type),
                torch.float16)

    verdict = check_setup(other_params, "cpu", steps=2)
    text = str(verdict)
    assert not verdict.passed and "the optimizer holds none of this model's parameters" in text
    assert "No inf checks were recorded" in text and "which parameters was the optimizer built on?" in text


def test_setup_checker_fails_an_optimizer_given_only_some_parameters():
    def partial(device_type):
        model = mlp(64, 64, 10).to(device_type)
        return (model, torch.optim.Adam(list(model.parameters())[:1]), torch.amp.GradScaler(device_type),
                torch.float16)

    verdict = check_setup(partial, "cpu", steps=2)
    text = str(verdict)
    n_left = sum(p.numel() for p in list(mlp(64, 64, 10).parameters())[1:])
    assert not verdict.passed
    assert f"the optimizer holds 1 of this model's 6 parameter tensors: the other 5 ({n_left:,} weights)" in text


def test_setup_checker_gives_float64_weights_their_own_finding():
    def doubled(device_type):
        model = mlp(64, 64, 10).to(device_type).double()
        return model, torch.optim.Adam(model.parameters()), torch.amp.GradScaler(device_type), torch.float16

    text = str(check_setup(doubled, "cpu", steps=2))
    assert "are torch.float64: the recipe keeps master weights in float32" in text
    assert "in which dtype do small updates survive" not in text and "Adam's eps" not in text


def test_the_broken_loop_is_refused_bug_by_bug():
    from amp_lessons.exercises import broken_clipping_loop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict = check_clipping_loop(lambda *args, **kwargs: broken_clipping_loop(*args, **kwargs), False)
    text = str(verdict)
    assert not verdict.passed and "built without a device" in text and "ran before scaler.unscale_" in text
    assert "weights moved ≈" in text and "right: in this loop it is not a bug" in text


def test_calling_backward_inside_autocast_is_answered_with_when_it_matters():
    from amp_lessons.exercises import fixed_clipping_loop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrong = check_clipping_loop(fixed_clipping_loop, True)
        right = check_clipping_loop(fixed_clipping_loop, False)
    assert not wrong.passed and "think again" in str(wrong) and "not a bug" not in str(wrong)
    assert right.passed and "right: in this loop it is not a bug" in str(right)
    for text in (str(wrong), str(right)):  # the case where it is a bug, named in both
        assert "autocast(enabled=False)" in text and "custom_bwd" in text


def test_setup_checker_refuses_bf16_for_the_float16_task_and_names_the_mistake_not_the_fix():
    from amp_lessons.exercises import broken_setup

    def to_bf16(device_type):
        model = mlp(64, 64, 10).to(device_type)
        return model, torch.optim.Adam(model.parameters()), torch.amp.GradScaler(device_type, enabled=False), \
            torch.bfloat16

    verdict = check_setup(to_bf16, "cpu", steps=2)
    assert not verdict.passed and "the task is a float16 run" in str(verdict)
    text = str(check_setup(broken_setup, "cpu", steps=2))
    assert "enabled=(dtype == torch.float16)" not in text and "does not scale" in text
    assert "decides whether it is enabled" not in text  # names the symptom, not where the fix goes
    # Adam's eps is a consequence of model.half(), reported with it, not as a third mistake
    assert sum("eps=1e-08" in line for line in text.splitlines()) == 1 and "The same mistake" in text


def _fp16_policy_record():
    """One rank's record of an fsdp_job with MixedPrecisionPolicy(param_dtype=torch.float16)."""
    return {"param_dtype": "fp16", "reduce_dtype": None, "sharded": {"dtype": "float32"},
            "forward": {"dtype": "float16"}, "gather": {"sent": ["float16"], "buffer": ["float16"]},
            "reduce": {"sent": ["float16"], "buffer": ["float16"], "ops": ["sum"]}, "grad": {"dtype": "float32"}}


def test_policy_prediction_takes_the_op_in_any_case_as_the_dtypes():
    from amp_lessons.exercises import check_policy_prediction

    right = {"sharded": "FLOAT32", "forward": torch.float16, "reduce_scatter": "fp16", "gradient": "float32"}
    for op in ("sum", "SUM", " Sum "):
        assert check_policy_prediction(dict(right, op=op), _fp16_policy_record()).passed, op
    assert not check_policy_prediction(dict(right, op="AVG"), _fp16_policy_record()).passed


def test_policy_prediction_hints_point_without_naming_the_answer():
    from amp_lessons.exercises import check_policy_prediction

    # reduce_scatter's hint names reduce_dtype=None's default, which differs by torch release
    wrong = {"sharded": "bf16", "forward": "bf16", "reduce_scatter": "fp16", "gradient": "bf16", "op": "avg"}
    verdict = check_policy_prediction(wrong, _fp16_policy_record())
    assert not verdict.passed and len([f for f in verdict.findings if "not " in f]) == 4
    hints = " ".join(f for f in verdict.findings if not f.startswith(("(the run", "right:")))
    for answer in ("float32", "float16", "fp16", "fp32", "overflow", "AdamW updates"):
        assert answer not in hints.replace("'bf16'", ""), answer


def _scheduler_first(model, opt, scaler, scheduler, x, y):
    """Sees the skip from the unscaled gradients, but steps the scheduler before the optimizer."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    skipped = not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    if not skipped:
        scheduler.step()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return skipped


def test_a_scheduler_stepped_before_the_optimizer_hears_the_order_not_the_guard():
    verdict = check_amp_step(_scheduler_first, "cpu")
    text = str(verdict)
    assert not verdict.passed
    assert "once per applied optimizer step, yet PyTorch warned" in text and "opposite order" in text
    assert "step the scheduler after scaler.step(opt)" in text
    assert "only when the step was not skipped" not in text


def _step_count_aliased(model, opt, scaler, scheduler, x, y):
    """Keeps the step tensor itself, not its value: it compares the tensor with itself."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    p = next(model.parameters())
    before = opt.state[p]["step"] if p in opt.state else None
    scaler.step(opt)
    scaler.update()
    skipped = before is None or bool(opt.state[p]["step"] == before) if p in opt.state else True
    if not skipped:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return skipped


def test_a_step_count_compared_with_itself_hears_to_copy_it():
    text = str(check_amp_step(_step_count_aliased, "cpu"))
    assert "it returns True on the applied steps after the first" in text and "float(opt.state[p]['step'])" in text


def _step_count_read_before_any_step(model, opt, scaler, scheduler, x, y):
    """Reads Adam's step count before the optimizer has any state."""
    p = next(model.parameters())
    before = float(opt.state[p]["step"])
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return float(opt.state[p]["step"]) == before


def test_reading_an_empty_optimizer_state_hears_why():
    text = str(check_amp_step(_step_count_read_before_any_step, "cpu"))
    assert "KeyError" in text and "AdamW's state is empty until its first applied step" in text
