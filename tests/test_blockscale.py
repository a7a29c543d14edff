"""Lesson 09's block-scale quantizers, checked against hand-computed blocks: e2m1's 16
values and packing, e8m0 codes, MX scales by both rules, NVFP4's two levels, the
block-scaled matmul, and the gpu-check branch simulated on a pretend Blackwell GPU."""

import math

import pytest
import torch

from amp_lessons import blockscale as bs
from amp_lessons import devicechecks
from amp_lessons.blockscale import (
    SCHEMES,
    accumulation_bound,
    block_amax,
    block_mm,
    e2m1_codes,
    e2m1_decode,
    e2m1_values,
    e8m0_decode,
    e8m0_encode,
    error,
    exact_values,
    mx_exponent,
    outlier_features,
    pack_fp4,
    quantize,
    reference_mm,
    round_e2m1,
    sqnr_db,
    to_blocked,
    unpack_fp4,
    with_scales,
)

# -- e2m1 --------------------------------------------------------------------------------------------


def test_e2m1_has_the_sixteen_values_of_the_ocp_table():
    assert e2m1_values().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1, e2m1_values()[8].item()) == -1  # code 8 is -0.0


def test_every_value_rounds_to_its_own_code():
    assert torch.equal(e2m1_codes(e2m1_values()), torch.arange(16, dtype=torch.uint8))
    assert torch.equal(e2m1_decode(torch.arange(16, dtype=torch.uint8)), e2m1_values())


@pytest.mark.parametrize(("x", "expected"), [
    (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
    (5.0, 4.0), (5.01, 6.0), (6.9, 6.0), (1e6, 6.0), (-0.74, -0.5), (-5.0, -4.0), (-1e6, -6.0),
])
def test_round_to_nearest_ties_to_even_and_saturates(x, expected):
    assert round_e2m1(torch.tensor([x])).item() == expected


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.full((20000,), 2.6)  # between 2 and 3: up with probability 0.6
    r = round_e2m1(x, "stochastic", g)
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.mean().item() - 2.6) < 0.02
    exact = e2m1_values()
    assert torch.equal(round_e2m1(exact, "stochastic", g), exact)  # grid values never move


def test_e2m1_refuses_nan_and_bad_rounding():
    with pytest.raises(ValueError, match="no NaN"):
        e2m1_codes(torch.tensor([math.nan]))
    with pytest.raises(ValueError, match="rounding must be one of nearest, stochastic"):
        e2m1_codes(torch.ones(2), "up")
    with pytest.raises(ValueError, match="uint8 values 0 to 15"):
        e2m1_decode(torch.tensor([16], dtype=torch.uint8))


def test_packing_puts_the_first_value_in_the_low_nibble():
    codes = e2m1_codes(torch.tensor([1.0, -6.0]))  # codes 2 and 15
    assert codes.tolist() == [2, 15]
    assert pack_fp4(codes).tolist() == [0xF2]
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(every)), every)
    assert unpack_fp4(torch.tensor([0x7A], dtype=torch.uint8)).tolist() == [0xA, 0x7]


def test_packing_refuses_odd_lengths_and_non_codes():
    with pytest.raises(ValueError, match="last dimension must be even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="e2m1 codes"):
        pack_fp4(torch.tensor([1.0, 2.0]))


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_torchs_fp4_dtype_holds_the_same_bytes():
    packed = pack_fp4(torch.arange(16, dtype=torch.uint8))
    fp4 = bs.as_float4_x2(packed)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and fp4.element_size() == 1
    assert torch.equal(fp4.view(torch.uint8), packed)
    assert torch.equal(unpack_fp4(fp4), torch.arange(16, dtype=torch.uint8))


# -- e8m0 -----------------------------------------------------------------------------------------------


def test_e8m0_codes_are_powers_of_two_and_255_is_nan():
    codes = torch.arange(255, dtype=torch.uint8)
    values = e8m0_decode(codes).double()
    assert torch.equal(values, torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float64))
    assert math.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())
    assert e8m0_encode(torch.tensor([-200, -127, 0, 5, 127, 300])).tolist() == [0, 0, 127, 132, 254, 254]


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8_e8m0fnu")
def test_torchs_e8m0_dtype_reads_the_same_values():
    codes = torch.arange(256, dtype=torch.uint8)
    theirs = bs.as_float8_e8m0(codes).float()
    assert torch.equal(theirs.nan_to_num(-1), e8m0_decode(codes).nan_to_num(-1))


