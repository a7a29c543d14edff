"""Interactive controls for the lessons. Thin by design: each widget only wires controls
to a pure function that the tests call directly, and uses only the ipywidgets API shared
by 7.7 (the version Colab pins) and 8.
"""

from __future__ import annotations

import html
import io

import ipywidgets as W
import matplotlib.pyplot as plt

from .hardware import pick_device, supported_precisions
from .precision import PRECISIONS, dtype_of, needs_scaler, uses_autocast


def _show(view, result) -> None:
    """Put a render result into its view: text into an HTML <pre>, a Figure into an Image."""
    if isinstance(view, W.Image):
        buf = io.BytesIO()
        result.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        plt.close(result)
        view.value = buf.getvalue()
    else:
        view.value = "<pre style='line-height:1.3'>" + html.escape(str(result)) + "</pre>"


def live(controls: list, render, figure: bool = False, layout=W.VBox):
    """A box of ``controls`` above a view that shows ``render()`` and follows every change.

    ``render`` takes no arguments and returns text (shown in an HTML <pre>) or, with
    ``figure=True``, a matplotlib Figure (shown as a PNG Image). Value-based views, not an
    Output widget, so the same code renders in JupyterLab, Colab (ipywidgets 7.7) and under
    nbval. If ``render`` raises, the error is shown in red under the view (JupyterLab
    would otherwise only log it) and re-raised. The box gets ``.view``, ``.error`` and
    ``.refresh()`` for tests.
    """
    view = W.Image(format="png") if figure else W.HTML()
    error = W.HTML()
    error.add_class("amp-render-error")  # not a view: browser tests skip it

    def refresh(_change=None):
        try:
            result = render()
        except Exception as err:
            error.value = ("<pre style='color:#b00020'>" + html.escape(f"{type(err).__name__}: {err}")
                           + "</pre>")
            raise
        error.value = ""
        _show(view, result)

    for c in controls:
        c.observe(refresh, names="value")
    refresh()
    box = layout([*controls, view, error])
    box.view = view
    box.error = error
    box.refresh = refresh
    return box


# --- 00_start_here -------------------------------------------------------------------


def describe_precision(name: str, device=None) -> str:
    """What choosing ``name`` means on ``device``: dtype, autocast, scaler, runs here?"""
    dev = pick_device(device)
    why_not = supported_precisions(dev)[name]
    lines = [
        f"precision      {name}",
        f"compute dtype  {dtype_of(name)}",
        f"autocast       {'yes' if uses_autocast(name) else 'no'}",
        f"GradScaler     {'yes' if needs_scaler(name) else 'no'}",
        f"runs on {dev.type:<6} {'yes' if why_not is None else 'no: ' + why_not}",
    ]
    return "\n".join(lines)


def precision_picker(device=None, value: str = "bf16"):
    """Lesson 00's first widget: pick a precision, read what it means on this device."""
    choice = W.ToggleButtons(options=list(PRECISIONS), value=value, description="precision")
    return live([choice], lambda: describe_precision(choice.value, device))


# --- 01_number_formats ---------------------------------------------------------------


def parse_number(text) -> float:
    """A typed number: ``"1e-4"``, ``"65504"``, ``"inf"``, or a power of two ``"2^-24"``/``"2**-24"``."""
    import re

    s = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"([+-]?)2(?:\^|\*\*)\(?([+-]?\d+)\)?", s)
    if m:
        return (-1.0 if m.group(1) == "-" else 1.0) * 2.0 ** int(m.group(2))
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"type a number such as 1e-4, 65504 or 2^-24; got {text!r}") from None


def value_in_format(text, name) -> str:
    """01: a typed value stored in format ``name``: its bits, the value kept, the error."""
    from .formats import bits_of

    try:
        value = parse_number(text)
    except ValueError as err:
        return str(err)
    return str(bits_of(value, name))


def format_explorer(value: str = "0.1", name: str = "fp16"):
    """01's first widget: pick a format, type a value, read how it is stored."""
    from .formats import FORMATS, parse_format

    fmt = W.ToggleButtons(options=list(FORMATS), value=parse_format(name), description="format")
    text = W.Text(value=str(value), description="value")
    return live([fmt, text], lambda: value_in_format(text.value, fmt.value))


