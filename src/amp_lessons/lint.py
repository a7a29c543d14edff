"""``check_loop``: read a training loop's source and name the mixed-precision mistakes in it.

Used in 06_error_messages and by ``python -m amp_lessons lint FILE.py``. The source is read
with :mod:`ast` (never run, never matched with regexes), so the checker sees calls, loops,
``with`` blocks and ``if`` guards as Python does. It finds what can be seen statically:

======================  ================================================================  ======
code                    the mistake                                                       lesson
======================  ================================================================  ======
deprecated-amp          ``torch.cuda.amp`` / ``torch.cpu.amp`` (FutureWarning)             06
scaler-no-device        ``GradScaler()`` without a device: means "cuda"; off without CUDA  03
clip-before-unscale     a clip on gradients still multiplied by the scale                  04
unscale-twice           ``unscale_`` twice for one optimizer before ``update()``           04
scheduler-unguarded     ``scheduler.step()`` also after a skipped step                     03
half-with-scaler        ``model.half()`` with a GradScaler                                 05
backward-in-autocast    ``backward()`` inside the autocast block (a convention)            02
update-per-optimizer    ``scaler.update()`` inside the loop over optimizers                06
accumulation-undivided  gradient accumulation without dividing the loss                    04
step-per-micro-batch    ``step``/``update`` on every micro-batch of an accumulation loop   04
======================  ================================================================  ======

It reads names the way training loops are usually written: a scaler is what was built by
``GradScaler(...)``, what ``unscale_`` or ``.scale(loss).backward()`` is called on, or a
name containing "scaler"; a scheduler is built by ``lr_scheduler.*`` or named "*sched*";
a model is built by ``nn.*``, has ``.parameters()`` called on it, or is named "*model*"
or "*net*". It sees one function at a time: a loss divided by the number of micro-batches
inside a helper, or a scheduler stepped by another function, is not seen. A line ending in
``# amp-lint: ignore`` (or ``# amp-lint: ignore[code, ...]``) is skipped: mark the lines
where the mistake is made on purpose (lesson 04's clip-before-unscale option, say).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

CHECKS = {
    "deprecated-amp": "06_error_messages",
    "scaler-no-device": "03_grad_scaler",
    "clip-before-unscale": "04_clipping",
    "unscale-twice": "04_clipping",
    "scheduler-unguarded": "03_grad_scaler",
    "half-with-scaler": "05_putting_it_together",
    "backward-in-autocast": "02_autocast",
    "update-per-optimizer": "06_error_messages",
    "accumulation-undivided": "04_clipping",
    "step-per-micro-batch": "04_clipping",
}
CONVENTIONS = {"backward-in-autocast"}  # style, not a wrong result: reported as a note
CLIPS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}
DEPRECATED = ("torch.cuda.amp", "torch.cpu.amp")
IGNORE = "amp-lint: ignore"


class LintError(ValueError):
    """The source could not be read or parsed; the message says where and what to do."""


@dataclass(frozen=True)
class Finding:
    """One mistake: the line it is on, a short code, what is wrong and how to fix it, and
    the lesson that shows it."""

    line: int
    code: str
    message: str
    lesson: str

    @property
    def kind(self) -> str:
        return "note" if self.code in CONVENTIONS else "mistake"

    def __str__(self) -> str:
        return f"line {self.line}: [{self.code}] {self.message} (lesson {self.lesson})"


class Findings(list):
    """The findings of one :func:`check_loop` call, sorted by line; prints one per line."""

    def __init__(self, items=(), name: str = "the source"):
        super().__init__(sorted(items, key=lambda f: (f.line, f.code)))
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


# --- reading the source ----------------------------------------------------------------------


def source_of(obj) -> tuple[str, int, str]:
    """``(source, first line, name)`` of a function, method, class, module, file path or
    source string. ``first line`` is the line in its file where the source starts."""
    if isinstance(obj, Path):
        try:
            return obj.read_text(encoding="utf-8"), 1, str(obj)
        except (OSError, UnicodeDecodeError) as err:
            raise LintError(f"cannot read {obj}: {err}") from err
    if isinstance(obj, str):
        return textwrap.dedent(obj), 1, "the source"
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        lines, first = inspect.getsourcelines(target)
    except (OSError, TypeError) as err:
        raise LintError(f"cannot read the source of {obj!r} ({err}); pass the loop's source "
                        "as a string, or the path of its file") from err
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(obj)))
    return textwrap.dedent("".join(lines)), max(first, 1), name


def parse(source: str, name: str = "the source") -> ast.Module:
    """``ast.parse``, with a :class:`LintError` that says where the syntax error is."""
    try:
        return ast.parse(source)
    except SyntaxError as err:
        where = f"line {err.lineno}" + (f", column {err.offset}" if err.offset else "")
        text = f": {err.text.strip()}" if err.text and err.text.strip() else ""
        raise LintError(f"cannot parse {name}: {err.msg} at {where}{text}. check_loop reads "
                        "Python source: pass a whole function or file that Python can "
                        "compile") from err


def dotted(node) -> str | None:
    """``a.b.c`` for a chain of names and attributes (``self.scaler``); None otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _last(name: str | None) -> str:
    return (name or "").rsplit(".", 1)[-1].lower()


