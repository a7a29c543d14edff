"""The op-dtype tracer of lesson 02, against what the tensors themselves say on this CPU."""

from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_lessons.exercises import check_dtype_predictions, dtype_exercise
from amp_lessons.hardware import DeviceUnavailableError, available_devices
from amp_lessons.models import TransformerBlock, card_model
from amp_lessons.trace import (
    EXAMPLES,
    differences,
    example,
    short,
    trace_example,
    trace_fn,
    trace_model,
)

LOW = [torch.bfloat16, torch.float16]


def _float32(*shape):
    return torch.randn(*shape)


def _lower_precision_calls():
    """(name, call, aten op) for ops on autocast's lower-precision list; float32 inputs."""
    x, w, b = _float32(8, 16), _float32(4, 16), _float32(4)
    m1, m2 = _float32(8, 16), _float32(16, 4)
    b1, b2 = _float32(3, 8, 16), _float32(3, 16, 4)
    img, k, kb = _float32(2, 3, 8, 8), _float32(5, 3, 3, 3), _float32(5)
    return [
        ("linear", partial(F.linear, x, w, b), "addmm", (x, w, b)),
        ("mm", partial(torch.mm, m1, m2), "mm", (m1, m2)),
        ("addmm", partial(torch.addmm, b, x, w.T), "addmm", (b, x, w.T)),
        ("bmm", partial(torch.bmm, b1, b2), "bmm", (b1, b2)),
        ("conv2d", partial(F.conv2d, img, k, kb), "convolution", (img, k, kb)),
    ]


