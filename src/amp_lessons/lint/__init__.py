"""``check_loop``: read a training loop's source and name the mixed-precision mistakes in it.

Used in 06_error_messages and by ``python -m amp_lessons lint PATH ...``. The source is read
with :mod:`ast` (never run, never matched with regexes), so the checker sees calls, loops,
``with`` blocks and ``if`` arms as Python does; it imports no torch. Modules:

- ``source``  reading: functions, strings, files in any encoding Python accepts, notebooks
  cell by cell, directories
- ``walk``    the traversal: the roles of the names, the calls in order, the state of the
  gradients at each call (branch by branch, around loops)
- ``rules``   one small function per mistake, in the table ``RULES`` (name, lesson, summary,
  a broken example and its fix)
- ``cli``     ``python -m amp_lessons lint``: text or JSON, exit codes, directories

======================  =================================================================  ======
code                    the mistake                                                        lesson
======================  =================================================================  ======
deprecated-amp          ``torch.cuda.amp`` / ``torch.cpu.amp`` (FutureWarning)              06
scaler-no-device        ``GradScaler()`` without a device: means "cuda"; off without CUDA   03
                        or torch_xla
scaler-cuda-only        a CUDA scaler in code that also runs without CUDA ("may")           03
clip-before-unscale     a clip on gradients still multiplied by the scale                   04
unscale-twice           ``unscale_`` twice for one optimizer before ``update()``            04
missing-update          ``scaler.step`` with no ``update()``, or a path that skips it       03
step-after-scaler-step  ``optimizer.step()`` again after ``scaler.step(optimizer)``         03
scheduler-unguarded     ``scheduler.step()`` also after a skipped step                      03
scheduler-guard-unread  ``scheduler.step()`` under a test that calls out ("may", a note)    03
half-with-scaler        ``model.half()`` with a GradScaler                                  05
fp16-without-scaler     float16 autocast and backward, no GradScaler in the file ("may")   03
backward-in-autocast    ``backward()`` inside the autocast block (a note)                   02
update-per-optimizer    ``scaler.update()`` between the optimizers' ``scaler.step`` calls   06
accumulation-undivided  gradient accumulation without dividing the loss                     04
step-per-micro-batch    ``step``/``update`` on every micro-batch of an accumulation loop    04
======================  =================================================================  ======

It reads names the way training loops are written (see :class:`.walk.Roles`): a scaler is
what ``GradScaler(...)`` built, what ``unscale_`` is called on, or a name ending in a part
holding "scaler" (``self.engine.scaler``); ``accelerator.backward(loss)`` and the like scale
by themselves and are left to their library. It follows each function on its own, through
both arms of every ``if`` (the ``else:`` of ``if scaler is not None:`` runs without a
scaler): a loss divided inside a helper, or a scheduler stepped by another function, is not
seen. A line ending in ``# amp-lint: ignore`` (or ``# amp-lint: ignore[code, ...]``) is
skipped: mark the lines where the mistake is made on purpose (lesson 04's clip-before-unscale
option, say).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from .rules import BY_NAME, RULES, Context
from .source import LintError, Source, parse, source_of

CHECKS = {rule.name: rule.lesson for rule in RULES}
CONVENTIONS = {rule.name for rule in RULES if rule.kind == "note"}
IGNORE = "amp-lint: ignore"

__all__ = ["CHECKS", "RULES", "Finding", "Findings", "LintError", "check_loop", "check_source", "listing"]


@dataclass(frozen=True)
class Finding:
    """One mistake: the line it is on (and the cell, in a notebook), a short code, what is
    wrong and how to fix it, and the lesson that shows it."""

    line: int
    code: str
    message: str
    lesson: str
    cell: int | None = None

    @property
    def kind(self) -> str:
        return "note" if self.code in CONVENTIONS else "mistake"

    @property
    def where(self) -> str:
        return f"cell {self.cell}, line {self.line}" if self.cell is not None else f"line {self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: [{self.code}] {self.message} (lesson {self.lesson})"

    def as_dict(self) -> dict:
        return {"cell": self.cell, "line": self.line, "code": self.code, "kind": self.kind,
                "message": self.message, "lesson": self.lesson}


class Findings(list):
    """The findings of one :func:`check_loop` call, sorted by place; prints one per line."""

    def __init__(self, items=(), name: str = "the source"):
        super().__init__(sorted(items, key=lambda f: (f.cell or 0, f.line, f.code)))
        self.name = name

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self]

    def __str__(self) -> str:
        if not self:
            return f"{self.name}: no findings"
        return "\n".join(str(f) for f in self)

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def check_loop(source_or_function, *, name: str | None = None) -> Findings:
    """The mistakes :mod:`amp_lessons.lint` can see in a training loop's source.

    ``source_or_function``: a function, method, class or module (its source is read with
    :mod:`inspect`; lines are the file's), a :class:`pathlib.Path` (a ``.py`` file or a
    ``.ipynb`` notebook), or a string of Python source (lines counted from its first line).
    Returns :class:`Findings`, one :class:`Finding` per mistake, each with its line, message
    and the lesson to read. Raises :class:`LintError` when the source cannot be read or parsed.
    """
    source = source_of(source_or_function)
    if name:
        source.name = name
    return check_source(source)


def check_source(source: Source) -> Findings:
    """:func:`check_loop` on a :class:`~.source.Source` already read. Python's cyclic garbage
    collector is paused meanwhile: a large file's tree is millions of objects without cycles,
    and its passes over them would double the time."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        tree = parse(source.text, source.name)
        ctx = Context(tree)
        found = {(line, rule.name): message for rule in RULES for line, message in rule.check(ctx)}
    except (RecursionError, MemoryError) as err:
        raise LintError(f"cannot check {source.name}: it is nested too deeply to follow "
                        f"({type(err).__name__}); split the deepest expression") from err
    finally:
        if collecting:
            gc.enable()
    lines = source.text.splitlines()
    kept = []
    for (line, code), message in found.items():
        if _ignored(code, lines[line - 1] if 0 < line <= len(lines) else ""):
            continue
        cell, where = source.where(line)
        kept.append(Finding(where, code, message, BY_NAME[code].lesson, cell))
    return Findings(kept, source.name)


def _ignored(code: str, text: str) -> bool:
    if IGNORE not in text:
        return False
    rest = text.split(IGNORE, 1)[1].strip()
    if not rest.startswith("["):
        return True
    return code in {c.strip() for c in rest[1:].split("]", 1)[0].split(",")}


def listing(source_or_function) -> str:
    """The source :func:`check_loop` reads, with line numbers: a string is numbered from 1
    (as its findings are), an object from its first line in its file."""
    source = source_of(source_or_function)
    lines = source.text.rstrip("\n").splitlines()
    width = len(str(source.first + len(lines) - 1))
    return "\n".join(f"{source.first + i:>{width}}  {line}" for i, line in enumerate(lines))
