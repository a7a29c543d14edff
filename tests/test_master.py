"""model.half() against fp32 master weights: lost updates and Adam's eps, against references."""

import copy

import pytest
import torch

from amp_lessons.data import digits
from amp_lessons.master import eps_in, gradients, lost_fraction_by_lr, lost_updates, spacing
from amp_lessons.models import mlp


@pytest.fixture
def model():
    torch.manual_seed(0)
    return mlp(64, 64, 10, depth=2)


def test_adam_eps_is_zero_in_fp16_only():
    assert eps_in(torch.float16) == 0.0
    assert eps_in("fp16") == 0.0
    assert eps_in(torch.bfloat16) == pytest.approx(1e-8, rel=1e-2)  # bf16 has fp32's range
    assert eps_in(torch.float32) == pytest.approx(1e-8, rel=1e-6)
    # the reason: 1e-8 is below half of fp16's smallest subnormal, 2**-24
    assert 1e-8 < torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps / 2


def test_spacing_matches_nextafter():
    w = torch.tensor([0.05, -0.3, 1.0, 3e-6, 1000.0])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        wd = w.to(dtype)
        gap = (torch.nextafter(wd, torch.full_like(wd, float("inf"))) - wd).double().abs()
        assert torch.equal(spacing(w, dtype), gap), dtype


def test_a_tiny_update_survives_in_fp32_master_weights_but_not_in_half(model):
    grads = [torch.full_like(p, 1e-3) for p in model.parameters()]  # every update is 1e-5
    result = lost_updates(model, grads, lr=1e-2, optimizer="sgd")
    master, half = result["fp32 master"], result["model.half()"]
    n = sum(p.numel() for p in model.parameters())
    assert master.meant == half.meant == n
    assert master.unchanged == 0 and master.predicted == 0
    assert half.unchanged > 0
    # the half-ulp rule predicts which: weights with |w| above ~2**-5 (spacing 2**-15 > 2e-5)
    assert abs(half.unchanged - half.predicted) <= 0.002 * n
    big = sum(int((p.detach().abs() >= 2**-5).sum()) for p in model.parameters())
    assert half.unchanged >= big * 0.99


def test_real_gradients_sgd_half_loses_most_updates(model):
    x, y = digits().batch(0, 64)
    grads = gradients(model, x, y, "bf16")
    assert [g.dtype for g in grads] == [torch.float32] * len(grads)
    result = lost_updates(model, grads, lr=1e-3, optimizer="sgd")
    assert result["model.half()"].fraction > 0.5
    assert result["fp32 master"].fraction < 0.05
    assert result["fp32 master"].nonfinite == result["model.half()"].nonfinite == 0


def test_adam_on_half_weights_makes_them_nonfinite(model):
    x, y = digits().batch(0, 64)
    grads = gradients(model, x, y)
    result = lost_updates(model, grads, lr=1e-3, optimizer="adam")
    assert result["fp32 master"].nonfinite == 0 and result["fp32 master"].unchanged == 0
    assert result["model.half()"].nonfinite > 0
    # with an eps fp16 can hold, the division by zero is gone
    assert lost_updates(model, grads, lr=1e-3, optimizer="adam", eps=1e-4)["model.half()"].nonfinite == 0


