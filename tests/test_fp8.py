"""Lesson 08's fp8 helpers, checked against float32 references, hand-counted censuses and
error bounds derived from the formats' own figures."""

import copy
import math

import pytest
import torch
from torch import nn

from amp_lessons import fp8, hardware
from amp_lessons.formats import census, format_info
from amp_lessons.fp8 import (
    EPS,
    RECIPES,
    Fp8Linear,
    Fp8Matmul,
    amax,
    convert_to_fp8,
    fp8_census,
    quantize,
    reference_mm,
    saturating_cast,
    scale_from_amax,
    scaled_mm,
    scaled_mm_support,
)

RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
ROW_MM = scaled_mm_support()["row"] is None  # torch 2.11's CPU _scaled_mm takes per-tensor scales only


def grid(shape, seed=0, step=0.25, top=4):
    """Multiples of ``step`` in [-top, top]: exact in e4m3 (at most 3 significant bits after scaling)."""
    g = torch.Generator().manual_seed(seed)
    n = int(top / step)
    return torch.randint(-n, n + 1, shape, generator=g).float() * step


def spread(shape, seed=0, lo=-20, hi=4):
    """Values of both signs whose magnitudes span 2^lo .. 2^hi."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(lo, hi, shape, generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return sign * (1 + torch.rand(shape, generator=g)) * 2.0**exps


# -- scales ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp16", "bf16", torch.float32, "fp61"])
def test_only_fp8_formats(bad):
    with pytest.raises(ValueError, match="fp8_e4m3, fp8_e5m2"):
        quantize(torch.ones(2, 2), bad)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="granularity must be one of tensor, row"):
        amax(torch.ones(2, 2), "column")
    with pytest.raises(ValueError, match="per-row scales need a matrix"):
        amax(torch.ones(3), "row")
    with pytest.raises(ValueError, match="floating-point tensor"):
        quantize(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="recipe must be one of tensorwise, rowwise, none"):
        Fp8Linear(16, 16, recipe="delayed")
    with pytest.raises(ValueError, match="must share K"):
        scaled_mm(quantize(torch.ones(4, 16)), quantize(torch.ones(4, 32)))


def test_scale_from_amax():
    a = torch.tensor([[2.0], [0.5], [0.0], [3.0]])
    s = scale_from_amax(a, "fp8_e4m3")
    assert s.dtype == torch.float32
    assert s[:2].flatten().tolist() == [224.0, 896.0]
    assert s[2].item() == pytest.approx(448 / EPS, rel=1e-6) and math.isfinite(s[2].item())  # floored amax
    assert s[3].item() == torch.tensor(448 / 3.0, dtype=torch.float64).float().item()
    p2 = scale_from_amax(a, "fp8_e5m2", power_of_2=True)
    assert p2[0].item() == 2.0**14 and p2[3].item() == 2.0**14  # 57344/2 = 28672 -> 2^14; /3 -> 2^14
    assert torch.all(torch.log2(p2) == torch.log2(p2).round())


def test_amax_per_tensor_and_per_row():
    x = torch.tensor([[1.0, -5.0], [0.25, 0.0], [0.0, 0.0]])
    assert amax(x).item() == 5.0 and amax(x).shape == ()
    assert amax(x, "row").flatten().tolist() == [5.0, 0.25, 0.0] and amax(x, "row").shape == (3, 1)


# -- quantize / dequantize ---------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_exact_values_round_trip_exactly(name, granularity):
    x = grid((8, 32), step=0.5, top=2) if name == "fp8_e5m2" else grid((8, 32))
    q = quantize(x, name, granularity, power_of_2=True)
    assert q.data.dtype == format_info(name).dtype and q.granularity == granularity
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_round_trip_error_is_what_the_format_allows(name, granularity):
    f = format_info(name)
    x = spread((16, 64))
    q = quantize(x, name, granularity)
    back = q.dequantize().double()
    s = q.scale.double()
    # half an ulp relative in the normal range; half the subnormal spacing (over the scale) below it
    allowed = torch.maximum(f.eps / 2 * x.double().abs(), f.smallest_subnormal / 2 / s) * (1 + 1e-6)
    assert torch.all((back - x.double()).abs() <= allowed)
    # amax lands on the largest value (per tensor, or in every row)
    top = q.data.float().abs().amax() if granularity == "tensor" else q.data.float().abs().amax(dim=1)
    assert torch.all(top == f.max)


def test_saturating_cast_is_the_same_on_every_release():
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, 464.0, 465.0, math.nan, 1.0])
    e4 = saturating_cast(x, "fp8_e4m3").float()
    assert e4[:6].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0] and e4[7].item() == 1.0
    assert math.isnan(e4[6].item())
    e5 = saturating_cast(x, "fp8_e5m2").float()
    assert e5[:4].tolist() == [57344.0, -57344.0, 57344.0, -57344.0]


def test_an_all_zero_row_gets_a_finite_scale():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    q = quantize(x, "fp8_e4m3", "row")
    assert torch.isfinite(q.scale).all()
    assert torch.equal(q.dequantize()[0], torch.zeros(3)) and not q.dequantize().isnan().any()


# -- census ---------------------------------------------------------------------------------------


def test_census_of_hand_built_tensors():
    # amax 1, power-of-two scale 2^8 (448 rounded down): 1 -> 256, 2^-5 -> 8, 2^-10 -> 2^-2,
    # 2^-16 -> 2^-8 (e4m3 subnormal: 2^-9 .. 2^-6), 2^-20 -> 2^-12 (flushed: at most 2^-10)
    x = torch.tensor([1.0, -2.0**-5, 2.0**-10, 2.0**-16, -(2.0**-20), 0.0])
    c = fp8_census(x, "fp8_e4m3", "tensor", power_of_2=True)
    assert (c.total, c.zero, c.flushed, c.subnormal, c.normal, c.overflow) == (6, 1, 1, 1, 3, 0)
    unscaled = fp8_census(x, "fp8_e4m3")
    assert unscaled == census(x, "fp8_e4m3")  # lesson 01's census, unchanged
    assert (unscaled.flushed, unscaled.subnormal, unscaled.normal) == (3, 0, 2)  # 2^-10 is the tie: 0
    # per row: the small row gets its own scale and keeps all of its values
    rows = torch.tensor([[1.0, 2.0**-5, 2.0**-10], [2.0**-16, 2.0**-20, 2.0**-18]])
    per_tensor = fp8_census(rows, "fp8_e4m3", "tensor", power_of_2=True)
    per_row = fp8_census(rows, "fp8_e4m3", "row", power_of_2=True)
    assert (per_tensor.flushed, per_tensor.subnormal, per_tensor.normal) == (2, 1, 3)
    assert (per_row.flushed, per_row.subnormal, per_row.normal) == (0, 0, 6)
    both = fp8_census([x, rows], "fp8_e4m3")
    assert both.total == 12 and both.flushed == unscaled.flushed + census(rows, "fp8_e4m3").flushed


def test_scaling_never_overflows_and_per_row_flushes_no_more():
    for seed in range(5):
        x = spread((32, 64), seed=seed, lo=-40, hi=30)
        for name in ("fp8_e4m3", "fp8_e5m2"):
            t, r = fp8_census(x, name, "tensor"), fp8_census(x, name, "row")
            assert t.overflow == r.overflow == 0
            assert r.flushed <= t.flushed and fp8_census(x, name).overflow > 0


def test_census_table_marks_the_measured_shares():
    groups = {"grad_output": [spread((8, 16))], "weight": [grid((8, 16))]}
    text = fp8.census_table(groups, "row")
    lines = text.splitlines()
    assert lines[0].startswith("scaled per row") and "e4m3 flushed" in lines[0] and "e5m2 overflow" in lines[0]
    assert lines[1].startswith("grad_output") and lines[1].count("≈") == 4  # overflow: 0 by construction
    assert lines[1].split()[3] == "0%" and lines[1].split()[6] == "0%"
    assert fp8.census_table(groups).splitlines()[1].count("≈") == 6  # unscaled, every share is measured


# -- torch._scaled_mm -------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("a_name, b_name", [("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e4m3"),
                                            ("fp8_e4m3", "fp8_e5m2")])
def test_scaled_mm_is_exactly_the_float32_product_on_exact_inputs(granularity, a_name, b_name):
    if granularity == "row" and not ROW_MM:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
    exact = {"fp8_e4m3": {"step": 0.25, "top": 4}, "fp8_e5m2": {"step": 0.5, "top": 2}}  # 3 or 2 mantissa bits
    a, b = grid((24, 48), seed=1, **exact[a_name]), grid((16, 48), seed=2, **exact[b_name])
    qa = quantize(a, a_name, granularity, power_of_2=True)
    qb = quantize(b, b_name, granularity, power_of_2=True)
    assert torch.equal(scaled_mm(qa, qb), a @ b.T)
    assert torch.equal(reference_mm(qa, qb), a @ b.T)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_scaled_mm_agrees_with_dequantize_then_matmul(granularity):
    a, b = spread((32, 64), seed=3), spread((48, 64), seed=4)
    qa, qb = quantize(a, "fp8_e4m3", granularity), quantize(b, "fp8_e4m3", granularity)
    want = reference_mm(qa, qb)
    torch.testing.assert_close(scaled_mm(qa, qb, emulate=not ROW_MM and granularity == "row"), want,
                               rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(scaled_mm(qa, qb, emulate=True), want)


def test_scaled_mm_support_follows_the_release():
    support = scaled_mm_support()
    assert support["tensor"] is None
    if RELEASE >= (2, 13):
        assert support["row"] is None
    if RELEASE == (2, 11):
        assert "per-tensor" in support["row"]


def test_a_device_without_fp8_dtypes_is_a_refusal_not_a_crash(monkeypatch):
    message = "Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that dtype."

    def no_fp8(*args, **kwargs):
        raise TypeError(message)

    monkeypatch.setattr(fp8, "quantize", no_fp8)  # what quantize's cast does on MPS
    assert fp8._scaled_mm_refusal.__wrapped__("cpu", "tensor") == message


def test_a_refused_granularity_says_what_to_do(monkeypatch):
    monkeypatch.setattr(fp8, "scaled_mm_support", lambda device="cpu": {"tensor": None, "row": "no rows here"})
    q = quantize(torch.ones(16, 16), "fp8_e4m3", "row")
    with pytest.raises(RuntimeError, match=r"row-wise scales on cpu \(no rows here\).*emulate=True"):
        scaled_mm(q, q)
    assert torch.equal(scaled_mm(q, q, emulate=True), torch.full((16, 16), 16.0))


# -- the fp8 linear layer -----------------------------------------------------------------------------


def _scale(x, name, granularity, power_of_2):
    """The scale the recipe must use, computed here from the definition (float64)."""
    a = x.double().abs().amax() if granularity == "tensor" else x.double().abs().amax(dim=1, keepdim=True)
    s = format_info(name).max / a.clamp(min=EPS)
    return torch.exp2(torch.floor(torch.log2(s))) if power_of_2 else s


def _product_bound(a, b, a_name, b_name, granularity, power_of_2):
    """Elementwise bound on |fp8(a) @ fp8(b).T - a @ b.T| from the formats' figures: each
    operand is off by at most half an ulp relative (eps/2) or half the subnormal spacing
    over its scale, whichever is larger; plus float32 accumulation."""
    a, b = a.double(), b.double()

    def delta(x, name):
        f = format_info(name)
        return torch.maximum(f.eps / 2 * x.abs(), f.smallest_subnormal / 2 / _scale(x, name, granularity, power_of_2))

    da, db = delta(a, a_name), delta(b, b_name)
    bound = da @ (b.abs() + db).T + a.abs() @ db.T
    slack = a.shape[1] * 2.0**-23 * ((a.abs() + da) @ (b.abs() + db).T)
    return bound + slack


def _fp8_product(a, b, a_name, b_name, granularity, power_of_2):
    """``fp8(a) @ fp8(b).T`` from the definition, in float64, and ``|fp8(a)| @ |fp8(b)|.T``:
    float32 scale ``max / amax``, multiply in float32, clamp, torch's cast, divide back."""
    def fp8_values(x, name):
        f = format_info(name)
        s = _scale(x, name, granularity, power_of_2).float()
        return (x.float() * s).clamp(-f.max, f.max).to(f.dtype).double() / s.double()

    qa, qb = fp8_values(a, a_name), fp8_values(b, b_name)
    return qa @ qb.T, qa.abs() @ qb.abs().T


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_float32_within_what_the_formats_allow(recipe):
    r = RECIPES[recipe]
    emulate = r.granularity == "row" and not ROW_MM
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    layer = Fp8Linear.from_linear(copy.deepcopy(ref), recipe, emulate=emulate)
    x = spread((48, 64), seed=5, lo=-12, hi=2).requires_grad_()
    x8 = x.detach().clone().requires_grad_()
    g = spread((48, 32), seed=6, lo=-30, hi=-8)  # small gradients, as in a real backward
    y = ref(x)
    y.backward(g)
    y8 = layer(x8)
    y8.backward(g)
    w = ref.weight.detach()
    f, gf, gr = r.forward_format, r.grad_format, r.granularity
    xd = x.detach()
    checks = [  # (what, fp8 result, float32 result, its operands and their formats)
        ("output", y8 - ref.bias, y - ref.bias, (xd, w, f, f)),
        ("grad_input", x8.grad, x.grad, (g, w.T, gf, f)),
        ("grad_weight", layer.weight.grad, ref.weight.grad, (g.T, xd.T, gf, f)),
    ]
    for what, got, want, (a, b, fa, fb) in checks:
        got, want = got.detach().double(), want.detach().double()
        # 1. exactly the fp8 computation the recipe names (formats, scales, transposes)
        fp8_want, magnitude = _fp8_product(a, b, fa, fb, gr, r.power_of_2)
        assert torch.all((got - fp8_want).abs() <= 1e-5 * magnitude + 1e-30), what
        # 2. within what the formats allow of float32
        err = (got - want).abs()
        bound = _product_bound(a, b, fa, fb, gr, r.power_of_2)
        assert torch.all(err <= bound), (what, (err - bound).max().item())
        assert err.max() > 0, what  # fp8 did round something
        assert (err.norm() / want.norm()).item() < 0.25, what
    assert torch.equal(layer.bias.grad, ref.bias.grad)  # the bias stays float32


