"""The traversal behind ``amp_lessons.lint`` (lesson 06): what the names in a training loop's
source are (scalers, optimizers, schedulers, models), the calls that matter in the order they
run, and what may be true of the gradients when each runs. The rules (:mod:`.rules`) read
these facts; nothing here decides a finding.

Every pass is linear in the size of the source: the tree is walked a fixed number of times,
facts about a name are computed once, and a loop's body is followed at most
:data:`LOOP_PASSES` times for each distinct state it is entered with.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

CLIPS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}
WRAPPED_BACKWARD = ("accelerat", "fabric", "engine", "deepspeed", "trainer", "strategy", "precision")
AMP_FLAG_WORDS = ("scaler", "amp", "fp16", "half")  # an `if` on these may switch the scaler off
LOOP_PASSES = 3  # a loop body is followed until its entry state stops changing, at most this often

# --- names ----------------------------------------------------------------------------------


def dotted(node) -> str | None:
    """``a.b.c`` for a chain of names and attributes (``self.scaler``); None otherwise."""
    if type(node) is ast.Name:
        return node.id
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def last(name: str | None) -> str:
    """The last part of a dotted name, lower case (``self.grad_scaler`` gives ``grad_scaler``)."""
    return (name or "").rsplit(".", 1)[-1].lower()


def names_in(node) -> set[str]:
    """Every dotted name and attribute word read in ``node`` (``self.skipped`` gives both)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute)):
            d = dotted(n)
            if d:
                out.add(d)
            out.add(n.id if isinstance(n, ast.Name) else n.attr)
    return out


def key(node) -> str:
    """A short text naming an expression (an optimizer argument): ``self.optimizer``."""
    return dotted(node) or ast.unparse(node)


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def calls_in_order(node):
    """The calls in ``node`` in evaluation order (a call's receiver and arguments first), not
    entering nested functions, lambdas or classes. Iterative: any nesting Python parses."""
    if isinstance(node, SCOPES):
        return []
    out, stack = [], [(node, False)]
    while stack:
        n, done = stack.pop()
        if done:
            out.append(n)
            continue
        if isinstance(n, ast.Call):
            stack.append((n, True))
        children = [c for c in ast.iter_child_nodes(n) if not isinstance(c, SCOPES)]
        stack.extend((c, False) for c in reversed(children))
    return out


ROLE_CALLS = {"unscale_", "parameters", "named_parameters", "backward"}
EVENT_ATTRS = {"backward", "manual_backward", "unscale_", "zero_grad", "update", "step"} | CLIPS


class Index:
    """One pass over the tree: its nodes by type, and the calls that may be events by the
    statement they are in (in evaluation order: a call's receiver and arguments end before
    it does); a call inside a lambda belongs to no statement's flow. Each node's parent is
    worked out only when a rule first asks (:attr:`parents`)."""

    def __init__(self, tree: ast.AST):
        self.tree = tree
        self.by_type: dict[type, list] = {}
        self.calls_by_stmt: dict[int, list] = {}
        self._parents: dict[int, ast.AST] | None = None
        fields: dict[type, list] = {}
        stack = [(tree, None)]  # (node, the statement it is in; False inside a lambda)
        while stack:  # ast.walk, without the Load/Store and operator leaves: every node once
            node, stmt = stack.pop()
            kind = type(node)
            if kind not in fields:
                fields[kind] = [f for f in kind._fields if f not in ("ctx", "op")]
                self.by_type[kind] = []
            self.by_type[kind].append(node)
            if isinstance(node, ast.stmt):
                stmt = node
            elif kind is ast.Lambda:
                stmt = False
            elif kind is ast.Call and stmt:
                func = node.func
                name = func.attr if type(func) is ast.Attribute else func.id if type(func) is ast.Name else ""
                if name in EVENT_ATTRS:
                    self.calls_by_stmt.setdefault(id(stmt), []).append(node)
            for name in fields[kind]:
                value = getattr(node, name, None)
                for child in value if type(value) is list else (value,):
                    if isinstance(child, ast.AST):
                        stack.append((child, stmt))
        for calls in self.calls_by_stmt.values():
            calls.sort(key=lambda c: (c.end_lineno, c.end_col_offset))

    def of(self, *types) -> list:
        if len(types) == 1:
            return self.by_type.get(types[0], [])
        return [n for t in types for n in self.by_type.get(t, [])]

    @property
    def parents(self) -> dict[int, ast.AST]:
        """id(node) -> its parent, built on first use (deprecation fallbacks, casts)."""
        if self._parents is None:
            self._parents = {id(c): n for nodes in self.by_type.values() for n in nodes
                             for c in ast.iter_child_nodes(n)}
        return self._parents


