"""Interactive controls for the lessons. Thin by design: each widget only wires controls
to a pure function that the tests call directly, and uses only the ipywidgets API shared
by 7.7 (the version Colab pins) and 8.

Every widget checks its arguments before it builds a control, and a bad one is a
``ValueError`` that says what is accepted (never ipywidgets' ``TraitError: Invalid
selection``). A widget whose redraw takes a while shows a busy cue while it computes.
How fast each control redraws in JupyterLab: ``python benchmarks/widget_latency.py``.
"""

from __future__ import annotations

import functools
import html
import io
import math
import numbers

import ipywidgets as W
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .formats import FORMATS, bits_of, parse_format, scale_table
from .hardware import available_devices, pick_device, usage
from .plots import gradient_histogram, scale_plot
from .precision import PRECISIONS, dtype_of, needs_scaler, parse_precision, uses_autocast
from .scaling import scale_run
from .trace import EXAMPLES, trace_example


def _whole(name: str, value, low: int, high: int, why: str = "") -> int:
    """``value`` as an int if it is a whole number from ``low`` to ``high``, else a
    ValueError that names the accepted range (and ``why`` it is that range)."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        raise ValueError(f"{name} must be a whole number from {low} to {high}{why}; got {value!r}")
    return int(value)


def png_of(figure, dpi: int = 80) -> bytes:
    """A Figure as PNG bytes, then closed. A figure with a layout engine (constrained or
    tight) is saved as laid out, in one draw; any other is cropped to its content
    (``bbox_inches="tight"``, which draws it twice)."""
    if not isinstance(figure, Figure):
        raise ValueError(f"png_of needs a matplotlib Figure (e.g. plt.figure()); got {type(figure).__name__}")
    buf = io.BytesIO()
    laid_out = getattr(figure, "get_layout_engine", lambda: None)() is not None
    figure.savefig(buf, format="png", dpi=dpi, bbox_inches=None if laid_out else "tight")
    plt.close(figure)
    return buf.getvalue()


def _show(view, result) -> None:
    """Put a render result into its view: text into an HTML <pre>, a Figure into an Image."""
    if isinstance(view, W.Image):
        view.value = png_of(result)
    else:
        view.value = "<pre style='line-height:1.3'>" + html.escape(str(result)) + "</pre>"


BUSY_STYLE = "color:#8a6d00;font-style:italic"


def _controls(controls) -> list:
    """``controls`` as a list of ipywidgets controls, else a ValueError saying what to pass."""
    if not isinstance(controls, (list, tuple)) or not all(isinstance(c, W.Widget) and hasattr(c, "value")
                                                            for c in controls):
        raise ValueError("controls must be a list of ipywidgets controls (sliders, buttons, text boxes), "
                         f"[] for none; got {controls!r}")
    return list(controls)


def live(controls: list, render, figure: bool = False, layout=W.VBox, busy: str | None = None):
    """A box of ``controls`` above a view that shows ``render()`` and follows every change.

    ``render`` takes no arguments and returns text (shown in an HTML <pre>) or, with
    ``figure=True``, a matplotlib Figure (shown as a PNG Image). Value-based views, not an
    Output widget, so the same code renders in JupyterLab, Colab (ipywidgets 7.7) and under
    nbval. If ``render`` raises, the error is shown in red under the view (JupyterLab
    would otherwise only log it) and re-raised.

    ``busy``: for a render that takes a while, the text of a cue shown between the controls
    and the view from the moment a control changes until the new view is in place (the
    browser gets it at once: the kernel sends each widget change as it happens). The line
    keeps its height when empty, so the page does not jump.

    The box gets ``.view``, ``.error``, ``.busy`` (``None`` without a cue) and
    ``.refresh()`` for tests.
    """
    controls = _controls(controls)
    if not callable(render):
        raise ValueError(f"render must be a function of no arguments that returns the view; got {render!r}")
    view = W.Image(format="png") if figure else W.HTML()
    error = W.HTML()
    error.add_class("amp-render-error")  # not a view: browser tests skip it
    cue = None
    if busy:
        cue = W.HTML(value="", layout=W.Layout(min_height="1.5em"))
        cue.add_class("amp-busy")  # not a view either: the browser tests time it apart
    busy_html = f"<span style='{BUSY_STYLE}'>&#8987; {html.escape(busy or '')}</span>"

    def refresh(_change=None):
        if cue is not None:
            cue.value = busy_html
        try:
            try:
                result = render()
            except Exception as err:
                error.value = ("<pre style='color:#b00020'>"
                               + html.escape(f"{type(err).__name__}: {err}") + "</pre>")
                raise
            error.value = ""
            _show(view, result)
        finally:
            if cue is not None:
                cue.value = ""

    for c in controls:
        c.observe(refresh, names="value")
    refresh()
    box = layout([*controls, *([cue] if cue is not None else []), view, error])
    box.view = view
    box.error = error
    box.busy = cue
    box.refresh = refresh
    return box


# --- 00_start_here -------------------------------------------------------------------


# Why fp16 comes with a GradScaler: it is needed where some gradients fall below fp16's range.
_SCALER_WHY = "yes, in case some gradients fall below fp16's range (lesson 01 counts them)"


def describe_precision(name, device=None) -> str:
    """00: what choosing ``name`` means on ``device``: dtype, autocast, scaler, and whether the
    course uses it there (:func:`~amp_lessons.hardware.usage`: on a GPU it leaves out what torch
    only emulates, such as bf16 before Ampere; on a CPU it runs every precision autocast runs,
    fast or slow, and refuses tf32).

    ``name`` is read by :func:`amp_lessons.precision.parse_precision`: ``"half"``,
    ``"float16"`` and ``torch.float16`` all mean fp16.
    """
    name = parse_precision(name)
    dev = pick_device(device)
    lines = [
        f"precision      {name}",
        f"compute dtype  {dtype_of(name)}",
        f"autocast       {'yes' if uses_autocast(name) else 'no'}",
        f"GradScaler     {_SCALER_WHY if needs_scaler(name) else 'no'}",
        f"used on {dev.type:<6} {usage(name, dev)}",
    ]
    return "\n".join(lines)


def precision_picker(device=None, value: str = "bf16"):
    """Lesson 00's first widget: pick a precision, read what it means on this device.

    ``value`` (the precision chosen first) is any name :func:`parse_precision` reads.
    """
    value = parse_precision(value)
    pick_device(device)  # an unavailable device is refused here, not at the first click
    choice = W.ToggleButtons(options=list(PRECISIONS), value=value, description="precision")
    return live([choice], lambda: describe_precision(choice.value, device))


# --- 01_number_formats ---------------------------------------------------------------

# What a typed number may be: float64's range, wider than every format the lessons show.
_FLOAT64_POWERS = (-1074, 1023)  # 2^-1074: float64's smallest subnormal; 2^1023: its largest power of two


def parse_number(text) -> float:
    """A typed number: ``"1e-4"``, ``"65504"``, ``"inf"``, or a power of two ``"2^-24"``/``"2**-24"``.

    Accepted: what a float64 holds (up to about 1.8e308, down to 2^-1074 = 4.9e-324,
    powers of two from 2^-1074 to 2^1023), ``inf`` and ``nan``. A number beyond that is a
    ValueError that says the range, where float64 would quietly make it inf or 0.
    """
    import re

    if not isinstance(text, (str, numbers.Real)) or isinstance(text, bool):
        raise ValueError(f"type a number such as 1e-4, 65504 or 2^-24; got {_short(text)}")
    s = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"([+-]?)2(?:\^|\*\*)\(?([+-]?)(\d+)\)?", s)
    if m:
        digits = m.group(3).lstrip("0")  # more than 6 of them: out of range, whatever they are
        k = int(m.group(2) + (digits or "0")) if len(digits) <= 6 else None
        low, high = _FLOAT64_POWERS
        if k is None or not low <= k <= high:
            shown = f"2^{k}" if k is not None else _cut(s)
            raise ValueError(f"{shown} is out of range: type a power of two from 2^{low} to 2^{high} "
                             "(float64's range, wider than any format here), or inf")
        return (-1.0 if m.group(1) == "-" else 1.0) * math.ldexp(1.0, k)
    try:
        x = float(s)
    except ValueError:
        raise ValueError(f"type a number such as 1e-4, 65504 or 2^-24; got {_short(text)}") from None
    if math.isinf(x) and "inf" not in s.lower():
        raise ValueError(f"{_cut(s)} is beyond float64's largest value (about 1.8e308): type a "
                         "number up to 1.8e308, or inf")
    if x == 0 and re.search(r"[1-9]", s.lower().split("e")[0]):
        raise ValueError(f"{_cut(s)} is below float64's smallest value (2^-1074, about 4.9e-324): "
                         "type a number from 4.9e-324 up, or 0")
    return x


def _cut(text: str, most: int = 40) -> str:
    """``text`` cut to ``most`` characters: a pasted page stays out of the message."""
    return text if len(text) <= most else text[: most - 4] + " ..."


def _short(value) -> str:
    """``repr(value)``, cut as :func:`_cut` does."""
    return _cut(repr(value))


def value_in_format(text, name) -> str:
    """01: a typed value stored in format ``name``: its bits, the value kept, the error.

    A value that cannot be read returns the message saying what to type (the explorer
    shows it in place of the bits)."""
    try:
        value = parse_number(text)
    except ValueError as err:
        return str(err)
    return str(bits_of(value, name))


def format_explorer(value: str = "0.1", name: str = "fp16"):
    """01's first widget: pick a format, type a value, read how it is stored.

    ``name`` is any name :func:`amp_lessons.formats.parse_format` reads (``"half"``,
    ``"e4m3"``, ``torch.bfloat16``); ``value`` is typed text, as in the box."""
    if not isinstance(value, (str, numbers.Real)) or isinstance(value, bool):
        raise ValueError(f"value is what the box shows first: text such as '0.1' or '2^-24', or a number; "
                         f"got {value!r}")
    fmt = W.ToggleButtons(options=list(FORMATS), value=parse_format(name), description="format")
    text = W.Text(value=str(value), description="value")
    return live([fmt, text], lambda: value_in_format(text.value, fmt.value))


# 2^40 times fp16's smallest subnormal (2^-24) is 2^16 > 65504: every gradient overflows fp16.
MAX_SCALE_EXPONENT = 40


def loss_scale_explorer(grads, exponent: int = 0, max_exponent: int = 24, histogram: bool = True):
    """01's slider: a loss scale 2^0 .. 2^max_exponent over ``grads``; shows the percentages
    flushed to zero, subnormal, normal and overflowed in fp16 and bf16
    (:func:`amp_lessons.formats.scale_table`) and the shifted histogram
    (:func:`amp_lessons.plots.gradient_histogram`), on one x-axis for every scale so the
    bars slide against the formats' bands. ``.slider``, ``.table`` and ``.histogram`` are
    its parts."""
    import torch


    if not (isinstance(grads, torch.Tensor) and grads.is_floating_point() and grads.numel()
            and grads.device.type != "meta"):
        got = (f"a {grads.dtype} tensor of shape {tuple(grads.shape)} on {grads.device}"
               if isinstance(grads, torch.Tensor) else type(grads).__name__)
        raise ValueError("grads must be a non-empty floating-point tensor of gradient values "
                         f"(e.g. first_step_gradients(...)); got {got}")
    bad = int((~grads.detach().isfinite()).sum())
    if bad:
        raise ValueError(f"grads holds {bad:,} inf or NaN value(s) of {grads.numel():,}: the gradients of "
                         "a step that overflowed, which GradScaler skips. Pass a step's gradients that "
                         "are all finite (e.g. first_step_gradients('fp32')), or grads[grads.isfinite()]")
    if not isinstance(histogram, bool):
        raise ValueError(f"histogram must be True (draw it) or False; got {histogram!r}")
    max_exponent = _whole("max_exponent", max_exponent, 1, MAX_SCALE_EXPONENT,
                          " (at 2^40 even fp16's smallest subnormal, 2^-24, overflows)")
    exponent = _whole("exponent", exponent, 0, max_exponent,
                      f" (the slider's scales are 2^0 .. 2^{max_exponent}, max_exponent)")
    top = 2.0**max_exponent
    slider = W.SelectionSlider(options=[(f"2^{k}", 2.0**k) for k in range(max_exponent + 1)],
                               value=2.0**exponent, description="loss scale", continuous_update=False)
    table = live([slider], lambda: scale_table(grads, slider.value))
    parts = [table]
    hist = None
    if histogram:
        hist = live([], lambda: gradient_histogram(grads, slider.value, max_scale=top), figure=True)
        slider.observe(hist.refresh, names="value")
        parts.append(hist)
    box = W.VBox(parts)
    box.slider, box.table, box.histogram = slider, table, hist
    return box


# --- 02_autocast ---------------------------------------------------------------------


def _example_name(model) -> str:
    if model not in EXAMPLES:
        raise ValueError(f"model must be one of {', '.join(EXAMPLES)}; got {model!r}")
    return model


def _autocast_precision(precision) -> str:
    name = parse_precision(precision)
    if name not in ("bf16", "fp16"):
        raise ValueError("the autocast trace needs a 16-bit precision: bf16 (bfloat16) or fp16 "
                         f"(float16); got {precision!r}, which runs without autocast")
    return name


def autocast_table(model: str = "card_model", precision: str = "bf16", device=None) -> str:
    """02: the traced table (and per-module summary) of one lesson model under autocast.

    ``model`` is one of :data:`amp_lessons.trace.EXAMPLES`; ``precision`` bf16 or fp16 (any
    name :func:`parse_precision` reads); ``<- fp32`` marks the ops that ran float32.
    """
    tr = trace_example(_example_name(model), _autocast_precision(precision), device)
    return "\n\n".join([tr.headline(), tr.table(), tr.summary()])


def autocast_explorer(device=None, precision: str = "bf16", model: str = "card_model"):
    """02's widget: pick a model, a 16-bit dtype and (where this machine has more than one)
    a device; the traced table re-renders. Only the devices this machine has are offered."""
    here = pick_device(device).type  # an unavailable device: DeviceUnavailableError naming those here
    first = _autocast_precision(precision)
    model = _example_name(model)
    devices = available_devices()
    dev = W.ToggleButtons(options=devices, value=here, description="device")
    prec = W.ToggleButtons(options=[("bfloat16", "bf16"), ("float16", "fp16")],
                           value=first, description="dtype")
    which = W.ToggleButtons(options=list(EXAMPLES), value=model, description="model")
    controls = [which, prec] + ([dev] if len(devices) > 1 else [])
    return live(controls, lambda: autocast_table(which.value, prec.value, dev.value))


# --- 03_grad_scaler ------------------------------------------------------------------

MAX_SCALE_STEPS = 200  # the widget reruns the whole run on every change: ~5 ms a step on a CPU


def _scale_settings(init_exponent, growth_interval, inject_at, steps) -> tuple[int, int, int, int]:
    """The scale run's settings, checked: ValueErrors name each accepted range."""
    steps = _whole("steps", steps, 1, MAX_SCALE_STEPS, " (the widget reruns them on every change)")
    return (
        _whole("init_exponent", init_exponent, 0, 24,
               " (init_scale = 2^init_exponent; GradScaler's default is 2^16)"),
        _whole("growth_interval", growth_interval, 1, steps,
               f" (the run's steps, {steps}: a longer interval never grows the scale here)"),
        _whole("inject_at", inject_at, -1, steps - 1,
               f" (-1: no inf; else a step of the {steps}-step run, counted from 0)"),
        steps,
    )


