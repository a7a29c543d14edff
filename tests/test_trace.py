"""The op-dtype tracer of lesson 02: against what the tensors themselves say on this CPU, its
CUDA replay against PyTorch's autocast docs, and the self-check's real-vs-simulated branch."""

from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_lessons import devicechecks
from amp_lessons.exercises import check_dtype_predictions, dtype_exercise
from amp_lessons.hardware import DeviceUnavailableError, available_devices
from amp_lessons.models import TransformerBlock, card_model
from amp_lessons.trace import (
    ALREADY,
    BY_AUTOCAST,
    EXAMPLES,
    PROBES,
    ProbeUnavailable,
    SimulationUnsupported,
    differences,
    example,
    lesson_dtype,
    probe,
    probe_table,
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
    # autocast is off in backward: its casts are autograd's, one per forward cast of a tensor
    # that needs a gradient (the input's cast has none)
    casts = [r for r in backward if r.kind == "cast"]
    assert [r.cast_by for r in casts] == ["autograd"] * 5 and not any(r.by_autocast for r in casts)
    assert [r.cast_by for r in tr.casts if r.module != "(backward)"] == ["autocast"] * 6
    assert sum(ln.split()[-1] == "autograd" for ln in tr.table().splitlines()) == 5


def test_backward_inside_tells_autocast_casts_from_autograd_ones():
    """Called inside the context, backward's own casts of gradients are still autograd's;
    the casts autocast inserts into a custom backward (a float32 saved input meeting a
    16-bit gradient) are autocast's."""
    model, x, y, loss_fn = example("card_model", "cpu")
    inside = trace_model(model, x, y, loss_fn, dtype=torch.bfloat16, backward="inside")
    assert {r.cast_by for r in inside.casts if r.module == "(backward)"} == {"autograd"}

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad @ b.T, a.T @ grad

    a, b = _float32(8, 16).requires_grad_(), _float32(16, 4).requires_grad_()
    tr = trace_fn(lambda: Plain.apply(a, b).float().sum().backward(), device="cpu",
                  dtype=torch.bfloat16)
    assert [r.cast_by for r in tr.casts] == ["autocast", "autocast", "explicit", "autograd",
                                            "autocast", "autocast", "autograd", "autograd"]


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


def test_table_is_stable_text_and_marks_why_an_op_is_float32():
    a = trace_example("card_model", torch.bfloat16, "cpu")
    b = trace_example("card_model", torch.bfloat16, "cpu")
    assert a.table() == b.table() and a.summary() == b.summary() and a.html() == b.html()
    lines = a.table().splitlines()
    assert lines[0].split() == ["#", "module", "op", "inputs", "output", "shape", "cast"]
    marks = {ln.split()[2]: ln.split("  ")[-1].strip() for ln in lines[1:] if "<- " in ln}
    # CPU: cross_entropy is on the float32 list: autocast casts the logits up, _log_softmax
    # runs on that copy; nll_loss_forward merely gets float32 from it
    assert marks == {"_log_softmax": BY_AUTOCAST, "nll_loss_forward": ALREADY}
    assert [r.op for r in a.rows() if r.to_fp32] == ["_log_softmax"]
    assert [r.op for r in a.rows() if r.already_fp32] == ["nll_loss_forward"]
    casts = [ln for ln in lines[1:] if " autocast" in ln and "_to_copy" in ln]
    assert len(casts) == len(a.casts) == 6 and all(r.autocast_cast for r in a.casts)
    assert "  t  " not in a.table() and any(r.op == "t" for r in a.rows(layout=True))
    assert a.html().count("background:#ffd8a8") == 1 and a.html().count("background:#f3ead8") == 1
    assert [ln.split() for ln in a.summary().splitlines()[1:]] == [
        ["0", "Linear", "3", "addmm", "-", "-"], ["1", "ReLU", "0", "relu", "-", "-"],
        ["2", "Linear", "2", "addmm", "-", "-"],
        ["(loss)", "-", "1", "-", "_log_softmax", "nll_loss_forward"],
    ]
    assert repr(a).startswith("<Trace: card_model on cpu, autocast torch.bfloat16: 5 computing")
    assert "1 autocast put in float32, 1 were float32 already, 6 casts" in a.headline()


def test_rules_and_marks_separate_autocast_from_float32_already():
    tr = trace_example("TransformerBlock", torch.bfloat16, "cpu")
    rules = {r.op: r.rule for r in tr.compute}
    # rule 1: autocast cast the float32 inputs; rule 3: it left the op alone
    assert rules["addmm"] == 1 and rules["relu" if "relu" in rules else "gelu"] == 3
    assert rules["_softmax"] == 3 and rules["native_layer_norm"] == 3  # CPU: on no list
    # the residual add (float32 + 16-bit) and layer_norm on float32: float32, not autocast's doing
    assert all(r.already_fp32 and not r.to_fp32 for r in tr.ops("add") + tr.ops("native_layer_norm"))
    assert {r.op for r in tr.compute if r.to_fp32} == set()
    assert all(r.rule is None for r in tr.casts)


def test_casts_inside_an_op_autocast_has_no_kernel_for_are_not_autocasts():
    """CPU autocast has no rms_norm kernel: its upcast and cast back are the op's own, as with
    autocast off; the simulated CUDA trace, whose list has rms_norm, credits its cast to autocast."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCPU")
    h = torch.randn(4, 8).to(torch.bfloat16)
    on = trace_fn(partial(torch.rms_norm, h, (8,)), device="cpu", dtype=torch.bfloat16)
    off = trace_fn(partial(torch.rms_norm, h, (8,)), device="cpu", enabled=False)
    assert len(on.casts) == len(off.casts) == 2
    assert not any(r.by_autocast for r in on.records)
    assert [r.op for r in on.records] == [r.op for r in off.records]
    w = torch.randn(8, 8)
    (weight_cast,) = trace_fn(lambda: h @ w, device="cpu", dtype=torch.bfloat16).casts
    assert weight_cast.autocast_cast  # mm's kernel casts the float32 weight: autocast's own
    cuda = trace_fn(partial(torch.rms_norm, h, (8,)), device="cuda", dtype=torch.bfloat16, simulate=True)
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA"):  # torch 2.13
        assert cuda.casts[0].autocast_cast
    else:  # torch 2.11: CUDA's autocast has no rms_norm kernel (its fused kernel, replayed, casts nothing)
        assert not any(r.by_autocast for r in cuda.records)


@pytest.mark.parametrize("op", ["softmax(x)", "log_softmax(x)"])
def test_cuda_softmax_casts_its_own_bf16_input_where_autocast_asks_for_float32(op):
    """CUDA's autocast calls softmax and log_softmax with dtype=float32 (fp32_set_opt_dtype):
    the bf16 upcast is the op's own (SoftMax.cpp's toType), yet the op is float32 because
    autocast asked; float16 needs no cast (half_to_float); layer_norm's cast is autocast's."""
    bf16 = probe(op, torch.bfloat16, "cuda", simulate=True)
    (cast,) = bf16.casts
    assert not cast.autocast_cast and "explicit" in bf16.table()
    (compute,) = bf16.compute
    assert compute.fp32 and compute.to_fp32 and not compute.already_fp32
    fp16 = probe(op, torch.float16, "cuda", simulate=True)
    assert not fp16.casts and fp16.compute[0].to_fp32
    (ln_cast,) = probe("layer_norm(x)", torch.bfloat16, "cuda", simulate=True).casts
    assert ln_cast.autocast_cast
    mps = probe(op, torch.bfloat16, "mps", simulate=True)  # MPS: plain fp32 policy, autocast casts
    assert mps.casts[0].autocast_cast


def test_an_op_kernel_for_own_casts_leaves_gradients_alone():
    x = torch.randn(3, 5, requires_grad=True)
    tr = trace_fn(lambda: torch.log_softmax(x, -1).sum().backward(), device="cpu", enabled=False)
    assert tr.records and x.grad is not None
    y = x.detach().clone().requires_grad_()
    torch.log_softmax(y, -1).sum().backward()
    assert torch.equal(x.grad, y.grad)


def test_a_cast_the_code_writes_is_explicit_not_autocast():
    h = torch.randn(4, 8).to(torch.bfloat16)
    tr = trace_fn(lambda: torch.exp(h.float()), device="cpu", dtype=torch.bfloat16)
    (cast,) = tr.casts
    assert not cast.by_autocast and not cast.autocast_cast
    assert tr.table().splitlines()[1].split()[-1] == "explicit"
    assert tr.ops("exp")[0].already_fp32  # exp got the code's own float32 copy
    asked = trace_fn(partial(torch.softmax, h, -1, dtype=torch.float32), device="cpu", dtype=torch.bfloat16)
    assert asked.result.dtype == torch.float32 and not asked.ops("_softmax")[0].to_fp32
    off = trace_fn(lambda: torch.relu(h).float(), device="cpu", enabled=False)
    assert off.casts and not any(r.by_autocast for r in off.records)


def test_example_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    example("TransformerBlock", "cpu")
    assert torch.equal(before, torch.get_rng_state())
    m1, x1, *_ = example("card_model", "cpu")
    m2, x2, *_ = example("card_model", "cpu")
    assert torch.equal(x1, x2) and torch.equal(m1[0].weight, m2[0].weight)


# --- simulated devices -----------------------------------------------------------------


def _autocast_state(device_type):
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), nesting


@pytest.mark.parametrize("dtype", LOW, ids=short)
@pytest.mark.parametrize("case", [*EXAMPLES, "exercise"])
def test_simulating_the_cpu_reproduces_the_real_cpu_trace(case, dtype):
    """The replay machinery, checked where it can be: CPU autocast, real against simulated."""
    if case == "exercise":
        model, x, y, loss_fn = dtype_exercise("cpu")
    else:
        model, x, y, loss_fn = example(case, "cpu")
    real = trace_model(model, x, y, loss_fn, dtype=dtype)
    sim = trace_model(model, x, y, loss_fn, dtype=dtype, device="cpu", simulate=True)
    assert sim.simulated and sim.where == "cpu (simulated)" and "(simulated)" in sim.headline()
    assert differences(real, sim, layout=False) == []
    assert [r.mark for r in real.rows()] == [r.mark for r in sim.rows()]
    assert [r.module for r in real.rows()] == [r.module for r in sim.rows()]
    assert sim.result.dtype == real.result.dtype and sim.loss.dtype == real.loss.dtype
    assert sim.result.shape == real.result.shape


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_simulating_the_cpu_reproduces_every_probe(dtype):
    for name in PROBES:
        real, sim = probe(name, dtype, "cpu"), probe(name, dtype, "cpu", simulate=True)
        assert differences(real, sim, layout=False) == [], name


def test_simulation_leaves_the_model_and_autocast_as_they_were():
    model, x, y, loss_fn = example("TransformerBlock", "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    state = _autocast_state("cuda"), _autocast_state("cpu")
    tr = trace_model(model, x, y, loss_fn, dtype=torch.float16, device="cuda", simulate=True)
    assert tr.device == "cuda" and tr.result.device.type == "cuda" and x.device.type == "cpu"
    assert list(model.parameters()) == params and all(p.grad is None for p in params)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert (_autocast_state("cuda"), _autocast_state("cpu")) == state
    _assert_clean(model)
    with pytest.raises(ZeroDivisionError):
        trace_fn(lambda: 1 / 0, device="cuda", dtype=torch.bfloat16, simulate=True)
    assert (_autocast_state("cuda"), _autocast_state("cpu")) == state
    assert _get_current_dispatch_mode() is None


def test_simulation_refuses_what_it_cannot_replay():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="pass them as arguments"):
        trace_fn(lambda: torch.relu(x), device="cuda", simulate=True)
    with pytest.raises(ValueError, match="needs the device type to replay"):
        trace_fn(torch.relu, x, simulate=True)
    with pytest.raises(ValueError, match="replays cuda, mps, cpu autocast"):
        trace_fn(torch.relu, x, device="xla", simulate=True)
    with pytest.raises(ValueError, match="forward \\+ loss only"):
        trace_model(card_model(), torch.randn(2, 512), torch.tensor([0, 1]), device="cuda",
                    simulate=True, backward="outside")
    with pytest.raises(ValueError, match="bfloat16 and torch.float16"):
        trace_fn(torch.relu, x, device="cuda", dtype=torch.float32, simulate=True)
    if "cuda" not in available_devices():
        with pytest.raises(DeviceUnavailableError, match="replay its lists here with simulate=True"):
            trace_fn(torch.relu, x, device="cuda")


def test_a_call_that_needs_the_real_device_says_so():
    """GRUCell's fused path asks the CUDA runtime itself: no replay on a machine without it."""
    try:
        tr = trace_fn(nn.GRUCell(8, 6), torch.randn(4, 8), device="cuda", dtype=torch.float16,
                      simulate=True)
    except SimulationUnsupported as err:
        assert "Trace it on a real cuda device" in str(err)
    else:  # a torch that can replay it must get the docs' answer
        assert tr.result.dtype == torch.float16


