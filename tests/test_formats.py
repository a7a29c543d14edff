"""Lesson 01's number formats, checked against torch.finfo, torch's casts and hand-made values."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from amp_lessons import formats
from amp_lessons.exercises import check_loss_scale
from amp_lessons.formats import (
    FORMATS,
    bits_of,
    census,
    e4m3_overflow,
    format_info,
    from_layout,
    parse_format,
    round_to_format,
    scale_table,
    scaled_census,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def wide_values(n=20_000, lo=-160, hi=140, seed=0):
    """Random float32 values of both signs whose magnitudes span 2^lo .. 2^hi."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(lo, hi, (n,), generator=g).double()
    mant = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * mant * 2.0**exps).float()


# -- the figures -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DTYPES))
def test_figures_are_torch_finfo(name):
    f, fi = format_info(name), torch.finfo(DTYPES[name])
    assert f.dtype == DTYPES[name]
    assert (f.bits, f.max, f.smallest_normal, f.eps) == (fi.bits, fi.max, fi.smallest_normal, fi.eps)
    assert f.bits == 1 + f.exponent_bits + f.mantissa_bits
    # smallest subnormal: the bit pattern 0...01 read as the dtype
    one = torch.tensor([1], dtype=INT_VIEW[fi.bits // 8]).view(DTYPES[name])
    assert f.smallest_subnormal == one.double().item() > 0


def test_the_figures_the_lesson_quotes():
    assert format_info("fp16").max == 65504
    assert format_info("fp16").smallest_subnormal == 2.0**-24
    assert format_info("fp16").smallest_normal == 2.0**-14
    assert format_info("bf16").max == pytest.approx(3.39e38, rel=1e-3)
    assert format_info("bf16").smallest_normal == format_info("fp32").smallest_normal == 2.0**-126
    assert format_info("fp8_e4m3").max == 448
    assert format_info("fp8_e5m2").max == 57344
    layouts = {n: (format_info(n).exponent_bits, format_info(n).mantissa_bits) for n in FORMATS}
    assert layouts == {"fp32": (8, 23), "tf32": (8, 10), "bf16": (8, 7), "fp16": (5, 10),
                       "fp8_e4m3": (4, 3), "fp8_e5m2": (5, 2)}


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8_e5m2"])
def test_bit_layout_derivation_matches_finfo(name):
    """The rule that gives tf32's figures gives torch's for every IEEE-style dtype."""
    f = format_info(name)
    derived = from_layout(name, f.exponent_bits, f.mantissa_bits)
    for field in ("bits", "max", "smallest_normal", "smallest_subnormal", "eps"):
        assert getattr(derived, field) == getattr(f, field), field


def test_tf32_follows_from_ten_mantissa_bits():
    f = format_info("tf32")
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (19, 8, 10)
    assert f.eps == 2.0**-10 == format_info("fp16").eps
    assert f.max == (2 - 2.0**-10) * 2.0**127
    assert f.smallest_normal == 2.0**-126 and f.smallest_subnormal == 2.0**-136
    assert f.dtype == torch.float32 and "layout" in f.source


def test_table_lists_every_format():
    text = formats.formats_table()
    for n in FORMATS:
        assert n in text
    assert "65504" in text and "2^-24" in text and "2^-136" in text


# -- names -------------------------------------------------------------------------------


def test_names_and_aliases():
    assert [parse_format(n) for n in ("half", "float16", "BF16", "bfloat16", "float32", "TF32")] == [
        "fp16", "fp16", "bf16", "bf16", "fp32", "tf32"]
    assert [parse_format(n) for n in ("e4m3", "fp8_e4m3fn", "float8_e4m3fn", "E5M2", "fp8-e5m2")] == [
        "fp8_e4m3", "fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "fp8_e5m2"]
    assert parse_format(torch.float8_e4m3fn) == "fp8_e4m3"
    assert parse_format(torch.bfloat16) == "bf16"


@pytest.mark.parametrize("bad", ["fp61", "", "int8", torch.int8, torch.float64, 16, None])
def test_unknown_format_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="format must be one of fp32, tf32, bf16, fp16, fp8_e4m3, fp8_e5m2"):
        format_info(bad)
    with pytest.raises(ValueError, match="format must be one of"):
        round_to_format(torch.ones(2), bad)


# -- rounding ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_rounding_is_torchs_cast(name):
    x = torch.cat([wide_values(), torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])
    got = round_to_format(x, name)
    want = x.to(DTYPES[name]).float()
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


# expected values worked out by hand: (input, fp16, bf16)
EDGES = [
    (1 + 2.0**-11, 1.0, 1.0),                       # fp16 tie between 1 and 1+2^-10: even is 1
    (1 + 3 * 2.0**-11, 1 + 2.0**-9, 1.0),           # fp16 tie: rounds up to the even neighbour
    (1 + 2.0**-8, 1 + 2.0**-8, 1.0),                # bf16 tie: its 7 mantissa bits drop 2^-8
    (1 + 3 * 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-6),  # bf16 tie rounds up to even
    (2.0**-24, 2.0**-24, 2.0**-24),                 # fp16's smallest subnormal
    (2.0**-25, 0.0, 2.0**-25),                      # half of it: a tie, flushed to 0 (even)
    (2.0**-25 * 1.0001, 2.0**-24, 2.0**-25 * 1.0),  # just above the tie: rounds up to 2^-24
    (3 * 2.0**-25, 2.0**-23, 3 * 2.0**-25),         # tie between 1 and 2 subnormal steps: 2
    (65504.0, 65504.0, 65536.0),                    # fp16 max; bf16 has only 8 bits: 2^16
    (65519.0, 65504.0, 65536.0),                    # below the overflow tie: stays finite
    (65520.0, math.inf, 65536.0),                   # the tie max+ulp/2 goes to inf
    (-1e6, -math.inf, -999424.0),
    # rounded once from float64: via float32 each of these would land on a tie and go the other way
    (65519.9999, 65504.0, 65536.0),                 # float32: 65520, the tie that goes to inf
    (2.0**-25 * (1 + 2.0**-40), 2.0**-24, 2.0**-25),  # float32: 2^-25, the tie that goes to 0
    (1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-10, 1.0),   # float32: 1 + 2^-11, fp16's tie, even is 1
    (1 + 2.0**-8 + 2.0**-40, 1 + 2.0**-8, 1 + 2.0**-7),  # float32: 1 + 2^-8, bf16's tie, even is 1
]


@pytest.mark.parametrize("value, fp16, bf16", EDGES)
def test_rounding_edges_by_hand(value, fp16, bf16):
    x = torch.tensor([value], dtype=torch.float64)
    assert round_to_format(x, "fp16").item() == fp16
    assert round_to_format(x, "bf16").item() == bf16
    assert bits_of(value, "fp16").stored == fp16


def nearest_reference(x: np.ndarray, name: str) -> np.ndarray:
    """Round values to format ``name``'s nearest value with numpy's round-half-even, in float64.

    Written from the definition (value = m * 2^e, spacing 2^(e - mantissa bits), floored at
    the subnormal spacing; too large: what :attr:`Format.overflows_to` says), not from the
    casts or bit patterns the package uses. Magnitudes up to 2^(largest exponent + 2).
    """
    f = format_info(name)
    x64 = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x64)  # x = m * 2^e with 0.5 <= |m| < 1: the leading bit is 2^(e-1)
    spacing_exp = np.maximum(e - 1, round(math.log2(f.smallest_normal))) - f.mantissa_bits
    out = np.ldexp(np.rint(np.ldexp(x64, -spacing_exp)), spacing_exp)
    too_large = f.overflows(torch.from_numpy(np.abs(x64))).numpy()
    out = np.where(too_large, np.copysign(f.overflows_to, x64), out)
    return np.where(np.isfinite(x64), out, x64)


def near_ties(name: str, n: int = 4000, seed: int = 0) -> torch.Tensor:
    """float64 values at and within 2^-40 (relative) of format ``name``'s rounding ties, in
    every binade from its subnormals to its overflow tie, of both signs: where rounding
    through float32 first would round twice."""
    f = format_info(name)
    g = np.random.default_rng(seed)
    emin, emax = round(math.log2(f.smallest_normal)), math.floor(math.log2(f.max))
    e = g.integers(emin - 1, emax + 1, n)  # emin - 1: the subnormals
    m = g.integers(0, 2**f.mantissa_bits, n) + 0.5
    ties = np.where(e < emin, m * 2.0 ** (emin - f.mantissa_bits), (1 + m / 2**f.mantissa_bits) * 2.0**e)
    ties = np.append(ties, [f.flush_below, f.normal_from, f.overflow_from])
    x = np.concatenate([ties, ties * (1 + 2.0**-40), ties * (1 - 2.0**-40)])
    return torch.from_numpy(x * np.where(g.random(len(x)) < 0.5, -1.0, 1.0))


def test_tf32_matches_an_independent_reference():
    x = wide_values(40_000, lo=-150, hi=128)
    # exact ties: low 13 bits 0x1000, with the kept lowest bit even and odd
    g = torch.Generator().manual_seed(1)
    pat = torch.randint(0x00800000, 0x7F000000, (2000,), generator=g, dtype=torch.int64)
    ties = ((pat & ~0x1FFF) | 0x1000).to(torch.int32).view(torch.float32)
    sub = torch.tensor([2.0**-149, 2.0**-137, 3 * 2.0**-137, 2.0**-136, 1.5 * 2.0**-136, 2.0**-126 * 0.99999],
                       dtype=torch.float32)
    big = torch.tensor([3.4e38, 3.40116e38, torch.finfo(torch.float32).max, 1.0, -0.0, 0.0])
    x = torch.cat([x, ties, -ties, sub, big, torch.tensor([math.inf, -math.inf])])
    got = round_to_format(x, "tf32").double().numpy()
    want = nearest_reference(x.numpy(), "tf32")
    assert np.array_equal(got, want)
    assert np.signbit(got[x.numpy() == 0]).tolist() == np.signbit(x.numpy()[x.numpy() == 0]).tolist()
    assert math.isnan(round_to_format(torch.tensor([math.nan]), "tf32").item())


@pytest.mark.parametrize("name", ["tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_float64_values_are_rounded_once(name):
    """Next to every tie, a float64 value is rounded once, as census classifies it; torch's
    CPU cast rounds it to float32 first, which goes the wrong way at some of them."""
    x = near_ties(name)
    want = nearest_reference(x.numpy(), name)
    got = round_to_format(x, name).double().numpy()
    assert np.array_equal(got, want, equal_nan=True)
    assert all(bits_of(v, name).stored == w or (math.isnan(w) and math.isnan(bits_of(v, name).stored))
               for v, w in zip(x[::40].tolist(), want[::40].tolist()))
    if name != "tf32":
        assert not np.array_equal(x.to(DTYPES[name]).double().numpy(), want, equal_nan=True)


def test_tf32_spot_values():
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-10, 1 + 1e-4, 2.0**-136, 2.0**-137])
    assert round_to_format(x, "tf32").tolist() == [1.0, 1 + 2.0**-9, 1 + 2.0**-10, 1.0, 2.0**-136, 0.0]
    near_max = torch.tensor([torch.finfo(torch.float32).max])
    assert round_to_format(near_max, "tf32").item() == math.inf
    assert round_to_format(torch.tensor([1.0]), "tf32").dtype == torch.float32


def test_non_floating_input_is_a_clear_error():
    with pytest.raises(ValueError, match="floating-point tensor"):
        round_to_format(torch.arange(4), "fp16")
    with pytest.raises(ValueError, match="floating-point tensor"):
        census(torch.ones(3, dtype=torch.int32), "fp16")
    with pytest.raises(ValueError, match="floating-point tensor or a number"):
        round_to_format("0.1", "fp16")
    with pytest.raises(ValueError, match="floating-point tensor or a number"):
        round_to_format(True, "fp16")


# -- bits ----------------------------------------------------------------------------------


def test_bits_of_known_patterns():
    one = bits_of(1.0, "fp16")
    assert (one.sign, one.exponent, one.mantissa, one.kind) == ("0", "01111", "0000000000", "normal")
    top = bits_of(65504, "fp16")
    assert (top.exponent, top.mantissa, top.rel_error) == ("11110", "1111111111", 0.0)
    tiny = bits_of(2.0**-24, "fp16")
    assert (tiny.exponent, tiny.mantissa, tiny.kind) == ("00000", "0000000001", "subnormal")
    gone = bits_of(1e-8, "fp16")
    assert (gone.stored, gone.kind, gone.rel_error) == (0.0, "zero", 1.0)
    assert bits_of(1e5, "fp16").kind == "inf" and bits_of(1e5, "fp16").rel_error == math.inf
    neg = bits_of(-2.0, "bf16")
    assert (neg.sign, neg.exponent, neg.mantissa) == ("1", "10000000", "0000000")
    assert bits_of(1 + 2.0**-8, "bf16").stored == 1.0
    t = bits_of(0.1, "tf32")
    assert len(t.exponent) == 8 and len(t.mantissa) == 10 and t.stored == round_to_format(
        torch.tensor([0.1], dtype=torch.float64), "tf32").item()
    assert bits_of(math.nan, "fp16").kind == "nan"


def test_e4m3_overflow_is_probed_and_matches_every_cast():
    """e4m3fn has no inf: the probe says what this release stores, and every cast agrees."""
    probe = e4m3_overflow()
    assert probe.saturates != probe.gives_nan  # one or the other, on 2.11 .. 2.14
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert probe.saturates == (release >= (2, 13)), str(probe)  # pytorch/pytorch#178817
    big = torch.cat([torch.tensor([465.0, 500.0, 1e6, 3e38, math.inf]), wide_values(50_000, lo=9, hi=127).abs()])
    for x in (big, -big, big.double(), big.bfloat16()):  # bf16 rounds 465 to 464, the tie: left out
        x = x[x.double().abs() > 464]
        got = x.to(torch.float8_e4m3fn).float()
        want = torch.full_like(got, probe.finite).copysign(x.float())
        assert len(x) > 50_000 - 10
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    f = format_info("fp8_e4m3")
    assert f.overflows_to == probe.finite or (math.isnan(f.overflows_to) and probe.gives_nan)
    assert format_info("fp8_e5m2").overflows_to == format_info("fp16").overflows_to == math.inf
    assert torch.__version__.split("+")[0] in str(probe) and probe.stored_as() in str(probe)


def test_bits_of_an_e4m3_overflow_says_what_this_release_stored():
    b = bits_of(1e6, "fp8_e4m3")
    release = f"torch {torch.__version__.split('+')[0]}"
    if e4m3_overflow().saturates:
        assert (b.stored, b.kind, b.exponent, b.mantissa) == (448.0, "normal", "1111", "110")
        assert f"{release}'s cast saturates it to the largest value, +448" in str(b)
    else:
        assert math.isnan(b.stored) and (b.kind, b.exponent, b.mantissa) == ("nan", "1111", "111")
        assert f"{release}'s cast stores NaN" in str(b)
    assert bits_of(464.0, "fp8_e4m3").stored == 448.0  # the tie rounds down on every release
    assert "too large" not in str(bits_of(464.0, "fp8_e4m3"))


@pytest.mark.parametrize("stored, kind, mantissa, words", [
    (448.0, "normal", "110", "saturates it to the largest value, -448"),
    (math.nan, "nan", "111", "stores NaN (fp8_e4m3 has no inf; torch 2.13 and later saturate to 448"),
])
def test_both_e4m3_overflow_texts(stored, kind, mantissa, words):
    """The text of the release that is not running here, built from its bits."""
    b = formats.Bits("fp8_e4m3", -1e6, -stored, "1", "1111", mantissa, kind)
    assert words in str(b) and "too large" in str(b)


def test_bits_rebuild_the_stored_value():
    for name in FORMATS:
        f = format_info(name)
        bias = 2 ** (f.exponent_bits - 1) - 1
        for v in (0.1, -3.75, 1e-3, 2.0**-20, 200.0):
            b = bits_of(v, name)
            if b.kind not in ("normal", "subnormal"):
                continue
            e = int(b.exponent, 2)
            lead = 1 if b.kind == "normal" else 0
            mant = lead + int(b.mantissa, 2) / 2**f.mantissa_bits
            value = mant * 2.0 ** (max(e, 1) - bias) * (-1 if b.sign == "1" else 1)
            assert value == b.stored, (name, v)


def test_bits_of_rejects_non_numbers():
    with pytest.raises(ValueError, match="value must be a number"):
        bits_of("0.1", "fp16")


# -- census --------------------------------------------------------------------------------


def test_census_of_a_hand_built_tensor():
    x = torch.tensor([0.0, 0.0, 1e-9, -2.0**-25, 2.0**-24, 1e-6, -6e-5,
                      1.0, -3.0, 1e-4, 65504.0, 65520.0, -1e9, math.inf, math.nan])
    c = census(x, "fp16")
    assert (c.total, c.zero, c.flushed, c.subnormal, c.normal, c.overflow, c.nan) == (15, 2, 2, 3, 4, 3, 1)
    assert c.nonzero == 13
    assert c.fraction("flushed") == pytest.approx(2 / 13)
    b = census(x, "bf16")
    assert (b.zero, b.flushed, b.subnormal, b.normal, b.overflow, b.nan) == (2, 0, 0, 11, 1, 1)
    with pytest.raises(ValueError, match="kind must be one of"):
        c.fraction("lost")


@pytest.mark.parametrize("name", ["fp16", "bf16", "tf32", "fp8_e5m2", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_census_agrees_with_rounding(name, dtype):
    f = format_info(name)
    edges = torch.tensor([f.flush_below, f.normal_from, f.smallest_normal, f.overflow_from, f.max], dtype=dtype)
    near = [edges, torch.nextafter(edges, edges.new_tensor(math.inf)), torch.nextafter(edges, edges.new_tensor(0.0))]
    x = torch.cat([wide_values(30_000, lo=-150, hi=128).to(dtype), *near, *(-e for e in near)])
    if dtype == torch.float64:
        x = torch.cat([x, near_ties(name)])
    r = round_to_format(x, name).double()
    c = census(x, name)
    too_large = x.double().abs() > f.overflow_from  # e4m3fn: 448 or NaN, by release
    over = r.isinf() if f.has_inf else too_large & ((r.abs() == f.max) | r.isnan())
    assert c.overflow == int(over.sum())
    assert c.flushed == int(((r == 0) & (x != 0)).sum())
    assert c.subnormal == int(((r != 0) & (r.abs() < f.smallest_normal)).sum())
    assert c.normal == int(((r.abs() >= f.smallest_normal) & ~over).sum())
    assert c.flushed + c.subnormal + c.normal + c.overflow == c.nonzero


def test_scaled_census_equals_classifying_the_scaled_tensor():
    g = wide_values(5000, lo=-40, hi=0)
    for k in (0, 4, 11, 16, 20, 24):
        s = 2.0**k
        direct = census(g * s, "fp16")
        slider = scaled_census(g, "fp16", s)
        assert slider == dataclasses.replace(direct, scale=s)
        for kind in formats.KINDS:
            assert slider.fraction(kind) == direct.fraction(kind)


def test_scale_table_shows_the_census_percentages():
    g = wide_values(5000, lo=-40, hi=0)
    text = scale_table(g, 2.0**12)
    assert text.splitlines()[0] == "loss scale 2^12 = 4096"
    for line, name in zip(text.splitlines()[2:4], ("fp16", "bf16")):
        c = census(g * 2.0**12, name)
        assert line.split() == [name, *(f"{c.fraction(k):.3%}" for k in formats.KINDS)]


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "65536", True, None])
def test_a_bad_loss_scale_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="loss scale must be a positive finite number"):
        scaled_census(torch.ones(3), "fp16", bad)
    with pytest.raises(ValueError, match="loss scale must be a positive finite number"):
        scale_table(torch.ones(3), bad)


