"""The lessons' widgets without a browser: their pure render functions, and each widget's
wiring (set a control's value, the view follows).

This file also runs under ipywidgets 7.7.1, the version Colab pins (``make test-colab``),
so it uses only what both 7.7 and 8 provide: ``.children``, ``.value``, ``.description``,
``.options``.
"""

from __future__ import annotations

import html
import math
import os
import re
from pathlib import Path

import ipywidgets as W
import pytest
import torch

import amp_lessons.widgets as widgets
from amp_lessons.precision import PRECISIONS, dtype_of, needs_scaler, uses_autocast

# ipywidgets 7.7.1 opens its comms through ipykernel.comm.Comm, which newer ipykernels
# deprecate; Colab's own ipykernel is older and does not warn. Not the lessons' code.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The `ipykernel.comm.Comm` class has been deprecated:DeprecationWarning"
)

WIDGETS_PY = Path(widgets.__file__)
IPYWIDGETS_MAJOR = int(W.__version__.split(".")[0])
PNG = b"\x89PNG\r\n\x1a\n"


def lesson_function(name: str):
    """A lesson's function from amp_lessons.widgets; skips only while it is not written yet."""
    fn = getattr(widgets, name, None)
    if fn is None:
        pytest.skip(f"amp_lessons.widgets.{name} does not exist yet")
    return fn


def control(box, description: str):
    """The control labelled ``description`` in a live() box (fails if there is none)."""
    found = [c for c in box.children[:-1] if getattr(c, "description", None) == description]
    assert len(found) == 1, (
        f"no single control {description!r} in {[c.description for c in box.children[:-1]]}"
    )
    return found[0]


def shown_text(box) -> str:
    """The text a live() box's HTML view shows (the <pre> content, unescaped)."""
    assert isinstance(box.view, W.HTML)
    m = re.fullmatch(r"<pre[^>]*>(.*)</pre>", box.view.value, flags=re.S)
    assert m, f"the view is not a <pre>: {box.view.value[:200]!r}"
    return html.unescape(m.group(1))


def shown_png(box) -> bytes:
    assert isinstance(box.view, W.Image)
    data = bytes(box.view.value)
    assert data.startswith(PNG), "the view does not hold a PNG"
    return data


# --- live() ----------------------------------------------------------------------------


def test_live_shows_text_and_follows_every_control():
    a = W.IntSlider(value=1, min=0, max=10, description="a")
    b = W.Dropdown(options=["x", "y"], value="x", description="b")
    calls = []

    def render():
        calls.append((a.value, b.value))
        return f"a={a.value} b={b.value} <&>"

    box = widgets.live([a, b], render)
    assert isinstance(box, W.VBox) and list(box.children) == [a, b, box.view, box.error]
    assert shown_text(box) == "a=1 b=x <&>"  # escaped in the HTML, read back as typed
    a.value = 7
    assert shown_text(box) == "a=7 b=x <&>"
    b.value = "y"
    assert shown_text(box) == "a=7 b=y <&>"
    assert calls == [(1, "x"), (7, "x"), (7, "y")]
    box.refresh()
    assert calls[-1] == (7, "y") and len(calls) == 4


def test_live_figure_view_is_a_png_that_changes_with_the_control():
    import matplotlib.pyplot as plt

    n = W.IntSlider(value=2, min=1, max=5, description="n")

    def render():
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot(range(n.value))
        return fig

    before = set(plt.get_fignums())
    box = widgets.live([n], render, figure=True)
    first = shown_png(box)
    n.value = 5
    assert shown_png(box) != first
    assert set(plt.get_fignums()) == before  # each rendered figure is closed


def test_live_accepts_another_layout():
    t = W.ToggleButtons(options=["p", "q"], value="p", description="t")
    box = widgets.live([t], lambda: t.value, layout=W.HBox)
    assert isinstance(box, W.HBox)
    t.value = "q"
    assert shown_text(box) == "q"


def test_live_shows_the_busy_cue_while_render_runs_and_clears_it():
    n = W.IntSlider(value=1, min=0, max=5, description="n")
    cues = []
    box = None

    def render():  # reads the cue while it runs, as the browser would see it
        cues.append(box.busy.value if box is not None else "(building)")
        return f"n={n.value}"

    box = widgets.live([n], render, busy="training 40 steps <fast>")
    assert list(box.children) == [n, box.busy, box.view, box.error]
    assert "amp-busy" in box.busy._dom_classes and box.busy.value == ""
    n.value = 3
    assert "training 40 steps &lt;fast&gt;" in cues[-1]  # shown while render ran, escaped
    assert box.busy.value == "" and shown_text(box) == "n=3"  # and cleared after the redraw


