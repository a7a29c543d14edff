"""The training loop: skipped steps, the loss scale, checkpoints, errors, the history.

References: the optimizer's own step counter, parameters compared bit for bit, scales
computed by hand from GradScaler's rules, an uninterrupted run for a resumed one.
"""

import functools
import math
import re
import warnings

import pytest
import torch

from amp_lessons.data import digits
from amp_lessons.models import mlp
from amp_lessons.scaling import first_step_gradients, flush_report, optimizer_steps
from amp_lessons.training import (
    GradientRecorder,
    NonFiniteLossError,
    ScaleCollapseError,
    Trainer,
    _count_zeros,
    _global_norm,
)

DATA = digits()
SCHEDULER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def small_model(seed=0, hidden=32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mlp(64, hidden, 10, depth=2)


def trainer(precision="fp16", seed=0, hidden=32, **kwargs):
    """A Trainer of the small MLP (its weights from ``seed``) with Adam at lr 1e-3, or the
    ``optimizer`` given, which then sets its own lr."""
    defaults = {"optimizer": "adam", "batch_size": 32, "init_scale": 2.0**10}
    if isinstance(kwargs.get("optimizer", "adam"), str):
        defaults["lr"] = 1e-3
    kwargs = {**defaults, **kwargs}
    return Trainer(small_model(seed, hidden), DATA, precision=precision, device="cpu", **kwargs)


def params(t):
    return [p.detach().clone() for p in t.model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def optimizer_tensors(t):
    return [v for s in t.optimizer.state_dict()["state"].values() for v in s.values()]


def without_time(history):
    """The records but their times, NaN as a string (a skipped step's norms are NaN)."""
    return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items() if k != "ms"}
            for r in history.as_dicts()]


# -- skipped steps -----------------------------------------------------------------------------


@pytest.mark.parametrize("inject", [(3,), (1, 4, 5)])
def test_injected_inf_steps_are_skipped_and_leave_parameters_unchanged(inject):
    t = trainer(inject_nonfinite=inject)
    total = 8
    for i in range(total):
        before = params(t)
        record = t.step()
        assert record.skipped == (i in inject), f"step {i}"
        assert same(before, params(t)) == (i in inject), f"step {i}: parameters"
    assert t.history.skipped == len(inject)
    assert [r.step for r in t.history if r.skipped] == list(inject)
    for p in t.model.parameters():  # Adam counts only the steps it applied
        assert int(t.optimizer.state[p]["step"]) == total - len(inject)
    assert optimizer_steps(t.optimizer) == total - len(inject)


def test_the_loss_of_a_skipped_step_is_recorded_as_inf():
    t = trainer(inject_nonfinite=(2,))
    h = t.fit(4)
    assert math.isinf(h[2].loss) and all(math.isfinite(v) for i, v in enumerate(h["loss"]) if i != 2)


def test_scale_halves_on_each_skip_and_doubles_after_growth_interval_clean_steps():
    t = trainer(init_scale=2.0**10, growth_interval=3, inject_nonfinite=(4, 9))
    h = t.fit(13)
    # by hand: 3 clean steps (0-2) -> x2 before step 3; step 4 skipped -> /2; steps 5-7
    # clean -> x2; step 8 clean; step 9 skipped -> /2 (the growth count restarts); 10-12 -> x2
    k = 2.0**10
    assert h["scale"] == [k, k, k, 2 * k, 2 * k, k, k, k, 2 * k, 2 * k, k, k, k]
    assert t.current_scale() == 2 * k
    assert [r.step for r in h if r.skipped] == [4, 9]


def test_a_scale_that_keeps_falling_raises_scale_collapse_instead_of_skipping_forever():
    t = trainer(init_scale=2.0**4, min_scale=2.0**-4, inject_nonfinite=range(100))
    before = params(t)
    with pytest.raises(ScaleCollapseError, match="floor") as err:
        t.fit(50)
    # 2^4 halves 9 times to 2^-5, below the floor 2^-4: raised after step 8
    assert "at step 8 after 9 skipped steps" in str(err.value)
    assert len(t.history) == 9 and t.history.skipped == 9
    assert same(before, params(t))