@pytest.mark.parametrize(("amax", "element", "floor", "rceil"), [
    (448.0, "e4m3", 0, 0), (449.0, "e4m3", 0, 1), (511.0, "e4m3", 0, 1), (512.0, "e4m3", 1, 1),
    (1.0, "e4m3", -8, -8), (3.0, "e4m3", -7, -7), (6.0, "e2m1", 0, 0), (7.0, "e2m1", 0, 1),
    (4.0, "e2m1", 0, 0), (3.0, "e2m1", -1, -1), (0.0, "e4m3", -127, -127), (2.0**-140, "e2m1", -127, -127),
])
def test_mx_exponent_by_hand(amax, element, floor, rceil):
    assert mx_exponent(torch.tensor([amax]), element, "floor").item() == floor
    assert mx_exponent(torch.tensor([amax]), element, "rceil").item() == rceil


def test_mx_exponent_refuses_unknown_rules_and_elements():
    with pytest.raises(ValueError, match="rule must be one of floor, rceil"):
        mx_exponent(torch.ones(1), "e4m3", "round")
    with pytest.raises(ValueError, match="element must be one of e4m3, e2m1"):
        mx_exponent(torch.ones(1), "e5m2")


# -- quantizers against hand-computed blocks ---------------------------------------------------------


def test_mxfp8_block_with_known_amax():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([3.0, -1.5, 0.75, 2.0**-12])
    q = quantize(x, "MXFP8")
    # floor(log2 3) - 8 = -7: X = 2^-7, code 120; the values are x * 128, cast to e4m3
    assert q.codes.tolist() == [[120]] and q.scales.tolist() == [[2.0**-7]]
    assert q.values[0, :4].tolist() == [384.0, -192.0, 96.0, 2.0**-5]
    assert torch.equal(q.dequantize(), x) and q.saturated == 0


def test_mxfp8_floor_saturates_where_rceil_does_not():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 1.9375  # floor: 1.9375 * 2^8 = 496 > 464, saturates to 448; rceil: X = 2^-7
    assert quantize(x, "MXFP8").saturated == 1
    q = quantize(x, with_scales("MXFP8", "e8m0", "rceil"))
    # 1.9375 * 2^7 = 248, halfway between e4m3's 240 and 256: the tie goes to 256 (even mantissa)
    assert q.saturated == 0 and q.codes.item() == 120 and q.values[0, 0].item() == 256.0


def test_mxfp4_block_by_hand():
    q = quantize(torch.tensor([[7.0, 5.0, 2.5, 1.0, 0.3, -0.2]]), "MXFP4")
    assert q.scales.item() == 1.0 and q.codes.item() == 127
    assert q.values.tolist() == [[6.0, 4.0, 2.0, 1.0, 0.5, -0.0]]
    assert q.saturated == 1  # 7 >= 7: the cast would need 8


def test_nvfp4_two_level_scales_by_hand():
    x = torch.cat([torch.full((16,), 5.0), torch.full((16,), 1.3)]).reshape(1, 32)
    q = quantize(x, "NVFP4")
    s = 5.0 / (448 * 6)
    assert q.tensor_scale == pytest.approx(s, rel=1e-15)
    # block scales amax / 6 / s = 448 and 116.48, which e4m3 rounds to 120 (step 8 in [64, 128))
    assert q.scales.tolist() == [[448.0, 120.0]]
    # block 2: 1.3 / (120 s) = 5.8240 rounds to 6
    assert q.values.tolist() == [[6.0] * 32]
    expected = torch.tensor([5.0] * 16 + [6 * 120 * s] * 16)
    assert torch.allclose(q.dequantize().flatten().double(), expected.double(), rtol=1e-6)


def test_fp32_tile_scales_put_each_tiles_amax_on_448():
    x = torch.zeros(2, 256)
    x[0, 3], x[0, 200], x[1, 100] = 3.0, -0.5, 7.0
    q = quantize(x, "1x128")
    assert q.scales.shape == (2, 2)
    assert q.values[0, 3].item() == 448 and q.values[0, 200].item() == -448 and q.values[1, 100].item() == 448
    assert torch.allclose(q.dequantize(), x)


def test_blocks_pad_ragged_edges_and_128x128_blocks_share_scales():
    x = torch.ones(130, 64)
    x[129, 0] = 4.0
    q = quantize(x, "128x128")
    assert q.scales.shape == (2, 1) and q.block == (128, 128)
    assert torch.allclose(q.scales[:, 0], torch.tensor([1 / 448, 4 / 448]), rtol=1e-6)
    assert q.values.shape == x.shape
    assert block_amax(torch.ones(3, 5), (2, 2)).shape == (2, 3)


def test_per_tensor_matches_lesson_08s_quantizer():
    from amp_lessons import fp8

    x = exact_values((16, 64), -10, 3)
    mine, theirs = quantize(x, "per tensor").dequantize(), fp8.quantize(x).dequantize()
    assert torch.allclose(mine, theirs, rtol=2**-4, atol=0)


