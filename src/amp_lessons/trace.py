"""Which aten op ran in which dtype under autocast: a tracer the learner runs on their device.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sits *below* autocast in
PyTorch's dispatcher, so it sees every aten op as it really executes, including the
``_to_copy`` casts that autocast inserts (a ``TorchFunctionMode`` sees only the Python
calls, not the casts). Forward pre/post hooks keep a stack of module names, so each op is
attributed to the module whose ``forward`` ran it. Used in 02_autocast.

    tr = trace_model(model, x, y, dtype=torch.bfloat16)   # forward + loss under autocast
    print(tr.table())      # one row per op: module, op, input dtypes, output dtype, cast
    print(tr.summary())    # per module: which ops ran 16-bit, which stayed float32
    tr                     # in a notebook: the table as HTML, float32 rows highlighted
"""

from __future__ import annotations

import contextlib
import difflib
import html
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .hardware import check_autocast, pick_device
from .precision import dtype_of

LOW = (torch.bfloat16, torch.float16)
BACKWARD = (None, "outside", "inside")

_SHORT = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    torch.int64: "int64", torch.int32: "int32", torch.bool: "bool",
}
# Ops that only reshape, alias or copy memory: hidden from the table unless asked for.
_LAYOUT = {"clone", "_unsafe_view", "contiguous", "copy_", "alias"}


def short(dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``: the course's names, for narrow tables."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class OpRecord:
    """One aten op as it executed: where, what went in, what came out."""

    op: str                          # the aten name, e.g. "addmm", "_to_copy", "_softmax"
    module: str                      # the innermost module running it, or "(loss)", "(backward)"
    inputs: tuple[torch.dtype, ...]  # dtypes of every tensor argument, in order
    outputs: tuple[torch.dtype, ...]  # dtypes of every tensor result
    shape: tuple[int, ...]           # shape of the first result
    kind: str                        # "cast", "layout" (view, clone) or "compute"

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
        """A computing op that produced float32: under autocast, one that *stayed* float32."""
        return self.kind == "compute" and self.dtype == torch.float32


def _kind(func, inputs, outputs) -> str:
    name = func.overloadpacket.__name__
    if name == "_to_copy" and inputs and outputs and inputs[0] != outputs[0]:
        return "cast"
    if func.is_view or name in _LAYOUT:
        return "layout"
    return "compute"


@dataclass(frozen=True)
class ModuleRow:
    """One module's share of a trace: its casts and which ops ran 16-bit or float32."""

    name: str
    type: str
    casts: int
    low: tuple[str, ...]
    fp32: tuple[str, ...]


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
    result: Any = None               # what the traced call returned (the model's output)
    loss: torch.Tensor | None = None

    # --- queries --------------------------------------------------------------------
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
        """Per module, in the order they first ran: casts, 16-bit ops, float32 ops."""
        order = list(dict.fromkeys(r.module for r in self.records))
        out = []
        for name in order:
            mine = [r for r in self.records if r.module == name]
            out.append(ModuleRow(
                name=name,
                type=self.types.get(name, "-"),
                casts=sum(r.kind == "cast" for r in mine),
                low=tuple(r.op for r in mine if r.kind == "compute" and r.low),
                fp32=tuple(r.op for r in mine if r.fp32),
            ))
        return out

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
                "yes" if r.kind == "cast" else "",
                "<- fp32" if r.fp32 else "",
            ]
            if self.model is not None:
                cells.insert(1, r.module)
            rows.append(cells)
        return head, rows, recs

    def headline(self) -> str:
        """One line: where it ran, and how many computing ops ran 16-bit or stayed float32."""
        fwd = [r for r in self.records if r.module != "(backward)"]
        comp = [r for r in fwd if r.kind == "compute"]
        low = sum(r.low for r in comp)
        fp32 = sum(r.fp32 for r in comp)
        casts = sum(r.kind == "cast" for r in fwd)
        mode = f"autocast {self.dtype}" if self.dtype is not None else "autocast disabled"
        return (f"{self.model or 'call'} on {self.device}, {mode}: {len(comp)} computing ops "
                f"(forward + loss), {low} ran 16-bit, {fp32} stayed float32, "
                f"{casts} casts")

    def table(self, layout: bool = False) -> str:
        """One row per op. ``<- fp32`` marks computing ops whose result is float32.

        Views and clones (which compute nothing) are left out unless ``layout=True``.
        """
        head, rows, _ = self._columns(layout)
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = []
        for cells in [head, *rows]:
            lines.append("  ".join(c.rjust(w) if j == 0 else c.ljust(w)
                                   for j, (c, w) in enumerate(zip(cells, widths))).rstrip())
        return "\n".join(lines)

    def summary(self) -> str:
        """Per module: casts, the ops that ran 16-bit, the ops that stayed float32."""
        head = ["module", "type", "casts", "ran 16-bit", "stayed float32"]
        rows = [[m.name, m.type, str(m.casts), _counted(m.low), _counted(m.fp32)]
                for m in self.modules()]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
                         for cells in [head, *rows])

    def oneline(self) -> str:
        """The computing ops and casts as ``op->dtype``, e.g. ``_to_copy->fp32 _softmax->fp32``."""
        return " ".join(f"{r.op}->{short(r.dtype)}" for r in self.rows())

    def html(self, layout: bool = False) -> str:
        """The table as HTML: float32 rows highlighted, casts in italics."""
        head, rows, recs = self._columns(layout)
        th = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head)
        body = []
        for cells, r in zip(rows, recs):
            style = ("background:#ffd8a8;font-weight:bold" if r.fp32 else
                     "font-style:italic;color:#555" if r.kind == "cast" else "")
            tds = "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in cells)
            body.append(f"<tr style='{style}'>{tds}</tr>")
        caption = html.escape(self.headline()) + " (float32 rows highlighted)"
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