# -- fp16 without a scaler ---------------------------------------------------------------------


def test_fp16_without_a_scaler_flushes_more_gradients_than_fp32_on_the_lessons_configuration():
    fp32 = first_step_gradients("fp32", device="cpu")
    fp16 = first_step_gradients("fp16", scaler=False, device="cpu")
    report = flush_report(fp32, fp16)
    assert report.zero_other / report.total > report.zero_reference / report.total + 0.3
    assert report.flushed_fraction > 0.5
    # the same first step through the Trainer's own history column
    zero_frac = {}
    for name, precision, scaler in (("fp32", "fp32", None), ("fp16", "fp16", False)):
        from amp_lessons.scaling import lesson_trainer

        zero_frac[name] = lesson_trainer(precision, scaler, device="cpu", progress=False).fit(1)[0].zero_frac
    assert zero_frac["fp16"] == pytest.approx(report.zero_other / report.total)
    assert zero_frac["fp32"] == pytest.approx(report.zero_reference / report.total)


def test_bf16_and_a_scaler_keep_the_gradients_that_fp16_alone_flushes():
    fp32 = first_step_gradients("fp32", device="cpu")
    for other, kwargs in (("bf16", {}), ("fp16", {"scaler": True})):
        report = flush_report(fp32, first_step_gradients(other, device="cpu", **kwargs), other)
        # not none at all: a sum that cancels can round to exactly 0 in 16 bits
        assert report.flushed_fraction < 1e-3, report


def test_zero_frac_is_the_exact_share_of_zero_gradient_values():
    counts = []

    class Count:
        def after_backward(self, t):
            grads = [p.grad for p in t.model.parameters()]
            counts.append(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))

    t = trainer("fp16", scaler=False, teaching=True, callbacks=[Count()])
    assert t.fit(3)["zero_frac"] == counts