def loss_scale_explorer(grads, exponent: int = 0, max_exponent: int = 24, histogram: bool = True):
    """01's slider: a loss scale 2^0 .. 2^max_exponent over ``grads``; shows the percentages
    flushed to zero, subnormal, normal and overflowed in fp16 and bf16
    (:func:`amp_lessons.formats.scale_table`) and the shifted histogram
    (:func:`amp_lessons.plots.gradient_histogram`). ``.slider``, ``.table`` and
    ``.histogram`` are its parts."""
    from .formats import scale_table
    from .plots import gradient_histogram

    slider = W.SelectionSlider(options=[(f"2^{k}", 2.0**k) for k in range(max_exponent + 1)],
                               value=2.0**exponent, description="loss scale", continuous_update=False)
    table = live([slider], lambda: scale_table(grads, slider.value))
    parts = [table]
    hist = None
    if histogram:
        hist = live([], lambda: gradient_histogram(grads, slider.value), figure=True)
        slider.observe(hist.refresh, names="value")
        parts.append(hist)
    box = W.VBox(parts)
    box.slider, box.table, box.histogram = slider, table, hist
    return box


# --- 02_autocast ---------------------------------------------------------------------


def autocast_table(model: str = "card_model", precision: str = "bf16", device=None) -> str:
    """02: the traced table (and per-module summary) of one lesson model under autocast.

    ``model`` is one of :data:`amp_lessons.trace.EXAMPLES`; ``<- fp32`` marks the ops that
    stayed float32.
    """
    from .trace import trace_example

    tr = trace_example(model, precision, device)
    return "\n\n".join([tr.headline(), tr.table(), tr.summary()])


def autocast_explorer(device=None, precision: str = "bf16", model: str = "card_model"):
    """02's widget: pick a model, a 16-bit dtype and (where there is a choice) a device;
    the traced table re-renders. Only the devices this machine has are offered."""
    from .hardware import available_devices
    from .precision import parse_precision
    from .trace import EXAMPLES

    dev = W.ToggleButtons(options=available_devices(), value=pick_device(device).type,
                          description="device")
    prec = W.ToggleButtons(options=[("bfloat16", "bf16"), ("float16", "fp16")],
                           value=parse_precision(precision), description="dtype")
    which = W.ToggleButtons(options=list(EXAMPLES), value=model, description="model")
    return live([which, prec, dev], lambda: autocast_table(which.value, prec.value, dev.value))


# --- 03_grad_scaler ------------------------------------------------------------------


def scale_figure(init_exponent: int = 16, growth_interval: int = 10, inject_at: int = -1,
                 steps: int = 40, device=None):
    """The scale plot of a short fp16 run (03's large-gradient loss) started at
    ``2**init_exponent``, growing every ``growth_interval`` clean steps, with an inf injected
    at step ``inject_at`` (-1: none). Pure: the widget below and the tests call it."""
    from .plots import scale_plot
    from .scaling import scale_run

    history, final = scale_run(2.0**init_exponent, growth_interval, inject_at, steps, device)
    return scale_plot(history, final, growth_interval, injected=(inject_at,))


def scale_explorer(init_exponent: int = 16, growth_interval: int = 10, inject_at: int = 25,
                   steps: int = 40, device=None):
    """03's widget: pick GradScaler's starting scale, its growth interval and a step to make
    the loss inf; a short fp16 training reruns and the scale plot redraws."""
    wide = {"style": {"description_width": "150px"}, "layout": W.Layout(width="520px")}  # aligned
    init = W.SelectionSlider(options=[(f"2^{k}", k) for k in range(25)], value=init_exponent,
                             description="init_scale", continuous_update=False, **wide)
    growth = W.IntSlider(value=growth_interval, min=1, max=30, description="growth_interval",
                         continuous_update=False, **wide)
    inject = W.IntSlider(value=inject_at, min=-1, max=steps - 1, description="inf at step (-1: none)",
                         continuous_update=False, **wide)
    box = live([init, growth, inject],
               lambda: scale_figure(init.value, growth.value, inject.value, steps, device), figure=True)
    box.init_scale, box.growth_interval, box.inject_at = init, growth, inject
    return box
