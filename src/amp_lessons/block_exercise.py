"""The checked exercise of lesson 09 (block scales): an MX block's e8m0 scale code.
Used in 09_block_scales."""

from __future__ import annotations

import torch

from .blockscale import e8m0_decode
from .exercises import Verdict


def e8m0_code_as_given(amax, element_max=448.0):
    """09's exercise, as given: the e8m0 code (uint8) of each block's power-of-two decode
    scale ``X = 2^(code - 127)``, chosen so that ``amax / X`` is as large as it can be without
    passing ``element_max``. One thing is wrong."""
    exponent = torch.round(torch.log2(amax / element_max)).clamp(-127, 127)
    return (exponent + 127).to(torch.uint8)


def _cases() -> torch.Tensor:
    """Exact block amaxes: the element's largest value times powers of two, just above and
    below them, values across e8m0's range, two so small that their scale would be below
    e8m0's smallest, 2^-127 (float32 subnormals, so the clamp matters), float32's largest
    power of two, and an all-zero block (last). No float32 amax needs a scale above 2^127."""
    amax = [1.0, 1.5, 1.75, 1.9375, 2.0, 3.0, 5.0, 6.0, 7.0, 448.0, 448.25, 449.0, 500.0, 511.0, 512.0,
            2.0**-20, 3 * 2.0**-20, 2.0**20, 2.0**-130, 3 * 2.0**-140, 2.0**127, 0.0]
    return torch.tensor(amax)


def _check_one(codes, amax: torch.Tensor, top: float) -> tuple[bool, list[str]]:
    """The findings for one element format's codes (already a uint8 tensor of the right shape)."""
    if (codes == 255).any():
        i = int((codes == 255).nonzero()[0])
        hint = ("an all-zero block needs a code too: log2(0) is -inf" if amax[i] == 0 else
                "is the bias of 127 added once, and the exponent clamped?")
        return False, [f"element max {top:g}: the block with amax {amax[i].item():g} got code 255, which "
                       f"e8m0 reserves for NaN ({hint})"]
    ratio = amax.double() / e8m0_decode(codes).double()
    nonzero = amax > 0
    # the exponent a block needs; below -127 e8m0 has nothing smaller, so the answer is code 0
    needed = torch.ceil(torch.log2(amax.double() / top))
    floor = nonzero & (needed < -127)
    unclamped = [i for i in range(len(amax)) if floor[i] and int(codes[i]) != 0]
    over = [i for i in range(len(amax)) if nonzero[i] and ratio[i] > top]
    low = [i for i in range(len(amax)) if nonzero[i] and not floor[i] and ratio[i] <= top / 2]
    findings = []
    if unclamped:
        i = unclamped[0]
        findings.append(f"element max {top:g}: a block with amax {amax[i].item():g} needs X = 2^"
                        f"{int(needed[i])}, below e8m0's smallest, 2^-127: its code should be 0 (clamp "
                        f"the exponent to [-127, 127]), not {int(codes[i])}")
    if over:
        i = over[0]
        findings.append(f"element max {top:g}: a block with amax {amax[i].item():g} gets X = 2^"
                        f"{int(codes[i]) - 127}, so its largest value lands at {ratio[i].item():g}, past "
                        f"{top:g}, the element's largest value")
    if low:
        i = low[0]
        findings.append(f"element max {top:g}: a block with amax {amax[i].item():g} lands at "
                        f"{ratio[i].item():g}, at or below half of {top:g}: its X is twice as large as it "
                        "needs to be")
    if not findings:
        findings.append(f"element max {top:g}: right: every block's largest value lands above {top / 2:g} "
                        f"and at most {top:g} (or takes e8m0's smallest scale, code 0, when even that is "
                        "too large), and the all-zero block gets a code below 255")
    return not (over or low or unclamped), findings


def check_e8m0_code(fn) -> Verdict:
    """09: check the learner's ``fn(amax, element_max) -> codes`` for e4m3 (448) and e2m1 (6)
    blocks: uint8 codes below 255 (NaN), one for an all-zero block too, no block's largest
    value past the element's largest after dividing by ``X``, and none at or below half of it
    (a scale one power of two too large wastes the element's top binade), except blocks so
    small that they need a scale below 2^-127, which must get code 0."""
    amax = _cases()
    findings, passed = [], True
    for top in (448.0, 6.0):
        try:
            codes = fn(amax.clone(), top)
        except Exception as err:
            return Verdict(False, [f"fn(amax, {top:g}) raised {type(err).__name__}: {err}"])
        if not isinstance(codes, torch.Tensor) or codes.shape != amax.shape:
            return Verdict(False, [f"fn(amax, {top:g}) should return one code per block, a tensor of shape "
                                   f"{tuple(amax.shape)}"])
        if codes.dtype != torch.uint8:
            passed = False
            findings.append(f"element max {top:g}: the codes are {codes.dtype}; e8m0 codes are one byte, uint8")
            continue
        ok, found = _check_one(codes, amax, top)
        passed &= ok
        findings += found
    return Verdict(passed, findings)