def clip_grad_norms_norm(grads):
    """The total norm ``clip_grad_norm_`` computes (and returns), on every torch release."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf)


def test_global_norm_is_clip_grad_norms_norm():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, 200, generator=g) * 1e-3, torch.randn(7, generator=g), torch.randn(3, 1, generator=g).t()]
    reference = clip_grad_norms_norm(grads)
    assert _global_norm(grads).item() == pytest.approx(reference.item(), rel=1e-6)
    exact = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    assert _global_norm(grads).item() == pytest.approx(exact, rel=1e-6)
    huge = [torch.full((4,), 1e20), torch.ones(3)]  # squares overflow float32, as in the clip
    assert math.isinf(_global_norm(huge).item()) and math.isinf(clip_grad_norms_norm(huge).item())
    assert math.isinf(_global_norm([torch.tensor([1.0, math.inf])]).item())
    assert math.isnan(_global_norm([torch.tensor([1.0, math.nan])]).item())
    assert _global_norm([]).item() == 0.0


def test_count_zeros_counts_negative_zero_and_not_nan():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        g = torch.tensor([0.0, -0.0, 1e-30, -1.0, float("nan"), float("inf"), 0.0], dtype=dtype)
        assert int(_count_zeros([g, g[:2], g[2:]])) == 2 * int((g == 0).sum())
    mixed = [torch.tensor([-0.0, 1.0]), torch.tensor([0.0, -0.0, 2.0], dtype=torch.float16)]
    assert int(_count_zeros(mixed)) == 3 and int(_count_zeros([torch.ones(3)])) == 0


# -- the loop's GradScaler ---------------------------------------------------------------------


def test_the_loop_never_builds_a_grad_scaler_without_a_device(monkeypatch):
    calls = []
    real = torch.amp.GradScaler

    class Recording(real):
        def __init__(self, *args, **kwargs):
            calls.append((args, kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    for precision, scaler in (("fp32", None), ("bf16", None), ("fp16", None), ("fp16", False)):
        trainer(precision, scaler=scaler, teaching=True).fit(1)
    assert len(calls) == 4
    for args, kwargs in calls:
        device = args[0] if args else kwargs.get("device")
        assert device == "cpu", (args, kwargs)


# -- non-finite losses without a scaler --------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_a_non_finite_loss_without_a_scaler_raises_naming_the_step(precision, accum_steps):
    t = trainer(precision, inject_nonfinite=(3,), accum_steps=accum_steps)
    t.fit(3)
    before = params(t)
    with pytest.raises(NonFiniteLossError, match="at step 3"):
        t.fit(5)
    assert same(before, params(t))
    assert t.step_count == 3 and len(t.history) == 3
    assert all(p.grad is None for p in t.model.parameters())


def test_fp16_without_a_scaler_warns_unless_teaching():
    with pytest.warns(UserWarning, match="fp16 without a GradScaler"):
        trainer("fp16", scaler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer("fp16", scaler=False, teaching=True)
        trainer("bf16", scaler=False)


def test_the_wrong_clip_order_warns_unless_teaching():
    with pytest.warns(UserWarning, match="clip_order='before_unscale'"):
        trainer("fp16", clip_norm=1.0, clip_order="before_unscale")


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


# -- the lr scheduler after a skipped step -----------------------------------------------------


def test_stepping_the_scheduler_after_a_skipped_first_step_warns():
    t = trainer("fp16", inject_nonfinite=(0,), scheduler=step_lr, step_scheduler_on_skip=True)
    with pytest.warns(UserWarning, match=SCHEDULER_WARNING.replace("(", r"\(").replace(")", r"\)")):
        t.fit(2)
    assert t.scheduler.last_epoch == 2  # stepped for the skipped step too


def test_by_default_the_scheduler_steps_only_with_the_optimizer():
    t = trainer("fp16", inject_nonfinite=(0, 4), scheduler=step_lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(8)
    assert not [w for w in caught if SCHEDULER_WARNING in str(w.message)]
    assert t.scheduler.last_epoch == optimizer_steps(t.optimizer) == 6
    # the schedule follows applied steps: StepLR(3, 0.5) halved the lr twice in 6
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    assert t.history[0].lr == t.history[1].lr == 1e-3  # step 1 used the lr step 0 did not


def test_the_history_records_the_lr_each_step_used():
    h = trainer("fp32", scheduler=step_lr).fit(7)  # StepLR(3, 0.5): halved after steps 2 and 5
    assert h["lr"] == pytest.approx([1e-3] * 3 + [5e-4] * 3 + [2.5e-4])


def test_the_scheduler_warning_comes_from_the_lessons_run_too():
    from amp_lessons.scaling import scheduler_warnings

    wrong, t = scheduler_warnings(True)
    assert t.history[0].skipped and any(SCHEDULER_WARNING in m for m in wrong)
    right, t = scheduler_warnings(False)
    assert t.history[0].skipped and not right


def test_history_records_the_unscaled_loss_and_gradient_norm():
    """The fp16 + scaler run's numbers are fp32's, not multiplied by the scale."""
    fp32 = trainer("fp32").fit(3)
    fp16 = trainer("fp16", init_scale=2.0**12).fit(3)
    for a, b in zip(fp32, fp16):
        assert b.loss == pytest.approx(a.loss, rel=2e-2)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=5e-2)
        assert b.scale == 2.0**12 and a.scale == 1.0


def test_a_callable_loss_and_optimizer_are_used():
    seen = []

    def loss_fn(logits, y):
        seen.append(logits.shape)
        return torch.nn.functional.cross_entropy(logits, y)

    t = trainer("fp32", loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    t.fit(2)
    assert seen == [torch.Size([32, 10])] * 2 and isinstance(t.optimizer, torch.optim.SGD)


# -- grad_stats: the per-step gradient statistics, on or off ----------------------------------


@pytest.mark.parametrize(("clip_norm", "clip_order"), [(None, "unscale_first"), (0.5, "unscale_first"),
                                                       (0.5, "before_unscale")])
def test_grad_stats_off_skips_the_statistics_and_changes_nothing_else(monkeypatch, clip_norm, clip_order):
    kwargs = {"clip_norm": clip_norm, "clip_order": clip_order, "teaching": True, "inject_nonfinite": (2,)}
    on = trainer("fp16", **kwargs)
    h_on = on.fit(4)
    import amp_lessons.training as training

    def must_not_run(*args):
        raise AssertionError("grad_stats=False still read every gradient")

    monkeypatch.setattr(training, "_count_zeros", must_not_run)
    monkeypatch.setattr(training, "_global_norm", must_not_run)
    off = trainer("fp16", grad_stats=False, **kwargs)
    h_off = off.fit(4)
    assert same(params(on), params(off)) and same(optimizer_tensors(on), optimizer_tensors(off))
    for a, b in zip(h_on, h_off):
        assert (a.loss, a.scale, a.skipped, a.lr) == (b.loss, b.scale, b.skipped, b.lr)
        assert math.isnan(b.zero_frac) and not math.isnan(a.zero_frac)
        if clip_norm is None:  # nothing computed the norm
            assert math.isnan(b.grad_norm) and math.isnan(b.applied_norm)
        else:  # the clip computed it anyway: recorded, the same value as with the statistics on
            assert b.grad_norm == a.grad_norm or (math.isnan(a.grad_norm) and math.isnan(b.grad_norm))
            assert b.clip_seen_norm == a.clip_seen_norm or math.isnan(a.clip_seen_norm)
            if clip_order == "unscale_first":
                assert b.applied_norm == a.applied_norm or math.isnan(a.applied_norm)
            else:
                assert math.isnan(b.applied_norm)  # after the clip: one more read, skipped
    assert [r.skipped for r in h_off] == [False, False, True, False]


def test_grad_stats_must_be_a_bool():
    with pytest.raises(TypeError, match="grad_stats must be True .* or False"):
        trainer("fp32", grad_stats="yes")
    assert trainer("fp32").grad_stats is True


# -- skipped steps, counted from what the optimizer did ----------------------------------------


def keep_scale_fixed(t):
    """Make ``update()`` leave the scale where it was: a skip can no longer be read from the scale."""
    real = t.scaler.update
    t.scaler.update = lambda new_scale=None: real(new_scale=t.scaler.get_scale())


OPTIMIZERS = {
    "adam": "adam",
    "sgd without state": functools.partial(torch.optim.SGD, lr=0.1),
    "sgd with momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "fused adamw (handles the scaler itself)": functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skips_are_counted_from_the_optimizer_not_from_the_scale(name):
    t = trainer(optimizer=OPTIMIZERS[name], inject_nonfinite=(1, 3))
    keep_scale_fixed(t)
    applied = []
    t.optimizer.register_step_post_hook(lambda *_: applied.append(t.step_count))
    for i in range(5):
        before = params(t)
        record = t.step()
        assert record.skipped == (i in (1, 3)), f"step {i}"
        assert same(before, params(t)) == record.skipped, f"step {i}: parameters"
    assert t.current_scale() == 2.0**10  # never moved: the scale said nothing
    assert t.history.skipped == 2
    if name.startswith("fused"):  # called every time; the kernel itself skipped the update
        assert len(applied) == 5 and int(t.optimizer.state[t.model[0].weight]["step"]) == 3
    else:
        assert applied == [0, 2, 4]


def test_the_lr_scheduler_follows_the_applied_steps_even_when_the_scale_stays():
    t = trainer(inject_nonfinite=(0, 2), scheduler=step_lr)
    keep_scale_fixed(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        t.fit(5)
    assert t.scheduler.last_epoch == optimizer_steps(t.optimizer) == 3


@pytest.mark.parametrize("init_scale", [2.0**10, 3.0 * 2**20, 1.7e38])
def test_the_backoff_closest_to_1_that_is_accepted_really_lowers_the_scale(init_scale):
    t = trainer(init_scale=init_scale, backoff_factor=1 - 2.0**-23, inject_nonfinite=(0, 1, 2))
    t.fit(3)
    scales = [*t.history["scale"], t.current_scale()]
    assert all(b < a for a, b in zip(scales, scales[1:])), scales


@pytest.mark.parametrize("init_scale", [2.0**3, 3.0 * 2**3 + 0.5])
def test_the_growth_closest_to_1_that_is_accepted_really_raises_the_scale(init_scale):
    t = trainer(init_scale=init_scale, growth_factor=1 + 2.0**-23, growth_interval=1)
    t.fit(3)
    scales = [*t.history["scale"], t.current_scale()]
    assert t.history.skipped == 0 and all(b > a for a, b in zip(scales, scales[1:])), scales


# -- clear errors for bad arguments ------------------------------------------------------------


def reduce_on_plateau(opt):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt)


class NotAnOptimizer:
    def __init__(self, params):
        self.params = list(params)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"seed": "abc"}, TypeError, "seed must be an integer from 0 to 2**32 - 1, e.g. seed=0; got 'abc'"),
    ({"seed": 1.5}, TypeError, "seed must be an integer from 0 to 2**32 - 1"),
    ({"seed": -1}, ValueError, "seed must be an integer from 0 to 2**32 - 1, e.g. seed=0; got -1"),
    ({"seed": 2**32}, ValueError, "seed must be an integer from 0 to 2**32 - 1"),
    ({"scheduler": "cosine"}, TypeError, "scheduler must be a function that takes the optimizer and returns "
                                         "an lr scheduler, e.g. scheduler=lambda opt: torch.optim.lr_scheduler."
                                         "StepLR(opt, step_size=100, gamma=0.5); got 'cosine'"),
    ({"scheduler": torch.optim.lr_scheduler.StepLR}, TypeError,
     "scheduler(optimizer) raised TypeError: "),
    ({"scheduler": reduce_on_plateau}, TypeError,
     "ReduceLROnPlateau.step() needs metrics, and the Trainer steps its scheduler after every optimizer "
     "step with no argument"),
    ({"scheduler": lambda opt: 0.5}, TypeError, "scheduler(optimizer) must return an lr scheduler"),
    ({"lr": True}, ValueError, "lr must be a positive finite number; got True"),
    ({"clip_norm": True}, ValueError, "clip_norm must be a positive finite number; got True"),
    ({"loss_fn": None}, TypeError, "loss_fn must be a function of (logits, labels) that returns the loss"),
    ({"init_scale": 1e39}, ValueError, "init_scale must lie between 1.18e-38 and 3.4e+38, the normal float32 "
                                       "numbers: GradScaler keeps the scale in float32; got 1e+39"),
    ({"init_scale": 2.0**-20}, ValueError, "init_scale (9.5367431640625e-07) must be at least min_scale"),
    ({"inject_nonfinite": ("3",)}, ValueError, "inject_nonfinite must hold step numbers (integers >= 0)"),
    ({"inject_nonfinite": 3}, TypeError, "inject_nonfinite must be a collection of step numbers"),
    ({"optimizer": NotAnOptimizer}, TypeError, "optimizer(params) must return a torch.optim.Optimizer"),
])
def test_bad_arguments_say_what_to_do(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Trainer(small_model(), DATA, precision="fp16", device="cpu", **kwargs)


def test_reduce_lr_on_plateau_is_stepped_by_hand_as_the_error_says():
    t = trainer("fp32")
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(t.optimizer, mode="max", patience=0)
    for _ in range(3):
        t.fit(2)
        sched.step(0.5)  # a metric that never improves: the lr falls
    assert t.optimizer.param_groups[0]["lr"] < 1e-3


def test_a_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got function"):
        Trainer(lambda x: x, DATA, device="cpu")


def test_evaluate_on_an_empty_test_split_says_so():
    from amp_lessons.data import Dataset

    empty = Dataset(DATA.x_train, DATA.y_train, DATA.x_test[:0], DATA.y_test[:0], name="digits")
    t = Trainer(small_model(), empty, device="cpu", progress=False)
    t.fit(1)
    with pytest.raises(ValueError, match=re.escape("the test split of digits is empty, so there is no "
                                                   "accuracy to measure; build the data with test examples")):
        t.evaluate()
    assert t.model.training
    assert 0.0 <= trainer("fp32").evaluate() <= 1.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_integer_inputs_get_an_error_naming_both_dtypes(precision):
    from amp_lessons.data import Dataset

    ints = Dataset((DATA.x_train * 16).long(), DATA.y_train, (DATA.x_test * 16).long(), DATA.y_test)
    t = Trainer(small_model(), ints, precision=precision, device="cpu", progress=False)
    before = params(t)
    message = "the model got inputs of dtype int64, but its weights are float32: it computes in floating " \
              "point and expects floating-point inputs (torch said: "
    with pytest.raises(TypeError, match=re.escape(message)) as err:
        t.fit(1)
    assert "Dataset(x_train.float(), y_train, x_test.float(), y_test)" in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own message, kept as the cause
    assert same(before, params(t)) and t.step_count == 0
    with pytest.raises(TypeError, match=re.escape(message)):
        t.evaluate()
    assert t.model.training


def test_inputs_of_the_wrong_width_say_what_the_model_and_the_data_hold():
    t = trainer("fp32", hidden=16)
    t.model[0] = torch.nn.Linear(63, 16)  # the wrong input width: not a dtype problem
    said = re.escape("the model cannot take this data's inputs of shape [32, 64] (torch said: ")
    # torch 2.15 names the op first ("addmm: mat1 and mat2 ..."); earlier releases do not
    with pytest.raises(ValueError, match=said + r"(addmm: )?mat1 and mat2 shapes cannot be multiplied") as err:
        t.fit(1)
    assert "mlp(64, ...)" in str(err.value) and isinstance(err.value.__cause__, RuntimeError)


def test_labels_beyond_the_models_outputs_are_refused_before_any_step():
    from amp_lessons.data import Dataset

    shifted = Dataset(DATA.x_train, DATA.y_train + 5, DATA.x_test, DATA.y_test)
    t = Trainer(small_model(), shifted, device="cpu", progress=False)
    before = params(t)
    with pytest.raises(ValueError, match="data.y_train holds the class number 1[0-4], but the model gives 10 scores"):
        t.fit(1)
    assert same(before, params(t)) and t.step_count == 0
    at_the_edge = DATA.y_train.clone()
    at_the_edge[0] = 10  # one past the last of 10 classes
    with pytest.raises(ValueError, match="holds the class number 10, but the model gives 10 scores"):
        Trainer(small_model(), Dataset(DATA.x_train, at_the_edge, DATA.x_test, DATA.y_test), device="cpu").fit(1)
    ignored = DATA.y_train.clone()
    ignored[:5] = -100  # cross_entropy's ignore_index: allowed
    Trainer(small_model(), Dataset(DATA.x_train, ignored, DATA.x_test, DATA.y_test), device="cpu").fit(1)


# -- gradient accumulation, against a loop written out by hand ----------------------------------


def hand_accumulation(model, steps, accum_steps, batch_size, lr, seed=0):
    """The recipe in fp32 with SGD, written out: micro-batch ``step * k + i`` of the seeded
    order, each loss divided by ``k``, one update per ``k`` backward passes."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum_steps):
            x, y = DATA.batch(step * accum_steps + micro, batch_size, seed)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if accum_steps > 1:
                loss = loss / accum_steps
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.mark.parametrize("accum_steps", [1, 2, 3, 4])
def test_accumulation_steps_match_a_hand_written_loop_bit_for_bit(accum_steps):
    """Every step draws its own k new micro-batches (not those of an earlier step) and
    divides each loss by k: 4 steps compared with the loop above, parameter bit for bit."""
    t = trainer("fp32", optimizer=lambda p: torch.optim.SGD(p, lr=0.1), accum_steps=accum_steps, batch_size=16)
    h = t.fit(4)
    reference = small_model()
    losses = hand_accumulation(reference, 4, accum_steps, 16, lr=0.1)
    assert same(params(t), [p.detach() for p in reference.parameters()])
    assert h["loss"] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("accum_steps", [2, 3])
