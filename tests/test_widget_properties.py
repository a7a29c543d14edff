"""The widgets' argument checks under random arguments (hypothesis): each call either works or
raises the course's own error that names what it got and what to pass, never another
exception (a TypeError, an OverflowError, ipywidgets' TraitError) from deeper down.

Every argument a widget accepts is bounded by its checks (steps <= 200, exponents <= 40), so
no drawn call can run long; the example counts are small, since some draws train a short run.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import amp_lessons.widgets as widgets  # noqa: E402
from amp_lessons.hardware import DeviceUnavailableError  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:The `ipykernel.comm.Comm` class has been deprecated:DeprecationWarning"
)

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# What a careless caller passes: the right kind, the wrong kind, and the extremes of each.
junk = st.one_of(
    st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(), max_size=3), st.just(torch.float16), st.just(b"fp16"),
)
small_ints = st.integers(-3, 45)
names = st.sampled_from(["fp32", "tf32", "bf16", "fp16", "half", "float16", "e4m3", "fp8_e5m2", "FP16 ",
                         "torch.bfloat16", "fp8", "int8", "", "card_model", "TransformerBlock"])
devices = st.one_of(st.none(), st.sampled_from(["cpu", "auto", "cuda", "cuda:7", "mps", "tpu", "", "cpu:0"]),
                    junk)
texts = st.one_of(st.text(alphabet="0123456789.-+e^*()infa x_", max_size=14),
                  st.sampled_from(["2^-24", "2**-1074", "2^1024", "1e308", "1e309", "-0", "nan", "2^-0001"]),
                  junk)


def mostly(good, bad=junk):
    """Draws of ``good`` three times in four, so most calls get past the first check."""
    return st.integers(0, 3).flatmap(lambda i: good if i else bad)  # one_of would flatten bad's branches


def gradients():
    values = st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2.0**-20, 2.0**-20),
                                st.sampled_from([math.inf, -math.inf, math.nan])), min_size=1, max_size=40)
    dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
    tensors = st.builds(lambda v, d: torch.tensor(v, dtype=torch.float64).to(d) if d.is_floating_point
                        else torch.arange(len(v), dtype=d), values, dtypes)
    return mostly(tensors)


def outcome(call):
    """Run ``call``: None if it worked, else the error, which must be the course's own and clear."""
    try:
        call()
    except (ValueError, DeviceUnavailableError) as err:
        text = str(err)
        assert any(word in text for word in ("got ", "type ", "Pass ")), f"unclear: {type(err).__name__}: {text}"
        return err
    return None


@FEW
@given(name=st.one_of(names, junk), device=devices)
def test_describe_precision_and_picker(name, device):
    outcome(lambda: widgets.describe_precision(name, device))
    outcome(lambda: widgets.precision_picker(device, name))


@settings(max_examples=200, deadline=None)
@given(text=texts, name=st.one_of(names, junk))
def test_parse_number_and_value_in_format(text, name):
    err = outcome(lambda: widgets.parse_number(text))
    if err is None:
        assert isinstance(widgets.parse_number(text), float)
    outcome(lambda: widgets.value_in_format(text, name))


@FEW
@given(value=texts, name=st.one_of(names, junk))
def test_format_explorer(value, name):
    outcome(lambda: widgets.format_explorer(value, name))


@settings(max_examples=40, deadline=None)
@given(grads=gradients(), exponent=mostly(st.integers(-1, 12)), max_exponent=mostly(st.integers(0, 41)),
       histogram=mostly(st.booleans()))
def test_loss_scale_explorer(grads, exponent, max_exponent, histogram):
    outcome(lambda: widgets.loss_scale_explorer(grads, exponent, max_exponent, histogram))


@FEW
@given(model=st.one_of(names, junk), precision=st.one_of(names, junk), device=devices)
def test_autocast_table_and_explorer(model, precision, device):
    outcome(lambda: widgets.autocast_table(model, precision, device))
    outcome(lambda: widgets.autocast_explorer(device, precision, model))


@settings(max_examples=15, deadline=None)
@given(init=st.one_of(st.integers(-2, 26), junk), growth=st.one_of(st.integers(-1, 6), junk),
       inject=st.one_of(st.integers(-3, 6), junk), steps=st.one_of(st.integers(-1, 5), junk), device=devices)
def test_scale_figure_and_explorer(init, growth, inject, steps, device):
    outcome(lambda: widgets.scale_figure(init, growth, inject, steps, device))
    outcome(lambda: widgets.scale_explorer(init, growth, inject, steps, device))