@pytest.mark.parametrize("dtype", LOW, ids=short)
@pytest.mark.parametrize("case", range(5), ids=["linear", "mm", "addmm", "bmm", "conv2d"])
def test_matmul_and_conv_run_16_bit_after_casts(dtype, case):
    _, call, op, inputs = _lower_precision_calls()[case]
    tr = trace_fn(call, device="cpu", dtype=dtype)
    # the tensor itself is the reference; the trace must agree with it
    assert tr.result.dtype == dtype
    assert tr.dtype_of(op) == dtype
    assert all(d == dtype for r in tr.ops(op) for d in r.inputs)
    # every float32 input was cast once by a _to_copy, float32 -> 16-bit, shape for shape
    assert [r.op for r in tr.casts] == ["_to_copy"] * len(inputs)
    assert all(r.inputs == (torch.float32,) and r.dtype == dtype for r in tr.casts)
    assert sorted(r.shape for r in tr.casts) == sorted(tuple(t.shape) for t in inputs)


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_losses_run_in_float32_even_on_16_bit_inputs(dtype):
    logits, target = _float32(8, 10).to(dtype), torch.randint(0, 10, (8,))
    ce = trace_fn(partial(F.cross_entropy, logits, target), device="cpu", dtype=dtype)
    assert ce.result.dtype == torch.float32
    assert ce.casts[0].op == "_to_copy" and ce.casts[0].inputs == (dtype,)
    assert ce.casts[0].dtype == torch.float32
    assert ce.dtype_of("_log_softmax") == ce.dtype_of("nll_loss_forward") == torch.float32

    nll = trace_fn(partial(F.nll_loss, logits, target), device="cpu", dtype=dtype)
    assert nll.result.dtype == nll.dtype_of("nll_loss_forward") == torch.float32

    a, b = _float32(8, 4).to(dtype), _float32(8, 4).to(dtype)
    mse = trace_fn(partial(F.mse_loss, a, b), device="cpu", dtype=dtype)
    assert mse.result.dtype == mse.dtype_of("mse_loss") == torch.float32
    assert [r.inputs for r in mse.casts] == [(dtype,), (dtype,)]


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_cpu_softmax_and_layer_norm_follow_their_input(dtype):
    """On CPU they are on neither list (on CUDA they are float32): no cast, 16-bit stays 16-bit."""
    z = _float32(4, 64)
    ln = nn.LayerNorm(64)
    for fn, op in ((partial(torch.softmax, dim=-1), "_softmax"), (ln, "native_layer_norm")):
        for src in (z, z.to(dtype)):
            tr = trace_fn(partial(fn, src), device="cpu", dtype=dtype)
            assert tr.result.dtype == src.dtype
            assert tr.dtype_of(op) == src.dtype
            assert tr.casts == []


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_card_model_logits_16_bit_loss_float32_ops_attributed(dtype):
    model, x, y, loss_fn = example("card_model", "cpu")
    tr = trace_model(model, x, y, loss_fn, dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):  # the reference: the card's own two lines
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    assert tr.result.dtype == logits.dtype == dtype
    assert tr.loss.dtype == loss.dtype == torch.float32
    assert torch.equal(tr.result, logits) and torch.equal(tr.loss, loss)
    assert [r.module for r in tr.ops("addmm")] == ["0", "2"]
    assert [r.module for r in tr.ops("relu")] == ["1"]
    assert {r.module for r in tr.ops("nll_loss_forward")} == {"(loss)"}
    # weight + bias of both layers, and the input of the first: 5 casts to 16-bit; 1 back
    to_low = [r for r in tr.casts if r.dtype == dtype]
    assert sorted(r.shape for r in to_low) == sorted(
        [tuple(p.shape) for p in model.parameters()] + [tuple(x.shape)])
    assert [r.module for r in tr.casts if r.dtype == torch.float32] == ["(loss)"]
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", EXAMPLES)
def test_float32_model_with_autocast_disabled_has_no_16_bit_op(name):
    model, x, y, loss_fn = example(name, "cpu")
    tr = trace_model(model, x, y, loss_fn, enabled=False, backward="outside")
    assert tr.dtype is None and tr.casts == []
    assert tr.records and all(d not in LOW for r in tr.records for d in (*r.inputs, *r.outputs))
    assert "ran 16-bit" in tr.headline() and ", 0 ran 16-bit" in tr.headline()


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_transformer_block_on_cpu(dtype):
    tr = trace_model(TransformerBlock(), _float32(2, 8, 64), _float32(2, 8, 64), F.mse_loss,
                     dtype=dtype)
    assert tr.dtype_of("addmm") == tr.dtype_of("bmm") == tr.dtype_of("gelu") == dtype
    assert tr.dtype_of("_softmax") == dtype  # CPU: not on the float32 list
    # the residual add: float32 input + 16-bit branch -> float32 by type promotion
    assert all(r.inputs == (torch.float32, dtype) for r in tr.ops("add"))
    assert tr.dtype_of("add") == torch.float32 == tr.dtype_of("native_layer_norm")
    assert tr.dtype_of("mse_loss") == torch.float32
    assert {r.module for r in tr.ops("_softmax")} == {"attn"}
    assert {r.module for r in tr.ops("add")} == {"(model)"}


def test_backward_outside_keeps_weights_and_grads_float32():
    model, x, y, loss_fn = example("card_model", "cpu")
    tr = trace_model(model, x, y, loss_fn, dtype=torch.bfloat16, backward="outside")
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    backward = [r for r in tr.records if r.module == "(backward)"]
    assert {r.dtype for r in backward if r.op == "mm"} == {torch.bfloat16}
    back_to_fp32 = [r for r in backward if r.kind == "cast" and r.dtype == torch.float32]
    assert sorted(r.shape for r in back_to_fp32) == sorted(tuple(p.shape) for p in model.parameters())


def test_backward_inside_and_outside_compared():
    a_model, x, y, loss_fn = example("TransformerBlock", "cpu")
    b_model, *_ = example("TransformerBlock", "cpu")
    outside = trace_model(a_model, x, y, loss_fn, backward="outside")
    inside = trace_model(b_model, x, y, loss_fn, backward="inside")
    assert differences(outside, inside, module="(backward)") == []  # this CPU: nothing to recast
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p.grad, q.grad) and q.grad.dtype == torch.float32
    other = trace_example("TransformerBlock", torch.float16, "cpu")
    diff = differences(outside, other)
    assert diff and any(d.startswith("+ addmm") and "fp16" in d for d in diff)


