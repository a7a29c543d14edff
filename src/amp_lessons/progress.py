"""Progress bars for everything slow (training runs, bench, side-by-side runs).

In a Jupyter kernel the bar is a small ipywidgets view (a progress bar and a label) that
is displayed *only* as a widget view, with no text fallback, and closes itself when done.
That matters for the course's tests: nbval compares every text output of a cell, but not
widget views, so a lesson prints the same compared text with bars on or off, on any
frontend. In a terminal (``bench``, ``gpu-check``) the bar is tqdm's, on stderr.

Bars show unless ``AMP_LESSONS_PROGRESS=0``; ``progress=False`` turns one off.
Used by ``training.Trainer.fit`` (01, 03-05), ``bench`` (05) and the newer lessons.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "AMP_LESSONS_PROGRESS"


def progress_enabled(progress=None) -> bool:
    """``progress`` if given, else True unless ``AMP_LESSONS_PROGRESS=0``."""
    if progress is not None:
        return bool(progress)
    return os.environ.get(ENV, "1") != "0"


def _in_kernel() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ip = shell.get_ipython() if hasattr(shell, "get_ipython") else None
    return ip is not None and getattr(ip, "kernel", None) is not None


class WidgetBar:
    """A progress bar for notebooks: ``IntProgress`` + ``Label``, shown as a widget view only."""

    def __init__(self, total: int, desc: str, min_interval: float = 0.2):
        import ipywidgets as w
        from IPython.display import display

        self.total, self.n, self.desc = max(1, int(total)), 0, desc
        self.postfix = ""
        self._bar = w.IntProgress(value=0, min=0, max=self.total)
        self._label = w.Label(value=self._text())
        self._box = w.HBox([self._bar, self._label])
        self._last = 0.0
        self._min_interval = min_interval
        # The view alone: no text/plain, so a notebook's compared text is the same without it.
        view = {"version_major": 2, "version_minor": 0, "model_id": self._box.model_id}
        display({"application/vnd.jupyter.widget-view+json": view}, raw=True)

    def _text(self) -> str:
        return f"{self.desc}: {self.n}/{self.total}" + (f"  {self.postfix}" if self.postfix else "")

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self._min_interval or self.n >= self.total:
            self._last = now
            self._bar.value = min(self.n, self.total)
            self._label.value = self._text()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        self._box.close()


def bar(total: int, desc: str, progress=None):
    """A progress bar with ``update(n)``, ``set_postfix(**kw)`` and ``close()``, or ``None``
    when bars are off. A widget in a notebook, tqdm on stderr elsewhere."""
    if not progress_enabled(progress):
        return None
    if _in_kernel():
        try:
            return WidgetBar(total, desc)
        except ImportError:  # no ipywidgets: no bar rather than text the tests would compare
            return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