# --- what the names are ----------------------------------------------------------------------


@dataclass
class Roles:
    """Which names in the source are scalers, schedulers, models and optimizers, and the
    import aliases. A scaler is what ``GradScaler(...)`` built, what ``unscale_`` or a
    ``.scale(loss).backward()`` is called on, or a name whose last part holds "scaler"
    (``runner.engine.scaler``); a scheduler is built by ``lr_scheduler.*``, named "*sched*",
    or a loop's name for the items of schedulers (``for s in schedulers``, ``zip(opts, schedulers)``);
    an optimizer is built by ``torch.optim.*`` or named "*opt*"; a model is built by ``nn.*``,
    has ``.parameters()`` called on it, or is named "*model*" / "*net"."""

    aliases: dict = field(default_factory=dict)  # local name -> dotted module path
    scalers: set = field(default_factory=set)
    schedulers: set = field(default_factory=set)
    metric_schedulers: set = field(default_factory=set)  # ReduceLROnPlateau: steps on a metric
    models: set = field(default_factory=set)
    optimizers: set = field(default_factory=set)
    scaler_builds: list = field(default_factory=list)  # GradScaler(...) calls

    def resolve(self, name: str | None) -> str | None:
        """``name`` with its first part replaced by what it was imported as."""
        if not name:
            return name
        head, _, rest = name.partition(".")
        full = self.aliases.get(head)
        return (full + ("." + rest if rest else "")) if full else name

    def is_scaler(self, name) -> bool:
        return bool(name) and (name in self.scalers or "scaler" in last(name))

    def is_scheduler(self, name) -> bool:
        return bool(name) and not self.is_scaler(name) and (
            name in self.schedulers or "sched" in last(name))

    def is_optimizer(self, text) -> bool:
        return bool(text) and not self.is_scaler(text) and not self.is_scheduler(text) and (
            text in self.optimizers or "opt" in last(text))

    def is_model(self, name) -> bool:
        end = last(name)
        return bool(name) and (name in self.models or "model" in end or end.endswith("net"))


def targets(node) -> list[str]:
    """The dotted names an assignment writes (``self.scaler = ...`` gives ``self.scaler``)."""
    found = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [d for t in found for d in [dotted(t)] if d]


def built_by(value) -> list[ast.Call]:
    """The calls an assigned value may be: the call itself, or each arm of ``a if c else b``."""
    if isinstance(value, ast.IfExp):
        return built_by(value.body) + built_by(value.orelse)
    return [value] if isinstance(value, ast.Call) else []