@pytest.mark.parametrize("bad, kind", [(torch.tensor(65536.0), "Tensor"), ("65536", "str"), (True, "bool")])
def test_a_loss_scale_of_the_wrong_type_is_refused_by_its_type(bad, kind):
    with pytest.raises(ValueError, match=f"Python int or float such as 2.0\\*\\*16; a {kind} is refused"):
        scaled_census(torch.ones(3), "fp16", bad)


def test_a_tensor_loss_scale_is_told_to_take_its_value():
    with pytest.raises(ValueError, match=r"take its value with float\(\.\.\.\)"):
        scaled_census(torch.ones(3), "fp16", torch.tensor(65536.0))


# -- exercise ------------------------------------------------------------------------------


def test_loss_scale_checker():
    g = torch.tensor([2.0**-30, 2.0**-20, 2.0**-10, 2.0**-3] * 25 + [0.0] * 7)
    assert not check_loss_scale(None, g).passed
    assert "no answer yet" in str(check_loss_scale("?", g))
    small = check_loss_scale(2.0**4, g)  # 2^-26 flushes, 2^-16 subnormal
    assert not small.passed and "too small" in str(small) and "25 flushed" in str(small)
    good = check_loss_scale(2.0**16, g)  # 2^-14 .. 2^13: all normal; at 2^15, 2^-15 is subnormal
    assert good.passed and "100.00%" in str(good)
    assert not check_loss_scale(2.0**15, g).passed and "too many values are still subnormal" in str(
        check_loss_scale(2.0**15, g))
    not_smallest = check_loss_scale(2.0**17, g)  # 2^-13 .. 2^14: all normal, but 2^16 does too
    assert not not_smallest.passed and "half of it does too: find the smallest" in str(not_smallest)
    big = check_loss_scale(2.0**20, g)  # 2^-3 * 2^20 = 2^17 overflows
    assert not big.passed and "25 values overflow" in str(big)
    assert not check_loss_scale(3000.0 * 16, g).passed
    assert "not a power of two" in str(check_loss_scale(3000.0 * 16, g))
    near = str(check_loss_scale(4096.0001, g))  # shown with its digits, not as "4096"
    assert "4096.0001 (2^12) is not a power of two" in near
    assert "positive finite" in str(check_loss_scale(-4.0, g))


