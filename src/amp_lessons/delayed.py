"""Delayed against current scaling for one fp8 tensor over many steps. Used in 09_block_scales.

**Current** scaling (lesson 08) computes a tensor's amax, then its scale, then casts: one
extra pass over the tensor before the cast. **Delayed** scaling, Transformer Engine's
``DelayedScaling`` recipe, casts with a scale computed from the amaxes of *earlier* steps
and records this step's amax afterwards:

- it keeps the last ``history_len`` amaxes (TE's ``amax_history_len``, default 1024);
- ``algo="max"`` reduces them to their largest, ``"most_recent"`` to the last one
  (TE's ``amax_compute_algo``);
- ``scale = fmt.max / amax / 2^margin`` (TE's ``margin``, default 0): a margin of m leaves
  m powers of two of headroom above the amax seen so far;
- the first step casts with scale 1, and a step whose reduced amax is 0 or not finite
  keeps the previous scale (TE's ``_default_sf_compute``; its older releases also rounded
  the scale down to a power of two, which is left out here).

A spike larger than everything in the history saturates on the step it arrives; the
history then holds it for ``history_len`` steps, and every step in between casts with a
scale that spike set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .blockscale import e8m0_decode
from .fp8 import fp8_format, saturating_cast

ALGOS = ("max", "most_recent")


class DelayedScaling:
    """The amax history and scale of one tensor under delayed scaling (see the module docstring)."""

    def __init__(self, history_len: int = 1024, margin: int = 0, algo: str = "max", name: str = "fp8_e4m3"):
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a whole number of steps, at least 1; got {history_len!r}")
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be a whole number of powers of two, 0 or more; got {margin!r}")
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {', '.join(ALGOS)}; got {algo!r}")
        self.fmt = fp8_format(name)
        self.history_len, self.margin, self.algo = history_len, margin, algo
        self.history: deque[float] = deque(maxlen=history_len)
        self.scale = 1.0

    def reduced_amax(self) -> float:
        """The amax the next scale is computed from: the history's largest, or its last."""
        if not self.history:
            return 0.0
        return max(self.history) if self.algo == "max" else self.history[-1]

    def update(self, amax: float) -> None:
        """Record this step's amax, then compute the scale the *next* step casts with."""
        self.history.append(float(amax))
        reduced = self.reduced_amax()
        if reduced > 0 and reduced < float("inf"):
            self.scale = self.fmt.max / reduced / 2.0**self.margin


@dataclass(frozen=True)
class Step:
    """One step's cast: the scale used, the tensor's amax after scaling, and exact counts of
    saturated values (scaled past the format's largest) and of nonzero values flushed to 0."""

    step: int
    amax: float
    scale: float
    scaled_amax: float
    saturated: int
    flushed: int


def cast_step(x: torch.Tensor, scale: float, step: int, name: str = "fp8_e4m3") -> Step:
    """Cast ``x * scale`` with :func:`amp_lessons.fp8.saturating_cast` and count what happened."""
    fmt = fp8_format(name)
    scaled = x.float() * scale
    back = saturating_cast(scaled, name).float()
    return Step(step, float(x.abs().max()), float(scale), float(scaled.abs().max()),
                int(fmt.overflows(scaled.abs()).sum()), int(((x != 0) & (back == 0)).sum()))


def run_delayed(tensors, history_len=1024, margin=0, algo="max", name="fp8_e4m3") -> list[Step]:
    """Each tensor of the sequence cast with delayed scaling: the scale from earlier amaxes."""
    state = DelayedScaling(history_len, margin, algo, name)
    steps = []
    for i, x in enumerate(tensors):
        steps.append(cast_step(x, state.scale, i, name))
        state.update(x.abs().max().item())
    return steps


def run_current(tensors, name="fp8_e4m3") -> list[Step]:
    """Each tensor cast with current scaling: ``fmt.max / amax`` of the tensor itself."""
    fmt = fp8_format(name)
    return [cast_step(x, fmt.max / max(x.abs().max().item(), 1e-12), i, name) for i, x in enumerate(tensors)]


def spike_sequence(steps: int = 40, spike_at: int = 20, factor: int = 16, n: int = 512, seed: int = 0):
    """``steps`` activation tensors of exact values (``±(1 + k/8) * 2^e``, e from -14 to 0,
    drawn from integers under their own seed, so every device gets the same numbers, all
    below 2); at step
    ``spike_at``, 4 of them are ``±2 * factor``, ``factor`` times the others' largest
    possible value 2 (one outlier token, once)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        mant = 1 + torch.randint(0, 8, (n,), generator=g).float() / 8
        exp = torch.randint(-14, 1, (n,), generator=g).float()
        sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
        x = sign * mant * e8m0_decode((exp + 127).to(torch.uint8))  # exact powers of two
        if i == spike_at:
            x[:4] = sign[:4] * 2.0 * factor
        out.append(x)
    return out