class _Recorder(TorchDispatchMode):
    """Appends one :class:`OpRecord` per aten op; ``where()`` names the running module."""

    def __init__(self, trace: Trace, where):
        super().__init__()
        self.trace = trace
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        res = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        outs = tuple(t.dtype for t in res)
        self.trace.records.append(OpRecord(
            op=func.overloadpacket.__name__, module=self.where(), inputs=ins, outputs=outs,
            shape=tuple(res[0].shape) if res else (), kind=_kind(func, ins, outs),
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
            with _Recorder(self.trace, self.where):
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


def _autocast_args(device, dtype, enabled) -> tuple[torch.device, torch.dtype | None]:
    """Check device and dtype before anything runs; errors say what is available."""
    dev = pick_device(device)
    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    if not enabled:
        return dev, None
    check_autocast(dev.type, dtype)
    return dev, dtype


@contextlib.contextmanager
def _autocast(dev: torch.device, dtype, enabled: bool):
    """``torch.autocast``, refusing to go on if torch quietly disabled it (unsupported here)."""
    with torch.autocast(dev.type, dtype=dtype, enabled=enabled):
        if enabled and not torch.is_autocast_enabled(dev.type):
            raise ValueError(f"torch disabled autocast on {dev.type} for {dtype}: this device "
                             "cannot run it. Try the other 16-bit dtype.")
        yield


def trace_fn(fn, *, device=None, dtype=torch.bfloat16, enabled: bool = True) -> Trace:
    """Trace ``fn()`` (no arguments: close over them) under ``torch.autocast``.

    ``device``: ``None``/``"auto"`` for the best one here, or a name (checked: an absent
    device raises :class:`~amp_lessons.hardware.DeviceUnavailableError` naming those
    present). ``dtype``: ``torch.bfloat16``/``torch.float16`` or a precision name.
    """
    dev, dtype = _autocast_args(device, dtype, enabled)
    trace = Trace(device=dev.type, dtype=dtype)
    with _Tracer(trace, None).recording(), _autocast(dev, dtype, enabled):
        trace.result = fn()
    return trace


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def trace_model(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor | None = None,
                loss_fn=F.cross_entropy, *, dtype=torch.bfloat16, device=None,
                enabled: bool = True, backward: str | None = None) -> Trace:
    """Trace ``loss_fn(model(x), target)`` under autocast, each op attributed to its module.

    ``device``: ``None`` traces on the device the model's parameters are on; a name is
    checked against this machine and the model. ``backward``: ``None`` (forward + loss
    only), ``"outside"`` (``loss.backward()`` after the autocast block, as the card says)
    or ``"inside"`` (within it); backward ops are attributed to ``"(backward)"``.
    With ``target=None`` the loss is ``loss_fn(model(x))``.
    """
    if backward not in BACKWARD:
        raise ValueError(f"backward must be one of None, 'outside', 'inside'; got {backward!r}")
    here = _model_device(model)
    dev, dtype = _autocast_args(here if device is None else device, dtype, enabled)
    if dev.type != here.type:
        raise ValueError(f"the model's parameters are on {here}, not {dev}: "
                         f"move it first with model.to({str(dev)!r})")
    x = x.to(dev)
    args = () if target is None else (target.to(dev),)
    trace = Trace(device=dev.type, dtype=dtype, model=type(model).__name__)
    tracer = _Tracer(trace, model)
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


def differences(a: Trace, b: Trace, module: str | None = None) -> list[str]:
    """The ops (``op: inputs -> output``) that one trace ran and the other did not.

    ``module`` limits the comparison to one module, e.g. ``"(backward)"``. Lines start
    with ``-`` (only in ``a``) or ``+`` (only in ``b``); an empty list means the same ops
    ran in the same dtypes, in the same order.
    """
    def lines(t):
        return [f"{r.op}: {' '.join(short(d) for d in r.inputs)} -> {short(r.dtype)}"
                for r in t.records if module is None or r.module == module]

    diff = difflib.ndiff(lines(a), lines(b))
    return [d.rstrip() for d in diff if d[:1] in "-+"]


# --- the lesson's two models, ready to trace (notebook and widget share them) ------------

EXAMPLES = ("card_model", "TransformerBlock")


def example(name: str = "card_model", device=None, seed: int = 0):
    """``(model, x, target, loss_fn)`` for one of :data:`EXAMPLES`, on ``device``.

    ``card_model``: the card's Linear-ReLU-Linear on a (64, 512) batch, cross-entropy loss.
    ``TransformerBlock``: attention + GELU MLP on (8, 16, 64) tokens, mean-squared error
    against a random target. Built under its own seed; the global RNG is left untouched.
    """
    from .models import TransformerBlock, card_model

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
                  backward: str | None = None) -> Trace:
    """:func:`trace_model` on :func:`example` ``(name, device)``."""
    model, x, target, loss_fn = example(name, device)
    return trace_model(model, x, target, loss_fn, dtype=dtype, backward=backward)
