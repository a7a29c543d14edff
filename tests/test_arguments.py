"""The argument checks of the training entry points: every bad value is a clear error, raised
before any work is done, with the trainer and the caller's objects untouched.

References: the messages the checks promise, the state of a model before and after a refused
call (bit for bit), and, for values that must work, what the run really used (the optimizer's lr).
"""

import math
import re
import signal
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import amp_lessons
from amp_lessons import arguments
from amp_lessons.data import Dataset, digits
from amp_lessons.models import mlp
from amp_lessons.training import Trainer

DATA = digits()


def small_model(seed=0, hidden=32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mlp(64, hidden, 10, depth=2)


def trainer(precision="fp16", **kwargs):
    kwargs = {"optimizer": "adam", "lr": 1e-3, "batch_size": 32, "init_scale": 2.0**10, "progress": False,
              **kwargs}
    return Trainer(small_model(), DATA, precision=precision, device="cpu", **kwargs)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


# -- the checks themselves ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, -math.inf, True, "1", None, 1 + 2j])
def test_check_positive_refuses_what_is_not_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=re.escape(f"x must be a positive finite number; got {value!r}")):
        arguments.check_positive("x", value)


@pytest.mark.parametrize("value", [1e-300, 1, 2.5, np.float32(3.0), 10**30])
def test_check_positive_accepts_positive_numbers(value):
    arguments.check_positive("x", value)


@pytest.mark.parametrize("value", [1.0, 2.5, 0, -3, True, np.float64(2.0)])
def test_check_positive_integer_wants_an_integer(value):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        arguments.check_positive("n", value, integer=True)
    arguments.check_positive("n", np.int64(3), integer=True)


def test_check_steps_takes_collections_of_step_numbers():
    assert arguments.check_steps("s", range(3)) == frozenset({0, 1, 2})
    assert arguments.check_steps("s", [np.int64(4)]) == frozenset({4})
    for bad in ("12", 3, None):
        with pytest.raises(TypeError, match="s must be a collection of step numbers, e.g. \\(3, 7\\)"):
            arguments.check_steps("s", bad)
    for bad in ((-1,), (True,), (1.5,)):
        with pytest.raises(ValueError, match="s must hold step numbers \\(integers >= 0\\)"):
            arguments.check_steps("s", bad)


@pytest.mark.parametrize("value", [1e-39, 2.0**-149, 1e39])
def test_a_scale_is_a_normal_float32_number(value):
    with pytest.raises(ValueError, match="s must lie between 1.18e-38 and 3.4e\\+38, the normal float32 numbers"):
        arguments.check_scale("s", value)
    arguments.check_scale("s", 2.0**-126)


def test_growth_interval_must_fit_grad_scalers_int32_counter():
    arguments.check_growth_interval(2**31 - 1)
    with pytest.raises(ValueError, match="growth_interval must be below 2\\*\\*31"):
        arguments.check_growth_interval(2**31)


@pytest.mark.parametrize("path", [None, 3, b"run.pt", True, ["run.pt"]])
def test_a_path_is_a_str_or_path_like(path):
    with pytest.raises(TypeError, match="path must be a file path \\(a str or pathlib.Path\\)"):
        arguments.check_path("path", path)
    assert arguments.check_path("path", "run.pt") == Path("run.pt")