def test_the_autograd_wiring_passes_gradcheck():
    """With no cast (recipe "none"), the same Function in float64: gradcheck checks the
    three matmuls and their transposes, which the fp8 recipes run unchanged."""
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: Fp8Matmul.apply(a, b, RECIPES["none"], False, None), (x, w))
    layer = Fp8Linear(5, 4, recipe="none", dtype=torch.float64)
    assert torch.autograd.gradcheck(layer, (x,))


def test_convert_swaps_only_layers_that_fit_and_shares_their_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 10)))
    weights = [m.weight for m in (model[0], model[2][0], model[2][1])]
    convert_to_fp8(model, "rowwise", emulate=not ROW_MM)
    assert [type(m).__name__ for m in (model[0], model[2][0], model[2][1])] == ["Fp8Linear", "Fp8Linear", "Linear"]
    assert model[0].weight is weights[0] and model[2][0].weight is weights[1]
    assert "recipe=rowwise" in repr(model[0])
    with pytest.raises(TypeError, match="Fp8Linear takes torch.float32 inputs"):
        model(torch.ones(2, 64, dtype=torch.bfloat16))
    y = model(torch.randn(3, 5, 64))  # leading dimensions are kept
    assert y.shape == (3, 5, 10)


def test_fp8_model_trains_and_records_its_scales():
    from amp_lessons.data import digits
    from amp_lessons.models import mlp
    from amp_lessons.training import Trainer

    torch.manual_seed(0)
    scales = fp8.ScaleHistory()
    trainer = Trainer(convert_to_fp8(mlp(64, 64, 10, depth=2)), digits(), precision="fp32", device="cpu",
                      lr=5e-3, callbacks=[scales], progress=False)
    history = trainer.fit(40)
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    series = scales.series()
    assert set(series) == {f"{layer}.{kind}" for layer in ("0", "2") for kind in ("input", "weight", "grad_output")}
    assert all(len(v) == 40 for v in series.values())
    assert min(series["2.grad_output"]) > max(series["2.weight"])  # the gradients need larger scales


