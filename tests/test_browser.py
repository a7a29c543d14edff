"""The lessons' widgets as a learner uses them: JupyterLab in headless Chromium.

Each lesson is opened from a copy of its stored notebook, run with Run > Run All Cells,
and its widget's control is changed with real clicks and key presses; the view must show
the expected new content within a second. ``make test-browser`` runs these; they need
Debian's chromium (``apt-get install chromium``): without it they skip, or fail under CI.
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

from _browser_lab import (
    Change,
    LabError,
    LabServer,
    change_control,
    dropdown,
    find_chromium,
    find_widget,
    launch_chromium,
    open_notebook,
    run_all,
    slider_keys,
    toggle,
)

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "artifacts"
RESPONSIVE_S = 1.0  # a widget must redraw within this, at the lesson's default sizes


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(what: str) -> None:
    if _in_ci():
        pytest.fail(f"{what} (CI=true: the browser tests must run)")
    pytest.skip(what)


# --- fixtures: one JupyterLab server and one Chromium for the whole module -----------


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        _missing("chromium not found: install Debian's with `apt-get install chromium`")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    """A JupyterLab server on copies of the stored lessons; always stopped afterwards."""
    root = tmp_path_factory.mktemp("lessons")
    for nb in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        shutil.copy2(nb, root / nb.name)
        _DEVTAG(root / nb.name)  # DEV-ONLY
    server = LabServer(root, home=tmp_path_factory.mktemp("jupyter-home"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab, chromium, tmp_path_factory):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed: pip install -e '.[dev]'")
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


def _DEVTAG(p):  # DEV-ONLY
    nb = nbformat.read(p, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code" and "NBVAL_RAISES_EXCEPTION" in c.source:
            c.metadata.setdefault("tags", []).append("raises-exception")
    nbformat.write(nb, p)


def report(capsys, line: str) -> None:
    """Print into the test run's output even when pytest captures it."""
    with capsys.disabled():
        print(line, flush=True)


# --- the lessons' widgets ------------------------------------------------------------


def _text(expected: Callable[[], str]) -> Callable[[Change], None]:
    def check(change: Change) -> None:
        assert change.kind == "html"
        assert change.after.strip() == expected().strip()

    return check


def _contains(*parts: str) -> Callable[[Change], None]:
    def check(change: Change) -> None:
        assert change.kind == "html"
        for part in parts:
            assert part in change.after, f"{part!r} not in the view:\n{change.after}"

    return check


def _new_image(change: Change) -> None:
    assert change.kind == "image"
    assert change.after.startswith("blob:") or change.after.startswith("data:image/png")
    assert change.after_digest, "the view's image did not decode"


def _describe(name: str) -> Callable[[], str]:
    def expected() -> str:
        from amp_lessons.widgets import describe_precision

        return describe_precision(name)

    return expected


def _autocast_table(model: str, precision: str) -> Callable[[], str]:
    def expected() -> str:
        from amp_lessons.widgets import autocast_table

        return autocast_table(model, precision)

    return expected


@dataclass
class Step:
    act: Callable  # changes a control with real input events
    check: Callable[[Change], None]  # asserts the view's new content


@dataclass
class LessonWidget:
    lesson: str  # notebook stem
    control: str  # label of the control that finds the widget
    steps: list[Step] = field(default_factory=list)
    initial: Callable[[Change], None] | None = None