def test_the_model_device_mismatch_points_at_simulate():
    with pytest.raises(ValueError, match="pass simulate=True"):
        trace_model(card_model().to("meta"), torch.randn(2, 512), torch.tensor([0, 1]), device="cpu")


# --- the simulated traces against PyTorch's autocast docs (CUDA op lists) -------------------
# https://pytorch.org/docs/stable/amp.html, "CUDA Op-Specific Behavior" (docs/source/amp.md):
# each list's ops, called as the docs name them, on inputs the list is about.


def _long(*shape, high=2):
    return lambda dev: torch.randint(0, high, shape, device=dev)


_CUDA_FP16_LIST = {  # "CUDA Ops that can autocast to float16": float32 inputs -> 16-bit
    "__matmul__": (lambda a, b: a @ b, [(4, 8), (8, 3)]),
    "addbmm": (torch.addbmm, [(4, 3), (2, 4, 8), (2, 8, 3)]),
    "addmm": (torch.addmm, [(4, 3), (4, 8), (8, 3)]),
    "addmv": (torch.addmv, [(4,), (4, 8), (8,)]),
    "addr": (torch.addr, [(4, 8), (4,), (8,)]),
    "baddbmm": (torch.baddbmm, [(2, 4, 3), (2, 4, 8), (2, 8, 3)]),
    "bmm": (torch.bmm, [(2, 4, 8), (2, 8, 3)]),
    "multi_dot": (lambda a, b, c: torch.linalg.multi_dot([a, b, c]), [(4, 8), (8, 3), (3, 5)]),
    "conv1d": (F.conv1d, [(2, 3, 8), (4, 3, 3)]),
    "conv2d": (F.conv2d, [(2, 3, 8, 8), (4, 3, 3, 3)]),
    "conv3d": (F.conv3d, [(2, 3, 6, 6, 6), (4, 3, 3, 3, 3)]),
    "conv_transpose1d": (F.conv_transpose1d, [(2, 3, 8), (3, 4, 3)]),
    "conv_transpose2d": (F.conv_transpose2d, [(2, 3, 8, 8), (3, 4, 3, 3)]),
    "conv_transpose3d": (F.conv_transpose3d, [(2, 3, 6, 6, 6), (3, 4, 3, 3, 3)]),
    "GRUCell": (lambda: nn.GRUCell(8, 6), [(4, 8)]),
    "linear": (F.linear, [(4, 8), (3, 8)]),
    "LSTMCell": (lambda: nn.LSTMCell(8, 6), [(4, 8)]),
    "matmul": (torch.matmul, [(4, 8), (8, 3)]),
    "mm": (torch.mm, [(4, 8), (8, 3)]),
    "mv": (torch.mv, [(4, 8), (8,)]),
    "prelu": (F.prelu, [(4, 8), (8,)]),
    "RNNCell": (lambda: nn.RNNCell(8, 6), [(4, 8)]),
}