@functools.lru_cache(maxsize=256)
def _scale_run(init_exponent: int, growth_interval: int, inject_at: int, steps: int, device: str):
    """:func:`amp_lessons.scaling.scale_run`'s run without the per-step gradient statistics
    (norm, zero count) that the scale plot does not draw, which saves about a fifth of its
    time; cached, so a setting seen before redraws without training again."""
    return scale_run(2.0**init_exponent, growth_interval, inject_at, steps, device, grad_stats=False)


def scale_figure(init_exponent: int = 16, growth_interval: int = 10, inject_at: int = -1,
                 steps: int = 40, device=None):
    """The scale plot of a short fp16 run (03's large-gradient loss) started at
    ``2**init_exponent``, growing every ``growth_interval`` clean steps, with an inf injected
    at step ``inject_at`` (-1: none). Pure: the widget below and the tests call it."""
    init, growth, inject, steps = _scale_settings(init_exponent, growth_interval, inject_at, steps)
    history, final = _scale_run(init, growth, inject, steps, str(pick_device(device)))
    return scale_plot(history, final, growth, injected=(inject,) if inject >= 0 else ())


def scale_explorer(init_exponent: int = 16, growth_interval: int = 10, inject_at: int = 25,
                   steps: int = 40, device=None):
    """03's widget: pick GradScaler's starting scale, its growth interval and a step to make
    the loss inf; a short fp16 training reruns (a busy cue shows meanwhile; a setting seen
    before redraws at once) and the scale plot redraws. Out-of-range settings are refused
    with the accepted range, never clamped to the sliders'."""
    init_exponent, growth_interval, inject_at, steps = _scale_settings(
        init_exponent, growth_interval, inject_at, steps)
    dev = str(pick_device(device))
    wide = {"style": {"description_width": "150px"}, "layout": W.Layout(width="520px")}  # aligned
    init = W.SelectionSlider(options=[(f"2^{k}", k) for k in range(25)], value=init_exponent,
                             description="init_scale", continuous_update=False, **wide)
    growth = W.IntSlider(value=growth_interval, min=1, max=steps, description="growth_interval",
                         continuous_update=False, **wide)
    inject = W.IntSlider(value=inject_at, min=-1, max=steps - 1, description="inf at step (-1: none)",
                         continuous_update=False, **wide)
    box = live([init, growth, inject],
               lambda: scale_figure(init.value, growth.value, inject.value, steps, dev), figure=True,
               busy=f"training {steps} fp16 steps with these settings, then redrawing ...")
    box.init_scale, box.growth_interval, box.inject_at = init, growth, inject
    return box
