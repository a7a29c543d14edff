"""The rules of ``amp_lessons.lint`` (lesson 06), one small function each, in :data:`RULES`.

A rule reads the facts of :mod:`.walk` (the roles of the names, each unit's calls and the
state of the gradients at each call) and yields ``(line, message)`` pairs. Each :class:`Rule`
carries its name, the lesson that shows the mistake, a one-line summary, a broken ``example``
and its ``fix``; the tests check that every example gives exactly its finding and every fix
none. Where a finding cannot be decided from the source alone, the message says "may" and why.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from .walk import Index, Unit, dotted, earlier, find_roles, key, last, names_in, same_run, units_of

DEPRECATED = ("torch.cuda.amp", "torch.cpu.amp")
TORCH_SCALERS = {"torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.GradScaler", "GradScaler"}
CONFIG_OBJECTS = {"args", "cfg", "config", "conf", "opt", "opts", "hparams", "hp", "params", "flags", "options"}
SKIP_WORDS = ("skip", "found_inf", "was_run", "overflow", "nonfinite", "not_finite")
FINITE_CHECKS = {"isfinite", "isinf", "isnan", "get_scale", "_found_inf_per_device", "_check_inf_per_device"}


class Context:
    """What every rule reads: the tree, the roles of its names, its units, and the parent of
    each node (computed when a rule first asks)."""

    def __init__(self, tree: ast.Module):
        self.tree, self.index = tree, Index(tree)
        self.roles = find_roles(self.index)
        self.units = units_of(self.index, self.roles)
        self.modern: dict[int, bool] = {}  # a fallback's other arm spells torch.amp

    @cached_property
    def device_check(self) -> ast.Call | None:
        """The ``torch.cuda.is_available()`` (or ``mps``/``xpu``) that picks another device when
        it is False (``"cuda" if torch.cuda.is_available() else "cpu"``): code that also runs
        without CUDA. A check that only logs or asserts does not count."""
        for call in self.index.of(ast.Call):
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "is_available"
                    and last(dotted(call.func.value)) in ("cuda", "mps", "xpu")):
                continue
            child, parent = call, self.index.parents.get(id(call))
            while parent is not None and not (isinstance(parent, (ast.IfExp, ast.If)) and child is parent.test):
                child, parent = parent, self.index.parents.get(id(parent))
            other = [] if parent is None else parent.orelse if isinstance(parent.orelse, list) else [parent.orelse]
            if any(isinstance(c, ast.Constant) and c.value in ("cpu", "mps", "xpu")
                   for part in other for c in ast.walk(part)):
                return call
        return None

    @cached_property
    def step_hook_names(self) -> frozenset:
        """The names an optimizer's step post-hook writes (``register_step_post_hook(lambda o,
        *_: ran.add(o))``, or a function defined in this source): a test that reads one reads
        whether that optimizer's step ran."""
        defs = {f.name: f for f in self.index.of(ast.FunctionDef)}
        found = set()
        for call in self.index.of(ast.Call):
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "register_step_post_hook"):
                continue
            for hook in call.args[:1]:
                fn = defs.get(hook.id) if isinstance(hook, ast.Name) else hook
                if isinstance(fn, (ast.Lambda, ast.FunctionDef)):
                    found |= _written_by(fn)
        return frozenset(found)

    def events(self, *kinds):
        for unit in self.units:
            for e in unit.of(*kinds):
                yield unit, e


def _written_by(fn) -> set[str]:
    """The outer names a hook function changes: the receiver of a method it calls
    (``ran.add(o)``, ``self.ran.append(o)``), or what it assigns or subscripts (``flags[0] =
    True``, a ``nonlocal``), its own parameters left out."""
    own = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    found = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            found.add(dotted(n.func.value))
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                found.add(dotted(t.value if isinstance(t, ast.Subscript) else t))
    return {name for name in found if name and name.split(".")[0] not in own and name != "self"}


@dataclass(frozen=True)
class Rule:
    """One mistake the checker names: ``check(ctx)`` yields ``(line, message)``."""

    name: str
    lesson: str
    summary: str
    example: str
    fix: str
    check: Callable[[Context], Iterator[tuple[int, str]]]
    kind: str = "mistake"  # or "note": a convention the source alone cannot show to change a result


# --- whole-file rules ------------------------------------------------------------------------