def test_live_clears_the_busy_cue_when_render_raises():
    n = W.IntSlider(value=1, min=0, max=5, description="n")

    def render():
        if n.value == 0:
            raise ValueError("no zero")
        return f"n={n.value}"

    box = widgets.live([n], render, busy="working")
    with pytest.raises(ValueError):
        n.value = 0
    assert box.busy.value == "" and "no zero" in box.error.value


def test_live_without_a_cue_has_none():
    box = widgets.live([], lambda: "x")
    assert box.busy is None and list(box.children) == [box.view, box.error]


def test_png_of_a_laid_out_figure_is_saved_as_laid_out():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 2), layout="constrained")
    ax.set_title("a title")
    png = widgets.png_of(fig, dpi=50)
    assert png.startswith(PNG)
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (200, 100)  # the figure's own size: not cropped
    assert fig.number not in plt.get_fignums()


# --- 00_start_here ---------------------------------------------------------------------


@pytest.mark.parametrize("name", PRECISIONS)
def test_describe_precision_matches_the_precision_module(name):
    text = widgets.describe_precision(name, "cpu")
    rows = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in text.splitlines() if "  " in line
    )
    assert rows["precision"] == name
    assert rows["compute dtype"] == str(dtype_of(name))
    assert rows["autocast"] == ("yes" if uses_autocast(name) else "no")
    assert rows["GradScaler"].split(",")[0] == ("yes" if needs_scaler(name) else "no")
    if needs_scaler(name):  # it says when the scaler is needed, not that it always is
        assert "in case some gradients fall below fp16's range" in rows["GradScaler"]


def test_describe_precision_fp16_against_torch():
    assert dtype_of("fp16") == torch.float16 and dtype_of("bf16") == torch.bfloat16
    text = widgets.describe_precision("fp16", "cpu")
    assert "compute dtype  torch.float16" in text and "GradScaler     yes" in text
    # CPU autocast runs float16 whatever its speed; the line says so instead of promising speed
    assert text.splitlines()[-1] == ("used on cpu    yes: CPU autocast runs it, fast or slow (a measured "
                                     "matmul rate says which: lesson 00 prints them)")
    assert widgets.describe_precision("fp32", "cpu").splitlines()[-1] == "used on cpu    yes"
    assert "no: " in widgets.describe_precision("tf32", "cpu").splitlines()[-1]


def test_precision_picker_follows_the_buttons():
    box = widgets.precision_picker(device="cpu")
    choice = control(box, "precision")
    assert isinstance(choice, W.ToggleButtons)
    assert list(choice.options) == list(PRECISIONS) and choice.value == "bf16"
    assert shown_text(box) == widgets.describe_precision("bf16", "cpu")
    for name in ("fp16", "fp32", "tf32"):
        choice.value = name
        assert shown_text(box) == widgets.describe_precision(name, "cpu")


def test_precision_picker_starts_where_asked():
    box = widgets.precision_picker(device="cpu", value="fp16")
    assert control(box, "precision").value == "fp16"
    assert shown_text(box) == widgets.describe_precision("fp16", "cpu")


@pytest.mark.parametrize("alias", ["half", "float16", "FP16", torch.float16])
def test_describe_precision_reads_names_as_parse_precision_does(alias):
    assert widgets.describe_precision(alias, "cpu") == widgets.describe_precision("fp16", "cpu")
    box = widgets.precision_picker(device="cpu", value=alias)
    assert control(box, "precision").value == "fp16"


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: widgets.describe_precision("fp61", "cpu"), "precision must be one of fp32, tf32, bf16, fp16; got 'fp61'"),
     (lambda: widgets.precision_picker("cpu", value="fp61"), "precision must be one of fp32, tf32, bf16, fp16; got 'fp61'"),
     (lambda: widgets.precision_picker("tpu"), "device must be one of"),
     (lambda: widgets.precision_picker("cuda:7" if not torch.cuda.is_available() else "cuda:99"), "was requested")],
)  # fmt: skip
def test_00_bad_arguments_say_what_is_accepted(call, message):
    with pytest.raises(Exception, match=re.escape(message)) as err:
        call()
    assert "TraitError" not in type(err.value).__name__


# --- 01_number_formats -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-4", 1e-4), ("65504", 65504.0), ("2^-24", 2.0**-24), ("2**-24", 2.0**-24),
     ("-2^3", -8.0), (" 2 ^ (-14) ", 2.0**-14), ("inf", float("inf"))],
)  # fmt: skip
def test_parse_number_reads_what_a_learner_types(text, value):
    assert lesson_function("parse_number")(text) == value


def test_parse_number_says_what_to_type():
    parse_number = lesson_function("parse_number")
    with pytest.raises(ValueError, match="type a number such as 1e-4"):
        parse_number("one")


