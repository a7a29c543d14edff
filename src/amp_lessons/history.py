"""The per-step history of a training run: one :class:`StepRecord` per optimizer step.

:class:`~amp_lessons.training.Trainer` appends to it; checkpoints save and restore it; the
lessons read its columns (loss, scale, skipped, norms) and print its table. Used in 01 and
03-05.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from .arguments import check_positive


@dataclass
class StepRecord:
    """What happened in one optimizer step (one row of :class:`History`)."""

    step: int
    loss: float
    scale: float
    skipped: bool
    grad_norm: float
    clip_seen_norm: float
    applied_norm: float
    zero_frac: float
    lr: float
    ms: float


COLUMNS = tuple(f.name for f in fields(StepRecord))
# Columns whose values come out of float kernels: another CPU, thread count or torch release
# prints other digits, so the table marks them with amp_lessons.claims.measured (``≈``).
MEASURED_COLUMNS = frozenset({"loss", "grad_norm", "clip_seen_norm", "applied_norm", "zero_frac", "ms"})


class History:
    """The per-step records of a run: a column by name, a row by index, a text table."""

    columns = COLUMNS

    def __init__(self, records=()):
        self.records: list[StepRecord] = list(records)

    @classmethod
    def from_dicts(cls, rows) -> History:
        """The inverse of :meth:`as_dicts` (a checkpoint's history)."""
        return cls(StepRecord(**r) for r in rows)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.columns:
                raise KeyError(f"history has columns {', '.join(self.columns)}; got {key!r}: use one of them")
            return [getattr(r, key) for r in self.records]
        return self.records[key]

    @property
    def skipped(self) -> int:
        """How many steps the optimizer did not apply (GradScaler found inf/NaN gradients)."""
        return sum(r.skipped for r in self.records)

    def trailing_skips(self) -> int:
        """How many of the last steps in a row were skipped (03: a collapsing scale)."""
        n = 0
        for r in reversed(self.records):
            if not r.skipped:
                break
            n += 1
        return n

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def table(self, every: int = 1, columns=("step", "loss", "scale", "skipped", "grad_norm", "zero_frac")) -> str:
        """Every ``every``-th row (and the last) as aligned text, numbers rounded for reading."""
        check_positive("every", every, integer=True)
        unknown = [c for c in columns if c not in self.columns]
        if unknown:
            raise KeyError(f"history has columns {', '.join(self.columns)}; got {unknown}: use those names")
        rows = [r for i, r in enumerate(self.records) if i % every == 0 or i == len(self.records) - 1]
        cells = [[_fmt(getattr(r, c), c in MEASURED_COLUMNS) for c in columns] for r in rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"History({len(self)} steps, {self.skipped} skipped)"


def _fmt(v, measured_value: bool = False) -> str:
    if measured_value and isinstance(v, float) and math.isfinite(v):
        return "≈" + _fmt(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e9:  # a loss scale: 65536, not 6.55e+04
        return str(int(v))
    if isinstance(v, float) and v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
