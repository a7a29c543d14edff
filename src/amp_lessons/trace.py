"""Which aten op ran in which dtype under autocast: a tracer the learner runs on their device.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sits *below* autocast in
PyTorch's dispatcher, so it sees every aten op as it really executes, including the
``_to_copy`` casts that autocast inserts (a ``TorchFunctionMode`` sees only the Python
calls, not the casts; the tracer runs one too, to tell a cast you wrote, ``h.float()``,
from one autocast inserted). Forward pre/post hooks keep a stack of module names, so each
op is attributed to the module whose ``forward`` ran it. Used in 02_autocast.

    tr = trace_model(model, x, y, dtype=torch.bfloat16)   # forward + loss under autocast
    print(tr.table())      # one row per op: module, op, input dtypes, output dtype, cast
    print(tr.summary())    # per module: 16-bit ops, ops autocast put in float32, ops already float32
    tr                     # in a notebook: the table as HTML, float32 rows highlighted

**Simulated devices.** ``simulate=True`` replays another device type's autocast on this
machine: the tensors become ``FakeTensor``\\ s (shapes and dtypes, no data) on ``device``,
built from meta tensors, and that device type's autocast is switched on directly
(``torch.set_autocast_enabled``/``set_autocast_dtype``), so PyTorch's own C++ autocast
lists for that device decide every cast, exactly as on the real device, and the same
dispatch-mode tracer records them. A CPU-only build can so show what CUDA (or MPS)
autocast does; every simulated trace says "(simulated)". Limits: forward + loss only (no
backward: autograd needs the real device), no values, and weights are not ``requires_grad``
there, so autocast's cast cache (a weight used twice in one forward is cast once on the
real device) is not replayed. :func:`amp_lessons.devicechecks.compare_simulated` checks the
simulation against the real device wherever one is present (``make gpu-check``).
"""

from __future__ import annotations

import contextlib
import difflib
import html
import re
import textwrap
import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .hardware import DeviceUnavailableError, check_autocast, hardware_report, pick_device
from .models import TransformerBlock, card_model
from .precision import dtype_of

LOW = (torch.bfloat16, torch.float16)
BACKWARD = (None, "outside", "inside")
SIMULATED = ("cuda", "mps", "cpu")  # device types whose autocast this build can replay

_SHORT = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    torch.int64: "int64", torch.int32: "int32", torch.bool: "bool",
}
# Ops that only reshape, alias or copy memory: hidden from the table unless asked for.
_LAYOUT = {"clone", "_unsafe_view", "contiguous", "copy_", "alias"}
# Python-level calls that cast on purpose: their _to_copy is the code's own cast, not autocast's.
_CAST_CALLS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "_to_copy"}

# The marks of the table's last column (both end in "fp32": tests and readers split on it).
BY_AUTOCAST = "<- autocast fp32"
ALREADY = "<- already fp32"