@pytest.mark.parametrize(
    ("text", "message"),
    [("2^1024", "type a power of two from 2^-1074 to 2^1023"),
     ("2**-1075", "type a power of two from 2^-1074 to 2^1023"),
     ("1e400", "beyond float64's largest value (about 1.8e308)"),
     ("-1e309", "beyond float64's largest value"),
     ("1e-400", "below float64's smallest value (2^-1074, about 4.9e-324)")],
)  # fmt: skip
def test_parse_number_refuses_what_float64_cannot_hold_and_says_the_range(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        widgets.parse_number(text)


def test_parse_number_keeps_float64s_own_extremes():
    assert widgets.parse_number("2^1023") == 2.0**1023 and widgets.parse_number("2^-1074") == 2.0**-1074
    assert widgets.parse_number("-inf") == -math.inf and math.isnan(widgets.parse_number("nan"))
    assert widgets.parse_number("0") == 0.0 and widgets.parse_number("-0.000") == 0.0


def test_format_explorer_shows_the_range_for_2_to_the_1024_in_place_of_an_error():
    box = widgets.format_explorer("0.1", "fp16")
    control(box, "value").value = "2^1024"
    assert shown_text(box).startswith("2^1024 is out of range: type a power of two from 2^-1074")
    assert box.error.value == ""  # not a red OverflowError
    control(box, "value").value = "2^15"
    assert shown_text(box) == widgets.value_in_format("2^15", "fp16")


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: widgets.format_explorer("1", "fp61"), "format must be one of fp32, tf32, bf16, fp16, fp8_e4m3, fp8_e5m2; got 'fp61'"),
     (lambda: widgets.loss_scale_explorer([1e-6, 2e-7]), "grads must be a non-empty floating-point tensor"),
     (lambda: widgets.loss_scale_explorer(torch.ones(3), exponent=30), "exponent must be a whole number from 0 to 24"),
     (lambda: widgets.loss_scale_explorer(torch.ones(3), exponent=1.5), "exponent must be a whole number from 0 to 24"),
     (lambda: widgets.loss_scale_explorer(torch.ones(3), max_exponent=99), "max_exponent must be a whole number from 1 to 40"),
     (lambda: widgets.loss_scale_explorer(torch.ones(3), max_exponent=True), "max_exponent must be a whole number"),
     (lambda: widgets.loss_scale_explorer(torch.tensor([1e-6, math.inf, math.nan])), "grads holds 2 inf or NaN value(s) of 3: the gradients of a step that overflowed"),
     (lambda: widgets.loss_scale_explorer(torch.full((4,), -math.inf)), "grads[grads.isfinite()]"),
     (lambda: widgets.loss_scale_explorer(torch.empty(3, device="meta")), "got a torch.float32 tensor of shape (3,) on meta"),
     (lambda: widgets.loss_scale_explorer(torch.arange(3)), "got a torch.int64 tensor"),
     (lambda: widgets.loss_scale_explorer(torch.ones(3), histogram="no"), "histogram must be True (draw it) or False; got 'no'"),
     (lambda: widgets.format_explorer(None), "value is what the box shows first"),
     (lambda: widgets.format_explorer([0.1]), "value is what the box shows first"),
     (lambda: widgets.parse_number(None), "type a number such as 1e-4, 65504 or 2^-24; got None"),
     (lambda: widgets.parse_number("2^" + "9" * 5000), "2^9999999999999999999999999999999999 ... is out of range"),
     (lambda: widgets.parse_number("2^-0000001075"), "2^-1075 is out of range"),
     (lambda: widgets.parse_number("9" * 400), "9" * 36 + " ... is beyond float64's largest value")],
)  # fmt: skip
def test_01_bad_arguments_say_what_is_accepted(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_format_explorer_takes_aliases_and_dtypes():
    assert control(widgets.format_explorer("1", torch.bfloat16), "format").value == "bf16"
    assert control(widgets.format_explorer("1", "e4m3"), "format").value == "fp8_e4m3"


def test_value_in_format_against_torch():
    value_in_format = lesson_function("value_in_format")
    tiny = 2.0**-24  # fp16's smallest subnormal (torch.finfo says so)
    assert torch.finfo(torch.float16).smallest_normal * 2.0**-10 == tiny
    kept = torch.tensor(tiny).to(torch.float16).item()
    assert f"is stored as {kept!r}" in value_in_format("2^-24", "fp16")
    flushed = torch.tensor(1e-8).to(torch.float16).item()
    assert flushed == 0.0 and "is stored as 0.0" in value_in_format("1e-8", "fp16")
    assert torch.tensor(1e-8).to(torch.bfloat16).item() != 0.0
    assert "is stored as 0.0" not in value_in_format("1e-8", "bf16")
    assert value_in_format("one", "fp16").startswith("type a number")  # shown, not raised


@pytest.mark.parametrize("text, stored, kind", [
    ("65519.9999", "65504.0", "normal"),  # below 65520, the tie: float32 would make it 65520, then inf
    ("2.98023224e-08", "5.960464477539063e-08", "subnormal"),  # just above 2^-25: float32 would make it the tie, then 0
])
def test_value_in_format_rounds_a_typed_value_once_as_census_does(text, stored, kind):
    from amp_lessons.formats import census

    shown = widgets.value_in_format(text, "fp16")
    assert f"is stored as {stored}" in shown
    c = census(torch.tensor([float(text)], dtype=torch.float64), "fp16")
    assert getattr(c, kind) == 1


def test_format_explorer_follows_format_and_value():
    explorer = lesson_function("format_explorer")
    value_in_format = lesson_function("value_in_format")
    box = explorer("1e-8", "half")
    fmt, text = control(box, "format"), control(box, "value")
    assert (fmt.value, text.value) == ("fp16", "1e-8")
    assert shown_text(box) == value_in_format("1e-8", "fp16")
    fmt.value = "bf16"
    assert shown_text(box) == value_in_format("1e-8", "bf16")
    text.value = "2^-24"
    assert shown_text(box) == value_in_format("2^-24", "bf16")
    text.value = "oops"
    assert shown_text(box).startswith("type a number")


def _fp16_flushed_percent(grads, scale) -> str:
    """The reference: the share of nonzero values that fp16 turns into 0 after scaling."""
    nonzero = grads[grads != 0].double()
    flushed = ((nonzero * scale).to(torch.float16) == 0).double().mean().item()
    return f"{flushed:.3%}"


def test_loss_scale_explorer_table_and_histogram_follow_the_slider():
    explorer = lesson_function("loss_scale_explorer")
    from amp_lessons.formats import scale_table

    g = torch.Generator().manual_seed(0)
    grads = torch.randn(4000, generator=g) * 2.0 ** torch.randint(-40, -5, (4000,), generator=g)
    box = explorer(grads)
    slider = box.slider
    assert slider.description == "loss scale" and slider.value == 1.0
    assert shown_text(box.table) == scale_table(grads, 1.0)
    assert _fp16_flushed_percent(grads, 1.0) in shown_text(box.table).splitlines()[2]
    png = shown_png(box.histogram)
    slider.value = 2.0**16
    table = shown_text(box.table)
    assert table == scale_table(grads, 2.0**16) and table.startswith("loss scale 2^16 = 65536")
    assert _fp16_flushed_percent(grads, 2.0**16) in table.splitlines()[2]
    assert shown_png(box.histogram) != png


def _histogram_axes(fig):
    return fig.axes[1]  # under the formats' strip


def test_histogram_axis_stays_put_across_scales_so_the_bars_slide():
    from amp_lessons.plots import gradient_histogram

    g = torch.Generator().manual_seed(1)
    grads = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-36, -6, (3000,), generator=g)
    limits = {k: _histogram_axes(gradient_histogram(grads, 2.0**k)).get_xlim() for k in (0, 8, 16, 24)}
    assert len(set(limits.values())) == 1, limits  # one axis for every scale up to 2^24
    lo, hi = limits[0]
    logs = grads[grads != 0].abs().double().log2()
    assert lo <= logs.min().item() and logs.max().item() + 24 <= hi  # holds the bars at 2^0 and 2^24

    def heights(k):  # the bars' heights, bin by bin over the shared axis (4 bins per octave)
        stairs = [p for p in _histogram_axes(gradient_histogram(grads, 2.0**k)).patches
                  if type(p).__name__ == "StepPatch"]
        return list(stairs[0].get_data().values)

    at_1, at_256 = heights(0), heights(8)
    assert len(at_1) == len(at_256) and at_1 != at_256
    assert at_256[32:] == at_1[:-32]  # a scale of 2^8 slides every bar 8 octaves right, nothing else
    # beyond the axis's reach the axis grows rather than drop bars
    assert gradient_histogram(grads, 2.0**30).axes[1].get_xlim()[1] >= logs.max().item() + 30


