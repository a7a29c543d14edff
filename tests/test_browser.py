"""The lessons' widgets as a learner uses them: JupyterLab in headless Chromium.

Each lesson is opened from a copy of its stored notebook, run with Run > Run All Cells,
and every control of its widgets is changed with real clicks and key presses; each change
must bring the expected new content into the widget's view. Nothing here is timed: how
fast each control redraws is measured by ``benchmarks/widget_latency.py``, run alone.

These tests need Debian's chromium (``apt-get install chromium``) and playwright, and run
only when asked: ``make test-browser``, ``pytest -m browser``, or ``AMP_LESSONS_BROWSER=1``.
Otherwise they skip and say so; asked for without Chromium or playwright, they fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from _browser_lab import (
    Change,
    LabError,
    LabServer,
    cell_output,
    change_control,
    control_labels,
    find_chromium,
    find_widget,
    launch_chromium,
    open_notebook,
    run_all,
    slider_key,
    toggle,
    type_text,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "artifacts"
BROWSER_ENV = "AMP_LESSONS_BROWSER"  # =1: run the browser tests (make test-browser sets -m browser)
HOW_TO_ASK = f"`make test-browser`, `pytest -m browser` or {BROWSER_ENV}=1"


def requested(config) -> bool:
    """True when the browser tests were asked for: ``-m browser`` (not ``-m "not browser"``)
    or ``AMP_LESSONS_BROWSER=1``."""
    if os.environ.get(BROWSER_ENV, "").strip().lower() in ("1", "true", "yes"):
        return True
    expr = config.getoption("markexpr", "") or ""
    return "browser" in expr and "not browser" not in expr


def _missing(config, what: str) -> None:
    """Fail when the browser tests were asked for, else skip, saying what is missing."""
    if requested(config):
        pytest.fail(f"{what}; the browser tests were asked for ({HOW_TO_ASK}), so they cannot skip")
    pytest.skip(what)


# --- fixtures: one JupyterLab server and one Chromium for the whole module -----------


@pytest.fixture(scope="module")
def chromium(request) -> str:
    if not requested(request.config):
        pytest.skip(f"JupyterLab-in-Chromium tests run only when asked: {HOW_TO_ASK}")
    path = find_chromium()
    if path is None:
        _missing(request.config, "chromium not found: install Debian's with `apt-get install chromium` "
                 "(or set AMP_LESSONS_CHROMIUM to a chromium binary)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing(request.config, "playwright is not installed: pip install -e '.[dev]'")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    """A JupyterLab server on copies of the stored lessons; always stopped afterwards."""
    root = tmp_path_factory.mktemp("lessons")
    for nb in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        shutil.copy2(nb, root / nb.name)
    server = LabServer(root, home=tmp_path_factory.mktemp("jupyter-home"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab, chromium, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = launch_chromium(pw, chromium, tmp_path_factory.mktemp("chromium-profile"))
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def lesson_page(lab, browser):
    """Open a notebook (by file name) in its own tab; the tab and its kernel end after the test."""
    pages = []

    def open_(name: str):
        page = open_notebook(browser, lab, name)
        pages.append(page)
        return page

    yield open_
    for page in pages:
        page.close()
    lab.shutdown_kernels()


# --- the lessons' widgets ------------------------------------------------------------

Check = Callable[[Change, object], None]  # (the change, the page) -> asserts


def shows(expected: Callable[[], str]) -> Check:
    """The (first) HTML view shows exactly ``expected()``, computed here by the package."""

    def check(change: Change, page) -> None:
        assert change.text(0).strip() == expected().strip()

    return check


def pure(fn: str, *args) -> Callable[[], str]:
    """``amp_lessons.widgets.<fn>(*args)``, the pure function a widget's view calls."""

    def expected() -> str:
        import amp_lessons.widgets

        return getattr(amp_lessons.widgets, fn)(*args)

    return expected


def loss_scale(k: int, reference_cell: str | None = None) -> Check:
    """01's slider at 2^k: the table names the scale (and, at 2^8, equals the table the
    lesson's own cell printed for the same gradients); the histogram is a new PNG."""

    def check(change: Change, page) -> None:
        table = change.text(0)
        assert table.startswith(f"loss scale 2^{k} = "), table
        if reference_cell:
            printed = cell_output(page, reference_cell).split("\nGradScaler starts at")[0]

            def words(text):  # the lesson's cell marks its figures with ≈ (claims.measured)
                return text.replace("≈", "").split()

            assert words(table) == words(printed)
        assert change.images() and all(change.digests[i] for i in change.images())

    return check


def redrawn(change: Change, page) -> None:
    """Every view shows something new: HTML text that is not empty, images that decode."""
    assert all(change.after[i].strip() for i, k in enumerate(change.kinds) if k == "html")
    assert all(change.digests[i] for i in change.images())