def test_nothing_changes_the_model(model):
    before = copy.deepcopy(model.state_dict())
    x, y = digits().batch(0, 32)
    grads = gradients(model, x, y, "fp16")
    lost_updates(model, grads, lr=1e-2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_smaller_learning_rates_lose_more_in_half(model):
    x, y = digits().batch(0, 64)
    grads = gradients(model, x, y)
    fractions = lost_fraction_by_lr(model, grads, [1e-1, 1e-2, 1e-3])
    half = fractions["model.half()"]
    assert half[0] < half[1] < half[2]
    assert all(m < h for m, h in zip(fractions["fp32 master"], half))


def test_bad_optimizer_and_gradient_count_say_what_to_do(model):
    grads = [torch.zeros_like(p) for p in model.parameters()]
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adam, adamw"):
        lost_updates(model, grads, lr=1e-2, optimizer="lion")
    with pytest.raises(ValueError, match="gradients for"):
        lost_updates(model, grads[:-1], lr=1e-2)


def test_the_exercise_checker_finds_the_bugs_and_passes_the_fix():
    from amp_lessons.exercises import broken_setup, check_setup

    broken = check_setup(broken_setup, "cpu", steps=3)
    text = str(broken)
    assert not broken.passed
    assert "in which dtype do small updates survive?" in text and "GradScaler that does not scale" in text
    assert "eps=1e-08" in text and "0.001 g^2" in text
    assert "keep the weights float32" not in text  # a hint, not the fix
    assert "inf/NaN" in text

    def fixed(device_type):
        model = mlp(64, 64, 10).to(device_type)
        dtype = torch.float16
        scaler = torch.amp.GradScaler(device_type, enabled=(dtype == torch.float16))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), scaler, dtype

    verdict = check_setup(fixed, "cpu", steps=3)
    assert verdict.passed, str(verdict)
    assert "every weight is finite" in str(verdict)


def test_the_exercise_checker_reports_a_setup_that_raises():
    from amp_lessons.exercises import check_setup

    def broken(device_type):
        raise RuntimeError("typo")

    verdict = check_setup(broken, "cpu")
    assert not verdict.passed and "RuntimeError: typo" in str(verdict)


def _linear():
    return torch.nn.Linear(4, 2)


BAD_MASTER_ARGUMENTS = [
    (lambda: eps_in(torch.int32), "dtype must be a floating-point dtype"),
    (lambda: eps_in("fp16", "a"), "eps must be a finite number >= 0"),
    (lambda: eps_in("fp16", -1e-8), "eps must be a finite number >= 0"),
    (lambda: spacing(torch.ones(2), torch.int32), "dtype must be a floating-point dtype"),
    (lambda: spacing([1.0], torch.float16), "w must be a torch tensor"),
    (lambda: gradients("model", torch.ones(1, 4), torch.zeros(1, dtype=torch.long)), "model must be a torch.nn.Module"),
    (lambda: gradients(_linear(), torch.ones(1, 4).numpy(), torch.zeros(1, dtype=torch.long)), "x must be a torch tensor"),
    (lambda: lost_updates(_linear(), [torch.ones(3, 4), torch.ones(2)], 0.1), r"gradient 0 must be a tensor of its parameter's shape \(2, 4\)"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), [1.0, 1.0]], 0.1), "gradient 1 must be a tensor"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], float("nan")), "lr must be a positive finite number"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], 0.0), "lr must be a positive finite number"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], -1.0), "lr must be a positive finite number"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], float("inf")), "lr must be a positive finite number"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], 0.1, "lion"), "optimizer must be one of sgd, adam, adamw"),
    (lambda: lost_updates(_linear(), [torch.ones(2, 4), torch.ones(2)], 0.1, "adam", -1.0), "eps must be a positive finite number"),
    (lambda: lost_fraction_by_lr(_linear(), [torch.ones(2, 4), torch.ones(2)], 0.1), "lrs must be a list of learning rates"),
]