def test_loss_scale_explorer_histogram_keeps_its_axis_as_the_slider_moves():
    g = torch.Generator().manual_seed(2)
    grads = torch.randn(2000, generator=g) * 2.0 ** torch.randint(-30, -8, (2000,), generator=g)
    box = widgets.loss_scale_explorer(grads, max_exponent=12)
    from amp_lessons.plots import gradient_histogram

    first = gradient_histogram(grads, 1.0, max_scale=2.0**12)
    last = gradient_histogram(grads, 2.0**12, max_scale=2.0**12)
    assert _histogram_axes(first).get_xlim() == _histogram_axes(last).get_xlim()
    box.slider.value = 2.0**12
    assert shown_png(box.histogram) == _png_of(lambda: gradient_histogram(grads, 2.0**12, max_scale=2.0**12))


def test_loss_scale_explorer_without_histogram():
    explorer = lesson_function("loss_scale_explorer")
    box = explorer(torch.full((10,), 1e-6), exponent=3, max_exponent=8, histogram=False)
    assert box.histogram is None and list(box.children) == [box.table]
    assert box.slider.value == 8.0 and len(box.slider.options) == 9


# --- 02_autocast -----------------------------------------------------------------------


def test_autocast_table_traces_the_card_model_on_cpu():
    autocast_table = lesson_function("autocast_table")
    text = autocast_table("card_model", "fp16", "cpu")
    assert text.startswith("card_model on cpu, autocast torch.float16")
    rows = [line.split() for line in text.split("\n\n")[1].splitlines()[1:]]
    ops = {row[2]: row for row in rows}
    assert ops["addmm"][3:6] == ["fp16", "fp16", "fp16"]  # the matmul ran in 16-bit
    assert (
        ops["_log_softmax"][-1] == "fp32" and ops["nll_loss_forward"][-1] == "fp32"
    )  # the loss did not
    assert "bf16" in autocast_table("card_model", "bf16", "cpu").split("\n\n")[1]