_CUDA_FP32_LIST = {  # "CUDA Ops that can autocast to float32": 16-bit inputs -> float32
    "__pow__": (lambda x: x ** 2, [(4, 8)]),
    "__rdiv__": (lambda x: 1 / x, [(4, 8)]),
    "__rpow__": (lambda x: 2 ** x, [(4, 8)]),
    "__rtruediv__": (lambda x: 2.0 / x, [(4, 8)]),
    "acos": (torch.acos, [(4, 8)]),
    "asin": (torch.asin, [(4, 8)]),
    "binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits, [(4, 8), (4, 8)]),
    "cosh": (torch.cosh, [(4, 8)]),
    "cosine_embedding_loss": (lambda a, b: F.cosine_embedding_loss(a, b, torch.ones(4, device=a.device)),
                              [(4, 8), (4, 8)]),
    "cdist": (torch.cdist, [(4, 8), (5, 8)]),
    "cosine_similarity": (F.cosine_similarity, [(4, 8), (4, 8)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=x.device)),
                      [(4, 8)]),
    "cumprod": (lambda x: torch.cumprod(x, 1), [(4, 8)]),
    "cumsum": (lambda x: torch.cumsum(x, 1), [(4, 8)]),
    "dist": (torch.dist, [(4, 8), (4, 8)]),
    "erfinv": (torch.erfinv, [(4, 8)]),
    "exp": (torch.exp, [(4, 8)]),
    "expm1": (torch.expm1, [(4, 8)]),
    "group_norm": (lambda x: F.group_norm(x, 2), [(4, 8)]),
    "hinge_embedding_loss": (lambda x: F.hinge_embedding_loss(x, torch.ones(4, 8, device=x.device)),
                             [(4, 8)]),
    "kl_div": (lambda a, b: F.kl_div(a, b, reduction="batchmean"), [(4, 8), (4, 8)]),
    "l1_loss": (F.l1_loss, [(4, 8), (4, 8)]),
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), [(4, 8)]),
    "log": (torch.log, [(4, 8)]),
    "log_softmax": (lambda x: F.log_softmax(x, -1), [(4, 8)]),
    "log10": (torch.log10, [(4, 8)]),
    "log1p": (torch.log1p, [(4, 8)]),
    "log2": (torch.log2, [(4, 8)]),
    "margin_ranking_loss": (lambda a, b: F.margin_ranking_loss(a, b, torch.ones(4, device=a.device)),
                            [(4,), (4,)]),
    "mse_loss": (F.mse_loss, [(4, 8), (4, 8)]),
    "multilabel_margin_loss": (lambda x: F.multilabel_margin_loss(
        x, torch.zeros(4, 8, dtype=torch.long, device=x.device)), [(4, 8)]),
    "multi_margin_loss": (lambda x: F.multi_margin_loss(x, torch.zeros(4, dtype=torch.long, device=x.device)),
                          [(4, 8)]),
    "nll_loss": (lambda x: F.nll_loss(x, torch.zeros(4, dtype=torch.long, device=x.device)), [(4, 8)]),
    "norm": (torch.norm, [(4, 8)]),
    "normalize": (F.normalize, [(4, 8)]),
    "pdist": (F.pdist, [(4, 8)]),
    "poisson_nll_loss": (F.poisson_nll_loss, [(4, 8), (4, 8)]),
    "pow": (lambda x: torch.pow(x, 2), [(4, 8)]),
    "prod": (torch.prod, [(4, 8)]),
    "reciprocal": (torch.reciprocal, [(4, 8)]),
    "rsqrt": (torch.rsqrt, [(4, 8)]),
    "sinh": (torch.sinh, [(4, 8)]),
    "smooth_l1_loss": (F.smooth_l1_loss, [(4, 8), (4, 8)]),
    "soft_margin_loss": (F.soft_margin_loss, [(4, 8), (4, 8)]),
    "softmax": (lambda x: F.softmax(x, -1), [(4, 8)]),
    "softmin": (lambda x: F.softmin(x, -1), [(4, 8)]),
    "softplus": (F.softplus, [(4, 8)]),
    "sum": (torch.sum, [(4, 8)]),
    "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), [(4, 8)]),
    "tan": (torch.tan, [(4, 8)]),
    "triplet_margin_loss": (F.triplet_margin_loss, [(4, 8), (4, 8), (4, 8)]),
}