def find_roles(index: Index) -> Roles:
    roles = Roles()
    for node in index.of(ast.Import):
        for a in node.names:
            roles.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in index.of(ast.ImportFrom):
        for a in node.names if node.module else ():
            roles.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in index.of(ast.Assign, ast.AnnAssign):
        if node.value is not None:
            for call in built_by(node.value):
                _role_of_built(roles, roles.resolve(dotted(call.func)) or "", targets(node))
    for node in index.of(ast.Call):
        func = node.func
        word = func.attr if type(func) is ast.Attribute else func.id if type(func) is ast.Name else ""
        if word not in ROLE_CALLS and not word.endswith("GradScaler") and word not in roles.aliases:
            continue
        what = roles.resolve(dotted(node.func)) or ""
        if what.endswith("GradScaler"):
            roles.scaler_builds.append(node)
        if not isinstance(node.func, ast.Attribute):
            continue
        receiver = dotted(node.func.value)
        if node.func.attr == "unscale_" and receiver:
            roles.scalers.add(receiver)
        elif node.func.attr in ("parameters", "named_parameters") and receiver:
            roles.models.add(receiver)
        elif node.func.attr == "backward" and isinstance(node.func.value, ast.Call):
            inner = node.func.value.func
            if isinstance(inner, ast.Attribute) and inner.attr == "scale" and dotted(inner.value):
                roles.scalers.add(dotted(inner.value))
    for node in index.of(ast.For, ast.AsyncFor, ast.comprehension):
        for target, items in _loop_pairs(node.target, node.iter):
            if roles.is_scheduler(items):
                roles.schedulers.add(target)
    return roles


def _loop_pairs(target, iterated) -> list[tuple[str, str]]:
    """``(loop name, the container it takes items from)``: ``for s in scheds`` gives
    ``(s, scheds)``; ``zip(a, b)`` pairs each name with its container, ``enumerate(x)`` its
    second name with ``x``."""
    if isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Name):
        if iterated.func.id == "enumerate" and iterated.args and isinstance(target, ast.Tuple) \
                and len(target.elts) == 2:
            return _loop_pairs(target.elts[1], iterated.args[0])
        if iterated.func.id == "zip" and isinstance(target, ast.Tuple) and len(target.elts) == len(iterated.args):
            return [pair for t, a in zip(target.elts, iterated.args) for pair in _loop_pairs(t, a)]
        return []
    name, items = dotted(target), dotted(iterated)
    return [(name, items)] if name and items else []


def _role_of_built(roles: Roles, what: str, names: list[str]) -> None:
    end = what.rsplit(".", 1)[-1]
    if end.endswith("GradScaler"):
        roles.scalers.update(names)
    elif end == "ReduceLROnPlateau":
        roles.schedulers.update(names)
        roles.metric_schedulers.update(names)
    elif "lr_scheduler" in what or end.endswith(("LR", "Scheduler")) or "schedule" in end:
        roles.schedulers.update(names)
    elif what.startswith(("torch.nn.", "nn.")) and end[:1].isupper():
        roles.models.update(names)
    elif what.startswith(("torch.optim.", "optim.")) and end[:1].isupper():
        roles.optimizers.update(names)


# --- events: the calls that matter, where they are ------------------------------------------


@dataclass(eq=False)
class Event:
    """A call that matters, where it is: the loops and if-arms around it (within its unit,
    outermost first) and whether it runs inside an autocast block.

    ``kind``: backward, unscale, scaler_step, update, opt_step, sched_step, zero_grad, clip.
    """

    kind: str
    node: ast.Call
    frames: tuple          # ("loop", node) and ("if", node, arm) entries, outermost first
    autocast: bool
    arg: ast.AST | None = None   # the optimizer of unscale_/step, the loss of backward
    scaled: bool = False         # backward of a scaler.scale(...) result
    wrapped: bool = False        # accelerator.backward(loss) and the like: scaling is theirs
    stmt: ast.stmt | None = None  # the statement it is in (its test or iter, for a compound one)

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def loops(self) -> tuple:
        return tuple(f[1] for f in self.frames if f[0] == "loop")

    @property
    def loop(self):
        loops = self.loops
        return loops[-1] if loops else None

    def arms_within(self, loop) -> list[tuple]:
        """The ``(if node, arm)`` pairs around this event inside ``loop`` (all, for None)."""
        start = 0
        if loop is not None:
            start = next(i for i, f in enumerate(self.frames) if f[0] == "loop" and f[1] is loop) + 1
        return [(f[1], f[2]) for f in self.frames[start:] if f[0] == "if"]


def is_autocast(item: ast.withitem, roles: Roles) -> bool:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    if not (roles.resolve(dotted(call.func)) or "").endswith("autocast"):
        return False
    return not any(kw.arg == "enabled" and isinstance(kw.value, ast.Constant) and kw.value.value is False
                   for kw in call.keywords)