def test_autocast_explorer_follows_model_dtype_and_device(monkeypatch):
    explorer = lesson_function("autocast_explorer")
    autocast_table = lesson_function("autocast_table")
    monkeypatch.setattr(widgets, "available_devices", lambda: ["mps", "cpu"])
    two = explorer(device="cpu")
    assert control(two, "device").options == ("mps", "cpu") and control(two, "device").value == "cpu"
    monkeypatch.setattr(widgets, "available_devices", lambda: ["cpu"])
    box = explorer(device="cpu")  # one device: no toggle with nothing to toggle to
    assert [c.description for c in box.children[:-2]] == ["model", "dtype"]
    dtype, model = control(box, "dtype"), control(box, "model")
    assert (model.value, dtype.value) == ("card_model", "bf16")
    assert shown_text(box) == autocast_table("card_model", "bf16", "cpu")
    dtype.value = "fp16"
    assert shown_text(box) == autocast_table("card_model", "fp16", "cpu")
    model.value = "TransformerBlock"
    assert shown_text(box) == autocast_table("TransformerBlock", "fp16", "cpu")


def test_autocast_explorer_takes_the_notebooks_dtype():
    explorer = lesson_function("autocast_explorer")
    box = explorer("cpu", precision=torch.float16)
    assert control(box, "dtype").value == "fp16"


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: widgets.autocast_explorer("cpu", precision="fp32"), "needs a 16-bit precision: bf16 (bfloat16) or fp16 (float16); got 'fp32'"),
     (lambda: widgets.autocast_explorer("cpu", precision="fp61"), "precision must be one of fp32, tf32, bf16, fp16; got 'fp61'"),
     (lambda: widgets.autocast_explorer("cpu", model="resnet"), "model must be one of card_model, TransformerBlock; got 'resnet'"),
     (lambda: widgets.autocast_explorer("tpu"), "device must be one of"),
     (lambda: widgets.autocast_table("resnet", "bf16", "cpu"), "model must be one of card_model, TransformerBlock"),
     (lambda: widgets.autocast_table("card_model", "tf32", "cpu"), "needs a 16-bit precision")],
)  # fmt: skip
def test_02_bad_arguments_say_what_is_accepted(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# --- 03_grad_scaler --------------------------------------------------------------------


def _png_of(figure_fn) -> bytes:
    """The PNG a figure view shows for ``figure_fn()``, rendered the way live() renders it."""
    return shown_png(widgets.live([], figure_fn, figure=True))


def test_scale_figure_draws_the_run_it_describes():
    scale_figure = lesson_function("scale_figure")
    from amp_lessons.scaling import scale_run

    history, final = scale_run(2.0**16, 10, 25, 40, "cpu")
    fig = scale_figure(16, 10, 25, 40, "cpu")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_yscale()) == ("training step (skipped ones included)", "log")
    line = next(ln for ln in ax.lines if ln.get_label().startswith("scale used by the step"))
    assert list(line.get_ydata()) == [*history["scale"], final]
    assert history.skipped >= 1  # the injected inf at step 25 is skipped, at the least
    assert (
        history[25].skipped and history[26].scale == history[25].scale / 2
    )  # and halves the scale
    assert ax.get_title().startswith(f"{history.skipped} of 40 steps skipped")
    assert "inf injected" in [ln.get_label() for ln in ax.lines]
    no_inf = scale_figure(16, 10, -1, 40, "cpu").axes[0]
    assert "inf injected" not in [ln.get_label() for ln in no_inf.lines]