_CUDA_PROMOTE_LIST = {  # "CUDA Ops that promote to the widest input type"
    "addcdiv": (torch.addcdiv, [(4, 8)] * 3),
    "addcmul": (torch.addcmul, [(4, 8)] * 3),
    "atan2": (torch.atan2, [(4, 8)] * 2),
    "bilinear": (F.bilinear, [(4, 8), (4, 5), (3, 8, 5)]),
    "cross": (lambda a, b: torch.cross(a, b, dim=1), [(4, 3)] * 2),
    "dot": (torch.dot, [(8,)] * 2),
    "grid_sample": (lambda a, g: F.grid_sample(a, g, align_corners=False), [(1, 2, 4, 4), (1, 3, 3, 2)]),
    "index_put": (lambda a, v: a.index_put((torch.tensor([0, 1], device=a.device),), v), [(4, 8), (2, 8)]),
    "scatter_add": (lambda a, s: a.scatter_add(0, torch.zeros(2, 8, dtype=torch.long, device=a.device), s),
                    [(4, 8), (2, 8)]),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=1), [(4, 8), (8, 3)]),
}

# Calls that ask the CUDA runtime itself: a build without CUDA (or without a driver) cannot
# replay them; the tracer must say so (SimulationUnsupported), never answer wrongly.
_NEEDS_THE_RUNTIME = {"GRUCell", "grid_sample"}


