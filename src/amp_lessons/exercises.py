"""Checkers for the lessons' exercises: each runs or inspects the learner's answer and
returns a :class:`Verdict` that says what is right and what is still wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    """The result of checking an exercise: ``passed`` plus one line per finding."""

    passed: bool
    findings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = "correct" if self.passed else "not yet"
        return "\n".join([head, *("  - " + f for f in self.findings)])

    __repr__ = __str__


# --- 01_number_formats ---------------------------------------------------------------

# --- 02_autocast ---------------------------------------------------------------------

# --- 03_grad_scaler ------------------------------------------------------------------

# --- 04_clipping ---------------------------------------------------------------------