def test_scale_explorer_reruns_and_redraws_on_each_slider():
    explorer = lesson_function("scale_explorer")
    scale_figure = lesson_function("scale_figure")
    box = explorer(device="cpu")
    init, growth = control(box, "init_scale"), control(box, "growth_interval")
    inject = control(box, "inf at step (-1: none)")
    assert (init.value, growth.value, inject.value) == (16, 10, 25)
    assert box.init_scale is init and box.growth_interval is growth and box.inject_at is inject
    assert [label for label, _ in init.options][:2] == ["2^0", "2^1"]
    start = shown_png(box)
    assert start == _png_of(
        lambda: scale_figure(16, 10, 25, 40, "cpu")
    )  # rendering is deterministic
    init.value = 10
    assert shown_png(box) == _png_of(lambda: scale_figure(10, 10, 25, 40, "cpu"))
    growth.value = 3
    inject.value = -1
    assert shown_png(box) == _png_of(lambda: scale_figure(10, 3, -1, 40, "cpu"))
    init.value, growth.value, inject.value = 16, 10, 25
    assert shown_png(box) == start


def test_scale_figure_draws_the_scale_of_the_run_it_describes():
    scale_figure = lesson_function("scale_figure")
    from amp_lessons.scaling import scale_run

    history, final = scale_run(2.0**4, 3, 7, steps=12)
    # 2^4 overflows nothing: growth after 3 clean steps (x2 at 3 and 6), the inf at 7 halves
    assert history["scale"][:8] == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0]
    assert [r.step for r in history if r.skipped] == [7]
    fig = scale_figure(4, 3, 7, steps=12)
    title = fig.axes[0].get_title()
    assert (
        title.startswith("1 of 12 steps skipped")
        and f"now 2^{torch.tensor(final).log2().item():g}" in title
    )


def test_scale_explorer_reruns_and_redraws_on_each_control():
    explorer = lesson_function("scale_explorer")
    box = explorer(init_exponent=16, growth_interval=10, inject_at=8, steps=12)
    init, growth, inject = (
        control(box, "init_scale"),
        control(box, "growth_interval"),
        box.inject_at,
    )
    assert (init.value, growth.value, inject.value) == (16, 10, 8)
    assert [label for label, _ in init.options][:2] == ["2^0", "2^1"] and len(init.options) == 25
    first = shown_png(box)
    seen = {first}
    for c, value in ((init, 4), (growth, 3), (inject, -1)):
        c.value = value
        png = shown_png(box)
        assert png not in seen, f"{c.description} did not redraw"
        seen.add(png)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"growth_interval": 0, "inject_at": 99}, "growth_interval must be a whole number from 1 to 40 (the run's steps, 40"),
     ({"inject_at": 99}, "inject_at must be a whole number from -1 to 39 (-1: no inf; else a step of the 40-step run"),
     ({"inject_at": -2}, "inject_at must be a whole number from -1 to 39"),
     ({"growth_interval": 2000}, "growth_interval must be a whole number from 1 to 40"),
     ({"init_exponent": 25}, "init_exponent must be a whole number from 0 to 24"),
     ({"init_exponent": 16.0}, "init_exponent must be a whole number from 0 to 24"),
     ({"steps": 0}, "steps must be a whole number from 1 to 200"),
     ({"steps": 10, "inject_at": 10}, "inject_at must be a whole number from -1 to 9"),
     ({"device": "tpu"}, "device must be one of")],
)  # fmt: skip
def test_scale_explorer_refuses_settings_out_of_range_instead_of_clamping(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        widgets.scale_explorer(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        widgets.scale_figure(**{"inject_at": 25, **kwargs})


def test_scale_explorer_sliders_span_what_the_run_accepts():
    box = widgets.scale_explorer(init_exponent=0, growth_interval=12, inject_at=-1, steps=12)
    assert (box.growth_interval.min, box.growth_interval.max) == (1, 12)
    assert (box.inject_at.min, box.inject_at.max) == (-1, 11)
    assert (box.init_scale.value, box.growth_interval.value, box.inject_at.value) == (0, 12, -1)


def test_scale_explorer_shows_a_busy_cue_while_it_trains():
    box = widgets.scale_explorer(steps=8, growth_interval=5, inject_at=-1, device="cpu")
    assert box.busy is not None and box.busy.value == ""
    seen = []
    box.busy.observe(lambda change: seen.append(change["new"]), names="value")
    box.growth_interval.value = 3
    assert len(seen) == 2 and "training 8 fp16 steps" in seen[0] and seen[1] == ""


def test_the_scale_run_is_cached_and_matches_scale_run():
    from amp_lessons.scaling import scale_run

    widgets._scale_run.cache_clear()
    fast, fast_final = widgets._scale_run(4, 3, 7, 12, "cpu")
    slow, slow_final = scale_run(2.0**4, 3, 7, 12, "cpu")
    assert fast["scale"] == slow["scale"] and fast["skipped"] == slow["skipped"]
    assert fast["loss"] == slow["loss"] and fast_final == slow_final  # the same run, bit for bit
    assert widgets._scale_run(4, 3, 7, 12, "cpu")[0] is fast  # a setting seen before: no rerun
    assert widgets._scale_run.cache_info().hits == 1


def test_scale_plot_keeps_tick_labels_off_the_title():
    fig = widgets.scale_figure(16, 10, 25, 40, "cpu")
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if low <= t <= high]
    assert ticks and max(ticks) < high / 2**0.5  # the top tick sits well inside the axes
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(re.fullmatch(r"2\^-?\d+", text) for text in labels), labels  # plain "2^k"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure was let go of by pyplot: draw it on its own canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    title = ax.title.get_window_extent(renderer)
    assert all(t.get_window_extent(renderer).y1 < title.y0 for t in ax.get_yticklabels() if t.get_text())


# --- the lessons' figures at JupyterLab's width ------------------------------------------

JUPYTERLAB_INCHES = 9.6  # ~960 px at the inline backend's 100 dpi: wider figures are shrunk


def _smallest_text_pt(fig) -> float:
    from matplotlib.text import Text

    return min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible())