def _simulate_docs_call(name, fn, shapes, dtype, input_dtype):
    fn = fn() if name[0].isupper() else fn  # the RNN cells: a fresh module
    args = [torch.randn(*s).to(input_dtype) for s in shapes]
    try:
        return trace_fn(fn, *args, device="cuda", dtype=dtype, simulate=True)
    except SimulationUnsupported:
        if name not in _NEEDS_THE_RUNTIME:
            raise
        return None


def _first(result):
    return result if isinstance(result, torch.Tensor) else result[0]


@pytest.mark.parametrize("dtype", LOW, ids=short)
@pytest.mark.parametrize("name", list(_CUDA_FP16_LIST))
def test_simulated_cuda_matches_the_docs_lower_precision_list(name, dtype):
    fn, shapes = _CUDA_FP16_LIST[name]
    tr = _simulate_docs_call(name, fn, shapes, dtype, torch.float32)
    if tr is not None:
        assert _first(tr.result).dtype == dtype, tr.oneline()
        assert tr.casts and all(r.autocast_cast and r.dtype == dtype for r in tr.casts)


@pytest.mark.parametrize("dtype", LOW, ids=short)
@pytest.mark.parametrize("name", list(_CUDA_FP32_LIST))
def test_simulated_cuda_matches_the_docs_float32_list(name, dtype):
    fn, shapes = _CUDA_FP32_LIST[name]
    tr = _simulate_docs_call(name, fn, shapes, dtype, dtype)
    assert _first(tr.result).dtype == torch.float32, tr.oneline()


@pytest.mark.parametrize("dtype", LOW, ids=short)
@pytest.mark.parametrize("name", list(_CUDA_PROMOTE_LIST))
def test_simulated_cuda_matches_the_docs_promote_list(name, dtype):
    fn, shapes = _CUDA_PROMOTE_LIST[name]
    all_low = _simulate_docs_call(name, fn, shapes, dtype, dtype)
    if all_low is None:
        return
    assert _first(all_low.result).dtype == dtype, all_low.oneline()
    args = [torch.randn(*s).to(dtype) for s in shapes]
    args[-1] = args[-1].float()  # one float32 input: everything runs float32
    mixed = trace_fn(fn, *args, device="cuda", dtype=dtype, simulate=True)
    assert _first(mixed.result).dtype == torch.float32, mixed.oneline()


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_simulated_cuda_follows_the_docs_eligibility_rules(dtype):
    """"Op Eligibility": float64, in-place, out= and explicit dtype= calls are not autocast;
    unlisted ops run in their inputs' type."""
    for name, want in (("mm(a64, b64)", torch.float64), ("c.addmm_(a, b)", torch.float32),
                       ("mm(a, b, out=c)", torch.float32), ("x.exp_()", dtype),
                       ("softmax(x, dtype=x.dtype)", dtype), ("relu(x)", dtype), ("mean(x)", dtype)):
        tr = probe(name, dtype, "cuda", simulate=True)
        assert tr.result.dtype == want and tr.casts == [], (name, tr.oneline())


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_simulated_cuda_cross_entropy_keeps_its_log_softmax_16_bit(dtype):
    """CUDA has no cross_entropy entry: log_softmax(x, 1, dtype=x.dtype), then nll_loss (fp32)."""
    tr = probe("cross_entropy(x, y)", dtype, "cuda", simulate=True)
    assert [(r.op, r.dtype) for r in tr.rows()] == [
        ("_log_softmax", dtype), ("_to_copy", torch.float32), ("nll_loss_forward", torch.float32)]
    assert [r.mark for r in tr.rows()] == ["", "", BY_AUTOCAST]
    cpu = probe("cross_entropy(x, y)", dtype, "cpu")
    assert [(r.op, r.dtype) for r in cpu.rows()] == [
        ("_to_copy", torch.float32), ("_log_softmax", torch.float32), ("nll_loss_forward", torch.float32)]


def test_simulated_cuda_softmax_casts_only_for_bfloat16():
    """float16: softmax reads fp16 and writes fp32 in one kernel (no _to_copy); bfloat16: a cast."""
    f16 = probe("softmax(x)", torch.float16, "cuda", simulate=True)
    b16 = probe("softmax(x)", torch.bfloat16, "cuda", simulate=True)
    assert [(r.op, r.dtype) for r in f16.rows()] == [("_softmax", torch.float32)]
    assert [(r.op, r.dtype) for r in b16.rows()] == [("_to_copy", torch.float32), ("_softmax", torch.float32)]
    assert f16.rows()[0].to_fp32 and b16.rows()[1].to_fp32  # autocast's doing, either way
    for dtype in LOW:
        ln = probe("layer_norm(x)", dtype, "cuda", simulate=True)
        assert [r.op for r in ln.rows()] == ["_to_copy", "native_layer_norm"]


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_simulated_cuda_transformer_block_runs_its_softmax_in_float32(dtype):
    cpu = trace_example("TransformerBlock", dtype, "cpu")
    cuda = trace_example("TransformerBlock", dtype, "cuda", simulate=True)
    assert cpu.dtype_of("_softmax") == dtype and cuda.dtype_of("_softmax") == torch.float32
    assert all(r.to_fp32 for r in cuda.ops("_softmax"))
    # float32 inputs to layer_norm on both: on CUDA autocast keeps it float32, it was already
    assert all(r.already_fp32 for r in cuda.ops("native_layer_norm"))
    assert cuda.dtype_of("addmm") == cuda.dtype_of("gelu") == dtype