def test_accumulated_gradients_are_the_mean_over_the_micro_batches(accum_steps):
    """k micro-batches of b, each divided by k: the gradient of one batch of k * b examples
    (an undivided loss would give k times it)."""
    seen = []

    class Grads:
        def after_backward(self, t):
            seen.append(torch.cat([p.grad.flatten() for p in t.model.parameters()]).clone())

    trainer("fp32", accum_steps=accum_steps, batch_size=16, callbacks=[Grads()]).fit(1)
    model = small_model()  # the weights the trainer started from
    xs, ys = zip(*(DATA.batch(i, 16, 0) for i in range(accum_steps)))
    torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    big = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(seen[0], big, rtol=1e-5, atol=1e-7)


# -- the norms the history records, around the clip ---------------------------------------------


@pytest.mark.parametrize("clip_order", ["unscale_first", "before_unscale"])
def test_applied_norm_is_the_norm_of_the_gradients_the_optimizer_applies(clip_order):
    """Read from the gradients at the optimizer's own step (a post-hook, before zero_grad)."""
    t = trainer("fp16", clip_norm=0.05, clip_order=clip_order, teaching=True, init_scale=2.0**10)
    at_step = []
    t.optimizer.register_step_post_hook(
        lambda opt, *_: at_step.append(float(torch.cat([p.grad.flatten() for p in t.model.parameters()]).norm())))
    h = t.fit(3)
    assert [r.skipped for r in h] == [False] * 3
    assert h["applied_norm"] == pytest.approx(at_step, rel=1e-4)
    for r in h:
        assert r.grad_norm > 0.05  # every step was clipped ...
        if clip_order == "unscale_first":  # ... down to clip_norm
            assert r.applied_norm == pytest.approx(0.05, rel=1e-4) and r.clip_seen_norm == pytest.approx(r.grad_norm)
        else:  # ... down to clip_norm / scale: the trap of lesson 04
            assert r.applied_norm == pytest.approx(0.05 / r.scale, rel=1e-3)
            assert r.clip_seen_norm == pytest.approx(r.grad_norm * r.scale, rel=1e-3)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"steps": "a"}, TypeError, "steps must be a collection of step numbers"),
    ({"steps": None}, TypeError, "steps must be a collection of step numbers"),
    ({"steps": (-1,)}, ValueError, "steps must hold step numbers (integers >= 0)"),
    ({"module_types": "Linear"}, TypeError, "module_types must be module classes, e.g. (torch.nn.Linear,)"),
])
def test_a_gradient_recorder_checks_its_arguments(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        GradientRecorder(**kwargs)
    assert GradientRecorder(steps=range(2), module_types=torch.nn.Linear).module_types == (torch.nn.Linear,)


# -- the optimizer: built with the lr asked for, on this model's parameters ----------------------


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def test_an_optimizer_class_trains_with_the_lr_given():
    """The issue's case: optimizer=torch.optim.SGD, lr=0.5 trained at SGD's default lr."""
    t = trainer("fp32", optimizer=torch.optim.SGD, lr=0.5, progress=False)
    assert isinstance(t.optimizer, torch.optim.SGD) and t.optimizer.param_groups[0]["lr"] == 0.5
    assert t.fit(1)[0].lr == 0.5 and t.lr == 0.5
    assert trainer("fp32", optimizer="SGD", lr=None).optimizer.param_groups[0]["lr"] == 1e-3


def test_an_optimizer_built_elsewhere_keeps_its_lr_and_may_not_be_contradicted():
    model = small_model()
    t = Trainer(model, DATA, device="cpu", optimizer=torch.optim.SGD(model.parameters(), lr=0.25))
    assert t.lr == 0.25 and t.fit(1)[0].lr == 0.25
    with pytest.raises(ValueError, match="the optimizer was built with lr 0.25, and lr=0.5 was passed too"):
        Trainer(model, DATA, device="cpu", optimizer=lambda p: torch.optim.SGD(p, lr=0.25), lr=0.5)


def test_an_optimizer_of_another_models_parameters_is_refused():
    other = small_model(seed=1)
    model = small_model()
    before = params_of(model)
    for optimizer in (torch.optim.SGD(other.parameters(), lr=0.1), lambda p: torch.optim.SGD(other.parameters())):
        with pytest.raises(ValueError, match="the optimizer holds 6 of its 6 parameters from outside this model"):
            Trainer(model, DATA, device="cpu", optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model)))


def test_an_optimizer_whose_step_needs_a_closure_is_refused():
    with pytest.raises(TypeError, match="LBFGS.step\\(\\) needs closure"):
        trainer("fp32", optimizer=torch.optim.LBFGS, lr=None)