class Unit:
    """One function body (or the module's top level): its statements, the calls in them, what
    each name was assigned, and (after :meth:`follow`) the state at each call."""

    def __init__(self, body: list, roles: Roles, index: Index):
        self.body, self.roles, self.index = body, roles, index
        self.events: list[Event] = []
        self.by_kind: dict[str, list[Event]] = {}
        self.by_stmt: dict[int, list[Event]] = {}
        self.assigned: dict[str, list[ast.AST]] = {}  # name -> values assigned to it (AugAssign nodes too)
        self.parents: dict[int, tuple] = {}  # id(stmt) -> (its block, its index, parent statement)
        self.autocasts: list[ast.Call] = []  # the autocast calls its with-blocks enter
        self._memo: dict[tuple, bool] = {}
        self._collect(body, (), False, None)  # a name's scale(...) is read from what came before
        self._memo = {}
        self.flow: Flow | None = None

    @property
    def event_by_id(self) -> dict[int, Event]:
        if ("by-id",) not in self._memo:
            self._memo[("by-id",)] = {id(e): e for e in self.events}
        return self._memo[("by-id",)]

    def of(self, *kinds) -> list[Event]:
        """The events of these kinds, in the order they are written."""
        if len(kinds) == 1:
            return self.by_kind.get(kinds[0], [])
        return [e for e in self.events if e.kind in kinds]

    # -- collection --
    def _collect(self, block, frames, autocast, parent):
        for i, stmt in enumerate(block):
            self.parents[id(stmt)] = (block, i, parent)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                for t in targets(stmt):
                    self.assigned.setdefault(t, []).append(stmt.value)
            elif isinstance(stmt, ast.AugAssign) and dotted(stmt.target):
                self.assigned.setdefault(dotted(stmt.target), []).append(stmt)
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                self._calls(stmt.iter if not isinstance(stmt, ast.While) else stmt.test, stmt, frames, autocast)
                self._collect(stmt.body, frames + (("loop", stmt),), autocast, stmt)
                self._collect(stmt.orelse, frames, autocast, stmt)
            elif isinstance(stmt, ast.If):
                self._calls(stmt.test, stmt, frames, autocast)
                self._collect(stmt.body, frames + (("if", stmt, 0),), autocast, stmt)
                self._collect(stmt.orelse, frames + (("if", stmt, 1),), autocast, stmt)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                entered = [item.context_expr for item in stmt.items if is_autocast(item, self.roles)]
                self.autocasts += entered
                inside = autocast or bool(entered)
                for item in stmt.items:
                    self._calls(item.context_expr, stmt, frames, autocast)
                self._collect(stmt.body, frames, inside, stmt)
            elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                for part in (stmt.body, *[h.body for h in stmt.handlers], stmt.orelse, stmt.finalbody):
                    self._collect(part, frames, autocast, stmt)
            elif isinstance(stmt, ast.Match):
                self._calls(stmt.subject, stmt, frames, autocast)
                for case in stmt.cases:
                    self._collect(case.body, frames, autocast, stmt)
            else:
                self._calls(stmt, stmt, frames, autocast)

    def _calls(self, node, stmt, frames, autocast):
        for call in self.index.calls_by_stmt.get(id(stmt), ()):
            event = self._classify(call, frames, autocast)
            if event is not None:
                event.stmt = stmt
                self.events.append(event)
                self.by_kind.setdefault(event.kind, []).append(event)
                self.by_stmt.setdefault(id(stmt), []).append(event)

    def _classify(self, call: ast.Call, frames, autocast) -> Event | None:
        roles = self.roles
        what = roles.resolve(dotted(call.func)) or ""

        def ev(kind, arg=None, scaled=False, wrapped=False):
            return Event(kind, call, frames, autocast, arg, scaled, wrapped)

        if what.rsplit(".", 1)[-1] in CLIPS and "accelerat" not in what:
            return ev("clip")
        if what == "torch.autograd.backward" and call.args:
            return self._backward(call.args[0], ev)
        if not isinstance(call.func, ast.Attribute):
            return None
        attr, receiver = call.func.attr, dotted(call.func.value)
        if attr in ("backward", "manual_backward"):
            if call.args and (attr == "manual_backward" or any(w in last(receiver) for w in WRAPPED_BACKWARD)):
                return ev("backward", call.args[0], wrapped=True)  # accelerator.backward(loss): it scales
            return self._backward(call.func.value, ev)
        if attr == "unscale_" and roles.is_scaler(receiver):
            return ev("unscale", call.args[0] if call.args else None)
        if attr == "zero_grad":
            return ev("zero_grad")
        if attr == "update" and roles.is_scaler(receiver):
            return ev("update")
        if attr == "step":
            if roles.is_scaler(receiver) and call.args:
                return ev("scaler_step", call.args[0])
            if roles.is_scheduler(receiver):
                return ev("sched_step")
            if roles.is_optimizer(receiver or ast.unparse(call.func.value)):
                return ev("opt_step", call.func.value)
        return None

    def _backward(self, value, ev) -> Event:
        """``value.backward()``: is ``value`` a ``scaler.scale(loss)`` (directly or by name)?"""
        if self._is_scale_call(value):
            return ev("backward", value.args[0], True)
        name = dotted(value)
        if name and self.remembered(("scaled", name), lambda: any(
                self._is_scale_call(v) for v in self.assigned.get(name, []))):
            scale = next(v for v in self.assigned[name] if self._is_scale_call(v))
            return ev("backward", scale.args[0], True)
        return ev("backward", value)

    def _is_scale_call(self, node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "scale" and len(node.args) == 1
                and self.roles.is_scaler(dotted(node.func.value)))

    # -- facts computed once per name --
    def remembered(self, what: tuple, compute) -> bool:
        """A fact about a name, computed once (a cycle of assignments reads as False)."""
        if what not in self._memo:
            self._memo[what] = False
            self._memo[what] = bool(compute())
        return self._memo[what]

    def divided(self, expr) -> bool:
        """Does ``expr`` (or what its names were assigned) divide, e.g. ``loss / k``?"""
        for n in ast.walk(expr):
            if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, (ast.Div, ast.FloorDiv)):
                return True
            if isinstance(n, ast.Call) and last(dotted(n.func)) in ("div", "div_", "true_divide"):
                return True
            name = dotted(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
            if name and name in self.assigned and self.remembered(
                    ("divided", name), lambda name=name: any(self.divided(v) for v in self.assigned[name])):
                return True
        return False

    @property
    def uses_scaler(self) -> bool:
        return any(e.kind in ("unscale", "scaler_step", "update") or e.scaled for e in self.events)

    def follow(self) -> Flow:
        """The states the gradients may be in at each call (:class:`Flow`), computed once."""
        if self.flow is None:
            self.flow = Flow(self)
        return self.flow


def units_of(index: Index, roles: Roles) -> list[Unit]:
    """The module's top level, then every function, each as one :class:`Unit`."""
    units = [Unit(list(index.tree.body), roles, index)]
    units += [Unit(n.body, roles, index) for n in index.of(ast.FunctionDef, ast.AsyncFunctionDef)]
    return units


# --- the flow: what may be true of the gradients at each call ---------------------------------


@dataclass(frozen=True)
class State:
    """What may be true when a call runs, on some path to it. Each field is a "may": the
    join of two paths keeps what either has. The optimizer sets hold ``(optimizer, event)``
    pairs: which call put the optimizer there (a rule compares the two calls' if-arms)."""

    scaled: bool = False            # a scaled backward ran and nothing unscaled since
    entry: bool = True              # nothing has touched the gradients yet in this function
    pending: frozenset = frozenset()   # clips made while ``entry`` (the caller's gradients)
    unscaled: frozenset = frozenset()  # optimizers unscale_'d since the last update()
    since_update: frozenset = frozenset()  # optimizers scaler.step'd since the last update()
    stepped: frozenset = frozenset()   # optimizers scaler.step'd in this iteration

    def rebound(self, names: set) -> State:
        """A loop variable names a new optimizer each time round: forget what it did before."""
        def keep(pairs):
            return frozenset(p for p in pairs if not (words(p[0]) & names))
        return self.replace(unscaled=keep(self.unscaled), since_update=keep(self.since_update))

    def join(self, other: State | None) -> State:
        if other is None:
            return self
        return State(self.scaled or other.scaled, self.entry or other.entry,
                     self.pending | other.pending, self.unscaled | other.unscaled,
                     self.since_update | other.since_update, self.stepped | other.stepped)

    def replace(self, **changes) -> State:
        return State(**{**self.__dict__, **changes})


_WORDS: dict[str, set] = {}


def words(text: str) -> set:
    """The names read in an optimizer's key text (``opts[i]`` gives ``opts``, ``i``)."""
    if text not in _WORDS:
        try:
            _WORDS[text] = names_in(ast.parse(text, mode="eval"))
        except SyntaxError:
            _WORDS[text] = {text}
    return _WORDS[text]


def join(*states) -> State | None:
    out = None
    for s in states:
        if s is not None:
            out = s if out is None else out.join(s)
    return out


def unscaled_arm(test, roles: Roles) -> int | None:
    """Which arm of ``if test:`` runs without a scaler: 0 (the body) for ``if scaler is None`` /
    ``if not use_amp``, 1 (the else) for ``if scaler is not None`` / ``if use_amp``."""
    negated = False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, True
    arm = None
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None and _is_amp_flag(test.left, roles):
        arm = 0 if isinstance(test.ops[0], ast.Is) else 1 if isinstance(test.ops[0], ast.IsNot) else None
    elif _is_amp_flag(test, roles):
        arm = 1
    elif isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "is_enabled":
        arm = 1
    if arm is None:
        return None
    return 1 - arm if negated else arm


def _is_amp_flag(node, roles: Roles) -> bool:
    name = dotted(node)
    return bool(name) and (roles.is_scaler(name) or any(w in last(name) for w in AMP_FLAG_WORDS))


class Flow:
    """Follows a unit's statements in order, through both arms of every ``if``, around every
    loop until its entry state stops changing, into ``try`` handlers, out at ``return``,
    ``break`` and ``continue``. ``at[id(event)]`` is the join of the states the event ran in;
    ``exits`` the join of the states the function may end in. ``steps`` counts the
    statements followed (the work, for the linear-time test)."""

    def __init__(self, unit: Unit):
        self.unit = unit
        self.at: dict[int, State] = {}
        self.exits: State | None = None
        self.steps = 0
        self._memo: dict[tuple, tuple] = {}
        out, _, _ = self.block(unit.body, State())
        self.exits = join(self.exits, out)
        self.unit = None  # no cycle Unit <-> Flow: a file's objects go as soon as it is checked

    def block(self, block, state):
        """``(state after, state at continue, state at break)``; None where no path goes."""
        conts = brks = None
        for stmt in block:
            if state is None:
                break
            state, c, b = self.statement(stmt, state)
            conts, brks = join(conts, c), join(brks, b)
        return state, conts, brks

    def statement(self, stmt, state):
        self.steps += 1
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return state, None, None
        state = self.apply(self.unit.by_stmt.get(id(stmt), ()), state)
        if isinstance(stmt, ast.Return):
            self.exits = join(self.exits, state)
            return None, None, None
        if isinstance(stmt, ast.Raise):
            return None, None, None
        if isinstance(stmt, ast.Continue):
            return None, state, None
        if isinstance(stmt, ast.Break):
            return None, None, state
        compound = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.Match)
        if not isinstance(stmt, compound) and type(stmt).__name__ != "TryStar":
            return state, None, None
        memo = (id(stmt), state)
        if memo not in self._memo:
            self._memo[memo] = self.compound(stmt, state)
        return self._memo[memo]

    def compound(self, stmt, state):
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            head, brks, back = state, None, None
            bound = names_in(stmt.target) if not isinstance(stmt, ast.While) else set()
            for _ in range(LOOP_PASSES):
                out, conts, b = self.block(stmt.body, head.rebound(bound) if bound else head)
                brks = join(brks, b)
                back = join(out, conts)  # the next iteration starts: nothing stepped in it yet
                new_head = join(head, back.replace(stepped=frozenset()) if back is not None else None)
                if new_head == head:
                    break
                head = new_head
            # after the loop, what its last iteration stepped (`for opt in opts: scaler.step(opt)`)
            after, c2, b2 = self.block(stmt.orelse, join(head, back))
            return join(after, brks), c2, b2
        if isinstance(stmt, ast.If):
            arms = [state, state]
            no_scaler = unscaled_arm(stmt.test, self.unit.roles)
            if no_scaler is not None:  # that arm runs without a scaler: nothing is scaled there
                arms[no_scaler] = State(entry=False)
            body = self.block(stmt.body, arms[0])
            orelse = self.block(stmt.orelse, arms[1])
            return tuple(join(x, y) for x, y in zip(body, orelse))
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            return self.block(stmt.body, state)
        if isinstance(stmt, ast.Match):
            results = [self.block(c.body, state) for c in stmt.cases]
            return tuple(join(state if i == 0 else None, *[r[i] for r in results]) for i in range(3))
        body = self.block(stmt.body, state)  # try
        handled = [self.block(h.body, join(state, body[0])) for h in stmt.handlers]
        orelse = self.block(stmt.orelse, body[0]) if body[0] is not None else (None, None, None)
        parts = [body, orelse, *handled]
        before_finally = join(orelse[0], *[h[0] for h in handled])
        final = self.block(stmt.finalbody, before_finally) if stmt.finalbody else (before_finally, None, None)
        return (final[0], join(final[1], *[p[1] for p in parts]), join(final[2], *[p[2] for p in parts]))

    def apply(self, events, state):
        for e in events:
            self.at[id(e)] = state.join(self.at.get(id(e)))
            state = transfer(e, state)
        return state