def _boom_model():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom in forward")

    return nn.Sequential(nn.Linear(4, 4), Boom())


def _assert_clean(model):
    assert _get_current_dispatch_mode() is None
    assert not torch.is_autocast_enabled("cpu")
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_nothing_left_behind_after_success_or_exception():
    model, x, y, loss_fn = example("card_model", "cpu")
    trace_model(model, x, y, loss_fn, backward="outside")
    _assert_clean(model)

    boom = _boom_model()
    with pytest.raises(RuntimeError, match="boom in forward"):
        trace_model(boom, _float32(2, 4), torch.tensor([0, 1]))
    _assert_clean(boom)

    def bad_loss(out, target):
        raise ValueError("boom in loss")

    with pytest.raises(ValueError, match="boom in loss"):
        trace_model(model, x, y, bad_loss)
    _assert_clean(model)
    with pytest.raises(ZeroDivisionError):
        trace_fn(lambda: 1 / 0, device="cpu")
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "fp32", torch.int8])
def test_dtypes_autocast_cannot_use_are_refused(dtype):
    with pytest.raises(ValueError, match="bfloat16 and torch.float16"):
        trace_fn(lambda: None, device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match="bfloat16 and torch.float16"):
        trace_model(card_model(), _float32(2, 512), torch.tensor([0, 1]), dtype=dtype)