# -- the Trainer's settings ---------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "fp61"}, "precision must be one of fp32, tf32, bf16, fp16; got 'fp61'"),
    ({"lr": 0}, "lr must be a positive finite number; got 0"),
    ({"lr": -1e-3}, "lr must be a positive"),
    ({"lr": float("nan")}, "lr must be a positive"),
    ({"lr": float("inf")}, "lr must be a positive"),
    ({"lr": 1e300}, "lr must be at most 3.4e+38, the largest float32 number"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"accum_steps": 1.5}, "accum_steps must be a positive integer"),
    ({"clip_norm": 0.0}, "clip_norm must be a positive finite number; got 0.0"),
    ({"clip_norm": -1.0}, "clip_norm must be a positive"),
    ({"clip_order": "after"}, "clip_order must be one of unscale_first, before_unscale; got 'after'"),
    ({"optimizer": "lion"}, "optimizer must be one of sgd, adam, adamw, an optimizer class such as torch.optim.SGD"),
    ({"init_scale": 0.0}, "init_scale must be a positive"),
    ({"growth_interval": 0}, "growth_interval must be a positive integer"),
    ({"growth_factor": 1.0}, "growth_factor must be a finite number >= 1 + 2**-23"),
    ({"backoff_factor": 1.0}, "backoff_factor must be between 0 and 1"),
    ({"min_scale": -1.0}, "min_scale must be a positive"),
    ({"backoff_factor": 1 - 1e-9}, "backoff_factor must be between 0 and 1 - 2**-23"),
    ({"backoff_factor": 1 - 2.0**-24}, "backoff_factor must be between 0 and 1 - 2**-23"),
    ({"growth_factor": 1 + 1e-9}, "growth_factor must be a finite number >= 1 + 2**-23"),
    ({"growth_factor": 1e39}, "growth_factor must be a finite number >= 1 + 2**-23"),
])
def test_bad_settings_are_clear_errors(kwargs, message):
    precision = kwargs.pop("precision", "fp16")
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer(precision, **kwargs)


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, None, "3"])
def test_fit_wants_a_positive_number_of_steps(steps):
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        trainer("fp32").fit(steps)


def test_fit_refuses_a_run_the_history_could_not_hold_before_any_step():
    t = trainer("fp32")
    before = weights(t.model)
    t.step_count = arguments.MAX_FIT_STEPS  # a run at the bound: one step more is refused, at once
    with pytest.raises(ValueError, match="this trainer has run 1,000,000 and got steps=1"):
        t.fit(1)
    t.step_count = 0
    with pytest.raises(ValueError, match="steps must keep the run within 1,000,000 optimizer steps"):
        t.fit(arguments.MAX_FIT_STEPS + 1)
    assert t.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, weights(t.model)))