def round_trip() -> tuple[Check, Check]:
    """A pair of checks: the second step must bring back the images the first one left."""
    start: list[str] = []

    def there(change: Change, page) -> None:
        redrawn(change, page)
        assert change.digests != change.before_digests
        start[:] = change.before_digests

    def back(change: Change, page) -> None:
        redrawn(change, page)
        assert change.digests == start, "the same settings did not redraw the same image"

    return there, back


_there, _back = round_trip()  # 03: init_scale 2^17 and back to 2^16 (a deterministic rerun)


def busy_then_redrawn(change: Change, page) -> None:
    """03 at a setting not computed before: the busy cue showed, then the plot redrew."""
    _there(change, page)
    assert change.cue_s is not None, "no busy cue appeared while the run was recomputed"


@dataclass
class Step:
    act: Callable  # changes a control with real input events (one event: one timing)
    check: Check  # asserts the views' new content
    expect: list[int] | None = None  # views that must change (default: all)


@dataclass
class WidgetCheck:
    control: str  # the label of a control: finds the widget
    steps: list[Step]


@dataclass
class Lesson:
    name: str  # notebook stem
    widgets: list[WidgetCheck] = field(default_factory=list)


LESSONS = [
    Lesson("00_start_here", [
        WidgetCheck("precision", [
            Step(toggle("precision", "fp16"), shows(pure("describe_precision", "fp16"))),
            Step(toggle("precision", "fp32"), shows(pure("describe_precision", "fp32"))),
            Step(toggle("precision", "tf32"), shows(pure("describe_precision", "tf32"))),
        ]),
    ]),
    Lesson("01_number_formats", [
        WidgetCheck("loss scale", [
            Step(slider_key("loss scale", "ArrowRight"), loss_scale(1)),
            Step(slider_key("loss scale", "PageUp"), loss_scale(6)),
            Step(slider_key("loss scale", "ArrowRight"), loss_scale(7)),
            Step(slider_key("loss scale", "ArrowRight"), loss_scale(8, "print(scale_table(grads, 2.0**8, measured=True))")),
            Step(slider_key("loss scale", "PageUp"), loss_scale(13)),
            Step(slider_key("loss scale", "PageUp"), loss_scale(18)),
        ]),
        WidgetCheck("format", [
            Step(toggle("format", "bf16"), shows(pure("value_in_format", "1e-8", "bf16"))),
            Step(type_text("value", "2^-24"), shows(pure("value_in_format", "2^-24", "bf16"))),
            Step(toggle("format", "fp16"), shows(pure("value_in_format", "2^-24", "fp16"))),
        ]),
    ]),
    Lesson("02_autocast", [
        WidgetCheck("dtype", [
            Step(toggle("dtype", "float16"), shows(pure("autocast_table", "card_model", "fp16"))),
            Step(toggle("model", "TransformerBlock"), shows(pure("autocast_table", "TransformerBlock", "fp16"))),
            Step(toggle("dtype", "bfloat16"), shows(pure("autocast_table", "TransformerBlock", "bf16"))),
        ]),
    ]),
    Lesson("03_grad_scaler", [
        WidgetCheck("init_scale", [
            Step(slider_key("init_scale", "ArrowRight"), busy_then_redrawn),
            Step(slider_key("growth_interval", "ArrowLeft"), redrawn),
            Step(slider_key("growth_interval", "ArrowRight"), redrawn),
            Step(slider_key("inf at step (-1: none)", "ArrowRight"), redrawn),
            Step(slider_key("inf at step (-1: none)", "ArrowLeft"), redrawn),
            Step(slider_key("init_scale", "ArrowLeft"), _back),
        ]),
    ]),
]  # fmt: skip


def test_every_widget_in_the_lessons_is_checked_here():
    """Each widget a stored lesson displays has a WidgetCheck in LESSONS."""
    checked = {lesson.name: len(lesson.widgets) for lesson in LESSONS}
    shown = {}
    for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        n = sum(
            any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in c.outputs)
            for c in nb.cells
            if c.cell_type == "code"
        )
        if n:
            shown[path.stem] = n
    unchecked = {name: n for name, n in shown.items() if checked.get(name, 0) < n}
    assert not unchecked, f"widgets shown by these lessons have no browser check: {unchecked}"