def test_loss_scale_checker_refuses_a_scale_that_still_flushes():
    g = torch.tensor([2.0**-40] + [2.0**-3] * 199)  # at 2^14: 2^-26 flushes, 99.5% normal
    at14 = check_loss_scale(2.0**14, g)
    assert not at14.passed and "1 flushed" in str(at14) and "some gradients still flush to zero" in str(at14)
    assert check_loss_scale(2.0**16, g).passed  # 2^-24: subnormal, kept; 2^15 would flush it


# -- plots (they show what the functions above computed; the widgets: test_widgets.py) -----


def test_format_ranges_figure():
    from matplotlib.figure import Figure

    from amp_lessons.plots import format_ranges

    fig = format_ranges(values=wide_values(100, lo=-30, hi=-2))
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_title() == "fp16 covers 40 powers of two; bf16 covers 261, nearly fp32's range"
    assert "log2" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == list(reversed(FORMATS))
    labels = {t.get_text() for t in ax.texts}
    assert {"2^-24", "65504 (~2^16)", "2^-149", "3.4e+38 (~2^128)", "448 (~2^8.8)"} <= labels


def test_gradient_histogram_title_states_the_census():
    from amp_lessons.plots import gradient_histogram

    g = wide_values(4000, lo=-36, hi=-3)
    c16, cbf = census(g, "fp16"), census(g, "bf16")
    fig = gradient_histogram(g)
    top, ax = fig.axes
    assert top.get_title() == (f"fp16 flushes {c16.fraction('flushed'):.2%} of the nonzero gradients "
                               f"to zero, bf16 {cbf.fraction('flushed'):.2%}")
    assert c16.flushed > 0 and cbf.flushed == 0
    assert ax.get_xlabel() == "log2 |gradient|" and "log scale" in ax.get_ylabel()
    assert "a bin: 1/4 of a power of two" in ax.get_ylabel()
    with_zeros = gradient_histogram(torch.cat([g, torch.zeros(7)])).axes[1]
    assert with_zeros.get_xlabel() == "log2 |gradient|   (the 7 exact zeros have no log2: not drawn)"
    assert "a bin: one power of two" in gradient_histogram(g, bins_per_octave=1).axes[1].get_ylabel()
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["subnormal range", "normal range"]
    shifted = gradient_histogram(g, 2.0**22).axes[0].get_title()
    over = scaled_census(g, "fp16", 2.0**22).fraction("overflow")
    assert shifted.startswith("loss scale 2^22: fp16 flushes") and f"fp16 overflows {over:.2%}" in shifted
    with pytest.raises(ValueError, match="loss scale"):
        gradient_histogram(g, 0)