@pytest.mark.parametrize("call, says", BAD_MASTER_ARGUMENTS, ids=[s for _, s in BAD_MASTER_ARGUMENTS])
def test_a_bad_argument_says_what_to_pass(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_eps_zero_stays_zero_and_an_empty_lr_list_gives_empty_curves():
    assert eps_in("fp16", 0.0) == 0.0 and eps_in(torch.bfloat16, 0) == 0.0
    assert lost_fraction_by_lr(_linear(), [torch.ones(2, 4), torch.ones(2)], []) == {"fp32 master": [], "model.half()": []}


def test_spacing_takes_a_precision_name_as_eps_in_does():
    assert torch.equal(spacing(torch.ones(2), "fp16"), spacing(torch.ones(2), torch.float16))


def test_half_adam_for_loop_and_foreach_make_nan_in_one_step_and_fused_later():
    from amp_lessons.master import ADAM_IMPLEMENTATIONS, half_adam

    torch.manual_seed(0)
    net, data = mlp(64, 64, 10, depth=2), digits()
    runs = {impl: half_adam(net, data, impl, steps=3) for impl in ADAM_IMPLEMENTATIONS}
    n = sum(p.numel() for p in net.parameters())
    assert all(p.dtype == torch.float32 for p in net.parameters())  # the model is not changed
    for impl in ("for-loop", "foreach"):
        assert runs[impl].n_weights == n and runs[impl].nonfinite[0] > n // 2  # eps = 0, v = 0
    fused = runs["fused"]
    if fused.error is None:  # torch has a fused fp16 Adam for this device
        assert fused.nonfinite[0] == 0  # eps and the arithmetic stay float32
        assert fused.v_zero > fused.nonzero_grads // 2  # but v is stored in float16, zeroed
        assert fused.largest_change[1] > 100 * fused.lr  # and step 2 divides by the v that forgot
    line = runs["for-loop"].line()
    assert "inf/NaN" in line and line.endswith(" nan") and "≈nan" not in line  # no finite weight left: no figure
    assert runs["for-loop"].finite_with_gradient == 0
    for r in runs.values():
        if r.error is None:  # a subset of the weights still finite
            assert 0 <= r.finite_with_gradient <= r.n_weights - r.nonfinite[-1]
    with pytest.raises(ValueError, match="implementation must be one of for-loop, foreach, fused"):
        half_adam(net, data, "apex")
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        half_adam(net, data, "fused", steps=1)


def _setup_with(**change):
    def setup(device_type):
        model = mlp(64, 64, 10).to(device_type)
        pieces = {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=change.get("lr", 1e-3)),
                  "scaler": torch.amp.GradScaler(device_type), "dtype": torch.float16}
        if change.get("half"):
            model.half()
            pieces["optimizer"] = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        pieces.update({k: v for k, v in change.items() if k in pieces})
        return tuple(pieces.values())
    return setup


def test_the_exercise_checker_refuses_a_setup_that_does_not_train():
    from amp_lessons.exercises import check_setup

    verdict = check_setup(_setup_with(lr=0.0), "cpu", steps=2)
    assert not verdict.passed and "no weight has changed" in str(verdict) and "learning rate" in str(verdict)


def test_the_exercise_checker_fails_a_setup_whose_loss_goes_nan_with_finite_weights():
    from amp_lessons.exercises import check_setup

    # float32 weights and a working scaler, but Adam(lr=10): the loss is nan within 5 steps
    verdict = check_setup(_setup_with(lr=10.0), "cpu")
    assert not verdict.passed and "a run that trains keeps a finite loss" in str(verdict)
    assert "inf/NaN" not in str(verdict)  # the weights themselves stay finite: the loss is what fails


def test_the_exercise_checker_names_a_missing_scaler_instead_of_crashing():
    from amp_lessons.exercises import check_setup

    verdict = check_setup(_setup_with(scaler=None), "cpu", steps=2)
    assert not verdict.passed and "the scaler must be a torch.amp.GradScaler; got NoneType" in str(verdict)
    verdict = check_setup(lambda device_type: (1, 2), "cpu")
    assert not verdict.passed and "must return four things" in str(verdict)


def test_the_exercise_checker_blames_v_not_eps_for_fused_adam_on_half_weights():
    from amp_lessons.exercises import check_setup

    text = str(check_setup(_setup_with(half=True, scaler=torch.amp.GradScaler("cpu", enabled=False)), "cpu",
                           steps=2))
    assert "exp_avg_sq" in text and "fused kernel" in text and "eps=" not in text


def test_half_adam_counts_only_finite_weights_that_had_a_gradient():
    from amp_lessons.data import Dataset
    from amp_lessons.master import half_adam

    # one Linear, input column 1 always 0: its weights get a zero gradient at every step
    x = torch.tensor([[1.0, 0.0]] * 4)
    net = torch.nn.Linear(2, 2)
    data = Dataset(x, torch.tensor([0, 1, 0, 1]), x, torch.tensor([0, 1, 0, 1]), name="two columns")
    run = half_adam(net, data, "fused", steps=2, batch_size=4, lr=1e-3)
    if run.error is None:
        assert run.nonfinite[-1] == 0  # a tiny, well-scaled step: all finite
        assert run.finite_with_gradient == 4  # column 0's weights and the biases; not column 1's two