def test_bad_precision_name_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fp32, tf32, bf16, fp16; got 'fp61'"):
        trace_fn(lambda: None, device="cpu", dtype="fp61")
    with pytest.raises(ValueError, match="backward must be one of"):
        trace_model(card_model(), _float32(2, 512), torch.tensor([0, 1]), backward="later")
    with pytest.raises(ValueError, match="model must be one of card_model, TransformerBlock"):
        example("resnet", "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        trace_fn(lambda: None, device="gpu0")


def test_absent_device_is_refused_naming_the_present_ones():
    have = available_devices()
    absent = next(d for d in ("cuda", "mps") if d not in have) if len(have) < 3 else None
    if absent is None:
        pytest.skip("this machine has every device type")
    with pytest.raises(DeviceUnavailableError, match=f"has only: {', '.join(have)}"):
        trace_fn(lambda: None, device=absent)
    with pytest.raises(DeviceUnavailableError, match="cpu"):
        trace_model(card_model(), _float32(2, 512), torch.tensor([0, 1]), device=absent)


def test_table_is_stable_text_and_marks_float32_ops():
    a = trace_example("card_model", torch.bfloat16, "cpu")
    b = trace_example("card_model", torch.bfloat16, "cpu")
    assert a.table() == b.table() and a.summary() == b.summary() and a.html() == b.html()
    lines = a.table().splitlines()
    assert lines[0].split() == ["#", "module", "op", "inputs", "output", "shape", "cast"]
    marked = [ln.split()[2] for ln in lines[1:] if ln.endswith("<- fp32")]
    assert marked == [r.op for r in a.rows() if r.fp32] == ["_log_softmax", "nll_loss_forward"]
    casts = [ln for ln in lines[1:] if " yes" in ln]
    assert len(casts) == len(a.casts) and all("_to_copy" in ln for ln in casts)
    assert "  t  " not in a.table() and any(r.op == "t" for r in a.rows(layout=True))
    assert a.html().count("background:#ffd8a8") == 2
    assert [ln.split() for ln in a.summary().splitlines()[1:]] == [
        ["0", "Linear", "3", "addmm", "-"], ["1", "ReLU", "0", "relu", "-"],
        ["2", "Linear", "2", "addmm", "-"], ["(loss)", "-", "1", "-", "_log_softmax", "nll_loss_forward"],
    ]
    assert repr(a).startswith("<Trace: Sequential on cpu, autocast torch.bfloat16: 5 computing")


def test_example_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    example("TransformerBlock", "cpu")
    assert torch.equal(before, torch.get_rng_state())
    m1, x1, *_ = example("card_model", "cpu")
    m2, x2, *_ = example("card_model", "cpu")
    assert torch.equal(x1, x2) and torch.equal(m1[0].weight, m2[0].weight)


# --- the exercise --------------------------------------------------------------------

CPU_ANSWERS = {  # CPU: GroupNorm and LogSoftmax are on no list, so they follow the conv
    "convolution": "low", "native_group_norm": "low", "gelu": "low",
    "_log_softmax": "low", "nll_loss_forward": "fp32",
}


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_exercise_checker_passes_right_answers(dtype):
    tr = trace_model(*dtype_exercise("cpu"), dtype=dtype)
    answers = {op: short(dtype) if a == "low" else a for op, a in CPU_ANSWERS.items()}
    verdict = check_dtype_predictions(answers, tr)
    assert verdict.passed, str(verdict)
    as_dtypes = {op: dtype if a == "low" else torch.float32 for op, a in CPU_ANSWERS.items()}
    assert check_dtype_predictions(as_dtypes, tr).passed


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_exercise_checker_fails_wrong_answers(dtype):
    tr = trace_model(*dtype_exercise("cpu"), dtype=dtype)
    right = {op: short(dtype) if a == "low" else a for op, a in CPU_ANSWERS.items()}
    # the classic wrong belief: "normalisation and softmax always stay float32"
    wrong = dict(right, native_group_norm="fp32", _log_softmax="float32")
    verdict = check_dtype_predictions(wrong, tr)
    assert not verdict.passed
    assert f"native_group_norm: you predicted fp32; on cpu it ran in {short(dtype)}" in verdict.findings
    assert sum("right" in f for f in verdict.findings) == 3
    other = "fp16" if dtype == torch.bfloat16 else "bf16"
    assert not check_dtype_predictions(dict(right, gelu=other), tr).passed
    unanswered = check_dtype_predictions(dict.fromkeys(right, "?"), tr)
    assert not unanswered.passed and all("no prediction yet" in f for f in unanswered.findings)
    assert not check_dtype_predictions(dict(right, gelu="fp61"), tr).passed
    absent = check_dtype_predictions(dict(right, softmax="fp32"), tr)
    assert not absent.passed and any("softmax: did not run" in f for f in absent.findings)
    assert not check_dtype_predictions({}, tr).passed


# --- widget and figure ---------------------------------------------------------------


def test_autocast_table_is_the_traced_table():
    from amp_lessons.widgets import autocast_table

    for name in EXAMPLES:
        text = autocast_table(name, "fp16", "cpu")
        tr = trace_example(name, torch.float16, "cpu")
        assert text == "\n\n".join([tr.headline(), tr.table(), tr.summary()])
        assert "autocast torch.float16" in text and "<- fp32" in text


def test_autocast_explorer_rerenders_on_a_new_dtype():
    from amp_lessons.widgets import autocast_explorer

    box = autocast_explorer("cpu")
    which, prec, dev = box.children[:3]
    assert list(dev.options) == available_devices()
    assert [label for label, _ in prec.options] == ["bfloat16", "float16"]
    assert "torch.bfloat16" in box.view.value and "Sequential" in box.view.value
    prec.value = "fp16"
    assert "torch.float16" in box.view.value
    which.value = "TransformerBlock"
    assert "TransformerBlock on cpu" in box.view.value and "_softmax" in box.view.value


def test_op_dtypes_figure_title_counts_the_ops():
    from amp_lessons.plots import op_dtypes

    traces = {n: trace_example(n, torch.bfloat16, "cpu") for n in EXAMPLES}
    comp = [r for t in traces.values() for r in t.compute]
    fig = op_dtypes(traces)
    title = fig.axes[0].get_title()
    assert f"{sum(r.low for r in comp)} of {len(comp)} computing ops ran 16-bit" in title
    assert f"{sum(r.fp32 for r in comp)} stayed float32" in title
    assert fig.axes[0].get_xlabel()