def test_rounding_error():
    from amp_lessons.formats import rounding_error

    x = torch.tensor([1 + 2.0**-11, 1e-9, 1e6, 0.0, -2.0])
    err = rounding_error(x, "fp16")
    assert err.tolist() == [2.0**-11 / (1 + 2.0**-11), 1.0, math.inf, 0.0]  # the 0 is left out
    g = wide_values(5000, lo=-120, hi=120)
    assert rounding_error(g, "bf16").max().item() <= 2.0**-8  # half of bf16's eps
    assert rounding_error(g, "tf32").max().item() <= 2.0**-11


def test_plots_leave_no_figure_open_in_pyplot():
    import matplotlib.pyplot as plt

    from amp_lessons.plots import format_ranges, gradient_histogram

    before = set(plt.get_fignums())
    format_ranges()
    gradient_histogram(wide_values(500, lo=-30, hi=-3), 2.0**8)
    assert set(plt.get_fignums()) == before


def test_gradient_recorder_keeps_the_gradients_between_layers():
    """The recorder's activation gradients are dL/d(output) of each Linear, as autograd gives them."""
    from amp_lessons.data import random_task
    from amp_lessons.models import mlp
    from amp_lessons.training import GradientRecorder, Trainer

    data = random_task(n=64, d_in=6, classes=3)
    model = mlp(6, 5, 3, depth=1)
    x, y = data.batch(0, 16)
    outs = []

    def keep(module, inputs, output):
        output.retain_grad()
        outs.append(output)

    hooks = [m.register_forward_hook(keep) for m in model if isinstance(m, torch.nn.Linear)]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = torch.cat([o.grad.flatten() for o in reversed(outs)])
    weights = torch.cat([p.grad.flatten() for p in model.parameters()])
    for h in hooks:
        h.remove()
    model.zero_grad()
    rec = GradientRecorder(steps={0})
    Trainer(model, data, precision="fp32", device="cpu", optimizer="sgd", lr=0.1, batch_size=16,
            callbacks=[rec]).fit(steps=2)
    assert torch.equal(rec.activation_grads, expected)  # backward reaches the last layer first
    assert torch.equal(rec.weight_grads, weights)


