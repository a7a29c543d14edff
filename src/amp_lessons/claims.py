"""Measured figures and the verdicts drawn from them: how a lesson states a claim that
float kernels decide.

A loss after 100 fp16 steps, a norm or a timing comes out of float kernels, and another
CPU (AVX2 instead of AVX-512, AMX or not, 1 thread or 8), another torch release or a GPU
prints other digits. So a lesson never lets its tests compare such digits, and never lets
its prose presume them. Two tools, used by every lesson:

- :func:`measured` formats a figure with a leading ``≈``: ``measured(1.3204, ".3f")`` is
  ``"≈1.320"``. The learner reads the digits; the tests' sanitize rule
  (``notebooks/sanitize.cfg``) masks every ``≈`` figure, so nbval compares the rest of
  the line (words, exact counts, dtypes) and not the digits.
- :func:`check` (and :func:`at_least`, :func:`at_most`, :func:`between`) turns a sentence
  the prose would otherwise presume into a verdict computed from the figures, with its
  margin in the words::

      ✓ holds: fp16 without a scaler ends with at least 2x fp32's loss (≈6.1x: ≈1.320 vs ≈0.216)
      ✗ did not hold here: ... (the same figures)

  nbval compares the verdict's words, so a claim that fails on some machine fails the
  notebook test there. With ``AMP_LESSONS_STRICT_CLAIMS=1`` (``make gpu-check``, the
  matrix's lax runs) a failed verdict also raises :class:`ClaimFailed` once printed. With
  ``AMP_LESSONS_CLAIMS_LOG=path`` every verdict is appended to that file as a JSON line
  (claim, holds, value, bound), which ``tools/claims_report.py`` tabulates across the
  test matrix: that is where each margin comes from.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from dataclasses import asdict, dataclass, field

MARK = "≈"
HOLDS = "✓ holds"
FAILED = "✗ did not hold here"
STRICT_ENV = "AMP_LESSONS_STRICT_CLAIMS"
LOG_ENV = "AMP_LESSONS_CLAIMS_LOG"

RECORDED: list[Verdict] = []  # every verdict of this process, in order (gpu-check prints them)


class ClaimFailed(AssertionError):
    """A lesson's claim did not hold on this machine (raised only in strict mode)."""


def measured(value, spec: str = ".3g") -> str:
    """A figure from float kernels, for the learner to read: ``≈`` + ``format(value, spec)``.

    The tests mask it (it differs between machines); print exact values without it.
    """
    _number("measured's value", value, nan=True)
    return MARK + _format(_scalar(value), spec).strip()  # no padding between the mark and the digits


@dataclass(frozen=True)
class Verdict:
    """A claim checked against this run's figures; prints as one line."""

    claim: str
    holds: bool
    figures: str = ""
    value: float | None = None
    bound: tuple[float | None, float | None] | None = None
    lesson: str = field(default="", compare=False)

    def line(self) -> str:
        head = HOLDS if self.holds else FAILED
        return f"{head}: {self.claim}" + (f" ({self.figures})" if self.figures else "")

    def __str__(self) -> str:
        return self.line()

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the line, not a dataclass repr
        p.text(self.line())


def strict() -> bool:
    """True when a failed verdict must raise (``AMP_LESSONS_STRICT_CLAIMS=1``)."""
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def check(claim: str, holds: bool, figures: str = "", *, value=None, bound=None) -> Verdict:
    """The verdict on ``claim``: ``holds`` computed by the caller from this run's figures.

    ``figures`` shows what was measured (format the float-kernel ones with :func:`measured`);
    ``value`` and ``bound = (low, high)`` are logged for the margin tables. Records the
    verdict, logs it when ``AMP_LESSONS_CLAIMS_LOG`` is set, and in strict mode prints it
    and raises :class:`ClaimFailed` when it does not hold.
    """
    if not isinstance(claim, str) or not claim.strip():
        raise ValueError("a verdict needs the claim it checks, as a sentence")
    if not isinstance(figures, str):
        raise ValueError(f"figures must be text (format the figures with measured()); got {figures!r}")
    value = None if value is None else _number("value", value, nan=True)
    if bound is not None and not (isinstance(bound, tuple) and len(bound) == 2 and all(
            b is None or _number("bound", b) is not None for b in bound)):
        raise ValueError(f"bound must be (low, high), each a number or None; got {bound!r}")
    verdict = Verdict(claim, _truth(holds), figures, value, bound, _lesson())
    RECORDED.append(verdict)
    _log(verdict)
    if not verdict.holds and strict():
        print(verdict.line(), flush=True)
        raise ClaimFailed(f"{verdict.line()}  [{verdict.lesson or 'this run'}]")
    return verdict