def test_simulated_mps_replays_the_mps_lists():
    """MPS (autocast_mode.cpp, AutocastMPS): softmax, layer_norm and sum on its float32 list, cast first."""
    for name in ("softmax(x)", "layer_norm(x)", "sum(x)"):
        tr = probe(name, torch.float16, "mps", simulate=True)
        assert tr.where == "mps (simulated)" and tr.result.dtype == torch.float32
        assert tr.rows()[0].op == "_to_copy" and tr.rows()[0].autocast_cast
    assert probe("mean(x)", torch.float16, "mps", simulate=True).result.dtype == torch.float16
    assert probe("mm(a, b)", torch.bfloat16, "mps", simulate=True).result.dtype == torch.bfloat16


def test_probe_table_shows_each_device_side_by_side():
    text = probe_table(["softmax(x)", "sum(x)"], torch.bfloat16, ["cpu", "cuda (simulated)"])
    head, softmax, total = text.splitlines()
    assert head.split("  ")[0] == "call" and "cpu" in head and head.endswith("cuda (simulated)")
    assert softmax.split() == ["softmax(x)", "_softmax->bf16", "_to_copy->fp32", "_softmax->fp32"]
    assert total.split() == ["sum(x)", "sum->bf16", "sum->fp32"]
    default = probe_table(["relu(x)"], torch.float16)
    here = available_devices()[0]
    assert default.splitlines()[0].split() == ["call", here, "cuda", "(simulated)"]
    with pytest.raises(ValueError, match="probe must be one of"):
        probe("softmax", torch.float16, "cpu")


def test_tables_wrap_long_chains_to_the_width_and_keep_every_word():
    names = ["cross_entropy(x, y)", "softmax(x, dtype=x.dtype)"]
    devices = ["cpu", "mps (simulated)"]
    whole = probe_table(names, torch.bfloat16, devices)
    wrapped = probe_table(names, torch.bfloat16, devices, width=80)
    assert max(map(len, whole.splitlines())) > 80 >= max(map(len, wrapped.splitlines()))
    assert len(wrapped.splitlines()) > len(whole.splitlines())
    assert sorted(wrapped.split()) == sorted(whole.split())  # wrapped, nothing lost
    assert wrapped.splitlines()[2].startswith(" " * len("softmax(x, dtype=x.dtype)"))
    tr = trace_model(*example("card_model", "cpu"), dtype=torch.bfloat16, backward="outside")
    lines = tr.summary().splitlines()
    assert max(map(len, lines)) <= 100 and any("mm x3" in line for line in lines)


def test_lesson_dtype_is_lesson_00s_recommendation_or_autocasts_default():
    from dataclasses import replace

    from amp_lessons.hardware import hardware_report

    report = hardware_report("cpu")
    cases = [("cuda", "bf16", torch.bfloat16), ("cuda", "fp16", torch.float16),
             ("cuda", "fp32", torch.float16), ("cpu", "fp32", torch.bfloat16),
             ("cpu", "bf16", torch.bfloat16), ("mps", "fp32", torch.float16)]
    for device, recommended, want in cases:
        assert lesson_dtype(replace(report, device=device, recommended=recommended)) == want
    assert lesson_dtype() in LOW


# --- the exercise --------------------------------------------------------------------

CPU_ANSWERS = {  # CPU: GroupNorm and LogSoftmax are on no list, so they follow the conv
    "convolution": "low", "native_group_norm": "low", "gelu": "low",
    "_log_softmax": "low", "nll_loss_forward": "fp32",
}
CUDA_ANSWERS = {  # CUDA: group_norm and log_softmax on the float32 list; gelu follows it
    "convolution": "low", "native_group_norm": "fp32", "gelu": "fp32",
    "_log_softmax": "fp32", "nll_loss_forward": "fp32",
}


def _answers(table, dtype):
    return {op: short(dtype) if a == "low" else a for op, a in table.items()}