def test_quantize_refuses_what_it_cannot_block():
    with pytest.raises(ValueError, match="a floating-point matrix"):
        quantize(torch.ones(4), "MXFP8")
    with pytest.raises(ValueError, match="scheme must be one of"):
        quantize(torch.ones(4, 4), "MXFP6")
    with pytest.raises(ValueError, match="no NaN"):
        quantize(torch.tensor([[1.0, math.nan]]), "MXFP4")
    with pytest.raises(ValueError, match="stochastic rounding is emulated for e2m1"):
        quantize(torch.ones(2, 32), "MXFP8", rounding="stochastic")
    with pytest.raises(ValueError, match="scale_format must be one of"):
        with_scales("MXFP4", "fp16")


def test_all_zero_blocks_stay_zero_and_finite():
    for name in SCHEMES:
        q = quantize(torch.zeros(4, 64), name)
        assert torch.equal(q.dequantize(), torch.zeros(4, 64)), name


# -- errors ----------------------------------------------------------------------------------------------


def test_sqnr_by_hand():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, torch.tensor([3.0, 3.5])) == pytest.approx(10 * math.log10(25 / 0.25))


def test_error_counts_flushed_and_saturated_values():
    x = torch.tensor([[7.0, 5.0, 2.5, 1.0, 0.3, -0.2]])
    e = error(x, "MXFP4")
    assert (e.flushed, e.saturated, e.nonzero) == (1, 1, 6)  # -0.2 flushes, 7 saturates
    left = torch.tensor([[True, False, False, False, False, False]])
    assert error(x, "MXFP4", leave_out=left).saturated == 0
    with pytest.raises(ValueError, match="leave_out"):
        error([x, x], "MXFP4", leave_out=left)


def test_outlier_feature_counts_are_exact_and_blocks_confine_it():
    x, mask = outlier_features()
    assert torch.equal(x, outlier_features()[0])
    flushed = {s: error(x, s, leave_out=mask).flushed for s in ("per tensor", "per row", "1x128", "MXFP8")}
    assert flushed["per tensor"] > flushed["per row"] > flushed["1x128"] > flushed["MXFP8"]


def test_e8m0_scales_stay_within_a_factor_of_two():
    x = exact_values((32, 256), -12, 4, seed=3) * 1.1
    amax = block_amax(x, (1, 32)).flatten().double()

    def ratio(element, rule):  # e8m0 decode scale over the exact one, amax / max
        scale = e8m0_decode(e8m0_encode(mx_exponent(amax.float(), element, rule))).double()
        return scale / (amax / (6.0 if element == "e2m1" else 448.0))

    assert bool(((ratio("e2m1", "rceil") >= 1) & (ratio("e2m1", "rceil") < 2)).all())
    assert bool(((ratio("e2m1", "floor") > 0.75) & (ratio("e2m1", "floor") <= 1.5)).all())
    assert bool(((ratio("e4m3", "floor") > 448 / 512) & (ratio("e4m3", "floor") <= 448 / 256)).all())


# -- block-scaled matmul ---------------------------------------------------------------------------------


def test_block_mm_is_exact_on_exact_inputs():
    a, b = exact_values((64, 256), -4, 0, seed=1), exact_values((16, 256), -4, 0, seed=2)
    scheme = with_scales("MXFP8", "e8m0", "rceil")
    qa, qb = quantize(a, scheme), quantize(b, scheme)
    assert torch.equal(qa.dequantize(), a)
    assert torch.equal(block_mm(qa, qb), reference_mm(qa, qb))
    assert torch.equal(block_mm(qa, qb), (a.double() @ b.double().t()).float())


@pytest.mark.parametrize("scheme", ["MXFP8", "MXFP4", "NVFP4", "1x128"])
def test_block_mm_is_within_the_accumulation_bound(scheme):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 256, generator=g), torch.randn(24, 256, generator=g)
    qa, qb = quantize(a, scheme), quantize(b, scheme)
    diff = (block_mm(qa, qb) - reference_mm(qa, qb)).abs()
    assert bool((diff <= accumulation_bound(qa, qb)).all())


def test_block_mm_refuses_mismatched_operands():
    with pytest.raises(ValueError, match="must share K"):
        block_mm(quantize(torch.ones(4, 64), "MXFP8"), quantize(torch.ones(4, 32), "MXFP8"))
    with pytest.raises(ValueError, match="same block size along K"):
        block_mm(quantize(torch.ones(4, 64), "MXFP8"), quantize(torch.ones(4, 64), "NVFP4"))