def deprecated_amp(ctx: Context):
    """``torch.cuda.amp`` / ``torch.cpu.amp``: torch warns FutureWarning. A fallback beside
    the ``torch.amp`` spelling (``A if new_torch else B``, an ``else:``, an ``except``) is the
    right way to support old torch and is not reported."""
    seen = set()
    for node in ctx.index.of(ast.Import, ast.ImportFrom, ast.Attribute):
        spelled = None
        if isinstance(node, ast.Import):
            spelled = next((a.name for a in node.names if a.name.startswith(DEPRECATED)), None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            full = [f"{node.module}.{a.name}" for a in node.names]
            spelled = next((f for f in full if f.startswith(DEPRECATED)), None)
        elif isinstance(node, ast.Attribute) and (dotted(node) or "").startswith(DEPRECATED):
            spelled = dotted(node)
        if spelled and node.lineno not in seen and not _is_fallback(ctx, node):
            seen.add(node.lineno)
            yield node.lineno, f"{spelled} is deprecated: torch warns FutureWarning. Write {_advice(spelled)}"


def _advice(spelled: str) -> str:
    device = "cuda" if ".cuda." in spelled + "." else "cpu"
    spellings = {
        "autocast": f"torch.amp.autocast('{device}', ...) (or torch.autocast)",
        "GradScaler": "torch.amp.GradScaler(device.type, ...) with the device the code runs on "
                      f"('{device}' only where it always is)",
        "custom_fwd": f"torch.amp.custom_fwd(device_type='{device}')",
        "custom_bwd": f"torch.amp.custom_bwd(device_type='{device}')",
    }
    return spellings.get(spelled.rsplit(".", 1)[-1], ", ".join(spellings.values()))


def _modern(part) -> bool:
    """Does this code spell ``torch.amp`` / ``torch.autocast`` (the current API)?"""
    nodes = part if isinstance(part, list) else [part]
    for root in nodes:
        for n in ast.walk(root):
            text = dotted(n) if isinstance(n, ast.Attribute) else (
                n.module if isinstance(n, ast.ImportFrom) else None)
            if text and (text.startswith("torch.amp") or text in ("torch.autocast", "torch.GradScaler")):
                return True
    return False


def _is_fallback(ctx: Context, node) -> bool:
    child, parent = node, ctx.index.parents.get(id(node))
    while parent is not None:
        other = None
        if isinstance(parent, ast.IfExp) and child is not parent.test:
            other = parent.orelse if child is parent.body else parent.body
        elif isinstance(parent, ast.If) and child is not parent.test:
            other = parent.orelse if any(child is s for s in parent.body) else parent.body
        elif isinstance(parent, ast.Try) and isinstance(child, ast.ExceptHandler):
            other = parent.body
        if other is not None:
            ident = id(other) if not isinstance(other, list) else id(parent) * 2 + (other is parent.body)
            if ident not in ctx.modern:
                ctx.modern[ident] = _modern(other)
            if ctx.modern[ident]:
                return True
        child, parent = parent, ctx.index.parents.get(id(parent))
    return False


def _device_of(call: ast.Call):
    """A GradScaler call's device argument (positional or ``device=``), or None."""
    if call.args:
        return call.args[0]
    return next((kw.value for kw in call.keywords if kw.arg == "device"), None)


def _enabled_by_a_flag(call: ast.Call) -> bool:
    """``enabled=<an expression>``: the flag may already switch the scaler off off-GPU."""
    return any(kw.arg == "enabled" and not (isinstance(kw.value, ast.Constant) and kw.value.value is True)
               for kw in call.keywords)


def scaler_no_device(ctx: Context):
    """``torch.amp.GradScaler()`` without a device means "cuda". Scalers of other libraries
    (``torch_npu``, apex, FSDP's ``ShardedGradScaler``) are not read."""
    for call in ctx.roles.scaler_builds:
        what = ctx.roles.resolve(dotted(call.func)) or ""
        if what not in TORCH_SCALERS or _device_of(call) is not None:
            continue
        if any(kw.arg is None for kw in call.keywords) or (
                what == "GradScaler" and "GradScaler" in ctx.roles.aliases):
            continue  # **kwargs may hold the device; a GradScaler imported from elsewhere
        if any(kw.arg == "enabled" and isinstance(kw.value, ast.Constant) and kw.value.value is False
               for kw in call.keywords):
            continue
        yield call.lineno, ("GradScaler() without a device means 'cuda': on a machine with neither CUDA "
                            "nor torch_xla it warns, disables itself and scale(loss) returns the loss unscaled. Pass the "
                            "device: torch.amp.GradScaler(device.type)")


def scaler_cuda_only(ctx: Context):
    """A CUDA scaler (``torch.cuda.amp.GradScaler()``, ``GradScaler("cuda")``) in code that also
    runs without CUDA (it asks ``torch.cuda.is_available()``)."""
    check = ctx.device_check
    if check is None:
        return
    for call in ctx.roles.scaler_builds:
        what = ctx.roles.resolve(dotted(call.func)) or ""
        device = _device_of(call)
        cuda = what.startswith("torch.cuda.amp") or (
            what in TORCH_SCALERS and isinstance(device, ast.Constant) and device.value == "cuda")
        if not cuda or _enabled_by_a_flag(call) or any(kw.arg is None for kw in call.keywords):
            continue
        yield call.lineno, (f"{ast.unparse(call.func)}({'' if device is None else repr(device.value)}) is a CUDA "
                            f"scaler, while this file also runs without CUDA (it asks "
                            f"{ast.unparse(check.func)}() at line {check.lineno}): there it may warn "
                            "'GradScaler is enabled, but CUDA is not available. Disabling.' and train "
                            "unscaled. Pass the device the code runs on: torch.amp.GradScaler(device.type)")


def half_with_scaler(ctx: Context):
    """``model.half()`` (or ``.to(torch.float16)``) with a GradScaler: float16 weights give
    float16 gradients, which ``unscale_`` refuses. ``model.half().float()`` ends in float32."""
    if not (ctx.roles.scaler_builds or ctx.roles.scalers):
        return
    assigned_to = {id(node.value): [dotted(t) for t in node.targets if dotted(t)]
                   for node in ctx.index.of(ast.Assign)}
    for node in ctx.index.of(ast.Call):
        if not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func.attr
        is_half = attr == "half" and not node.args and not node.keywords
        is_to = attr == "to" and any(_is_float16(a) for a in [*node.args, *[k.value for k in node.keywords]])
        if not (is_half or is_to) or _cast_back(ctx, node):
            continue
        receiver = dotted(node.func.value)
        owners = ([receiver] if receiver else []) + assigned_to.get(id(node), [])
        if any(ctx.roles.is_model(o) for o in owners):
            call = f"{receiver or 'model'}.{attr}({'' if is_half else 'torch.float16'})"
            yield node.lineno, (f"{call} with a GradScaler: the gradients are float16 and scaler.unscale_ "
                                "raises 'Attempting to unscale FP16 gradients.' (so does scaler.step, except for "
                                "a fused=True Adam, AdamW or SGD, and Adagrad in torch 2.13). Keep the weights "
                                "in float32 and let autocast run the ops in float16")


def _cast_back(ctx: Context, call: ast.Call) -> bool:
    """Is ``call``'s result cast on to float32 in the same expression (``.half().float()``)?"""
    attr = ctx.index.parents.get(id(call))
    outer = ctx.index.parents.get(id(attr)) if isinstance(attr, ast.Attribute) else None
    if not (isinstance(outer, ast.Call) and outer.func is attr):
        return False
    args = [*outer.args, *[k.value for k in outer.keywords]]
    return attr.attr == "float" or (attr.attr == "to" and any(
        (dotted(a) or "") in ("torch.float32", "torch.float") for a in args))


def _is_float16(node) -> bool:
    return (dotted(node) or "") in ("torch.float16", "torch.half", "float16", "half")


TORCH_AUTOCASTS = {"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast",
                   "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"}


def fp16_without_scaler(ctx: Context):
    """torch's autocast in float16 and a plain ``loss.backward()`` in one function, with no
    scaler anywhere in the file. A scaler in another file (a wrapper, a framework) is not
    seen: the message says "may"."""
    roles = ctx.roles
    if roles.scaler_builds or roles.scalers:
        return
    backwards = [e for _, e in ctx.events("backward")]
    if not backwards or any(e.wrapped or e.scaled for e in backwards):
        return
    if any("scaler" in n.id.lower() for n in ctx.index.of(ast.Name)) or any(
            "scaler" in n.attr.lower() for n in ctx.index.of(ast.Attribute)):
        return
    for unit in ctx.units:
        autocasts = [c for c in unit.autocasts if _autocast_float16(c, roles)]
        if not autocasts or not unit.of("backward"):
            continue
        node, backward = autocasts[0], unit.of("backward")[0]
        yield node.lineno, ("autocast in float16 (its default on CUDA when no dtype is given) and a "
                            f"plain loss.backward() (line {backward.line}), with no GradScaler in this "
                            "file: gradients below float16's range (about 6e-8) flush to zero, so the "
                            "run may train on zeros without a word. Scale the loss: "
                            "torch.amp.GradScaler(device.type), unless a scaler in another file already does")


def _autocast_float16(call: ast.Call, roles) -> bool:
    """torch's autocast in float16: ``dtype=torch.float16``, or no dtype on a device that may be
    CUDA (autocast's default there is float16; on "cpu" it is bfloat16)."""
    what = roles.resolve(dotted(call.func)) or ""
    if what not in TORCH_AUTOCASTS and not (what == "autocast" and "autocast" not in roles.aliases):
        return False  # a wrapper (self.amp_autocast, accelerator.autocast): its dtype is elsewhere
    legacy = what.startswith(("torch.cuda.amp", "torch.cpu.amp"))  # autocast(enabled, dtype)
    dtype = next((kw.value for kw in call.keywords if kw.arg == "dtype"),
                 call.args[1] if len(call.args) > 1 and not legacy else None)
    enabled = next((kw.value for kw in call.keywords if kw.arg == "enabled"), None)
    if isinstance(enabled, ast.Constant) and enabled.value is False:
        return False
    if dtype is not None:
        return _is_float16(dtype)
    if legacy:
        return what.startswith("torch.cuda.amp")
    device = next((kw.value for kw in call.keywords if kw.arg == "device_type"), call.args[0] if call.args else None)
    return not (isinstance(device, ast.Constant) and device.value != "cuda")


def missing_update(ctx: Context):
    """``scaler.step`` with no ``scaler.update()``, or a path on which ``scaler.step`` can run
    again before ``update()``: torch raises 'step() has already been called since the last
    update().', and the scale never adapts."""
    steps = sorted(ctx.events("scaler_step"), key=lambda pair: pair[1].line)
    if not steps:
        return
    if not any(True for _ in ctx.events("update")):
        unit, first = steps[0]
        yield first.line, (f"{ast.unparse(first.node.func)}({key(first.arg)}) with no scaler.update() in this "
                           "file: the next scaler.step raises 'step() has already been called since the "
                           "last update().', and the scale never grows nor backs off. Call "
                           "scaler.update() once per iteration, after the steps")
        return
    for unit, e in steps:
        state = unit.follow().at.get(id(e))
        if state is not None and earlier(unit, state.since_update, e):
            yield e.line, (f"{ast.unparse(e.node.func)}({key(e.arg)}) can run again before scaler.update() "
                           "(a path through this loop skips the update): torch raises 'step() has already "
                           "been called since the last update().' Call scaler.update() on every path "
                           "that steps")


# --- rules on the order of the calls ---------------------------------------------------------


def clip_before_unscale(ctx: Context):
    """A clip on gradients still multiplied by the loss scale: after a scaled backward and
    before ``unscale_``, or in a function that clips and only then unscale_s or steps."""
    for unit in ctx.units:
        if not unit.uses_scaler:
            continue
        flow, by_id = unit.follow(), {id(e): e for e in unit.of("clip")}
        for e in unit.of("clip"):
            state = flow.at.get(id(e))
            if state is not None and state.scaled:
                yield e.line, _clip_message(e)
        for e in unit.of("unscale", "scaler_step"):
            state = flow.at.get(id(e))
            for pending in state.pending if state is not None else ():
                yield by_id[pending].line, _clip_message(by_id[pending])


def _clip_message(e) -> str:
    name = (dotted(e.node.func) or "the clip").rsplit(".", 1)[-1]
    return (f"{name} runs on gradients still multiplied by the loss scale (no scaler.unscale_(opt) "
            "before it): the threshold acts as threshold/scale. Call scaler.unscale_(opt) first, then clip")


def unscale_twice(ctx: Context):
    """``unscale_`` a second time for one optimizer before ``update()``."""
    for unit, e in ctx.events("unscale"):
        state = unit.follow().at.get(id(e))
        k = key(e.arg) if e.arg is not None else "?"
        if state is not None and earlier(unit, state.unscaled, e):
            yield e.line, (f"scaler.unscale_({k}) can run a second time before scaler.update(): torch "
                           "raises 'unscale_() has already been called on this optimizer since the last "
                           "update().' Call it once per optimizer step, after the last backward")


def step_after_scaler_step(ctx: Context):
    """``optimizer.step()`` after ``scaler.step(optimizer)`` in the same iteration."""
    for unit, e in ctx.events("opt_step"):
        state = unit.follow().at.get(id(e))
        k = key(e.arg)
        if state is not None and any(name == k for name, _ in state.stepped):
            yield e.line, (f"{k}.step() after scaler.step({k}) in the same iteration: the update is applied "
                           "twice, and when GradScaler skipped the step for an inf, this one applies the "
                           f"gradients it refused. scaler.step({k}) already steps: remove {k}.step()")


def scheduler_unguarded(ctx: Context):
    """``scheduler.step()`` in the iteration that ran ``scaler.step``, not guarded by a test that
    the step was not skipped. A scheduler stepped on a metric (``ReduceLROnPlateau``) or once
    per epoch is not reported."""
    for unit in ctx.units:
        steps = unit.of("scaler_step")
        if not steps:
            continue
        flow, loops = unit.follow(), _iteration_loops(unit)
        step_loops = {id(_iteration_loop(s, loops)) for s in steps}
        hooked = ctx.step_hook_names
        for e in unit.of("sched_step"):
            receiver = dotted(e.node.func.value)
            if e.node.args or e.node.keywords or receiver in ctx.roles.metric_schedulers:
                continue
            state = flow.at.get(id(e))
            if state is None or not state.stepped or id(_iteration_loop(e, loops)) not in step_loops:
                continue
            if _guarded(unit, e, hooked) or _asks_a_call(unit, e):
                continue
            yield e.line, (f"{receiver or 'scheduler'}.step() runs even when GradScaler skipped the optimizer "
                           "step, and the schedule moves on a step ahead of the training; PyTorch warns "
                           "('Detected call of `lr_scheduler.step()` before `optimizer.step()`') only when "
                           "the first step is skipped, and never for a fused=True Adam, AdamW or SGD (Adagrad "
                           "too in torch 2.13). Step it only after a step that ran: with one optimizer, when scaler.get_scale() "
                           "did not drop; with several on one scaler, when its own optimizer stepped "
                           "(optimizer.register_step_post_hook; a fused=True optimizer's skipped steps "
                           "may fire it too: with Adam, AdamW or Adagrad, compare state['step'] "
                           "instead)")


def scheduler_guard_unread(ctx: Context):
    """``scheduler.step()`` under an ``if`` whose test calls a function on an optimizer the
    iteration stepped (``if count(opt) > before:``): the call may read whether the step ran,
    and the checker cannot follow it, so it says "may"."""
    for unit in ctx.units:
        if not unit.of("scaler_step"):
            continue
        hooked = ctx.step_hook_names
        for e in unit.of("sched_step"):
            if e.node.args or e.node.keywords or dotted(e.node.func.value) in ctx.roles.metric_schedulers:
                continue
            if _asks_a_call(unit, e) and not _guarded(unit, e, hooked):
                receiver = dotted(e.node.func.value) or "scheduler"
                yield e.line, (f"{receiver}.step() may run after a step GradScaler skipped: its if-test "
                               "calls a function on the optimizer that this checker cannot read as a guard. "
                               "Make sure the call answers whether that optimizer's step ran (its step "
                               "count, say), not whether the scaler exists")


def _asks_a_call(unit: Unit, e) -> bool:
    """Is ``e`` inside an ``if`` whose test (or a name it reads, assigned in this function)
    calls a function with an optimizer that ``scaler.step`` took as an argument?"""
    stepped = {key(s.arg) for s in unit.of("scaler_step") if s.arg is not None}

    def asks(test, depth=0):
        for n in ast.walk(test):
            if isinstance(n, ast.Call) and any(key(a) in stepped for a in n.args):
                return True
            if depth < 3 and isinstance(n, ast.Name) and n.id in unit.assigned \
                    and any(asks(v, depth + 1) for v in unit.assigned[n.id]):
                return True
        return False
    return any(asks(node.test) for node, _ in e.arms_within(None))


def _iteration_loops(unit: Unit) -> set[int]:
    """The loops that run backward passes (or scaler steps, in a function without backward)."""
    work = unit.of("backward") or unit.of("scaler_step")
    return {id(loop) for w in work for loop in w.loops}


def _iteration_loop(e, loops: set[int]):
    return next((loop for loop in reversed(e.loops) if id(loop) in loops), None)


def _reads_skip(unit: Unit, test, hooked: frozenset = frozenset(), depth: int = 0) -> bool:
    """Does an if-test read whether GradScaler skipped the step: ``get_scale()``, a found-inf or
    skip flag computed in this function, a finiteness check, a name an optimizer's step
    post-hook writes (``hooked``), an optimizer state's ``["step"]`` count? A flag on a configuration object (``args.skip_sched``) or a
    test that the scaler exists (``use_grad_scaler``) does not."""
    if hooked & names_in(test):
        return True
    if "state" in names_in(test) and any(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
                                         and n.slice.value == "step" for n in ast.walk(test)):
        return True  # an optimizer's own step count (``opt.state[p]["step"]``), which a skip leaves as it was
    for n in ast.walk(test):
        if isinstance(n, ast.Call) and last(dotted(n.func) or getattr(n.func, "attr", "")) in FINITE_CHECKS:
            return True
        if not isinstance(n, (ast.Name, ast.Attribute)):
            continue
        name = dotted(n)
        if not name:
            continue
        parts = name.lower().split(".")
        if any(p in CONFIG_OBJECTS for p in parts[:-1]) or (len(parts) > 1 and parts[0] == "self"
                                                               and parts[1] in CONFIG_OBJECTS):
            continue
        if any(w in parts[-1] for w in SKIP_WORDS):
            return True
        if depth < 3 and name in unit.assigned and unit.remembered(
                ("skip", name), lambda name=name: any(_reads_skip(unit, v, hooked, depth + 1)
                                                   for v in unit.assigned[name])):
            return True
    return False


def _guarded(unit: Unit, e, hooked: frozenset = frozenset()) -> bool:
    if any(_reads_skip(unit, node.test, hooked) for node, _ in e.arms_within(None)):
        return True
    stmt = e.stmt  # an earlier `if <skipped>: return/continue` in an enclosing block
    while stmt is not None and id(stmt) in unit.parents:
        block, index, parent = unit.parents[id(stmt)]
        if _first_exit_guard(unit, block, hooked) < index:
            return True
        stmt = parent
    return False


def _first_exit_guard(unit: Unit, block, hooked: frozenset = frozenset()) -> int:
    def first():
        for i, s in enumerate(block):
            if isinstance(s, ast.If) and any(isinstance(b, (ast.Return, ast.Continue)) for b in s.body) \
                    and _reads_skip(unit, s.test, hooked):
                return i
        return len(block)
    memo = ("exit-guard", id(block))
    if memo not in unit._memo:
        unit._memo[memo] = first()
    return unit._memo[memo]


def update_per_optimizer(ctx: Context):
    """``scaler.update()`` inside the loop over the optimizers it steps, or between two
    optimizers' ``scaler.step`` calls after one backward (``step(a); update(); step(b)``).
    A scaler per optimizer is no mistake: two steps on differently named scalers, or an
    update on a scaler the loop itself takes (``for opt, scaler in zip(opts, scalers)``)."""
    for unit in ctx.units:
        flow = unit.follow()
        for e in unit.of("scaler_step"):
            state = flow.at.get(id(e))
            if state is None or e.arg is None:
                continue
            k, events = key(e.arg), unit.event_by_id
            before = sorted({name for name, i in state.stepped - state.since_update
                             if name != k and same_run(events[i], e)
                             and _receiver(events[i]) == _receiver(e)})
            if before:
                yield e.line, (f"scaler.step({k}) after scaler.update(), in the iteration that stepped "
                               f"{before[0]}: the update can change the scale between the two steps, so "
                               f"{k}'s gradients, made at the old scale, are unscaled by the new one. Call "
                               "scaler.step(opt) for each optimizer, then scaler.update() once")
        stepped_in: dict[int, set] = {}  # loop -> names read by the optimizers stepped in it
        for s in unit.of("scaler_step", "unscale"):
            if s.arg is not None:
                for loop in s.loops:
                    stepped_in.setdefault(id(loop), set()).update(names_in(s.arg))
        for e in unit.of("update"):
            for loop in reversed(e.loops):
                if not isinstance(loop, (ast.For, ast.AsyncFor)):
                    continue
                if names_in(e.node.func.value) & names_in(loop.target):
                    break  # a scaler per optimizer, taken by the loop: each updates its own
                if stepped_in.get(id(loop), set()) & names_in(loop.target):
                    yield e.line, ("scaler.update() inside the loop over optimizers: the scale can change "
                                   "between two optimizers' steps, so the next optimizer's gradients are "
                                   "unscaled by the wrong factor, and growth_interval counts once per "
                                   "optimizer. Call scaler.step(opt) for each, then scaler.update() once")
                    break


def _receiver(e) -> str:
    """The scaler a ``scaler.step``/``update`` call is made on: ``scaler1``, ``self.scaler``."""
    return key(e.node.func.value)


def backward_in_autocast(ctx: Context):
    """``backward()`` inside the autocast block: autocast acts on the backward's ops too. On
    the CPU the gradients are the same unless the forward has a region autocast did not cast, which the
    source of the loop alone does not show: a note, not a mistake."""
    for _, e in ctx.events("backward"):
        if e.autocast:
            yield e.line, ("backward() inside the autocast block: autocast acts on the backward's ops "
                           "too. On the CPU the gradients came out the same for ops autocast cast in the "
                           "forward (lesson 04 measured it; not measured on a GPU); a region the forward ran under "
                           "autocast(enabled=False), or a custom autograd Function without "
                           "custom_fwd/custom_bwd, may get 16-bit matmuls in its backward. The recipe "
                           "runs backward after the with-block: move it out")


# --- gradient accumulation -------------------------------------------------------------------


class _Steps:
    """Counts of the optimizer steps in a unit, per loop and per if-arm, so that the steps a
    backward can share an iteration with are counted without comparing every pair: a step in
    the other arm of an ``if`` the backward is in never runs with it."""

    def __init__(self, unit: Unit):
        self.unit = unit
        self.steps = unit.of("scaler_step", "opt_step")
        self.total = len(self.steps)
        self.in_arm: dict[tuple, int] = {}       # (if, arm) -> steps under it
        self.in_loop: dict[int, int] = {}        # loop -> steps in it
        self.every: dict[int, list] = {}         # loop -> steps in it under no if of it
        self.modulo: dict[int, int] = {}         # loop -> steps under an `if i % k` in it
        self.loop_arm: dict[tuple, int] = {}     # (loop, if, arm) -> steps of that loop under it
        self.loop_arm_modulo: dict[tuple, int] = {}
        for s in self.steps:
            for node, arm in s.arms_within(None):
                self.in_arm[(id(node), arm)] = self.in_arm.get((id(node), arm), 0) + 1
            for loop in s.loops:
                arms = s.arms_within(loop)
                mod = any(_has_modulo(node.test) for node, _ in arms)
                self.in_loop[id(loop)] = self.in_loop.get(id(loop), 0) + 1
                if not arms:
                    self.every.setdefault(id(loop), []).append(s)
                if mod:
                    self.modulo[id(loop)] = self.modulo.get(id(loop), 0) + 1
                for node, arm in arms:
                    k = (id(loop), id(node), arm)
                    self.loop_arm[k] = self.loop_arm.get(k, 0) + 1
                    if mod:
                        self.loop_arm_modulo[k] = self.loop_arm_modulo.get(k, 0) + 1

    def with_(self, b, loop) -> tuple[int, int, int]:
        """``(steps in loop, steps outside it, modulo-guarded steps in it)`` that can run in
        the same pass as backward ``b``."""
        everywhere = self.total - sum(self.in_arm.get((id(n), 1 - a), 0) for n, a in b.arms_within(None))
        arms = b.arms_within(loop)
        inside = self.in_loop.get(id(loop), 0) - sum(self.loop_arm.get((id(loop), id(n), 1 - a), 0) for n, a in arms)
        modulo = self.modulo.get(id(loop), 0) - sum(
            self.loop_arm_modulo.get((id(loop), id(n), 1 - a), 0) for n, a in arms)
        return inside, everywhere - inside, modulo


def _has_modulo(test) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def _accumulating(unit: Unit):
    """``(backward, its loop, steps in the loop, steps outside, modulo-guarded)`` for each
    plain or scaled backward in a loop that is not a loop over several losses."""
    counts = _Steps(unit)
    for b in unit.of("backward"):
        loop = b.loop
        if loop is None or b.wrapped or b.arg is None:
            continue  # accelerator.backward: the wrapper divides inside accumulate()
        if isinstance(loop, (ast.For, ast.AsyncFor)) and dotted(b.arg) in names_in(loop.target):
            continue  # a loop over several losses (`for loss in losses`), not over micro-batches
        yield (b, loop, *counts.with_(b, loop)), counts


def accumulation_undivided(ctx: Context):
    """Gradient accumulation (the step outside the backward's loop, or under ``if i % k``)
    without dividing the loss."""
    for unit in ctx.units:
        for (b, _loop, inside, outside, modulo), _ in _accumulating(unit):
            if ((not inside and outside) or modulo) and not unit.divided(b.arg):
                yield b.line, ("gradient accumulation without dividing the loss: the backward of every "
                               "micro-batch adds up, so the step sees k times the mean gradient (with SGD, "
                               "a k times larger learning rate). Divide each micro-batch's loss by the "
                               "number of micro-batches")


def step_per_micro_batch(ctx: Context):
    """``step``/``update`` on every pass of a micro-batch loop: its gradients are zeroed only
    outside it, or its loss is divided by its length."""
    for unit in ctx.units:
        zeros = unit.of("zero_grad")
        for (b, loop, *_), counts in _accumulating(unit):
            every = counts.every.get(id(loop), [])
            zeroed_outside = zeros and not any(loop in z.loops for z in zeros)
            if not every or not (zeroed_outside or _divided_by_length(unit, loop, b)):
                continue
            others = [u for u in unit.of("unscale", "update") if loop in u.loops and not u.arms_within(loop)]
            calls = sorted({ast.unparse(s.node.func) for s in every[:8] + others[:8]})
            yield every[0].line, (f"{', '.join(calls)} run on every micro-batch, while the gradients are "
                                  "zeroed only outside this loop: each step sees the gradients summed so "
                                  "far. Accumulate the backward passes, then unscale_, clip, step and "
                                  "update once, after the last micro-batch")


def _divided_by_length(unit: Unit, loop, b) -> bool:
    """Is the loss divided by this loop's length (``range(k)`` / ``len(batches)``)?"""
    if not isinstance(loop, (ast.For, ast.AsyncFor)):
        return False
    lengths = _lengths(unit, loop)
    divisors = _divisors(b.arg)
    for n in names_in(b.arg):
        if n in unit.assigned:
            memo = ("divisors", n)
            if memo not in unit._memo:
                unit._memo[memo] = set().union(*[_divisors(v) for v in unit.assigned[n]])
            divisors = divisors | unit._memo[memo]
    return bool(divisors & lengths)


def _divisors(expr) -> set[str]:
    return {ast.unparse(n.right if isinstance(n, ast.BinOp) else n.value) for n in ast.walk(expr)
            if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Div)}