# -- the lesson's other helpers ---------------------------------------------------------------------


def test_record_operands_matches_autograd_and_leaves_grads_alone():
    from amp_lessons.models import mlp

    torch.manual_seed(0)
    model = mlp(8, 16, 3, depth=1)
    x, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 0, 1])
    ops = fp8.record_operands(model, x, y)
    assert [o.layer for o in ops] == ["0", "2"]
    assert all(p.grad is None for p in model.parameters())
    h = model[0](x)
    h.retain_grad()
    out = model[2](model[1](h))
    out.retain_grad()
    nn.functional.cross_entropy(out, y).backward()
    assert torch.equal(ops[0].input, x) and torch.equal(ops[0].weight, model[0].weight)
    assert torch.allclose(ops[0].grad_output, h.grad) and torch.allclose(ops[1].grad_output, out.grad)


def test_an_outlier_channel_hurts_per_tensor_scaling_only():
    x, w, mask = fp8.outlier_layer(1.0)
    x16, w16, _ = fp8.outlier_layer(2.0**16)
    assert torch.equal(x, x16) and torch.equal(w[1:], w16[1:]) and mask[:, 0].all() and not mask[:, 1:].any()
    row, row16 = fp8.layer_error(x, w, "row", mask), fp8.layer_error(x16, w16, "row", mask)
    assert row16 == pytest.approx(row, rel=1e-6)  # the other rows' scales do not see the outlier
    assert fp8.layer_error(x16, w16, "tensor", mask) > 2 * row16
    rows = fp8.outlier_sweep((0, 20))
    assert [r["k"] for r in rows] == [0, 20] and rows[1]["flushed"] > 0.9 and rows[0]["flushed"] == 0