@pytest.fixture(scope="module")
def side_by_side_result():
    from amp_lessons import bench
    from amp_lessons.data import digits
    from amp_lessons.models import mlp

    return bench.train_side_by_side(lambda: mlp(64, 16, 10), digits(), ["fp32", "bf16"], steps=3,
                                    device="cpu", progress=False)


@pytest.fixture(scope="module")
def clipped_runs():
    from amp_lessons.clipping import lesson_model
    from amp_lessons.data import digits
    from amp_lessons.training import Trainer

    data = digits()
    return {label: Trainer(lesson_model(), data, precision=precision, device="cpu", optimizer="sgd",
                           lr=0.5, clip_norm=1.0, clip_order=order, teaching=True, seed=0,
                           progress=False).fit(4)
            for label, precision, order in (("fp32", "fp32", "unscale_first"),
                                            ("fp16, clip then unscale_", "fp16", "before_unscale"))}


def _lesson_figures(side_by_side_result, clipped_runs):
    from amp_lessons import plots

    g = torch.Generator().manual_seed(3)
    grads = torch.randn(500, generator=g) * 2.0 ** torch.randint(-30, -5, (500,), generator=g)
    return {
        "format_ranges": plots.format_ranges(values=grads),
        "gradient_histogram": plots.gradient_histogram(grads, 2.0**8),
        "scale_plot": widgets.scale_figure(4, 3, 7, steps=12),
        "loss_curves": plots.loss_curves(clipped_runs),
        "clipping_runs": plots.clipping_runs(clipped_runs, 1.0),
        "side_by_side": plots.side_by_side(side_by_side_result),
        "lost_updates": plots.lost_updates([1e-2, 1e-3, 1e-4], {"fp32 master": [0, 0, 0.1],
                                                                 "model.half()": [0.2, 0.5, 0.9]}),
    }


def test_lesson_figures_read_at_jupyterlab_width(side_by_side_result, clipped_runs):
    for name, fig in _lesson_figures(side_by_side_result, clipped_runs).items():
        assert fig.get_figwidth() <= JUPYTERLAB_INCHES, f"{name} is {fig.get_figwidth()} in wide"
        assert _smallest_text_pt(fig) >= 8, f"{name} has {_smallest_text_pt(fig)} pt text"
        titles = [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]
        assert any(titles), f"{name} has no title"


def test_multi_panel_figures_stack_their_panels_with_legends_of_9_pt(side_by_side_result, clipped_runs):
    from amp_lessons import plots

    for fig in (plots.clipping_runs(clipped_runs, 1.0), plots.side_by_side(side_by_side_result)):
        assert fig.get_figwidth() <= 9 and len(fig.axes) == 3
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends and all(t.get_fontsize() >= 9 for lg in legends for t in lg.get_texts())
        # no more than two panels side by side: each panel at least half the width
        assert all(ax.get_position().width >= 0.35 for ax in fig.axes)


def test_side_by_side_draws_everything_a_step_holds_not_only_the_activations(side_by_side_result):
    from amp_lessons import plots
    from amp_lessons.measure import MiB, training_memory

    result = side_by_side_result
    fig = plots.side_by_side(result)
    held = fig.axes[2]
    tops = {}
    for bar in held.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    for x, p in enumerate(result.runs):
        t = result.runs[p].trainer
        batch = t.data.batch(0, t.batch_size, t.seed)
        expected = training_memory(t.model, *batch, p, optimizer=type(t.optimizer)).total / MiB
        assert tops[x] == pytest.approx(expected, rel=1e-9), p  # the bar is the whole step
    title = fig._suptitle.get_text()
    bf16, fp32 = (training_memory(result.runs[p].trainer.model, *batch, p) for p in ("bf16", "fp32"))
    drawn = bf16.activations / fp32.activations  # the activation bars, the batch drawn apart
    assert f"activations {drawn:.2f}x fp32's" in title
    assert f"the step's summed memory {bf16.total / fp32.total:.2f}x" in title
    labels = held.get_legend_handles_labels()[1]
    assert any("weights" in label for label in labels) and any("16-bit weight copies" in label for label in labels)
    assert "speed ≈" in title and "accuracy ≈" in title  # float-kernel figures are marked