def _names_in(node) -> set[str]:
    """Every dotted name and attribute word read in ``node`` (``self.skipped`` gives both)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute)):
            d = dotted(n)
            if d:
                out.add(d)
            out.add(n.id if isinstance(n, ast.Name) else n.attr)
    return out


def _calls_in_order(node):
    """The calls in ``node`` in evaluation order (a call's receiver and arguments first),
    not entering nested functions, lambdas or classes."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _calls_in_order(child)
    if isinstance(node, ast.Call):
        yield node


# --- what the names are: scalers, schedulers, models, imports ----------------------------------


@dataclass
class Roles:
    """Which names in the source are scalers, schedulers and models, and import aliases."""

    aliases: dict = field(default_factory=dict)  # local name -> dotted module path
    scalers: set = field(default_factory=set)
    schedulers: set = field(default_factory=set)
    models: set = field(default_factory=set)
    optimizers: set = field(default_factory=set)
    built_scaler: bool = False

    def resolve(self, name: str | None) -> str | None:
        """``name`` with its first part replaced by what it was imported as."""
        if not name:
            return name
        head, _, rest = name.partition(".")
        full = self.aliases.get(head)
        return (full + ("." + rest if rest else "")) if full else name

    def is_scaler(self, name) -> bool:
        return bool(name) and (name in self.scalers or "scaler" in _last(name))

    def is_scheduler(self, name) -> bool:
        return bool(name) and not self.is_scaler(name) and (
            name in self.schedulers or "sched" in _last(name))

    def is_optimizer(self, text) -> bool:
        return bool(text) and not self.is_scaler(text) and not self.is_scheduler(text) and (
            text in self.optimizers or "opt" in _last(text))

    def is_model(self, name) -> bool:
        last = _last(name)
        return bool(name) and (name in self.models or "model" in last or last.endswith("net"))


def _targets(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [d for t in targets for d in [dotted(t)] if d]


def find_roles(tree: ast.AST) -> Roles:
    roles = Roles()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                roles.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                roles.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            what = roles.resolve(dotted(node.value.func)) or ""
            last = what.rsplit(".", 1)[-1]
            if last.endswith("GradScaler"):
                roles.scalers.update(_targets(node))
            elif "lr_scheduler" in what or last.endswith(("LR", "Scheduler")) or "schedule" in last:
                roles.schedulers.update(_targets(node))
            elif what.startswith(("torch.nn.", "nn.")) and last[:1].isupper():
                roles.models.update(_targets(node))
            elif what.startswith(("torch.optim.", "optim.")) and last[:1].isupper():
                roles.optimizers.update(_targets(node))
        if not isinstance(node, ast.Call):
            continue
        what = roles.resolve(dotted(node.func)) or ""
        if what.endswith("GradScaler"):
            roles.built_scaler = True
        if not isinstance(node.func, ast.Attribute):
            continue
        receiver = dotted(node.func.value)
        if node.func.attr == "unscale_" and receiver:
            roles.scalers.add(receiver)
        elif node.func.attr in ("scale", "step", "update") and "scaler" in _last(receiver):
            roles.scalers.add(receiver)
        elif node.func.attr in ("parameters", "named_parameters") and receiver:
            roles.models.add(receiver)
        elif node.func.attr == "backward" and isinstance(node.func.value, ast.Call):
            inner = node.func.value.func
            if isinstance(inner, ast.Attribute) and inner.attr == "scale" and dotted(inner.value):
                roles.scalers.add(dotted(inner.value))
    return roles


# --- the checker -----------------------------------------------------------------------------


def check_loop(source_or_function, *, name: str | None = None) -> Findings:
    """The mistakes :mod:`amp_lessons.lint` can see in a training loop's source.

    ``source_or_function``: a function, method, class or module (its source is read with
    :mod:`inspect`; lines are the file's), a :class:`pathlib.Path`, or a string of Python
    source (lines counted from its first line). Returns :class:`Findings`, one
    :class:`Finding` per mistake, each with its line, message and the lesson to read.
    Raises :class:`LintError` when the source cannot be read or parsed.
    """
    source, first, default_name = source_of(source_or_function)
    name = name or default_name
    tree = parse(source, name)
    checker = _Checker(tree)
    findings = checker.run()
    lines = source.splitlines()
    kept = [replace(f, line=f.line + first - 1) for f in findings if not _ignored(f, lines)]
    return Findings(kept, name)


def _ignored(finding: Finding, lines: list[str]) -> bool:
    text = lines[finding.line - 1] if 0 < finding.line <= len(lines) else ""
    if IGNORE not in text:
        return False
    rest = text.split(IGNORE, 1)[1].strip()
    if not rest.startswith("["):
        return True
    codes = {c.strip() for c in rest[1:].split("]", 1)[0].split(",")}
    return finding.code in codes


@dataclass
class _Event:
    """A call that matters, where it is: enclosing loops and ifs (within its unit), autocast."""

    kind: str          # backward, unscale, scaler_step, update, opt_step, sched_step, zero_grad, clip
    node: ast.Call
    loops: tuple       # enclosing loop nodes, outermost first
    ifs: tuple         # enclosing ast.If nodes, outermost first
    autocast: bool
    arg: ast.AST | None = None   # the optimizer of unscale_/step, the loss of backward
    scaled: bool = False         # backward of a scaler.scale(...) result
    stmt: ast.stmt | None = None  # the statement it is in (its test or iter, for a compound one)

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def loop(self):
        return self.loops[-1] if self.loops else None


def _is_autocast(item: ast.withitem, roles: Roles) -> bool:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    what = roles.resolve(dotted(call.func)) or ""
    if not what.endswith("autocast"):
        return False
    for kw in call.keywords:
        if kw.arg == "enabled" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
            return False
    return True


class _Unit:
    """One function body (or the module's top level): its statements and the calls in them."""

    def __init__(self, body: list, roles: Roles):
        self.body, self.roles = body, roles
        self.events: list[_Event] = []
        self.assigned: dict[str, list[ast.AST]] = {}  # name -> values assigned to it (and AugAssign nodes)
        self.parents: dict[int, tuple] = {}  # id(stmt) -> (its block, its index, parent statement)
        self._collect(body, (), (), False)

    # -- collection --
    def _collect(self, block, loops, ifs, autocast, parent=None):
        for i, stmt in enumerate(block):
            self.parents[id(stmt)] = (block, i, parent)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                for t in _targets(stmt):
                    self.assigned.setdefault(t, []).append(stmt.value)
            elif isinstance(stmt, ast.AugAssign):
                t = dotted(stmt.target)
                if t:
                    self.assigned.setdefault(t, []).append(stmt)
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                self._calls(stmt.iter if not isinstance(stmt, ast.While) else stmt.test, stmt, loops, ifs, autocast)
                self._collect(stmt.body, loops + (stmt,), ifs, autocast, stmt)
                self._collect(stmt.orelse, loops, ifs, autocast, stmt)
            elif isinstance(stmt, ast.If):
                self._calls(stmt.test, stmt, loops, ifs, autocast)
                self._collect(stmt.body, loops, ifs + (stmt,), autocast, stmt)
                self._collect(stmt.orelse, loops, ifs + (stmt,), autocast, stmt)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                inside = autocast or any(_is_autocast(item, self.roles) for item in stmt.items)
                for item in stmt.items:
                    self._calls(item.context_expr, stmt, loops, ifs, autocast)
                self._collect(stmt.body, loops, ifs, inside, stmt)
            elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                for part in (stmt.body, *[h.body for h in stmt.handlers], stmt.orelse, stmt.finalbody):
                    self._collect(part, loops, ifs, autocast, stmt)
            elif isinstance(stmt, ast.Match):
                for case in stmt.cases:
                    self._collect(case.body, loops, ifs, autocast, stmt)
            else:
                self._calls(stmt, stmt, loops, ifs, autocast)

    def _calls(self, node, stmt, loops, ifs, autocast):
        for call in _calls_in_order(node):
            event = self._classify(call, loops, ifs, autocast)
            if event is not None:
                event.stmt = stmt
                self.events.append(event)

    def _classify(self, call: ast.Call, loops, ifs, autocast) -> _Event | None:
        roles = self.roles
        what = roles.resolve(dotted(call.func)) or ""
        def ev(kind, arg=None, scaled=False):
            return _Event(kind, call, loops, ifs, autocast, arg, scaled)
        if what.rsplit(".", 1)[-1] in CLIPS:
            return ev("clip")
        if what == "torch.autograd.backward" and call.args:
            return self._backward(call.args[0], ev)
        if not isinstance(call.func, ast.Attribute):
            return None
        attr, receiver = call.func.attr, dotted(call.func.value)
        if attr == "backward":
            return self._backward(call.func.value, ev)
        if attr == "unscale_":
            return ev("unscale", call.args[0] if call.args else None)
        if attr == "zero_grad":
            return ev("zero_grad")
        if attr == "update" and roles.is_scaler(receiver) and not call.args:
            return ev("update")
        if attr == "step":
            if roles.is_scaler(receiver) and call.args:
                return ev("scaler_step", call.args[0])
            if roles.is_scheduler(receiver):
                return ev("sched_step")
            if roles.is_optimizer(receiver or ast.unparse(call.func.value)):
                return ev("opt_step", call.func.value)
        return None

    def _backward(self, value, ev) -> _Event:
        """``value.backward()``: is ``value`` a ``scaler.scale(loss)`` (directly or by name)?"""
        loss, scaled = value, False
        if self._is_scale_call(value):
            loss, scaled = value.args[0], True
        else:
            name = dotted(value)
            for v in self.assigned.get(name, []) if name else []:
                if self._is_scale_call(v):
                    loss, scaled = v.args[0], True
        return ev("backward", loss, scaled)

    def _is_scale_call(self, node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "scale" and len(node.args) == 1
                and self.roles.is_scaler(dotted(node.func.value)))

    # -- helpers for the checks --
    def of(self, *kinds) -> list[_Event]:
        return [e for e in self.events if e.kind in kinds]

    def iteration_loop(self, e: _Event):
        """The innermost loop around ``e`` that runs backward passes (the training iteration);
        None when ``e`` is in none (a one-step function)."""
        work = self.of("backward") or self.of("scaler_step")
        for loop in reversed(e.loops):
            if any(loop in w.loops for w in work):
                return loop
        return None

    @property
    def uses_scaler(self) -> bool:
        return any(e.kind in ("unscale", "scaler_step", "update") or e.scaled for e in self.events)

    def divided(self, expr, seen=None) -> bool:
        """Does ``expr`` (or what its names were assigned) divide, e.g. ``loss / k``?"""
        seen = set() if seen is None else seen
        for n in ast.walk(expr):
            if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv)):
                return True
            if isinstance(n, ast.AugAssign) and isinstance(n.op, (ast.Div, ast.FloorDiv)):
                return True
            if isinstance(n, ast.Call) and _last(dotted(n.func)) in ("div", "div_", "true_divide"):
                return True
            name = dotted(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
            if name and name not in seen:
                seen.add(name)
                if any(self.divided(v, seen) for v in self.assigned.get(name, [])):
                    return True
        return False


class _Checker:
    def __init__(self, tree: ast.Module):
        self.tree, self.roles = tree, find_roles(tree)
        self.findings: dict[tuple[int, str], Finding] = {}

    def add(self, line: int, code: str, message: str) -> None:
        self.findings.setdefault((line, code), Finding(line, code, message, CHECKS[code]))

    def run(self) -> list[Finding]:
        self.check_deprecated()
        self.check_scaler_device()
        self.check_half()
        units = [_Unit(list(self.tree.body), self.roles)]  # the module's top level, then each function
        units += [_Unit(n.body, self.roles) for n in ast.walk(self.tree)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for unit in units:
            self.check_backward_in_autocast(unit)
            self.check_update_per_optimizer(unit)
            self.check_scheduler(unit)
            self.check_order(unit)
            self.check_accumulation(unit)
        return list(self.findings.values())

    # -- whole-source checks --
    def check_deprecated(self) -> None:
        def advice(what: str) -> str:
            device = "cuda" if ".cuda." in what + "." else "cpu"
            name = what.rsplit(".", 1)[-1]
            spellings = {
                "autocast": f"torch.amp.autocast('{device}', ...) (or torch.autocast)",
                "GradScaler": f"torch.amp.GradScaler('{device}', ...)",
                "custom_fwd": f"torch.amp.custom_fwd(device_type='{device}')",
                "custom_bwd": f"torch.amp.custom_bwd(device_type='{device}')",
            }
            return spellings.get(name, ", ".join(spellings.values()))

        for node in ast.walk(self.tree):
            spelled = None
            if isinstance(node, ast.Import):
                spelled = next((a.name for a in node.names if a.name.startswith(DEPRECATED)), None)
            elif isinstance(node, ast.ImportFrom) and node.module:
                full = [f"{node.module}.{a.name}" for a in node.names]
                spelled = next((f for f in full if f.startswith(DEPRECATED) or f in DEPRECATED), None)
            elif isinstance(node, ast.Attribute) and (dotted(node) or "").startswith(DEPRECATED):
                spelled = dotted(node)
            if spelled and not any(k[0] == node.lineno and k[1] == "deprecated-amp" for k in self.findings):
                self.add(node.lineno, "deprecated-amp",
                         f"{spelled} is deprecated: torch warns FutureWarning. Write {advice(spelled)}")

    def check_scaler_device(self) -> None:
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            what = self.roles.resolve(dotted(node.func)) or ""
            if not what.endswith("GradScaler") or what.startswith(DEPRECATED):
                continue
            if node.args or any(kw.arg in ("device", None) for kw in node.keywords):
                continue
            self.add(node.lineno, "scaler-no-device",
                     "GradScaler() without a device means 'cuda': on a machine without CUDA it "
                     "warns, disables itself and scale(loss) returns the loss unscaled. Pass the "
                     "device: torch.amp.GradScaler(device.type)")

    def check_half(self) -> None:
        if not (self.roles.built_scaler or self.roles.scalers):
            return
        assigned_to = {id(node.value): _targets(node) for node in ast.walk(self.tree)
                       if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None}
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            is_half = attr == "half" and not node.args and not node.keywords
            is_to = attr == "to" and any(_is_float16(a) for a in [*node.args, *[k.value for k in node.keywords]])
            if not (is_half or is_to):
                continue
            receiver = dotted(node.func.value)
            owners = [receiver] if receiver else []
            owners += assigned_to.get(id(node), [])
            if any(self.roles.is_model(o) for o in owners):
                call = f"{receiver or 'model'}.{attr}({'' if is_half else 'torch.float16'})"
                self.add(node.lineno, "half-with-scaler",
                         f"{call} with a GradScaler: the gradients are float16 and scaler.step / "
                         "unscale_ raise 'Attempting to unscale FP16 gradients.'. Keep the weights "
                         "in float32 and let autocast run the ops in float16")

    # -- per-unit checks --
    def check_backward_in_autocast(self, unit: _Unit) -> None:
        for e in unit.of("backward"):
            if e.autocast:
                self.add(e.line, "backward-in-autocast",
                         "backward() inside the autocast block: the gradients come out the same "
                         "(backward ops run in the dtype their forward ops ran in), but the "
                         "recipe runs it after the with-block; move it out (a convention, not a "
                         "numerical bug)")

    def check_update_per_optimizer(self, unit: _Unit) -> None:
        steps = unit.of("scaler_step", "unscale")
        for e in unit.of("update"):
            for loop in reversed(e.loops):
                if not isinstance(loop, (ast.For, ast.AsyncFor)):
                    continue
                bound = _names_in(loop.target)
                per_optimizer = [s for s in steps if loop in s.loops and s.arg is not None
                                 and _names_in(s.arg) & bound]
                if per_optimizer:
                    self.add(e.line, "update-per-optimizer",
                             "scaler.update() inside the loop over optimizers: the scale can change "
                             "between two optimizers' steps, so the next optimizer's gradients are "
                             "unscaled by the wrong factor, and growth_interval counts once per "
                             "optimizer. Call scaler.step(opt) for each, then scaler.update() once")
                    break

    def check_scheduler(self, unit: _Unit) -> None:
        steps = unit.of("scaler_step")
        if not steps:
            return
        step_loops = {id(unit.iteration_loop(s)) for s in steps}
        for e in unit.of("sched_step"):  # stepped once per training iteration, like the optimizer?
            if id(unit.iteration_loop(e)) not in step_loops or self._guarded(unit, e):
                continue
            name = dotted(e.node.func.value) or "scheduler"
            self.add(e.line, "scheduler-unguarded",
                     f"{name}.step() runs even when GradScaler skipped the optimizer step: if the "
                     "first step is skipped, PyTorch warns 'Detected call of `lr_scheduler.step()` "
                     "before `optimizer.step()`'; a later skip moves the schedule on silently. "
                     "Step it only when scaler.get_scale() did not drop")

    def _skip_test(self, unit: _Unit, test, depth=0) -> bool:
        """Does an if-test read whether the step was skipped (the scale, a 'skip' flag)?"""
        for word in _names_in(test):
            low = word.lower()
            if any(k in low for k in ("skip", "found_inf", "was_run", "get_scale")) or (
                    "scale" in low and "scaler" not in low):
                return True
            if depth < 2 and any(self._skip_test(unit, v, depth + 1) for v in unit.assigned.get(word, [])):
                return True
        return False

    def _guarded(self, unit: _Unit, e: _Event) -> bool:
        if any(self._skip_test(unit, i.test) for i in e.ifs):
            return True
        # an earlier `if <skipped>: return/continue` in an enclosing block also guards it
        stmt = e.stmt
        while stmt is not None and id(stmt) in unit.parents:
            block, index, parent = unit.parents[id(stmt)]
            for before in block[:index]:
                if (isinstance(before, ast.If) and self._skip_test(unit, before.test)
                        and any(isinstance(s, (ast.Return, ast.Continue)) for s in before.body)):
                    return True
            stmt = parent
        return False

    def check_order(self, unit: _Unit) -> None:
        """clip-before-unscale and unscale-twice, by following the statements in order."""
        if not unit.uses_scaler:
            return
        by_stmt: dict[int, list[_Event]] = {}
        for e in unit.events:
            by_stmt.setdefault(id(e.stmt), []).append(e)
        # On entry the gradients may be scaled: a function that clips before its unscale_
        # clips what some scaled backward left.
        start = _State(scaled=True, unscaled=frozenset())
        self._walk(unit.body, start, by_stmt)

    def _walk(self, block, state, by_stmt):
        for stmt in block:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            state = self._apply(by_stmt.get(id(stmt), []), state)
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                bound = _names_in(stmt.target) if not isinstance(stmt, ast.While) else set()
                first = self._walk(stmt.body, state.rebound(bound), by_stmt)
                second = self._walk(stmt.body, state.join(first).rebound(bound), by_stmt)
                state = state.join(second)
                state = self._walk(stmt.orelse, state, by_stmt)
            elif isinstance(stmt, ast.If):
                state = self._walk(stmt.body, state, by_stmt).join(self._walk(stmt.orelse, state, by_stmt))
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                state = self._walk(stmt.body, state, by_stmt)
            elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                for part in (stmt.body, *[h.body for h in stmt.handlers], stmt.orelse, stmt.finalbody):
                    state = self._walk(part, state, by_stmt)
            elif isinstance(stmt, ast.Match):
                states = [self._walk(c.body, state, by_stmt) for c in stmt.cases]
                for s in states:
                    state = state.join(s)
        return state

    def _apply(self, events, state):
        for e in events:
            if e.kind == "backward" and e.scaled:
                state = _State(True, state.unscaled)
            elif e.kind == "unscale":
                key = ast.unparse(e.arg) if e.arg is not None else "?"
                if key in state.unscaled:
                    self.add(e.line, "unscale-twice",
                             f"scaler.unscale_({key}) can run a second time before scaler.update(): "
                             "torch raises 'unscale_() has already been called on this optimizer "
                             "since the last update().' Call it once per optimizer step, after the "
                             "last backward")
                state = _State(False, state.unscaled | {key})
            elif e.kind == "clip" and state.scaled:
                name = dotted(e.node.func).rsplit(".", 1)[-1] if dotted(e.node.func) else "the clip"
                self.add(e.line, "clip-before-unscale",
                         f"{name} runs on gradients still multiplied by the loss scale (no "
                         "scaler.unscale_(opt) before it): the threshold acts as threshold/scale. "
                         "Call scaler.unscale_(opt) first, then clip")
            elif e.kind in ("scaler_step", "zero_grad"):
                state = _State(False, state.unscaled)
            elif e.kind == "update":
                state = _State(state.scaled, frozenset())
        return state

    def check_accumulation(self, unit: _Unit) -> None:
        steps = unit.of("scaler_step", "opt_step")
        zeros = unit.of("zero_grad")
        for b in unit.of("backward"):
            loop = b.loop
            if loop is None:
                continue
            loss_names = _names_in(b.arg) if b.arg is not None else set()
            if isinstance(loop, (ast.For, ast.AsyncFor)) and loss_names & _names_in(loop.target):
                continue  # a loop over several losses, not over micro-batches
            inside = [s for s in steps if loop in s.loops]
            outside = [s for s in steps if loop not in s.loops]
            every = [s for s in inside if not _ifs_within(s, loop)]
            conditional = [s for s in inside if s not in every]
            accumulates = (not inside and outside) or any(
                _has_modulo(i.test) for s in conditional for i in _ifs_within(s, loop))
            if accumulates and b.arg is not None and not unit.divided(b.arg):
                self.add(b.line, "accumulation-undivided",
                         "gradient accumulation without dividing the loss: the backward of every "
                         "micro-batch adds up, so the step sees k times the mean gradient (with SGD, "
                         "a k times larger learning rate). Divide each micro-batch's loss by the "
                         "number of micro-batches")
            micro = self._micro_batch_loop(unit, loop, b)
            zeroed_outside = zeros and not any(loop in z.loops for z in zeros)
            if every and (zeroed_outside or micro):
                first = min(every, key=lambda s: (s.line, s.node.col_offset))
                calls = sorted({ast.unparse(s.node.func) for s in every + [
                    u for u in unit.of("unscale", "update") if loop in u.loops and not _ifs_within(u, loop)]})
                self.add(first.line, "step-per-micro-batch",
                         f"{', '.join(calls)} run on every micro-batch, while the gradients are "
                         "zeroed only outside this loop: each step sees the gradients summed so far. "
                         "Accumulate the backward passes, then unscale_, clip, step and update once, "
                         "after the last micro-batch")

    def _micro_batch_loop(self, unit: _Unit, loop, b: _Event) -> bool:
        """Is the loss divided by this loop's length (``range(k)`` / ``len(batches)``)?"""
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or b.arg is None:
            return False
        it = loop.iter
        lengths = set()
        if isinstance(it, ast.Call) and dotted(it.func) == "range" and it.args:
            lengths.add(ast.unparse(it.args[-1] if len(it.args) == 1 else it.args[1]))
        lengths.add(f"len({ast.unparse(it)})")
        for name, values in unit.assigned.items():
            if any(not isinstance(v, ast.AugAssign) and ast.unparse(v) in lengths for v in values):
                lengths.add(name)
        divisors = set()
        exprs = [b.arg] + [v for n in _names_in(b.arg) for v in unit.assigned.get(n, [])]
        for expr in exprs:
            for n in ast.walk(expr):
                if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Div):
                    divisors.add(ast.unparse(n.right if isinstance(n, ast.BinOp) else n.value))
        return bool(divisors & lengths)


@dataclass(frozen=True)
class _State:
    scaled: bool              # the gradients may still be multiplied by the scale
    unscaled: frozenset       # optimizers unscale_'d since the last update()

    def join(self, other: _State) -> _State:
        return _State(self.scaled or other.scaled, self.unscaled | other.unscaled)

    def rebound(self, names: set) -> _State:
        """A loop variable names a new optimizer each time round: forget what it did before."""
        return _State(self.scaled, frozenset(k for k in self.unscaled if not (set(_words(k)) & names)))


def _words(text: str) -> list[str]:
    try:
        return list(_names_in(ast.parse(text, mode="eval")))
    except SyntaxError:
        return [text]


def _ifs_within(e: _Event, loop) -> list:
    """The ifs around ``e`` that are inside ``loop``."""
    return [i for i in e.ifs if any(i is n for n in ast.walk(loop))]


def _has_modulo(test) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def _is_float16(node) -> bool:
    return (dotted(node) or "") in ("torch.float16", "torch.half", "float16", "half")


def listing(source_or_function) -> str:
    """The source :func:`check_loop` reads, with line numbers: a string is numbered from 1
    (as its findings are), an object from its first line in its file."""
    source, first, _ = source_of(source_or_function)
    lines = source.rstrip("\n").splitlines()
    width = len(str(first + len(lines) - 1))
    return "\n".join(f"{first + i:>{width}}  {line}" for i, line in enumerate(lines))


# --- the command line ------------------------------------------------------------------------


def lint_file(path) -> Findings:
    """:func:`check_loop` on a file; the findings' lines are the file's."""
    path = Path(path)
    if not path.is_file():
        raise LintError(f"{path}: no such file; pass the path of a Python file (a training script)")
    return check_loop(path, name=str(path))


def main(args) -> int:
    """``python -m amp_lessons lint FILE.py ...``: 0 without findings, 1 with, 2 when a file
    cannot be read or parsed."""
    import sys

    status = 0
    for path in args.files:
        try:
            findings = lint_file(path)
        except LintError as err:
            print(f"error: {err}", file=sys.stderr)
            status = 2
            continue
        for f in findings:
            print(f"{path}:{f.line}: {f.kind}: [{f.code}] {f.message} (lesson {f.lesson})")
        if findings and status == 0:
            status = 1
        if not findings:
            print(f"{path}: no findings")
    return status


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("lint", help="read a training loop and name its mixed-precision "
                              "mistakes (lesson 06)")
    p.add_argument("files", nargs="+", metavar="FILE.py", help="Python files to check")
    p.set_defaults(run=main)