def test_fp8_support_by_device():
    from amp_lessons.hardware import fp8_support

    cases = {("cuda", (7, 5)): False, ("cuda", (8, 0)): False, ("cuda", (8, 6)): False,
             ("cuda", (8, 9)): True, ("cuda", (9, 0)): True, ("cuda", (10, 0)): True, ("cuda", (12, 0)): True,
             ("cpu", None): False, ("mps", None): False, ("cuda", None): False}
    for (kind, cc), fast in cases.items():
        got, why = fp8_support(kind, cc)
        assert got is fast, (kind, cc, why)
    assert "8.9 or 9.0+" in fp8_support("cuda", (8, 0))[1]
    assert fp8_support("cpu")[1] == "CPU: no fp8 tensor cores; torch._scaled_mm runs (Blas.cpp)"
    # torch 2.11's ScaledBlas.cpp row-wise path that writes only bf16/fp16: below 9.0, old cuBLAS, 10.0+
    row = "per-row scales need a bf16 or fp16 output (read in torch 2.11)"  # pull request 187569 adds fp32
    assert fp8_support("cuda", (8, 9))[1].endswith(row)
    assert fp8_support("cuda", (10, 0))[1].endswith(row) and fp8_support("cuda", (12, 0))[1].endswith(row)
    assert fp8_support("cuda", (9, 0))[1].endswith(row.replace(" (read", " below cuBLAS 12.9 (read"))