def test_side_by_side_says_what_it_needs_without_trainers(side_by_side_result):
    import dataclasses

    from amp_lessons import bench, plots

    bare = bench.SideBySide({p: dataclasses.replace(r, trainer=None)
                             for p, r in side_by_side_result.runs.items()}, "cpu")
    with pytest.raises(ValueError, match="has no trainer to measure; pass memory="):
        plots.side_by_side(bare)


# --- the API both ipywidgets 7.7.1 (Colab) and 8 provide ---------------------------------

# Names and arguments that exist only in ipywidgets 8: on Colab (7.7.1) they raise or warn.
# (Output exists in both, but breaks the stored outputs nbval compares: live() replaces it.)
ONLY_IN_8 = [
    r"\bStack\b", r"\bTagsInput\b", r"\bColorsInput\b", r"\bFloatsInput\b", r"\bIntsInput\b",
    r"\bTimePicker\b", r"\bNaiveDatetimePicker\b", r"\bDatetimePicker\b",
    r"\btooltip=", r"\btitles=", r"\bdescription_allow_html\b", r"\bbehavior=", r"\btabbable\b",
    r"\bOutput\(",
]  # fmt: skip


def test_widgets_module_uses_only_api_shared_by_ipywidgets_7_and_8():
    source = WIDGETS_PY.read_text()
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    found = [pattern for pattern in ONLY_IN_8 if re.search(pattern, code)]
    assert not found, f"amp_lessons/widgets.py uses ipywidgets-8-only (or Output) API: {found}"


def test_every_widget_function_the_lessons_import_is_tested_here():
    notebooks = Path(__file__).resolve().parents[1] / "notebooks"
    imported = set()
    for path in notebooks.glob("[0-9][0-9]_*.py"):
        for names in re.findall(r"from amp_lessons\.widgets import ([\w, ]+)", path.read_text()):
            imported |= {n.strip() for n in names.split(",")}
    this_file = Path(__file__).read_text()
    untested = sorted(
        n
        for n in imported
        if f'lesson_function("{n}")' not in this_file and f"widgets.{n}(" not in this_file
    )
    assert not untested, f"widget functions the lessons use but this file does not test: {untested}"


def test_running_ipywidgets_version():
    # make test-colab runs this file under 7.7.1 (and says so); .venv has 8
    assert IPYWIDGETS_MAJOR in (7, 8)
    expected = os.environ.get("AMP_LESSONS_EXPECT_IPYWIDGETS")
    if expected:
        assert W.__version__ == expected


def test_live_shows_a_render_error_under_the_view_and_clears_it():
    import ipywidgets as W
    import pytest

    from amp_lessons.widgets import live

    box_value = W.IntSlider(value=1, min=0, max=3)

    def render():
        if box_value.value == 0:
            raise ValueError("loss scale must be a positive finite number; got 0")
        return f"value {box_value.value}"

    box = live([box_value], render)
    assert box.error.value == "" and "value 1" in box.view.value
    with pytest.raises(ValueError):
        box_value.value = 0
    assert "ValueError: loss scale must be a positive finite number; got 0" in box.error.value
    assert "value 1" in box.view.value  # the last good view stays
    box_value.value = 2
    assert box.error.value == "" and "value 2" in box.view.value


def test_an_overflowed_steps_finite_gradients_can_still_be_explored():
    grads = torch.tensor([1e-6, math.inf, 2e-7, math.nan])
    box = widgets.loss_scale_explorer(grads[grads.isfinite()], histogram=False)
    assert "(of 2 nonzero values; 0 exact zeros left out)" in html.unescape(box.table.view.value)


def test_parse_number_reads_powers_with_leading_zeros():
    assert widgets.parse_number("2^-0024") == 2.0**-24 and widgets.parse_number("2**(0)") == 1.0
    assert widgets.parse_number(0.5) == 0.5


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: widgets.live(None, lambda: "x"), "controls must be a list of ipywidgets controls"),
     (lambda: widgets.live([1, 2], lambda: "x"), "controls must be a list of ipywidgets controls"),
     (lambda: widgets.live([], None), "render must be a function of no arguments"),
     (lambda: widgets.png_of(None), "png_of needs a matplotlib Figure")],
)  # fmt: skip
def test_live_and_png_of_say_what_they_take(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