def test_a_census_of_measured_values_marks_its_figures():
    from amp_lessons.formats import census, scale_table, scaled_census

    g = torch.tensor([0.0, 1e-9, 1e-3, 1.0])
    assert "≈" not in str(census(g, "fp16"))
    text = str(census(g, "fp16", measured=True))
    assert text.startswith("fp16 x 1: flushed ≈33.333%") and "of ≈3 nonzero values" in text
    assert scaled_census(g, "fp16", 2.0**4, measured=True).measured
    assert "≈" in scale_table(g, 2.0**4, measured=True) and "≈" not in scale_table(g, 2.0**4)


BAD_FORMAT_ARGUMENTS = [
    (lambda: formats.from_layout("x", 0, 3), "exponent_bits must be a whole number from 2 to 11"),
    (lambda: formats.from_layout("x", 1.5, 3), "exponent_bits must be a whole number from 2 to 11"),
    (lambda: formats.from_layout("x", 10**6, 3), "exponent_bits must be a whole number from 2 to 11"),
    (lambda: formats.from_layout("x", 5, -1), "mantissa_bits must be a whole number from 0 to 52"),
    (lambda: formats.bits_of(10**400, "fp16"), "beyond float64's largest"),
    (lambda: formats.scale_table(torch.ones(3), 1.0, names=[]), "names must hold at least one format"),
    (lambda: formats.e4m3_overflow("tpu"), "device must be a torch device such as 'cpu'"),
    (lambda: formats.e4m3_overflow(3.5), "device must be a torch device such as 'cpu'"),
]


