"""Lesson 09's exercise checker: wrong answers fail with a specific finding, the right one passes."""

import torch

from amp_lessons.block_exercise import check_e8m0_code, e8m0_code_as_given


def ceil_code(amax, element_max=448.0):
    e = torch.ceil(torch.log2(amax / element_max)).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def test_the_right_answer_passes():
    v = check_e8m0_code(ceil_code)
    assert v.passed and all("right" in f for f in v.findings)


def test_as_given_saturates():
    v = check_e8m0_code(e8m0_code_as_given)
    assert not v.passed and "past 448, the element's largest value" in v.findings[0]


def test_the_ocp_floor_rule_saturates_too():
    def floor(amax, m=448.0):
        e = (torch.floor(torch.log2(amax)) - torch.floor(torch.log2(torch.tensor(m)))).clamp(-127, 127)
        return (e + 127).to(torch.uint8)

    assert not check_e8m0_code(floor).passed


def test_ceil_without_the_clamp_fails_on_tiny_blocks():
    def unclamped(amax, element_max=448.0):
        return (torch.ceil(torch.log2(amax / element_max)) + 127).to(torch.uint8)

    v = check_e8m0_code(unclamped)
    assert not v.passed and any("should be 0" in f and "2^-127" in f for f in v.findings)


def test_one_power_too_large_wastes_the_top_binade():
    v = check_e8m0_code(lambda a, m=448.0: ceil_code(a, m) + 1)
    assert not v.passed and any("twice as large" in f for f in v.findings)


def test_nan_code_wrong_dtype_shape_and_errors():
    def nan_for_zero(a, m=448.0):
        c = ceil_code(a.clamp(min=2.0**-100), m)
        c[a == 0] = 255
        return c

    assert "reserves for NaN" in check_e8m0_code(nan_for_zero).findings[0]
    assert "uint8" in check_e8m0_code(lambda a, m: ceil_code(a, m).long()).findings[0]
    assert "one code per block" in check_e8m0_code(lambda a, m: ceil_code(a, m)[:3]).findings[0]

    def boom(a, m):
        raise ZeroDivisionError("no")

    assert "raised ZeroDivisionError" in check_e8m0_code(boom).findings[0]


def test_a_ceil_nudged_down_fails_just_above_the_element_max():
    v = check_e8m0_code(lambda a, m=448.0: ((torch.ceil(torch.log2(a / m) - 0.001)).clamp(-127, 127) + 127)
                        .to(torch.uint8))
    assert not v.passed and any("448.25" in f for f in v.findings)


def test_a_missing_bias_gets_a_hint_about_the_bias():
    def no_clamp_double_bias(a, m=448.0):
        return (torch.ceil(torch.log2(a.clamp(min=2.0**-126) / m)) + 254).clamp(0, 255).to(torch.uint8)

    first = check_e8m0_code(no_clamp_double_bias).findings[0]
    assert "code 255" in first and "bias of 127" in first and "log2(0)" not in first