def test_fp8_device_gives_the_cpu_on_a_mac(monkeypatch):
    from amp_lessons.hardware import fp8_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # Apple silicon
    assert fp8_device() == fp8_device("auto") == torch.device("cpu")
    assert fp8_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"no float8_e5m2 .*132624.*device='cpu'"):
        fp8_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert fp8_device() == torch.device("cpu")
    with pytest.raises(hardware.DeviceUnavailableError, match="only: cpu"):
        fp8_device("mps")


def test_fp8_device_keeps_a_cuda_gpu(monkeypatch):
    from amp_lessons.hardware import fp8_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert fp8_device() == torch.device("cuda")
    assert fp8_device("cpu") == torch.device("cpu")


def test_row_scale_exercise_checker():
    from amp_lessons.exercises import check_row_scale, row_scale_as_given

    given = check_row_scale(row_scale_as_given)
    # as given, the checker says which row fails and how, not why: that is the exercise
    assert not given.passed and str(given).count("the scale of row 6 is inf: a scale must be finite") == 3
    assert "all zeros" not in str(given) and "1.3e-36" not in str(given)
    copied = check_row_scale(lambda x, name="fp8_e4m3": row_scale_as_given(x, name))  # changed code: the hint
    assert "row 6 is all zeros" in str(copied) and "what does your formula give" in str(copied)
    # flooring the amax at float32's smallest normal still overflows: 448 / 1.18e-38 is inf
    floor = torch.finfo(torch.float32).tiny
    tiny = check_row_scale(lambda x, name: format_info(name).max / x.abs().amax(dim=1, keepdim=True).clamp(min=floor))
    assert not tiny.passed and "row 6 is all zeros" in str(tiny) and "inf for every amax below 1.3e-36" in str(tiny)
    assert "clamp" not in str(given) and "1e-12" not in str(given)  # a hint, not the answer
    right = check_row_scale(lambda x, name: scale_from_amax(amax(x, "row"), name))
    assert right.passed and str(right).count("right:") == 3 and "x in bfloat16: right:" in str(right)
    # max instead of abs().amax: the row whose largest magnitude is negative (7: one -3) gets a hint at the sign
    signed = check_row_scale(lambda x, name: format_info(name).max / x.amax(dim=1, keepdim=True).clamp(min=1e-12))
    assert not signed.passed and "row 7 reaches 1.344e+15" in str(signed) and "a negative value, -3" in str(signed)
    assert "negative" not in str(check_row_scale(lambda x, name: 2 * scale_from_amax(amax(x, "row"), name)))
    # scales in x's own dtype: right for float32 x, and named for a bfloat16 x
    own = check_row_scale(lambda x, name: format_info(name).max / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12))
    assert not own.passed and "fp8_e4m3, x in bfloat16: the scales are torch.bfloat16" in str(own)
    assert str(own).count("right:") == 2
    # a scale that keeps every row in range but not on the largest value is half right, and fails
    pow2 = check_row_scale(lambda x, name: scale_from_amax(amax(x, "row"), name, power_of_2=True))
    assert not pow2.passed and "not at 448" in str(pow2) and "power-of-two scales are a recipe" in str(pow2)
    half = check_row_scale(lambda x, name: 0.51 * scale_from_amax(amax(x, "row"), name))
    assert not half.passed and "not at 448" in str(half) and "not at 57344" in str(half)
    eps = torch.finfo(torch.float32).eps  # off by float32 rounding only: right
    assert check_row_scale(lambda x, name: (1 - eps) * scale_from_amax(amax(x, "row"), name)).passed
    assert check_row_scale(lambda x, name: (1 + eps) * scale_from_amax(amax(x, "row"), name)).passed
    # 3% too large: e4m3's cast rounds 461 back to 448, and the checker still says no
    above = check_row_scale(lambda x, name: 1.03 * scale_from_amax(amax(x, "row"), name))
    assert not above.passed and "rounds it back to 448, yet the scale is too large" in str(above)
    assert "right:" not in str(above)
    # an amax floor above the smallest row's amax (7.5 * 2^-36) lifts that row's amax: its scale is too small
    floored = check_row_scale(lambda x, name: format_info(name).max / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-6))
    assert not floored.passed and "row 0's largest value lands at" in str(floored) and "9.2e+03-fold" in str(floored)
    # an epsilon added to the amax is 0.9% of the smallest row's (7.5 * 2^-36): named as such
    plus = check_row_scale(lambda x, name: format_info(name).max / (x.abs().amax(dim=1, keepdim=True) + 1e-12))
    assert not plus.passed and "an epsilon added to the amax" in str(plus) and "by 0.9%" in str(plus)
    # a zero scale for the zero row is not finite-and-positive, and gets no word about inf
    zero = check_row_scale(lambda x, name: torch.nan_to_num(format_info(name).max / x.abs().amax(dim=1, keepdim=True),
                                                            posinf=0.0))
    assert not zero.passed and "row 6 is 0.0" in str(zero) and "inf" not in str(zero)
    # an amax read from bf16 fails on the row bf16 cannot hold (8), though every other row is bf16-exact
    bf16 = check_row_scale(lambda x, name: scale_from_amax(amax(x.bfloat16().float(), "row"), name))
    assert not bf16.passed and "row 8 reaches 448.109" in str(bf16)
    assert "shape ()" in str(check_row_scale(lambda x, name: scale_from_amax(amax(x), name)))
    per_tensor = check_row_scale(lambda x, name: scale_from_amax(amax(x), name).expand(x.shape[0], 1))
    assert not per_tensor.passed and "per-tensor scaling" in str(per_tensor) and "its own amax" in str(per_tensor)
    too_big = check_row_scale(lambda x, name: 2 * scale_from_amax(amax(x, "row"), name))
    assert not too_big.passed and "too large for 448" in str(too_big)
    too_small = check_row_scale(lambda x, name: scale_from_amax(amax(x, "row"), name) / 4)
    assert not too_small.passed and "not at 448" in str(too_small) and "epsilon" not in str(too_small)
    as_double = check_row_scale(lambda x, name: scale_from_amax(amax(x, "row"), name).double())
    assert not as_double.passed and "float32" in str(as_double) and "right:" not in str(as_double)
    assert "raised ZeroDivisionError" in str(check_row_scale(lambda x, name: 1 / 0))
    # mending only amax == 0 leaves row 9 (amax 3.5e-37, nonzero) an inf scale: named as such
    def zero_only(x, name):
        a = x.float().abs().amax(dim=1, keepdim=True)
        return format_info(name).max / torch.where(a == 0, 1, a)

    mended = check_row_scale(zero_only)
    assert not mended.passed and str(mended).count("the scale of row 9 is inf; row 9 is not all zeros") == 3
    assert "its amax is 3.5e-37" in str(mended) and "inf for every amax below 1.3e-36" in str(mended)
    assert "right:" not in str(mended)
    # any finite positive scale for that row passes: its exact one overflows float32
    capped = check_row_scale(lambda x, name: torch.nan_to_num(
        format_info(name).max / x.float().abs().amax(dim=1, keepdim=True), posinf=1.0))
    assert capped.passed and "but row 9's, whose 448 / amax overflows float32" in str(capped)