def _lengths(unit: Unit, loop) -> set[str]:
    memo = ("lengths", id(loop))
    if memo in unit._memo:
        return unit._memo[memo]
    it, lengths = loop.iter, set()
    if isinstance(it, ast.Call) and dotted(it.func) == "range" and it.args:
        lengths.add(ast.unparse(it.args[-1] if len(it.args) == 1 else it.args[1]))
    lengths.add(f"len({ast.unparse(it)})")
    if ("value-texts",) not in unit._memo:
        texts: dict[str, set] = {}
        for name, values in unit.assigned.items():
            for v in values:
                if not isinstance(v, ast.AugAssign) and isinstance(v, (ast.Name, ast.Attribute, ast.Call, ast.Constant)):
                    texts.setdefault(ast.unparse(v), set()).add(name)
        unit._memo[("value-texts",)] = texts
    texts = unit._memo[("value-texts",)]
    lengths |= {name for text in list(lengths) for name in texts.get(text, ())}
    unit._memo[memo] = lengths
    return lengths


# --- the table -------------------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    Rule("deprecated-amp", "06_error_messages", "torch.cuda.amp / torch.cpu.amp (FutureWarning)",
         "with torch.cuda.amp.autocast():\n    loss = model(x)\n",
         "with torch.autocast('cuda'):\n    loss = model(x)\n", deprecated_amp),
    Rule("scaler-no-device", "03_grad_scaler", "GradScaler() without a device: means 'cuda'; off without CUDA or torch_xla",
         "scaler = torch.amp.GradScaler()\n", "scaler = torch.amp.GradScaler(device.type)\n", scaler_no_device),
    Rule("scaler-cuda-only", "03_grad_scaler", "a CUDA scaler in code that also runs without CUDA",
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\nscaler = torch.amp.GradScaler('cuda')\n",
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\nscaler = torch.amp.GradScaler(device)\n",
         scaler_cuda_only),
    Rule("clip-before-unscale", "04_clipping", "a clip on gradients still multiplied by the scale",
         "scaler.scale(loss).backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
         "scaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()\n",
         "scaler.scale(loss).backward()\nscaler.unscale_(opt)\n"
         "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nscaler.step(opt)\nscaler.update()\n",
         clip_before_unscale),
    Rule("unscale-twice", "04_clipping", "unscale_ twice for one optimizer before update()",
         "for x in batches:\n    scaler.scale(model(x).sum() / 4).backward()\n    scaler.unscale_(opt)\n"
         "scaler.step(opt)\nscaler.update()\n",
         "for x in batches:\n    scaler.scale(model(x).sum() / 4).backward()\nscaler.unscale_(opt)\n"
         "scaler.step(opt)\nscaler.update()\n", unscale_twice),
    Rule("missing-update", "03_grad_scaler", "scaler.step without scaler.update(), or a path that skips it",
         "for x in batches:\n    scaler.scale(model(x).sum()).backward()\n    scaler.step(opt)\n"
         "    opt.zero_grad()\n",
         "for x in batches:\n    scaler.scale(model(x).sum()).backward()\n    scaler.step(opt)\n"
         "    scaler.update()\n    opt.zero_grad()\n", missing_update),
    Rule("step-after-scaler-step", "03_grad_scaler", "optimizer.step() again after scaler.step(optimizer)",
         "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\nopt.step()\n",
         "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\n", step_after_scaler_step),
    Rule("scheduler-unguarded", "03_grad_scaler", "scheduler.step() also after a skipped step",
         "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\nscheduler.step()\n",
         "scaler.scale(loss).backward()\nscale = scaler.get_scale()\nscaler.step(opt)\nscaler.update()\n"
         "if scaler.get_scale() >= scale:\n    scheduler.step()\n", scheduler_unguarded),
    Rule("scheduler-guard-unread", "03_grad_scaler", "scheduler.step() under a test the checker cannot read (\"may\")",
         "scaler.scale(loss).backward()\nbefore = count(opt)\nscaler.step(opt)\nscaler.update()\n"
         "if count(opt) > before:\n    scheduler.step()\n",
         "scaler.scale(loss).backward()\nbefore = opt.state[p][\"step\"]\nscaler.step(opt)\nscaler.update()\n"
         "if opt.state[p][\"step\"] > before:\n    scheduler.step()\n", scheduler_guard_unread, "note"),
    Rule("half-with-scaler", "05_putting_it_together", "model.half() with a GradScaler",
         "model = Net().half()\nscaler = torch.amp.GradScaler('cuda')\n",
         "model = Net()\nscaler = torch.amp.GradScaler('cuda')\n", half_with_scaler),
    Rule("fp16-without-scaler", "03_grad_scaler", "float16 autocast and backward with no GradScaler",
         "with torch.autocast('cuda', dtype=torch.float16):\n    loss = model(x)\nloss.backward()\nopt.step()\n",
         "scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda', dtype=torch.float16):\n"
         "    loss = model(x)\nscaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\n",
         fp16_without_scaler),
    Rule("backward-in-autocast", "02_autocast", "backward() inside the autocast block (a note)",
         "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\n    loss.backward()\n",
         "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\nloss.backward()\n",
         backward_in_autocast, "note"),
    Rule("update-per-optimizer", "06_error_messages", "scaler.update() between the optimizers' scaler.step calls",
         "scaler.scale(loss).backward()\nfor opt in optimizers:\n    scaler.step(opt)\n    scaler.update()\n",
         "scaler.scale(loss).backward()\nfor opt in optimizers:\n    scaler.step(opt)\nscaler.update()\n",
         update_per_optimizer),
    Rule("accumulation-undivided", "04_clipping", "gradient accumulation without dividing the loss",
         "for x in batches:\n    scaler.scale(model(x).sum()).backward()\nscaler.step(opt)\nscaler.update()\n",
         "for x in batches:\n    scaler.scale(model(x).sum() / len(batches)).backward()\nscaler.step(opt)\n"
         "scaler.update()\n", accumulation_undivided),
    Rule("step-per-micro-batch", "04_clipping", "step/update on every micro-batch of an accumulation loop",
         "for x in batches:\n    scaler.scale(model(x).sum() / len(batches)).backward()\n    scaler.step(opt)\n"
         "    scaler.update()\nopt.zero_grad()\n",
         "for x in batches:\n    scaler.scale(model(x).sum() / len(batches)).backward()\nscaler.step(opt)\n"
         "scaler.update()\nopt.zero_grad()\n", step_per_micro_batch),
)

BY_NAME = {rule.name: rule for rule in RULES}