def at_least(claim: str, value: float, bound: float, spec: str = ".3g", figures: str = "") -> Verdict:
    """``claim`` holds when ``value >= bound``; shows ``≈value`` and the bound. A NaN or
    infinite ``value`` does not hold; a ``value`` or ``bound`` that is no number is a ValueError."""
    x, bound = _number("value", value, nan=True), _number("bound", bound)
    shown = f"{measured(value, spec)}; needs >= {bound:g}" + (f"; {figures}" if figures else "")
    return check(claim, math.isfinite(x) and x >= bound, shown, value=x, bound=(bound, None))


def at_most(claim: str, value: float, bound: float, spec: str = ".3g", figures: str = "") -> Verdict:
    """``claim`` holds when ``value <= bound``; shows ``≈value`` and the bound (see :func:`at_least`)."""
    x, bound = _number("value", value, nan=True), _number("bound", bound)
    shown = f"{measured(value, spec)}; needs <= {bound:g}" + (f"; {figures}" if figures else "")
    return check(claim, math.isfinite(x) and x <= bound, shown, value=x, bound=(None, bound))


def between(claim: str, value: float, low: float, high: float, spec: str = ".3g",
            figures: str = "") -> Verdict:
    """``claim`` holds when ``low <= value <= high``; shows ``≈value`` and the range (see
    :func:`at_least`; ``low`` above ``high`` is a ValueError)."""
    x, low, high = _number("value", value, nan=True), _number("low", low), _number("high", high)
    if low > high:
        raise ValueError(f"between needs low <= high; got low {low:g}, high {high:g}: swap them")
    shown = f"{measured(value, spec)}; needs {low:g} to {high:g}" + (f"; {figures}" if figures else "")
    return check(claim, math.isfinite(x) and low <= x <= high, shown, value=x, bound=(low, high))


def summary(verdicts=None) -> str:
    """``N verdicts, M held`` and every one that did not hold (gpu-check's last lines)."""
    verdicts = RECORDED if verdicts is None else list(verdicts) if hasattr(verdicts, "__iter__") else [verdicts]
    if not all(isinstance(v, Verdict) for v in verdicts):
        raise ValueError("summary takes verdicts (what check, at_least, at_most and between return), "
                         f"or None for this run's; got {verdicts!r:.80}")
    failed = [v for v in verdicts if not v.holds]
    lines = [f"{len(verdicts)} verdicts, {len(verdicts) - len(failed)} held, {len(failed)} did not"]
    lines += [f"  {v.lesson}: {v.line()}" for v in failed]
    return "\n".join(lines)


def _item(x):
    """The Python value a one-value tensor or array holds (``x.item()``), else None."""
    size = getattr(x, "numel", None) or getattr(x, "size", None)
    size = size() if callable(size) else size
    return x.item() if size == 1 and hasattr(x, "item") else None


def _scalar(x):
    """A number as itself; a one-value tensor or array as its Python number; anything else
    (a bool among them) None."""
    item = x if isinstance(x, numbers.Real) else _item(x)
    return item if isinstance(item, numbers.Real) and not isinstance(item, bool) else None


def _number(what: str, x, nan: bool = False) -> float:
    """``x`` (a number, or a tensor or array holding one) as a float, else a ValueError. NaN
    is refused unless ``nan``: a bound must be a number a figure can be compared with."""
    item = _scalar(x)
    if item is None or (not nan and math.isnan(item)):
        raise ValueError(f"{what} must be a number (a measured figure or its bound); got {x!r:.80}")
    return float(item)


def _truth(holds) -> bool:
    """``holds`` as a bool: True or False, numpy's or a one-value bool tensor; else a ValueError."""
    value = holds if isinstance(holds, bool) else _item(holds)
    if not isinstance(value, bool):
        raise ValueError("holds must be True or False: the claim's test, computed from this run's figures "
                         f"(a comparison such as ratio >= 2); got {holds!r:.80}")
    return value


def _format(value, spec: str) -> str:
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a format spec such as '.3g', '.1%' or ','; got {spec!r}")
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        raise ValueError(f"spec {spec!r} cannot format {value!r:.40}: use one such as '.3g', '.1%' or ','") from None


def _lesson() -> str:
    """The lesson running this verdict: a script's name, or AMP_LESSONS_LESSON (set by the tools)."""
    name = os.environ.get("AMP_LESSONS_LESSON")
    if name:
        return name
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.splitext(os.path.basename(main))[0]


def _log(verdict: Verdict) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    row = asdict(verdict)
    row["config"] = os.environ.get("AMP_LESSONS_CONFIG", "")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