def test_accumulation_beyond_one_epoch_per_step_is_refused_with_its_bound():
    """The issue's case: accum_steps=10**7 was accepted, and fit(1) never finished."""
    n = len(DATA.x_train)
    with pytest.raises(ValueError, match=re.escape(f"more than the {n:,} of the training set")) as err:
        trainer("fp32", accum_steps=10**7)
    assert f"Use accum_steps <= {n // 32} (one epoch per step)" in str(err.value)
    trainer("fp32", accum_steps=n // 32).fit(1)  # the bound itself runs
    with pytest.raises(ValueError, match=f"Use accum_steps <= {n // 32} "):
        trainer("fp32", accum_steps=n // 32 + 1)


def tiny_data(**changes):
    g = torch.Generator().manual_seed(0)
    fields = {"x_train": torch.randn(16, 64, generator=g), "y_train": torch.randint(0, 10, (16,), generator=g),
              "x_test": torch.randn(4, 64, generator=g), "y_test": torch.randint(0, 10, (4,), generator=g)}
    return Dataset(**{**fields, **changes}, name="tiny")


BAD_DATA = {
    "None": (None, TypeError, "data must be a dataset, e.g. digits(), or Dataset(x_train, y_train, x_test, "
                              "y_test) from amp_lessons.data; got NoneType"),
    "a tuple": ((DATA.x_train, DATA.y_train), TypeError, "data must be a dataset"),
    "numpy inputs": (tiny_data(x_train=np.zeros((16, 64), np.float32)), TypeError,
                     "data.x_train must be a torch.Tensor; got ndarray: convert it with torch.as_tensor(x_train)"),
    "a list of labels": (tiny_data(y_train=[0] * 16), TypeError, "data.y_train must be a torch.Tensor; got list"),
    "more labels than inputs": (tiny_data(y_train=torch.zeros(17, dtype=torch.long)), ValueError,
                                "data.x_train holds 16 examples and data.y_train 17 labels"),
    "float labels": (tiny_data(y_train=torch.zeros(16)), TypeError,
                     "data.y_train holds torch.float32 values, one per example: cross_entropy takes class numbers"),
    "bool labels": (tiny_data(y_train=torch.zeros(16, dtype=torch.bool)), TypeError,
                    "data.y_train holds torch.bool values, one per example: cross_entropy takes class numbers"),
    "bool inputs": (tiny_data(x_train=torch.ones(16, 64, dtype=torch.bool)), TypeError,
                    "data.x_train has dtype torch.bool; the inputs must be numbers"),
    "nan inputs": (tiny_data(x_train=torch.full((16, 64), math.nan)), ValueError,
                   "data.x_train holds 1024 inf/NaN values"),
    "no examples": (tiny_data(x_train=torch.zeros(0, 64), y_train=torch.zeros(0, dtype=torch.long)), ValueError,
                    "data has no training examples"),
    "a 0-dim tensor": (tiny_data(y_test=torch.tensor(3)), ValueError, "data.y_test must hold one row per example"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_a_clear_error_before_any_work(case):
    data, error, message = BAD_DATA[case]
    model = small_model()
    before = weights(model)
    with pytest.raises(error, match=re.escape(message)):
        Trainer(model, data, device="cpu", batch_size=8)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))


def test_a_batch_larger_than_the_data_is_refused_at_once():
    with pytest.raises(ValueError, match="batch_size 32 is larger than the 16 training examples; use batch_size <= 16"):
        Trainer(small_model(), tiny_data(), device="cpu", batch_size=32)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"callbacks": None}, TypeError, "callbacks must be a list of callback objects"),
    ({"callbacks": [print]}, TypeError, "each callback needs a method before_step(trainer) or after_backward"),
    ({"progress": "yes"}, TypeError, "progress must be True (show a progress bar) or False"),
    ({"teaching": 1}, TypeError, "teaching must be True"),
    ({"scaler": "yes"}, TypeError, "scaler must be True (use a GradScaler"),
    ({"step_scheduler_on_skip": None}, TypeError, "step_scheduler_on_skip must be True"),
    ({"growth_interval": 2**40}, ValueError, "growth_interval must be below 2**31"),
    ({"init_scale": math.nan}, ValueError, "init_scale must be a positive finite number; got nan"),
])
def test_other_bad_arguments_say_what_to_do(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        trainer(**kwargs)


def test_a_model_without_trainable_parameters_is_refused():
    model = small_model().requires_grad_(False)
    with pytest.raises(ValueError, match="model has no parameter that requires a gradient"):
        Trainer(model, DATA, device="cpu")


@pytest.mark.parametrize("loss_fn", [lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
                                     lambda out, y: 0.5, lambda out, y: (out.argmax(1) == y).sum()])
def test_a_loss_that_is_not_one_number_is_refused_before_backward(loss_fn):
    t = trainer("fp32", loss_fn=loss_fn)
    before = weights(t.model)
    with pytest.raises(TypeError, match="loss_fn must return the loss as one floating-point number"):
        t.fit(1)
    assert t.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, weights(t.model)))
    assert all(p.grad is None for p in t.model.parameters())


def test_numpy_numbers_are_accepted_as_the_numbers_they_are(tmp_path):
    t = trainer("fp16", lr=np.float64(1e-3), batch_size=np.int64(16), accum_steps=np.int64(2),
                growth_interval=np.int64(3), clip_norm=np.float32(1.0), seed=np.int64(0))
    t.fit(2)
    assert type(t.batch_size) is int and type(t.clip_norm) is float
    other = trainer("fp16", lr=1e-3, batch_size=16, accum_steps=2, growth_interval=3, clip_norm=1.0)
    other.load(t.save(tmp_path / "run.pt"))  # plain numbers in the file: it loads, and matches
    assert other.step_count == 2


def test_seed_everything_checks_its_seed():
    from amp_lessons.seeding import seed_everything

    with pytest.raises(TypeError, match="seed must be an integer"):
        seed_everything("abc")
    assert seed_everything(2**32 - 1) is None  # no stray Out: in the lessons' setup cells


def test_the_data_functions_check_their_arguments():
    from amp_lessons.data import random_task

    with pytest.raises(ValueError, match="test_fraction must be at least 0 .* and below 1; got 1.5"):
        digits(test_fraction=1.5)
    with pytest.raises(TypeError, match="seed must be an integer"):
        digits(seed="abc")
    with pytest.raises(ValueError, match="seed must be an integer"):
        random_task(seed=-3)
    assert len(digits(test_fraction=0.0).x_test) == 0  # allowed; evaluate() then says what is missing


# -- random arguments: they work, or the course refuses them itself ------------------------------