@pytest.mark.parametrize("call, says", BAD_FORMAT_ARGUMENTS, ids=[s for _, s in BAD_FORMAT_ARGUMENTS])
def test_a_bad_argument_says_what_to_pass(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_one_format_name_is_a_table_of_one_and_layouts_at_the_ends_of_the_range():
    assert formats.formats_table("fp16").splitlines()[1:] == formats.formats_table(["fp16"]).splitlines()[1:]
    assert len(formats.formats_table("fp16").splitlines()) == 2
    assert formats.scale_table(torch.ones(3), 1.0, names="bf16").splitlines()[2].startswith("bf16")
    f64 = formats.from_layout("fp64", 11, 52)
    assert (f64.max, f64.smallest_normal, f64.eps) == (torch.finfo(torch.float64).max,
                                                      torch.finfo(torch.float64).smallest_normal, 2.0**-52)
    assert formats.from_layout("e2m0", 2, 0).max == 2.0


def test_sums_by_order_tells_a_wider_accumulator_from_bf16_orders():
    # 1, 1 + 1/128, ..., 1 + 127/128, repeating: exact in bf16, and every float32 partial sum
    # is exact (under 2^14 with 7 fractional bits), so torch's sum cannot depend on its order.
    x = (1 + torch.arange(10000) % 128 / 128).to(torch.bfloat16)
    sums = formats.sums_by_order(x)
    assert sums["float64, rounded once"] == 14976  # 14953.9375 to bf16's nearest, spacing 64
    assert sums["one at a time"] == 512  # bf16's spacing is 4 there: each value under 2 rounds away
    assert sums["pairwise"] == 14912
    assert sums["torch's sum"] == 14976
    ones = formats.sums_by_order(torch.ones(10000, dtype=torch.bfloat16))  # ones cannot tell them apart
    assert ones["pairwise"] == ones["float64, rounded once"] == 9984 and ones["one at a time"] == 256


def test_sums_by_order_rounds_once_from_float64_in_the_tensors_dtype():
    assert formats.sums_by_order(torch.tensor([65504.0, 15.0], dtype=torch.float16))["float64, rounded once"] == 65504
    assert formats.sums_by_order(torch.tensor([2.5]))["pairwise"] == 2.5  # one element: itself, four times


@pytest.mark.parametrize("bad", [torch.ones(2, 2), torch.ones(0), torch.ones(3, dtype=torch.float64),
                                 torch.ones(3, dtype=torch.int64), [1.0, 2.0]])
def test_sums_by_order_refuses_what_it_cannot_sum_and_says_what_to_pass(bad):
    with pytest.raises(ValueError, match="must be a"):
        formats.sums_by_order(bad)