def test_the_latency_benchmark_moves_the_controls_these_tests_move():
    """benchmarks/widget_latency.py times what these tests check: the same controls."""
    spec = importlib.util.spec_from_file_location("widget_latency", ROOT / "benchmarks" / "widget_latency.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    checked = {lesson.name: {step.act.label for w in lesson.widgets for step in w.steps} for lesson in LESSONS}
    timed = {name: {there.label for _, pairs in moves for there, _ in pairs} for name, moves in bench.MOVES.items()}
    assert timed == checked


class _Config:
    """Just enough of pytest's config for :func:`requested`."""

    def __init__(self, markexpr: str):
        self.markexpr = markexpr

    def getoption(self, name, default=None):
        return self.markexpr if name == "markexpr" else default


def test_browser_tests_run_only_when_asked_and_fail_then_if_they_cannot(monkeypatch):
    monkeypatch.delenv(BROWSER_ENV, raising=False)
    assert not requested(_Config("")) and not requested(_Config("not browser"))
    assert requested(_Config("browser")) and requested(_Config("browser and not slow"))
    with pytest.raises(pytest.skip.Exception, match="chromium not found"):
        _missing(_Config(""), "chromium not found")
    with pytest.raises(pytest.fail.Exception, match="chromium not found; the browser tests were asked for"):
        _missing(_Config("browser"), "chromium not found")
    monkeypatch.setenv(BROWSER_ENV, "1")
    assert requested(_Config(""))
    with pytest.raises(pytest.fail.Exception, match="playwright is not installed"):
        _missing(_Config(""), "playwright is not installed")


def unmoved_controls(box, steps) -> list[str]:
    """The controls of a rendered widget that no step moves (a control with one choice,
    such as the device on a CPU-only machine, has nothing to move to and is left out)."""
    moved = {step.act.label for step in steps}
    return sorted(label for label, choices in control_labels(box).items()
                  if label not in moved and choices != 1)


@pytest.mark.browser
@pytest.mark.parametrize("lesson", LESSONS, ids=[lesson.name for lesson in LESSONS])
def test_every_control_of_the_lesson_widgets_redraws_in_jupyterlab(lesson: Lesson, lesson_page):
    notebook = NOTEBOOKS / f"{lesson.name}.ipynb"
    if not notebook.exists():
        pytest.skip(f"{notebook.name} is not in notebooks/ yet")
    page = lesson_page(notebook.name)
    run_all(page, timeout=300)
    for n, widget in enumerate(lesson.widgets):
        box = find_widget(page, widget.control)
        box.scroll_into_view_if_needed()
        assert not unmoved_controls(box, widget.steps), (
            f"{lesson.name}: the widget with {widget.control!r} has controls no step moves: "
            f"{unmoved_controls(box, widget.steps)}; add a Step for each")
        for step in widget.steps:
            # no time limit but the harness's own (a view that never changes fails)
            change = change_control(page, box, step.act, expect=step.expect, timeout=60)
            step.check(change, page)
        shot = ARTIFACTS / "screenshots" / (f"{lesson.name}.png" if n == 0 else f"{lesson.name}-{n + 1}.png")
        shot.parent.mkdir(parents=True, exist_ok=True)
        box.locator("xpath=ancestor::div[contains(@class, 'jp-CodeCell')][1]").screenshot(path=str(shot))


# --- the checker itself: a broken widget or a missing one must fail -------------------

BROKEN_CELLS = [
    "import ipywidgets as W\nfrom amp_lessons.widgets import live",
    # render() raises as soon as the control leaves its first value
    'mode = W.ToggleButtons(options=["ok", "boom"], value="ok", description="mode")\n'
    "def render():\n"
    '    if mode.value == "boom":\n'
    '        raise RuntimeError("render failed on purpose")\n'
    '    return f"mode {mode.value}"\n'
    "live([mode], render)",
    # a working widget beside it, so the page is known to render widgets
    'good = W.ToggleButtons(options=["a", "b"], value="a", description="good")\n'
    'live([good], lambda: f"good {good.value}")',
]


@pytest.fixture(scope="module")
def probe_notebook(lab) -> str:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "name": "python3",
    }
    nb.cells = [nbformat.v4.new_code_cell(src) for src in BROKEN_CELLS]
    name = "zz_widget_probe.ipynb"
    nbformat.write(nb, lab.root / name)
    return name


@pytest.mark.browser
def test_checker_passes_a_working_widget_and_fails_a_broken_one(probe_notebook, lesson_page):
    page = lesson_page(probe_notebook)
    run_all(page)

    good = find_widget(page, "good")
    change = change_control(page, good, toggle("good", "b"))
    assert change.text(0).strip() == "good b"

    broken = find_widget(page, "mode")
    with pytest.raises(LabError, match="log console|error output|did not change") as failure:
        change_control(page, broken, toggle("mode", "boom"), timeout=5)
    assert "render failed on purpose" in str(failure.value)


@pytest.mark.browser
def test_checker_fails_when_the_widget_is_missing(probe_notebook, lesson_page):
    page = lesson_page(probe_notebook)
    run_all(page)
    with pytest.raises(LabError, match="no rendered widget with a control labelled 'loss scale'"):
        find_widget(page, "loss scale", timeout=2)


@pytest.mark.browser
def test_checker_fails_when_run_all_stops_early(lab, lesson_page):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "name": "python3",
    }
    nb.cells = [
        nbformat.v4.new_code_cell(s) for s in ("1 + 1", "raise ValueError('stop here')", "2 + 2")
    ]
    nbformat.write(nb, lab.root / "zz_stops.ipynb")
    page = lesson_page("zz_stops.ipynb")
    with pytest.raises(LabError, match=r"(?s)did not run code cells \[2\].*stop here"):
        run_all(page)