PACKAGE = str(Path(amp_lessons.__file__).parent)
OTHER = torch.nn.Linear(64, 10)
NAN = math.nan
TINY = tiny_data()
GOOD = {
    "precision": ["fp32", "bf16", "fp16", "half", torch.float16],
    "optimizer": ["sgd", "adam", "ADAMW", torch.optim.SGD, lambda p: torch.optim.SGD(p, lr=0.1)],
    "lr": [None, 1e-3, 0.5, np.float64(0.01)],
    "batch_size": [1, 4, 8, np.int64(8)],
    "accum_steps": [1, 2, 3],
    "clip_norm": [None, 0.5, 1e-30, 1e30],
    "clip_order": ["unscale_first", "before_unscale"],
    "scaler": [None, True, False],
    "init_scale": [2.0**10, 1.0, 2.0**-13],
    "growth_interval": [1, 5, 2000],
    "growth_factor": [2.0, 1.5],
    "backoff_factor": [0.5, 0.25],
    "min_scale": [2.0**-14, 1e-30],
    "seed": [0, 1, 2**32 - 1],
    "inject_nonfinite": [(), (0,), (1,), range(5)],
    "loss_fn": [torch.nn.functional.cross_entropy, lambda out, y: out.float().pow(2).mean()],
    "data": [TINY],
    "teaching": [True, False],
}
BAD = {
    "precision": ["fp61", None, 16, torch.int8],
    "optimizer": ["lion", torch.optim.SGD(OTHER.parameters(), lr=0.1), None, 3, lambda p: "no", torch.optim.LBFGS],
    "lr": [1e30, 0, -1.0, NAN, math.inf, True, "0.1"],
    "batch_size": [0, -1, 2.5, 10**9, True, None, 17],
    "accum_steps": [0, 10**7, 1.5, None, 5],
    "clip_norm": [0, -1.0, NAN, math.inf, "1"],
    "clip_order": ["after", None, 1],
    "scaler": ["yes", 0],
    "init_scale": [0, NAN, 1e39, -1.0, "big"],
    "growth_interval": [0, 2**40, 1.5, -3],
    "growth_factor": [1.0, 1e39, NAN, 0.5],
    "backoff_factor": [1.0, 0.0, -0.5, NAN],
    "min_scale": [0.0, 2.0**20, NAN],
    "seed": [-1, 2**32, "a", 1.5, None],
    "inject_nonfinite": ["1", 3, (-1,), (True,), None],
    "loss_fn": [None, "mse", lambda out, y: out.sum(0), lambda out, y: 1.0],
    "data": [None, (TINY.x_train, TINY.y_train), tiny_data(x_train=TINY.x_train.numpy()),
             tiny_data(y_train=TINY.y_train[:5]), tiny_data(x_train=torch.full((16, 64), math.inf))],
    "teaching": ["no", None],
}


@st.composite
def arguments_to_try(draw):
    """Good values for every argument but zero to two, drawn from the bad ones."""
    bad = set(draw(st.lists(st.sampled_from(list(BAD)), max_size=2)))
    return {k: draw(st.sampled_from(BAD[k] if k in bad else GOOD[k])) for k in GOOD}


ACCEPTED_ERRORS = (ValueError, TypeError, FloatingPointError, RuntimeError)


def raised_by_the_course(err) -> bool:
    """The exception's last frame is in amp_lessons: the course's own message, not torch's."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(PACKAGE)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("a call with these arguments ran for more than 20 s")


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(choice=arguments_to_try(),
       steps=st.sampled_from([1, 2, 1, 2, 1, 0, 2.5]))
def test_random_arguments_work_or_get_the_courses_own_error(choice, steps):
    model = torch.nn.Linear(64, 10)
    before = weights(model)
    kwargs = {k: v for k, v in choice.items() if k != "data"}
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the lessons' wrong settings warn on purpose
            t = Trainer(model, choice["data"], device="cpu", progress=False, **kwargs)
            t.fit(steps)
    except ACCEPTED_ERRORS as err:
        assert raised_by_the_course(err), f"{type(err).__name__} from outside the course: {err}"
        assert not isinstance(err, RuntimeError) or type(err).__module__.startswith("amp_lessons")
        event(f"refused: {type(err).__name__}")
        if not isinstance(err, FloatingPointError):  # refused arguments: nothing trained
            assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    else:
        assert len(t.history) == steps and t.step_count == steps
        event("trained")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