LESSONS = [
    LessonWidget(
        "00_start_here",
        "precision",
        steps=[
            Step(toggle("precision", "fp16"), _text(_describe("fp16"))),
            Step(toggle("precision", "fp32"), _text(_describe("fp32"))),
            Step(toggle("precision", "tf32"), _text(_describe("tf32"))),
        ],
    ),
    LessonWidget(
        "01_number_formats",
        "loss scale",
        steps=[
            Step(slider_keys("loss scale", "ArrowRight", 4), _new_image),
            Step(slider_keys("loss scale", "ArrowLeft", 8), _new_image),
            Step(slider_keys("loss scale", "ArrowRight", 2), _new_image),
        ],
    ),
    LessonWidget(
        "02_autocast",
        "dtype",
        steps=[
            Step(toggle("dtype", "float16"), _text(_autocast_table("card_model", "fp16"))),
            Step(toggle("model", "TransformerBlock"), _text(_autocast_table("TransformerBlock", "fp16"))),
            Step(toggle("dtype", "bfloat16"), _text(_autocast_table("TransformerBlock", "bf16"))),
        ],
    ),
    LessonWidget(
        "03_grad_scaler",
        "init_scale",
        steps=[
            Step(slider_keys("init_scale", "ArrowRight", 4), _new_image),
            Step(slider_keys("init_scale", "ArrowLeft", 8), _new_image),
        ],
    ),
]
_ = dropdown  # available for lessons whose control is a Dropdown


@pytest.mark.parametrize("spec", LESSONS, ids=[s.lesson for s in LESSONS])
def test_lesson_widget_responds_in_jupyterlab(spec: LessonWidget, lesson_page, capsys):
    notebook = NOTEBOOKS / f"{spec.lesson}.ipynb"
    if not notebook.exists():
        pytest.skip(f"{notebook.name} is not in notebooks/ yet")
    page = lesson_page(notebook.name)
    seconds = run_all(page)
    box = find_widget(page, spec.control)
    box.scroll_into_view_if_needed()

    latencies = []
    report(capsys, "")
    for step in spec.steps:
        change = change_control(page, box, step.act)
        step.check(change)
        latencies.append(change.latency_s)
        report(capsys, f"  {spec.lesson}: {step.act.__doc__}: view updated in {change.latency_s * 1000:.0f} ms")

    shot = ARTIFACTS / "screenshots" / f"{spec.lesson}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    box.locator("xpath=ancestor::div[contains(@class, 'jp-CodeCell')][1]").screenshot(path=str(shot))
    median = statistics.median(latencies)
    report(
        capsys,
        f"  {spec.lesson}: Run All {seconds:.1f} s; widget {spec.control!r}: median {median * 1000:.0f} ms, "
        f"max {max(latencies) * 1000:.0f} ms over {len(latencies)} changes; screenshot {shot.relative_to(ROOT)}",
    )
    assert median < RESPONSIVE_S, f"{spec.lesson}'s widget took {latencies} s to redraw (limit {RESPONSIVE_S} s)"


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
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in BROKEN_CELLS]
    name = "zz_widget_probe.ipynb"
    nbformat.write(nb, lab.root / name)
    return name


def test_checker_passes_a_working_widget_and_fails_a_broken_one(probe_notebook, lesson_page):
    page = lesson_page(probe_notebook)
    run_all(page)

    good = find_widget(page, "good")
    change = change_control(page, good, toggle("good", "b"))
    assert change.after.strip() == "good b"

    broken = find_widget(page, "mode")
    with pytest.raises(LabError, match="log console|error output|did not change") as failure:
        change_control(page, broken, toggle("mode", "boom"), timeout=5)
    print("FAILURE:", failure.value)
    assert "render failed on purpose" in str(failure.value)


def test_checker_fails_when_the_widget_is_missing(probe_notebook, lesson_page):
    page = lesson_page(probe_notebook)
    run_all(page)
    with pytest.raises(LabError, match="no rendered widget with a control labelled 'loss scale'"):
        find_widget(page, "loss scale", timeout=2)


def test_checker_fails_when_run_all_stops_early(lab, lesson_page):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in ("1 + 1", "raise ValueError('stop here')", "2 + 2")]
    nbformat.write(nb, lab.root / "zz_stops.ipynb")
    page = lesson_page("zz_stops.ipynb")
    with pytest.raises(LabError, match=r"(?s)did not run code cells \[2\].*stop here"):
        run_all(page)