def short(dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``: the course's names, for narrow tables."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class OpRecord:
    """One aten op as it executed: where, what went in, what came out, and why."""

    op: str                          # the aten name, e.g. "addmm", "_to_copy", "_softmax"
    module: str                      # the innermost module running it, or "(loss)", "(backward)"
    inputs: tuple[torch.dtype, ...]  # dtypes of every tensor argument, in order
    outputs: tuple[torch.dtype, ...]  # dtypes of every tensor result
    shape: tuple[int, ...]           # shape of the first result
    kind: str                        # "cast", "layout" (view, clone) or "compute"
    by_autocast: bool = False        # a cast autocast inserted, or an op whose dtype autocast chose
    cast_by: str = ""                # a cast's origin: "autocast", "explicit" or "autograd"

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the op produced (its first result)."""
        return self.outputs[0] if self.outputs else None

    @property
    def low(self) -> bool:
        """Produced a 16-bit (bfloat16 or float16) result."""
        return self.dtype in LOW

    @property
    def fp32(self) -> bool:
        """A computing op that produced float32, for either reason below."""
        return self.kind == "compute" and self.dtype == torch.float32

    @property
    def to_fp32(self) -> bool:
        """A float32 computing op that autocast made float32: it got a float32 copy autocast
        cast from 16-bit, or only 16-bit inputs and autocast asked for a float32 result
        (CUDA's softmax and sum take ``dtype=float32`` instead of a separate cast)."""
        return self.fp32 and self.by_autocast

    @property
    def already_fp32(self) -> bool:
        """A float32 computing op autocast did not touch: its inputs were float32 already
        (the model's float32 input, a residual sum promoted to float32), or the code asked."""
        return self.fp32 and not self.by_autocast

    @property
    def autocast_cast(self) -> bool:
        """A ``_to_copy`` cast that autocast inserted (not one the code wrote, like ``.float()``)."""
        return self.kind == "cast" and self.by_autocast

    @property
    def rule(self) -> int | None:
        """Which of lesson 02's three rules gave a computing op its dtype: 1, autocast cast its
        float32 inputs to 16-bit (the lower-precision list); 2, autocast made it float32 (the
        float32 list); 3, autocast changed nothing (the op is on no list, or its inputs had its
        list's dtype already), the op ran in the dtype its inputs had.
        ``None`` for casts and views."""
        if self.kind != "compute":
            return None
        if not self.by_autocast:
            return 3
        return 2 if self.dtype == torch.float32 else 1

    @property
    def mark(self) -> str:
        """The table's last column: :data:`BY_AUTOCAST`, :data:`ALREADY` or nothing."""
        return BY_AUTOCAST if self.to_fp32 else ALREADY if self.already_fp32 else ""


def _kind(func, inputs, outputs) -> str:
    name = func.overloadpacket.__name__
    if name == "_to_copy" and inputs and outputs and inputs[0] != outputs[0]:
        return "cast"
    if func.is_view or name in _LAYOUT:
        return "layout"
    return "compute"


@dataclass(frozen=True)
class ModuleRow:
    """One module's share of a trace: its casts, its 16-bit ops and its float32 ops by reason."""

    name: str
    type: str
    casts: int
    low: tuple[str, ...]
    to_fp32: tuple[str, ...]       # autocast made them float32
    already_fp32: tuple[str, ...]  # float32 without autocast's doing

    @property
    def fp32(self) -> tuple[str, ...]:
        """Every float32 computing op, for either reason."""
        return self.to_fp32 + self.already_fp32


WIDTH = 100  # the widest line of a text table: wider ones wrap in Jupyter and Colab


def _wrap(text: str, limit: int) -> list[str]:
    glued = re.sub(r" (x\d)", "\0\\1", text)  # "mm x3" stays on one line
    lines = textwrap.wrap(glued, limit, break_long_words=False, break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines] or [""]


def _grid(head: list[str], rows: list[list[str]], width: int | None = WIDTH) -> str:
    """Left-aligned columns two spaces apart, at most ``width`` characters a line where the
    words allow (``None``: no limit): the first column stays whole, the others wrap at
    spaces onto more lines."""
    natural = [max(len(x) for x in col) for col in zip(head, *rows)]
    if width is None:
        width = sum(natural) + 2 * (len(natural) - 1)
    room = width - natural[0] - 2 * (len(natural) - 1)
    limits, rest = {}, sorted(range(1, len(natural)), key=natural.__getitem__)
    for n, j in enumerate(rest):  # the narrow columns keep their width, the wide share the room
        share = room // (len(rest) - n)
        limits[j] = min(natural[j], max(share, 1))
        room -= limits[j]
    cells = [[[c] if j == 0 else _wrap(c, limits[j]) for j, c in enumerate(row)]
             for row in [head, *rows]]
    widths = [max(len(line) for row in cells for line in row[j]) for j in range(len(natural))]
    lines = []
    for row in cells:
        for k in range(max(len(c) for c in row)):
            lines.append("  ".join((c[k] if k < len(c) else "").ljust(w)
                                   for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _counted(names) -> str:
    if not names:
        return "-"
    return " ".join(n if c == 1 else f"{n} x{c}" for n, c in Counter(names).items())


@dataclass
class Trace:
    """The ops one call ran, in order, with the device and autocast dtype it ran under."""

    device: str
    dtype: torch.dtype | None        # the autocast dtype; None when autocast was disabled
    records: list[OpRecord] = field(default_factory=list)
    model: str | None = None         # the traced model's class name (None: a plain call)
    types: dict[str, str] = field(default_factory=dict)  # module name -> class name
    result: Any = None               # what the traced call returned (simulated: a FakeTensor)
    loss: torch.Tensor | None = None
    simulated: bool = False          # replayed with FakeTensors, not run on the device

    # --- queries --------------------------------------------------------------------
    @property
    def where(self) -> str:
        """``"cpu"``, or ``"cuda (simulated)"`` for a replayed device."""
        return f"{self.device} (simulated)" if self.simulated else self.device

    def rows(self, layout: bool = False) -> list[OpRecord]:
        """The records, without views and clones unless ``layout=True``."""
        return [r for r in self.records if layout or r.kind != "layout"]

    def ops(self, name: str) -> list[OpRecord]:
        """Every execution of the aten op ``name`` (e.g. ``"addmm"``)."""
        return [r for r in self.records if r.op == name]

    def dtypes_of(self, name: str) -> set[torch.dtype]:
        """The dtypes op ``name`` produced here (empty if it did not run)."""
        return {r.dtype for r in self.ops(name)}

    def dtype_of(self, name: str) -> torch.dtype:
        """The one dtype op ``name`` produced; KeyError if it did not run or ran in several."""
        found = self.dtypes_of(name)
        if len(found) != 1:
            ran = ", ".join(sorted({r.op for r in self.rows()}))
            what = "did not run" if not found else f"ran in several dtypes ({_names(found)})"
            raise KeyError(f"op {name!r} {what} in this trace; ops that ran: {ran}")
        return found.pop()

    @property
    def casts(self) -> list[OpRecord]:
        return [r for r in self.records if r.kind == "cast"]

    @property
    def compute(self) -> list[OpRecord]:
        return [r for r in self.records if r.kind == "compute"]

    def modules(self) -> list[ModuleRow]:
        """Per module, in the order they first ran: casts, 16-bit ops, float32 ops by reason."""
        order = list(dict.fromkeys(r.module for r in self.records))
        out = []
        for name in order:
            mine = [r for r in self.records if r.module == name]
            out.append(ModuleRow(
                name=name,
                type=self.types.get(name, "-"),
                casts=sum(r.kind == "cast" for r in mine),
                low=tuple(r.op for r in mine if r.kind == "compute" and r.low),
                to_fp32=tuple(r.op for r in mine if r.to_fp32),
                already_fp32=tuple(r.op for r in mine if r.already_fp32),
            ))
        return out

    def counts(self) -> dict[str, int]:
        """Forward + loss: computing ops, 16-bit ones, float32 by autocast, float32 already, casts."""
        fwd = [r for r in self.records if r.module != "(backward)"]
        comp = [r for r in fwd if r.kind == "compute"]
        return {"compute": len(comp), "low": sum(r.low for r in comp),
                "to_fp32": sum(r.to_fp32 for r in comp),
                "already_fp32": sum(r.already_fp32 for r in comp),
                "casts": sum(r.kind == "cast" for r in fwd)}

    # --- text -----------------------------------------------------------------------
    def _columns(self, layout: bool) -> tuple[list[str], list[list[str]], list[OpRecord]]:
        head = ["#", "op", "inputs", "output", "shape", "cast", ""]
        if self.model is not None:
            head.insert(1, "module")
        rows, recs = [], self.rows(layout)
        for i, r in enumerate(recs, 1):
            cells = [
                str(i), r.op, " ".join(short(d) for d in r.inputs) or "-",
                short(r.dtype) if r.outputs else "-",
                "[" + ",".join(str(s) for s in r.shape) + "]",
                r.cast_by, r.mark,
            ]
            if self.model is not None:
                cells.insert(1, r.module)
            rows.append(cells)
        return head, rows, recs

    def headline(self) -> str:
        """One line: where it ran, and how many computing ops ran 16-bit or float32, and why."""
        c = self.counts()
        mode = f"autocast {self.dtype}" if self.dtype is not None else "autocast disabled"
        return (f"{self.model or 'call'} on {self.where}, {mode}: {c['compute']} computing ops "
                f"(forward + loss), {c['low']} ran 16-bit, {c['to_fp32']} autocast put in float32, "
                f"{c['already_fp32']} were float32 already, {c['casts']} casts")

    def table(self, layout: bool = False) -> str:
        """One row per op. The last column marks float32 computing ops: ``<- autocast fp32``
        (autocast made it float32) or ``<- already fp32`` (its inputs were float32 already).
        The cast column says who inserted each ``_to_copy`` cast: ``autocast``, the code or
        the op itself (``explicit``, e.g. ``h.float()``), or the backward pass (``autograd``:
        a forward cast's backward casts the gradient back). Views and clones (which compute
        nothing) are left out unless ``layout=True``.
        """
        head, rows, _ = self._columns(layout)
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = []
        for cells in [head, *rows]:
            lines.append("  ".join(c.rjust(w) if j == 0 else c.ljust(w)
                                   for j, (c, w) in enumerate(zip(cells, widths))).rstrip())
        return "\n".join(lines)

    def summary(self) -> str:
        """Per module: casts, 16-bit ops, ops autocast put in float32, ops already float32
        (a long list wraps onto more lines)."""
        head = ["module", "type", "casts", "ran 16-bit", "autocast -> fp32", "already fp32"]
        rows = [[m.name, m.type, str(m.casts), _counted(m.low), _counted(m.to_fp32),
                 _counted(m.already_fp32)] for m in self.modules()]
        return _grid(head, rows)

    def oneline(self) -> str:
        """The computing ops and casts as ``op->dtype``, e.g. ``_to_copy->fp32 _softmax->fp32``."""
        return " ".join(f"{r.op}->{short(r.dtype)}" for r in self.rows())

    def html(self, layout: bool = False) -> str:
        """The table as HTML: autocast's float32 rows orange, float32-already rows sand, casts grey."""
        head, rows, recs = self._columns(layout)
        th = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head)
        body = []
        for cells, r in zip(rows, recs):
            style = ("background:#ffd8a8;font-weight:bold" if r.to_fp32 else
                     "background:#f3ead8" if r.already_fp32 else
                     "font-style:italic;color:#555" if r.kind == "cast" else "")
            tds = "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in cells)
            body.append(f"<tr style='{style}'>{tds}</tr>")
        caption = (html.escape(self.headline()) + ". Orange: autocast put the op in float32; "
                   "sand: float32 already; grey italics: casts")
        return (f"<table style='font-family:monospace;font-size:12px'><caption>{caption}</caption>"
                f"<tr>{th}</tr>{''.join(body)}</table>")

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<Trace: {self.headline()}>"


def _names(dtypes) -> str:
    return ", ".join(sorted(short(d) for d in dtypes))


class _Calls(TorchFunctionMode):
    """Remembers the Python-level torch call in progress (the outermost one), so the
    recorder can tell a cast the code asked for (``.float()``, ``dtype=``) from autocast's,
    and whether autocast was on when the call began (inside a call, autocast's own kernels
    turn it off while they cast, so the state must be read before)."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.explicit = False  # the running call is a cast method or passed a dtype
        self.autocast: bool | None = None  # autocast on at the call's start; None: no call running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.explicit, self.autocast
        self.explicit = (getattr(func, "__name__", "") in _CAST_CALLS
                         or any(isinstance(a, torch.dtype) for a in tree_leaves((args, kwargs))))
        self.autocast = torch.is_autocast_enabled(self.device_type)
        try:
            return func(*args, **kwargs)
        finally:
            self.explicit, self.autocast = before


class _OwnCasts:
    """Tells an op's own cast from one autocast inserted, for lesson 02's ``cast`` column.

    Autocast casts an op's inputs with its own dispatch key excluded, so those casts never
    pass through it. Every other cast does: the code's ``.float()``, and the casts inside an
    op that autocast has no kernel for (``torch.rms_norm``'s decomposition, as a CPU runs it,
    upcasts and casts back itself).
    While active, a kernel on the autocast keys for ``_to_copy`` notes each cast passing
    through, then runs it as before.

    One kind of own cast runs with autocast's key excluded: ``softmax`` and ``log_softmax``
    are on CUDA's ``fp32_set_opt_dtype`` list, so autocast calls them with ``dtype=float32``
    and casts nothing; the op then casts its own input (``input.toType(dtype)`` in
    ``aten/src/ATen/native/SoftMax.cpp``), except for a float16 CUDA input, which its kernel
    reads directly (``_softmax(input, dim, half_to_float=True)``). Those two ops get a kernel
    on the autograd keys that marks the casts inside them as their own, and
    ``for_autocast`` while autocast is the caller (the result is float32 because autocast
    asked for it)."""

    KEYS = ("AutocastCPU", "AutocastCUDA", "AutocastMPS")
    AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradMPS")
    OPT_DTYPE_OPS = ("softmax.int", "log_softmax.int")

    def __init__(self):
        self.passing = False  # a cast that came through an autocast key, or an op's own, is running
        self.for_autocast = False  # ... inside an op autocast called with dtype=float32
        self._lib = None

    def _kernel(self, key):
        keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def through_autocast(*args, **kwargs):
            before, self.passing = self.passing, True
            try:
                with torch._C._ExcludeDispatchKeyGuard(keys):
                    return torch.ops.aten._to_copy.default(*args, **kwargs)
            finally:
                self.passing = before
        return through_autocast

    def _own_body(self, overload):
        op = getattr(torch.ops.aten, overload.split(".")[0]).int

        def own_casts(x, dim, dtype=None, **kwargs):
            called_by_autocast = (dtype is not None and x.device.type in ("cpu", "cuda", "mps")
                                  and not torch.is_autocast_enabled(x.device.type))
            before = self.passing, self.for_autocast
            self.passing, self.for_autocast = True, called_by_autocast
            try:
                return op.decompose(x, dim, dtype, **kwargs)
            finally:
                self.passing, self.for_autocast = before
        return own_casts

    def __enter__(self):
        self._lib = torch.library.Library("aten", "IMPL")
        for key in self.KEYS:
            if hasattr(torch._C.DispatchKey, key):
                self._lib.impl("_to_copy", self._kernel(key), key)
        for key in self.AUTOGRAD_KEYS:
            if hasattr(torch._C.DispatchKey, key):
                for overload in self.OPT_DTYPE_OPS:
                    self._lib.impl(overload, self._own_body(overload), key)
        return self

    def __exit__(self, *exc):
        self._lib._destroy()
        self._lib = None


class _Recorder(TorchDispatchMode):
    """Appends one :class:`OpRecord` per aten op; ``where()`` names the running module.

    Tensors that came out of an autocast cast (and views of them) are remembered, so an op
    fed by one is marked as given its dtype by autocast (rule 1 or 2 of :attr:`OpRecord.rule`).
    """

    def __init__(self, trace: Trace, where, calls: _Calls, own: _OwnCasts):
        super().__init__()
        self.trace, self.where, self.calls, self.own = trace, where, calls, own
        self.from_cast: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor

    def _marked(self, t) -> bool:
        return self.from_cast.get(id(t)) is t

    def _mark(self, tensors) -> None:
        for t in tensors:
            self.from_cast[id(t)] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # FakeTensors answer .device through prim ops: not work
            return out
        tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        res = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = tuple(t.dtype for t in tensors_in)
        outs = tuple(t.dtype for t in res)
        kind = _kind(func, ins, outs)
        fed = any(self._marked(t) for t in tensors_in)
        autocast_on = (self.trace.dtype is not None and self.calls.autocast is not False
                       and not self.calls.explicit)
        cast_by = ""
        if kind == "cast":
            by_autocast = autocast_on and not self.own.passing
            if by_autocast or (autocast_on and self.own.for_autocast):
                self._mark(res)
            in_backward = torch._C._current_graph_task_id() != -1
            cast_by = ("autocast" if by_autocast else
                       "autograd" if in_backward and not self.calls.explicit else "explicit")
        elif kind == "layout":
            by_autocast = False
            if fed:
                self._mark(res)
        else:
            floats = [d for d in ins if d.is_floating_point]
            only_low = bool(floats) and all(d in LOW for d in floats)
            made_fp32 = bool(outs) and outs[0] == torch.float32 and autocast_on and only_low
            by_autocast = bool(outs) and outs[0].is_floating_point and (fed or made_fp32)
        self.trace.records.append(OpRecord(
            op=func.overloadpacket.__name__, module=self.where(), inputs=ins, outputs=outs,
            shape=tuple(res[0].shape) if res else (), kind=kind, by_autocast=by_autocast,
            cast_by=cast_by,
        ))
        return out


class _Tracer:
    """Recorder + module hooks, removed on exit (also when the traced code raises)."""

    def __init__(self, trace: Trace, model: torch.nn.Module | None):
        self.trace, self.model = trace, model
        self.phase = "forward"
        self.stack: list[str] = []

    def where(self) -> str:
        return self.stack[-1] if self.stack else f"({self.phase})"

    @contextlib.contextmanager
    def recording(self):
        handles = []
        try:
            if self.model is not None:
                for name, mod in self.model.named_modules():
                    label = name or "(model)"
                    self.trace.types[label] = type(mod).__name__
                    handles.append(mod.register_forward_pre_hook(self._push(label)))
                    handles.append(mod.register_forward_hook(self._pop, always_call=True))
            calls, own = _Calls(self.trace.device), _OwnCasts()
            with own, calls, _Recorder(self.trace, self.where, calls, own):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.stack.clear()

    def _push(self, label):
        def hook(module, args):
            self.stack.append(label)
        return hook

    def _pop(self, module, args, output):
        if self.stack:
            self.stack.pop()


# --- running for real, or simulated ----------------------------------------------------


def _autocast_args(device, dtype, enabled, simulate=False) -> tuple[torch.device, torch.dtype | None]:
    """Check device and dtype before anything runs; errors say what is available."""
    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    if simulate:
        dev = _simulated_device(device)
    else:
        try:
            dev = pick_device(device)
        except DeviceUnavailableError as err:
            kind = str(device).split(":")[0]
            if kind in SIMULATED:
                raise DeviceUnavailableError(
                    f"{err} To see what {kind} autocast would do, replay its lists here "
                    "with simulate=True.") from None
            raise
    if not enabled:
        return dev, None
    if simulate:
        if dtype not in LOW:
            raise ValueError(f"autocast on {dev.type} supports torch.bfloat16 and torch.float16; "
                             f"got {dtype}")
    else:
        check_autocast(dev.type, dtype)
    return dev, dtype


def _simulated_device(device) -> torch.device:
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        raise ValueError("simulate=True needs the device type to replay: device='cuda', "
                         "'mps' or 'cpu'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be one of {', '.join(SIMULATED)}; got {device!r}") from err
    if dev.type not in SIMULATED:
        raise ValueError(f"simulate=True replays {', '.join(SIMULATED)} autocast; got {device!r}")
    return torch.device(dev.type)


@contextlib.contextmanager
def _autocast(dev: torch.device, dtype, enabled: bool):
    """``torch.autocast``, refusing to go on if torch quietly disabled it (unsupported here)."""
    with torch.autocast(dev.type, dtype=dtype, enabled=enabled):
        if enabled and not torch.is_autocast_enabled(dev.type):
            raise ValueError(f"torch disabled autocast on {dev.type} for {dtype}: this device "
                             "cannot run it. Try the other 16-bit dtype.")
        yield


@contextlib.contextmanager
def _restored_tensors(model):
    """Put every module's own parameters and buffers back on exit: ``functional_call`` on a
    model that holds one module twice (``nn.Sequential(lin, lin)``) leaves the fakes in it."""
    kept = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for m, params, buffers in kept:
            m._parameters.update(params)
            m._buffers.update(buffers)


@contextlib.contextmanager
def _simulated_autocast(device_type: str, dtype, enabled: bool):
    """What ``torch.autocast.__enter__/__exit__`` do, without its check that the device is here."""
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, enabled)
    if enabled:
        torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])


class SimulationUnsupported(RuntimeError):
    """A call that ``simulate=True`` cannot replay: it asks the absent device's runtime
    itself (PyTorch 2.13 on a CPU-only build: ``nn.GRUCell``, ``F.grid_sample``)."""


_NEEDS_DEVICE = ("not compiled with", "not linked with support", "NVIDIA driver",
                 "no CUDA GPUs", "MPS backend")


class _Simulation:
    """FakeTensors on ``device`` (any type, present or not), made from meta tensors."""

    def __init__(self, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.device = device
        self.mode = FakeTensorMode()

    def fake(self, value):
        """A FakeTensor with ``value``'s shape, strides and dtype on the simulated device;
        anything that is not a tensor comes back unchanged. Never ``requires_grad``:
        autograd on a device this build lacks aborts the process."""
        if not isinstance(value, torch.Tensor):
            return value
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        convert = self.mode.fake_tensor_converter.from_meta_and_device
        return convert(self.mode, meta, self.device)

    def prepare(self, fn, args, kwargs):
        """A no-argument call of ``fn`` on fakes of ``args`` and ``kwargs`` (a module runs with
        fake parameters and buffers). The fakes are made here, before any tracing starts."""
        args, kwargs = tree_map(self.fake, (args, kwargs))
        if isinstance(fn, torch.nn.Module):
            state = {k: self.fake(v) for k, v in (*fn.named_parameters(), *fn.named_buffers())}
            return partial(torch.func.functional_call, fn, state, args, kwargs)
        return partial(fn, *args, **kwargs)

    @contextlib.contextmanager
    def active(self):
        """Inside: the fake mode. A real tensor reaching an op, or an op that needs the real
        device even to be replayed, gets an error that says so."""
        try:
            with self.mode:
                yield
        except (AssertionError, RuntimeError) as err:
            text = str(err)
            if "FakeTensor" in text:
                op = re.search(r"Found in ([\w.]+)", text)
                raise ValueError(
                    "simulate=True can only replay tensors it was given: pass them as arguments "
                    "(trace_fn(torch.softmax, x, ...) or partial(torch.softmax, x, dim=-1)), or "
                    "a module; a function that closes over real tensors cannot be simulated "
                    f"(a real tensor reached {op.group(1) if op else 'an op'}).") from None
            if any(s in text for s in _NEEDS_DEVICE):
                raise SimulationUnsupported(
                    f"this call cannot be replayed on {self.device.type} without the device: "
                    f"part of it asks the {self.device.type} runtime itself "
                    f"({text.splitlines()[0][:120]}). Trace it on a real {self.device.type} "
                    "device.") from None
            raise


def _unwrap(fn, args) -> tuple[Any, tuple, dict]:
    """``partial(f, a, k=v)`` with ``args`` -> ``(f, (a, *args), {k: v})``, so tensors it holds can be faked."""
    if isinstance(fn, partial):
        return fn.func, (*fn.args, *args), dict(fn.keywords)
    return fn, tuple(args), {}


def trace_fn(fn, *args, device=None, dtype=torch.bfloat16, enabled: bool = True,
             simulate: bool = False) -> Trace:
    """Trace ``fn(*args)`` under ``torch.autocast`` (or close over the arguments: ``fn()``).

    ``device``: ``None``/``"auto"`` for the best one here, or a name (checked: an absent
    device raises :class:`~amp_lessons.hardware.DeviceUnavailableError` naming those
    present). ``dtype``: ``torch.bfloat16``/``torch.float16`` or a precision name.
    ``simulate=True`` replays ``device``'s autocast with FakeTensors (module docstring);
    then ``fn``'s tensors must come as ``args``, a ``functools.partial`` or a module's
    parameters, and the trace says "(simulated)".
    """
    dev, dtype = _autocast_args(device, dtype, enabled, simulate)
    trace = Trace(device=dev.type, dtype=dtype, simulated=simulate)
    if not simulate:
        with _Tracer(trace, None).recording(), _autocast(dev, dtype, enabled):
            trace.result = fn(*args)
        return trace
    sim = _Simulation(dev)
    call = sim.prepare(*_unwrap(fn, args))
    with sim.active(), _Tracer(trace, None).recording(), _simulated_autocast(dev.type, dtype, enabled):
        trace.result = call()
    return trace


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def trace_model(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor | None = None,
                loss_fn=F.cross_entropy, *, dtype=torch.bfloat16, device=None,
                enabled: bool = True, backward: str | None = None, simulate: bool = False) -> Trace:
    """Trace ``loss_fn(model(x), target)`` under autocast, each op attributed to its module.

    ``device``: ``None`` traces on the device the model's parameters are on; a name is
    checked against this machine and the model. ``backward``: ``None`` (forward + loss
    only), ``"outside"`` (``loss.backward()`` after the autocast block, as the card says)
    or ``"inside"`` (within it); backward ops are attributed to ``"(backward)"``.
    With ``target=None`` the loss is ``loss_fn(model(x))``.

    ``simulate=True`` (with ``device="cuda"``, ``"mps"`` or ``"cpu"``) replays that
    device's autocast on this machine with FakeTensors of the model's parameters, ``x`` and
    ``target``, wherever the model is; the model itself is not touched. Forward + loss only.
    """
    if backward not in BACKWARD:
        raise ValueError(f"backward must be one of None, 'outside', 'inside'; got {backward!r}")
    if simulate and backward is not None:
        raise ValueError("simulate=True traces forward + loss only: backward needs the real "
                         "device (autograd cannot run on a simulated one); pass backward=None")
    here = _model_device(model)
    dev, dtype = _autocast_args(here if device is None and not simulate else device, dtype,
                                enabled, simulate)
    if not simulate and dev.type != here.type:
        raise ValueError(f"the model's parameters are on {here}, not {dev}: "
                         f"move it first with model.to({str(dev)!r}), or pass simulate=True "
                         f"to replay {dev.type} autocast here")
    trace = Trace(device=dev.type, dtype=dtype, model=type(model).__name__, simulated=simulate)
    tracer = _Tracer(trace, model)
    if simulate:
        sim = _Simulation(dev)
        forward = sim.prepare(model, (x,), {})
        args = tuple(sim.fake(t) for t in ([] if target is None else [target]))
        with _restored_tensors(model), sim.active(), tracer.recording(), \
                _simulated_autocast(dev.type, dtype, enabled):
            trace.result = forward()
            tracer.phase = "loss"
            trace.loss = loss_fn(trace.result, *args)
        return trace
    x = x.to(dev)
    args = () if target is None else (target.to(dev),)
    with tracer.recording():
        with _autocast(dev, dtype, enabled):
            trace.result = model(x)
            tracer.phase = "loss"
            trace.loss = loss_fn(trace.result, *args)
            if backward == "inside":
                tracer.phase = "backward"
                trace.loss.backward()
        if backward == "outside":
            tracer.phase = "backward"
            trace.loss.backward()
    return trace


def differences(a: Trace, b: Trace, module: str | None = None, layout: bool = True) -> list[str]:
    """The ops (``op: inputs -> output``) that one trace ran and the other did not.

    ``module`` limits the comparison to one module, e.g. ``"(backward)"``. Lines start
    with ``-`` (only in ``a``) or ``+`` (only in ``b``); an empty list means the same ops
    ran in the same dtypes, in the same order. ``layout=False`` leaves out views and
    clones (autograd's ``detach`` of a saved output is one: a simulated trace has none).
    """
    def lines(t):
        return [f"{r.op}: {' '.join(short(d) for d in r.inputs)} -> {short(r.dtype)}"
                for r in t.rows(layout) if module is None or r.module == module]

    diff = difflib.ndiff(lines(a), lines(b))
    return [d.rstrip() for d in diff if d[:1] in "-+"]


# --- the lesson's models, ready to trace (notebook, widget and self-check share them) -----

EXAMPLES = ("card_model", "TransformerBlock")


def example(name: str = "card_model", device=None, seed: int = 0):
    """``(model, x, target, loss_fn)`` for one of :data:`EXAMPLES`, on ``device``.

    ``card_model``: the card's Linear-ReLU-Linear on a (64, 512) batch, cross-entropy loss.
    ``TransformerBlock``: attention + GELU MLP on (8, 16, 64) tokens, mean-squared error
    against a random target. Built under its own seed; the global RNG is left untouched.
    """
    if name not in EXAMPLES:
        raise ValueError(f"model must be one of {', '.join(EXAMPLES)}; got {name!r}")
    dev = pick_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "card_model":
            model = card_model()
            x, target, loss_fn = torch.randn(64, 512), torch.randint(0, 10, (64,)), F.cross_entropy
        else:
            model = TransformerBlock(dim=64, heads=4)
            x, target, loss_fn = torch.randn(8, 16, 64), torch.randn(8, 16, 64), F.mse_loss
    return model.to(dev), x.to(dev), target.to(dev), loss_fn


def trace_example(name: str = "card_model", dtype=torch.bfloat16, device=None,
                  backward: str | None = None, simulate: bool = False) -> Trace:
    """:func:`trace_model` on :func:`example` ``(name, device)``, labelled ``name`` (as in
    the figures and the widget); ``simulate=True`` replays ``device`` (built on the CPU,
    traced as FakeTensors on ``device``)."""
    model, x, target, loss_fn = example(name, "cpu" if simulate else device)
    trace = trace_model(model, x, target, loss_fn, dtype=dtype, backward=backward,
                        device=device if simulate else None, simulate=simulate)
    trace.model = name
    return trace


def lesson_dtype(report=None) -> torch.dtype:
    """02: the 16-bit dtype to trace on this device: the precision lesson 00 recommends
    (``hardware_report().recommended``) when it is bf16 or fp16; where it recommends fp32
    (a CPU without AMX, MPS, a GPU without tensor cores), autocast's own default for the
    device type (``torch.get_autocast_dtype``: bfloat16 on a CPU, float16 on CUDA and MPS).
    """
    if report is None:
        report = hardware_report()
    if report.recommended in ("bf16", "fp16"):
        return dtype_of(report.recommended)
    return torch.get_autocast_dtype(torch.device(report.device).type)


# --- single calls, on the learner's device and simulated ------------------------------------

PROBE_INPUTS = ("x: a 16-bit (4, 16) activation; y: int64 class indices\n"
                "a, b, c: float32 (4, 16), (16, 8), (4, 8); a64, b64: float64")


def _probe_tensors(dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        a, b, c = torch.randn(4, 16), torch.randn(16, 8), torch.randn(4, 8)
        return {"x": torch.randn(4, 16).to(dtype), "y": torch.randint(0, 16, (4,)),
                "a": a, "b": b, "c": c, "a64": a.double(), "b64": b.double()}


_PROBES = {  # name -> (function, names of the tensor arguments, keyword arguments)
    "mm(a, b)": (torch.mm, ("a", "b"), {}),
    "addmm(c, a, b)": (torch.addmm, ("c", "a", "b"), {}),
    "c.addmm_(a, b)": (torch.Tensor.addmm_, ("c", "a", "b"), {}),
    "mm(a, b, out=c)": (torch.mm, ("a", "b"), {"out": "c"}),
    "mm(a64, b64)": (torch.mm, ("a64", "b64"), {}),
    "relu(x)": (torch.relu, ("x",), {}),
    "softmax(x)": (torch.softmax, ("x",), {"dim": -1}),
    "softmax(x, dtype=x.dtype)": (torch.softmax, ("x",), {"dim": -1, "dtype": "x.dtype"}),
    "log_softmax(x)": (torch.log_softmax, ("x",), {"dim": -1}),
    "layer_norm(x)": (F.layer_norm, ("x",), {"normalized_shape": (16,)}),
    "group_norm(x)": (F.group_norm, ("x",), {"num_groups": 2}),
    "cross_entropy(x, y)": (F.cross_entropy, ("x", "y"), {}),
    "mse_loss(x, x)": (F.mse_loss, ("x", "x"), {}),
    "sum(x)": (torch.sum, ("x",), {}),
    "mean(x)": (torch.mean, ("x",), {}),
    "exp(x)": (torch.exp, ("x",), {}),
    "x.exp_()": (torch.Tensor.exp_, ("x",), {}),
}
PROBES = tuple(_PROBES)


def probe(name: str, dtype=torch.bfloat16, device=None, simulate: bool = False) -> Trace:
    """Trace one of :data:`PROBES` (inputs: :data:`PROBE_INPUTS`) under autocast ``dtype``.

    ``simulate=True`` replays ``device``'s autocast here (see the module docstring).
    """
    if name not in _PROBES:
        raise ValueError(f"probe must be one of {', '.join(PROBES)}; got {name!r}")
    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    fn, arg_names, kw = _PROBES[name]
    where = torch.device("cpu") if simulate else pick_device(device)
    if where.type == "mps" and any(a.endswith("64") for a in arg_names):
        raise ProbeUnavailable(f"{name} needs float64, which MPS does not have", short="no float64 on mps")
    t = {k: v.to(where) for k, v in _probe_tensors(dtype).items() if not (where.type == "mps" and k.endswith("64"))}

    def value(v):  # a tensor's name, "x.dtype", or a literal
        return (t["x"].dtype if v == "x.dtype" else t[v]) if isinstance(v, str) else v

    args = tuple(t[a] for a in arg_names)
    kwargs = {k: value(v) for k, v in kw.items()}
    return trace_fn(partial(fn, **kwargs), *args, device=device, dtype=dtype, simulate=simulate)


class ProbeUnavailable(ValueError):
    """A probe that cannot run on the device asked for (float64 on MPS)."""

    def __init__(self, message: str, short: str):
        super().__init__(message)
        self.short = short  # for a table cell


def _cell(name, dtype, device, simulate) -> str:
    try:
        return probe(name, dtype, device, simulate).oneline()
    except ProbeUnavailable as err:
        return f"({err.short})"


def _wheres(devices) -> list[tuple[str, bool]]:
    if devices is None:  # the CPU always (its lists are the lessons' contrast), this device, CUDA replayed
        here = pick_device().type
        return [("cpu", False), *([(here, False)] if here != "cpu" else []), ("cuda", True)]
    out = []
    for d in devices:
        name = str(d)
        sim = name.endswith("(simulated)")
        out.append((name.removesuffix("(simulated)").strip(), sim))
    return out


def probe_table(names=PROBES, dtype=torch.bfloat16, devices=None, width: int | None = None) -> str:
    """02: each call of ``names`` traced on each of ``devices``, side by side, as ``op->dtype``.

    ``devices``: names, a name ending in ``"(simulated)"`` is replayed (``"cuda (simulated)"``);
    default: this machine's device and ``"cuda (simulated)"``. ``width``: the widest line,
    long chains wrapping onto more lines (default: no limit).
    """
    wheres = _wheres(devices)
    head = ["call", *(f"{d} (simulated)" if s else d for d, s in wheres)]
    rows = [[name, *(_cell(name, dtype, d, s) for d, s in wheres)] for name in names]
    return _grid(head, rows, width)
