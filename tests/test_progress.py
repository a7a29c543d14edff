"""Progress bars: a widget view with no text in notebooks (nbval compares no part of it), tqdm elsewhere."""

import pytest

from amp_lessons import progress


def test_off_when_asked(monkeypatch):
    monkeypatch.setenv(progress.ENV, "0")
    assert progress.bar(10, "x") is None
    assert progress.bar(10, "x", progress=False) is None
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.progress_enabled() and not progress.progress_enabled(False)


def test_outside_a_kernel_it_is_tqdm_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setattr(progress, "_in_kernel", lambda: False)
    bar = progress.bar(3, "steps")
    bar.update(3)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and "steps" in captured.err


def test_in_a_kernel_the_bar_is_a_widget_view_only(monkeypatch):
    pytest.importorskip("ipywidgets")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setattr(progress, "_in_kernel", lambda: True)
    bar = progress.bar(20, "fp16 on cpu")
    assert isinstance(bar, progress.WidgetBar)
    (bundle, raw), = shown
    assert raw and list(bundle) == ["application/vnd.jupyter.widget-view+json"]  # no text/plain
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == bar._box.model_id
    for _ in range(20):
        bar.update()
    bar.set_postfix(loss="0.1")
    bar.update(0)
    assert bar._bar.value == 20 and bar._label.value.startswith("fp16 on cpu: 20/20")
    bar.close()