def test_fp8_training_figure():
    from matplotlib.figure import Figure

    from amp_lessons.plots import fp8_training
    from amp_lessons.training import History, StepRecord

    h = History([StepRecord(i, 2.0 / (i + 1), 1.0, False, 0.0, math.nan, 0.0, 0.0, 1e-3, 1.0) for i in range(5)])
    scales = {"0.input": [8.2] * 5, "0.weight": [9.4] * 5, "0.grad_output": [21.3] * 5}
    fig = fp8_training({"bf16": h, "fp8": h}, scales)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    title = fig.axes[1].get_title()
    assert "e4m3's 448, e5m2's 57344" in title  # the formats' share of each scale, said once
    assert "apart" not in title and "loss scale" not in title  # the distance is the lesson's amax check
    labels = [line.get_label() for line in fig.axes[1].get_lines()]
    assert labels == ["layer 0: input (e4m3)", "layer 0: weight (e4m3)", "layer 0: grad_output (e5m2)"]
    assert "log2" in fig.axes[1].get_ylabel()
    assert fig.axes[0].get_title() == "training loss, both runs" and fig._suptitle is None


def test_torchao_is_optional(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    found, why = fp8.torchao_float8()
    assert found is None and 'pip install -e ".[fp8]"' in why


def test_gpu_cast_rule_allows_only_cuda_13_saturation():
    nan, sat = (math.nan, math.nan), (448.0, 448.0)
    assert fp8._gpu_cast_as_told(sat, sat, "12.8") and fp8._gpu_cast_as_told(sat, sat, None)
    assert fp8._gpu_cast_as_told(nan, sat, "13.0") and fp8._gpu_cast_as_told(nan, sat, "13.2")
    assert not fp8._gpu_cast_as_told(nan, sat, "12.8")  # only a CUDA 13 build saturates on its own
    assert not fp8._gpu_cast_as_told(sat, nan, "13.2")  # never NaN where the CPU saturates
    assert not fp8._gpu_cast_as_told(nan, (448.0, math.nan), "13.2")
    assert fp8._gpu_cast_as_told((float("nan"),) * 2, (float("nan"),) * 2, "12.8")  # NaN agrees with NaN


def test_selfcheck_on_this_cpu():
    verdicts = fp8.selfcheck("cpu")
    assert len(verdicts) == 3 and all(v.holds for v in verdicts), [str(v) for v in verdicts]
    assert "the stricter rules are CUDA's" in str(verdicts[-1])


BAD_FP8_ARGUMENTS = [
    (lambda: fp8.amax(torch.randn(3, 0), "row"), "rows of at least one value"),
    (lambda: fp8.quantize(torch.ones(2, 2), power_of_2="no"), "power_of_2 must be True or False"),
    (lambda: fp8.scale_from_amax([2.0]), "amax must be a floating-point tensor"),
    (lambda: fp8.saturating_cast([1.0]), "must be a floating-point tensor"),
    (lambda: fp8.saturating_cast(torch.arange(3)), "must be a floating-point tensor"),
    (lambda: fp8.fp8_census(None), "tensors must be a tensor or a list of tensors"),
    (lambda: fp8.fp8_census([]), "no tensors to classify: pass a tensor"),
    (lambda: fp8.census_table({}), "groups must be a non-empty dict"),
    (lambda: fp8.census_table({"w": [torch.ones(2, 2)]}, "col"), "granularity must be one of tensor, row"),
    (lambda: fp8.scaled_mm(torch.ones(2, 3), torch.ones(2, 3), emulate=True), "quantize both operands first"),
    (lambda: fp8.scaled_mm(fp8.quantize(torch.ones(3)), fp8.quantize(torch.ones(3)), emulate=True), "must be matrices"),
    (lambda: fp8.convert_to_fp8("model"), "model must be a torch.nn.Module"),
    (lambda: fp8.convert_to_fp8(nn.Linear(16, 16), keep=True), "keep must be a function"),
    (lambda: fp8.outlier_layer(0.0), "factor must be a positive finite number"),
    (lambda: fp8.outlier_layer(math.nan), "factor must be a positive finite number"),
    (lambda: fp8.outlier_layer(2.0**80), r"factor must be a positive finite number up to 2\^64"),
    (lambda: fp8.outlier_layer(n=0), "n must be a whole number from 1 to 4096"),
    (lambda: fp8.outlier_layer(batch=-1), "batch must be a whole number from 1 to 4096"),
    (lambda: fp8.outlier_sweep(("a",)), "exponents must be whole numbers from 0 to 64"),
    (lambda: fp8.outlier_sweep((10**6,)), "exponents must be whole numbers from 0 to 64"),
]


@pytest.mark.parametrize("call, says", BAD_FP8_ARGUMENTS, ids=[s for _, s in BAD_FP8_ARGUMENTS])
def test_a_bad_argument_says_what_to_pass(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_scale_from_amax_takes_a_number_and_an_empty_batch_has_no_rows():
    assert fp8.scale_from_amax(2.0).item() == 224.0  # 448 / 2
    assert fp8.amax(torch.ones(0, 3), "row").shape == (0, 1)
    assert fp8.outlier_sweep(()) == []