def test_exercise_net_prints_the_same_on_every_torch_release():
    net, *_ = dtype_exercise("cpu")
    assert [type(m).__name__ for m in net] == [
        "Conv2d", "GroupNorm", "GELU", "Flatten", "Linear", "LogSoftmax"]


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_exercise_checker_passes_right_answers(dtype):
    tr = trace_model(*dtype_exercise("cpu"), dtype=dtype)
    verdict = check_dtype_predictions(_answers(CPU_ANSWERS, dtype), tr)
    assert verdict.passed, str(verdict)
    assert verdict.findings[0] == f"convolution: {short(dtype)}, right (rule 1)"
    as_dtypes = {op: dtype if a == "low" else torch.float32 for op, a in CPU_ANSWERS.items()}
    assert check_dtype_predictions(as_dtypes, tr).passed
    cuda = trace_model(*dtype_exercise("cpu"), dtype=dtype, device="cuda", simulate=True)
    assert check_dtype_predictions(_answers(CUDA_ANSWERS, dtype), cuda).passed
    assert not check_dtype_predictions(_answers(CPU_ANSWERS, dtype), cuda).passed


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_exercise_checker_hints_with_the_rule_not_the_answer(dtype):
    tr = trace_model(*dtype_exercise("cpu"), dtype=dtype)
    right = _answers(CPU_ANSWERS, dtype)
    # the classic wrong belief: "normalisation and softmax always stay float32"
    wrong = dict(right, native_group_norm="fp32", _log_softmax="float32", convolution="fp32")
    verdict = check_dtype_predictions(wrong, tr)
    assert not verdict.passed
    for finding in verdict.findings:  # a wrong prediction gets no dtype back: no answer given away
        if "right" not in finding:
            assert short(dtype) not in finding and "fp32" not in finding, finding
    gn = next(f for f in verdict.findings if f.startswith("native_group_norm"))
    assert "Rule 3" in gn and "dtype its inputs gave it" in gn and "normalization's weight" in gn
    assert "fp32" not in gn
    (lsm,) = [f for f in verdict.findings if f.startswith("_log_softmax")]
    assert "Rule 3" in lsm and "normalization" not in lsm and "float32 list" not in lsm
    conv = next(f for f in verdict.findings if f.startswith("convolution"))
    # rules 1 and 2 share a hint: either number, or a list's name, would give the dtype away
    assert "(rule 1 or 2)" in conv and "lower-precision" not in conv and "float32" not in conv
    assert sum("right" in f for f in verdict.findings) == 2
    revealed = check_dtype_predictions(wrong, tr, reveal=True)
    assert f"[it ran in {short(dtype)}]" in revealed.findings[0]
    other = "fp16" if dtype == torch.bfloat16 else "bf16"
    assert not check_dtype_predictions(dict(right, gelu=other), tr).passed
    (swapped,) = [f for f in check_dtype_predictions(dict(right, convolution=other), tr).findings
                  if f.startswith("convolution")]  # the right family, the other 16-bit dtype
    assert "A 16-bit dtype, yes; which one did this run ask autocast for?" in swapped
    assert "lists" not in swapped and short(dtype) not in swapped
    unanswered = check_dtype_predictions(dict.fromkeys(right, "?"), tr)
    assert not unanswered.passed and all("no prediction yet" in f for f in unanswered.findings)
    for guess in ("fp61", "fp64", torch.float64):  # fp64 is a dtype, just not an answer here
        (bad,) = [f for f in check_dtype_predictions(dict(right, gelu=guess), tr).findings
                  if f.startswith("gelu")]
        assert bad == (f"gelu: {guess!r} is not one of this exercise's answers; "
                       "write 'fp32', 'bf16' or 'fp16'")
    absent = check_dtype_predictions({"softmax": "fp32"}, tr, ops=None)
    assert not absent.passed and any("softmax: did not run" in f for f in absent.findings)
    assert not check_dtype_predictions({}, tr).passed
    cuda = trace_model(*dtype_exercise("cpu"), dtype=dtype, device="cuda", simulate=True)
    hint = check_dtype_predictions({"native_group_norm": short(dtype)}, cuda, ops=None).findings[0]
    assert hint == ("native_group_norm: not yet. Autocast stepped in for this op (rule 1 or 2): "
                    "which of cuda (simulated)'s two lists is it on? Look it up: the three rules "
                    "name their ops, and the full lists are in aten/src/ATen/autocast_mode.h and "
                    "autocast_mode.cpp.")
    assert conv.removeprefix("convolution") == hint.removeprefix("native_group_norm").replace(
        "cuda (simulated)", "cpu")
    # CUDA's nll_loss is on the float32 list, but its input came float32 from log_softmax
    (nll,) = check_dtype_predictions({"nll_loss_forward": short(dtype)}, cuda, ops=None).findings
    assert "Rule 3" in nll and "its inputs had its list's dtype already" in nll
    # the same words for a float32 result (nll on CUDA) and a 16-bit one (log_softmax on a CPU)
    assert nll.removeprefix("nll_loss_forward") == lsm.removeprefix("_log_softmax").replace(
        "on cpu", "on cuda (simulated)")
    assert "normalization" not in nll and "fp32" not in nll


@pytest.mark.parametrize("dtype", LOW, ids=short)
def test_exercise_checker_wants_all_five_ops_and_no_others(dtype):
    tr = trace_model(*dtype_exercise("cpu"), dtype=dtype)
    right = _answers(CPU_ANSWERS, dtype)
    one = check_dtype_predictions({"convolution": short(dtype)}, tr)
    assert not one.passed
    assert one.findings == ["missing: 'native_group_norm', 'gelu', '_log_softmax', "
                            "'nll_loss_forward'; predict all 5 ops, with '?' for the ones "
                            "you have not decided"]
    typo = check_dtype_predictions(dict(right, softmax="fp32"), tr)
    assert not typo.passed and len(typo.findings) == 1
    assert typo.findings[0].startswith("not asked: 'softmax'; the exercise's ops are 'convolution'")
    renamed = {("log_softmax" if op == "_log_softmax" else op): a for op, a in right.items()}
    both = check_dtype_predictions(renamed, tr)
    assert [f.split(":")[0] for f in both.findings] == ["not asked", "missing"]
    assert "'log_softmax'" in both.findings[0] and "'_log_softmax'" in both.findings[1]
    assert check_dtype_predictions(right, tr).passed