def test_to_blocked_follows_the_32_4_4_layout():
    s = torch.arange(128 * 4).reshape(128, 4)
    flat = to_blocked(s)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (33, 2), (127, 3)]:
        assert flat[(r % 32) * 16 + (r // 32) * 4 + c].item() == s[r, c].item()
    assert to_blocked(torch.ones(130, 5)).numel() == 256 * 8  # padded to whole 128 x 4 tiles


# -- make gpu-check, simulated ----------------------------------------------------------------------------


def test_gpu_check_skips_on_a_cpu_and_says_why():
    result = bs.block_kernel_check("cpu")
    assert result.skipped and "compute capability 10.0+" in result.skipped and "cpu" in result.skipped
    verdicts = devicechecks.blockscale_verdicts("cpu")
    assert len(verdicts) == 1 and verdicts[0].holds and "skipped" in verdicts[0].claim


def _pretend_gpu(monkeypatch, cc):
    monkeypatch.setattr(bs, "pick_device", lambda device=None: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)


def test_gpu_check_skips_below_blackwell(monkeypatch):
    _pretend_gpu(monkeypatch, (9, 0))
    result = bs.block_kernel_check()
    assert "10.0+" in result.skipped and "9.0" in result.skipped


def test_gpu_check_is_not_run_on_rocm(monkeypatch):
    _pretend_gpu(monkeypatch, (9, 5))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "ROCm" in bs.block_kernel_check().skipped


def test_gpu_check_compares_the_kernel_with_the_reference(monkeypatch):
    _pretend_gpu(monkeypatch, (10, 0))
    exact = bs.block_kernel_check(kernel=lambda qa, qb, dev: reference_mm(qa, qb))
    assert exact.skipped is None and exact.equal and exact.within_bound and exact.max_diff == 0
    off = bs.block_kernel_check(kernel=lambda qa, qb, dev: reference_mm(qa, qb) + 1)
    assert off.equal is False and off.within_bound is False


def test_gpu_check_reports_a_refused_call(monkeypatch):
    _pretend_gpu(monkeypatch, (10, 0))

    def refuse(qa, qb, dev):
        raise RuntimeError("Invalid scaling configuration\nmore lines")

    assert bs.block_kernel_check(kernel=refuse).skipped == "torch refused the call: Invalid scaling configuration"


def test_selfcheck_verdicts_on_a_pretend_blackwell(monkeypatch):
    _pretend_gpu(monkeypatch, (10, 0))
    monkeypatch.setattr(devicechecks, "block_kernel_check", lambda device=None: bs.KernelCheck(None, True, True, 0.0))
    assert [v.holds for v in devicechecks.blockscale_verdicts()] == [True, True]
    monkeypatch.setattr(devicechecks, "block_kernel_check", lambda device=None: bs.KernelCheck(None, False, False, 3.0))
    assert [v.holds for v in devicechecks.blockscale_verdicts()] == [False, False]


def test_selfcheck_registers_the_block_check():
    assert ("block scales (lesson 09)", devicechecks.blockscale_verdicts) in devicechecks.CHECKS


def test_cpu_refusal_names_a_missing_function(monkeypatch):
    from torch.nn import functional as F

    monkeypatch.delattr(F, "scaled_mm", raising=False)
    assert "has no torch.nn.functional.scaled_mm" in bs.cpu_block_refusal()


def test_cpu_refusal_keeps_the_options_and_drops_the_arguments(monkeypatch):
    from torch.nn import functional as F

    def refuse(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration.\n- For TensorWise scaling, ...\nGot mat_a.dtype()=...")

    monkeypatch.setattr(F, "scaled_mm", refuse, raising=False)
    if not hasattr(F, "ScalingType") or bs.as_float8_e8m0(torch.zeros(1, dtype=torch.uint8)) is None:
        pytest.skip("this torch release has no block-scale arguments to pass")
    assert bs.cpu_block_refusal() == "Invalid scaling configuration.\n- For TensorWise scaling, ..."


def test_accumulation_bound_is_twice_gamma_n():
    q = quantize(torch.ones(1, 252), "1x128")  # n = K + 4 = 256 roundings: nu = 2^-16
    assert accumulation_bound(q, q).item() == pytest.approx(2 * 252 * 2.0**-16 / (1 - 2.0**-16), rel=1e-7)


def test_hardware_table_names_every_device_class_and_wraps():
    lines = bs.hardware_table().splitlines()
    starts = [line.split(":")[0] for line in lines if not line.startswith(" ")]
    assert starts == [device.split(":")[0] for device, _ in bs.HARDWARE] and len(starts) == 5
    assert max(len(line) for line in lines) <= 92
