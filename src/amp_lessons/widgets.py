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
    nbval. The box gets ``.view`` and ``.refresh()`` for tests.
    """
    view = W.Image(format="png") if figure else W.HTML()

    def refresh(_change=None):
        _show(view, render())

    for c in controls:
        c.observe(refresh, names="value")
    refresh()
    box = layout([*controls, view])
    box.view = view
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

# --- 02_autocast ---------------------------------------------------------------------

# --- 03_grad_scaler ------------------------------------------------------------------