def test_exercise_checker_refuses_tf32_with_a_reason():
    tr = trace_model(*dtype_exercise("cpu"), dtype=torch.bfloat16)
    verdict = check_dtype_predictions(dict(_answers(CPU_ANSWERS, torch.bfloat16),
                                           nll_loss_forward="tf32"), tr)
    assert not verdict.passed
    (finding,) = [f for f in verdict.findings if f.startswith("nll_loss_forward")]
    assert "'tf32' is not a dtype" in finding and "write 'fp32'" in finding


# --- widget and figure ---------------------------------------------------------------


def test_autocast_table_is_the_traced_table():
    from amp_lessons.widgets import autocast_table

    for name in EXAMPLES:
        text = autocast_table(name, "fp16", "cpu")
        tr = trace_example(name, torch.float16, "cpu")
        assert text == "\n\n".join([tr.headline(), tr.table(), tr.summary()])
        assert "autocast torch.float16" in text and "<- " in text


def test_autocast_explorer_rerenders_on_a_new_dtype():
    from amp_lessons.widgets import autocast_explorer

    box = autocast_explorer("cpu")
    which, prec = box.children[:2]
    devs = [c for c in box.children if getattr(c, "description", None) == "device"]
    assert [list(d.options) for d in devs] == ([available_devices()] if len(available_devices()) > 1 else [])
    assert [label for label, _ in prec.options] == ["bfloat16", "float16"]
    assert "torch.bfloat16" in box.view.value and "card_model on cpu" in box.view.value
    prec.value = "fp16"
    assert "torch.float16" in box.view.value
    which.value = "TransformerBlock"
    assert "TransformerBlock on cpu" in box.view.value and "_softmax" in box.view.value


def test_op_dtypes_figure_names_every_op_readably_and_counts_them():
    from matplotlib.colors import to_hex

    from amp_lessons.plots import op_dtypes

    cpu = trace_example("TransformerBlock", torch.bfloat16, "cpu")
    cuda = trace_example("TransformerBlock", torch.bfloat16, "cuda", simulate=True)
    fig = op_dtypes([cpu, cuda])
    assert len(fig.axes) == 2
    for ax, tr in zip(fig.axes, (cpu, cuda)):
        c = tr.counts()
        title = ax.get_title(loc="left")
        assert f"TransformerBlock on {tr.where}, autocast bf16: {c['low']} of {c['compute']}" in title
        assert f"{c['to_fp32']} autocast put in float32, {c['already_fp32']} float32 already" in title
        names = [t.get_text() for t in ax.texts]
        assert names == [f"{i}. {r.op}" for i, r in enumerate(tr.rows(), 1)]
        assert all(t.get_fontsize() >= 9 and t.get_rotation() == 0 for t in ax.texts)
    assert "(simulated)" in fig.axes[1].get_title(loc="left")
    softmax = next(p for t, p in zip(fig.axes[1].texts, fig.axes[1].patches) if t.get_text().endswith("_softmax"))
    assert to_hex(softmax.get_facecolor()) == "#f58518"  # autocast put it in float32
    head = fig._suptitle.get_text()
    assert all(len(line) <= 100 for line in head.splitlines())
    assert all(not w.endswith("-") for w in head.split())  # wrapped between words
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "autocast put it in float32" in legend and "float32 already (no input cast)" in legend
    assert fig.get_size_inches()[0] <= 9.6  # ~960 px: shown at its own size in JupyterLab, not shrunk


def test_a_probe_that_needs_float64_is_marked_on_mps(monkeypatch):
    """MPS has no float64: the side-by-side table says so instead of failing the lesson."""
    import amp_lessons.trace as trace

    monkeypatch.setattr(trace, "pick_device", lambda d=None: torch.device("mps"))
    with pytest.raises(ProbeUnavailable, match="MPS does not have"):
        probe("mm(a64, b64)", torch.float16, "mps")
    assert trace._cell("mm(a64, b64)", torch.float16, "mps", False) == "(no float64 on mps)"
    assert "mm(a64, b64)" not in devicechecks._probes_on(torch.device("mps"))
    assert len(devicechecks._probes_on(torch.device("mps"))) == len(PROBES) - 1


def test_probe_table_keeps_the_cpu_column_on_a_gpu_machine(monkeypatch):
    from amp_lessons import trace as T

    monkeypatch.setattr(T, "pick_device", lambda *a, **k: torch.device("cuda"))
    assert T._wheres(None) == [("cpu", False), ("cuda", False), ("cuda", True)]
    monkeypatch.setattr(T, "pick_device", lambda *a, **k: torch.device("cpu"))
    assert T._wheres(None) == [("cpu", False), ("cuda", True)]


def test_a_simulated_trace_leaves_a_model_that_reuses_a_module_untouched():
    lin = nn.Linear(8, 8)
    seq, x = nn.Sequential(lin, lin), torch.randn(2, 8)
    weight = lin.weight
    trace_model(seq, x, None, lambda o: o.sum(), dtype=torch.bfloat16, device="cuda", simulate=True)
    assert lin.weight is weight and type(lin.weight) is nn.Parameter
    assert trace_model(seq, x, None, lambda o: o.sum(), dtype=torch.bfloat16).ops("addmm")