def transfer(e: Event, s: State) -> State:
    """The state after event ``e`` runs in state ``s``."""
    if e.kind == "backward":
        if e.scaled:
            return s.replace(scaled=True, entry=False, pending=frozenset(), stepped=frozenset())
        if e.wrapped:
            return s.replace(scaled=False, entry=False, pending=frozenset(), stepped=frozenset())
        return s.replace(stepped=frozenset())
    if e.kind == "unscale":
        k = key(e.arg) if e.arg is not None else "?"
        return s.replace(scaled=False, entry=False, pending=frozenset(), unscaled=s.unscaled | {(k, id(e))})
    if e.kind == "clip" and s.entry:
        return s.replace(pending=s.pending | {id(e)})
    if e.kind == "scaler_step":
        k = (key(e.arg), id(e))
        return s.replace(scaled=False, entry=False, pending=frozenset(), since_update=s.since_update | {k},
                         stepped=s.stepped | {k})
    if e.kind == "zero_grad":
        return s.replace(scaled=False, entry=False, pending=frozenset(), stepped=frozenset())
    if e.kind == "update":
        return s.replace(unscaled=frozenset(), since_update=frozenset())
    return s


def same_run(a: Event, b: Event) -> bool:
    """Can ``a`` and ``b`` run in one pass: are they never in the two arms of one ``if``?"""
    arms = {id(f[1]): f[2] for f in a.frames if f[0] == "if"}
    return all(arms.get(id(f[1]), f[2]) == f[2] for f in b.frames if f[0] == "if")


def earlier(unit: Unit, pairs: frozenset, e: Event) -> list[Event]:
    """The calls in ``pairs`` (``(optimizer, event)``) on ``e``'s optimizer that can run in
    the same pass as ``e``."""
    k = key(e.arg) if e.arg is not None else "?"
    events = unit.event_by_id
    return [events[i] for name, i in pairs if name == k and same_run(events[i], e)]
