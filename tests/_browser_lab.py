"""JupyterLab in headless Chromium, driven the way a learner drives it.

Used by tests/test_browser.py: start a JupyterLab server on copies of the lessons, open
a lesson, Run > Run All Cells, find a widget by its control's label, change the control
with real mouse and keyboard events, and wait for the widget's view to show new content,
timing it in the browser from the input event to the view's update (and to the busy cue,
for a widget whose redraw takes a while). The tests only check that each control redraws;
the times are reported by benchmarks/widget_latency.py, run alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Debian's chromium run as root in a container: no sandbox, no GPU, no network of its own.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

# User settings for the test server only: no news pop-up, no update check.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


class LabError(AssertionError):
    """The lesson did not behave in JupyterLab as a learner would need it to."""


def find_chromium() -> str | None:
    """Debian's chromium (``apt-get install chromium``), or AMP_LESSONS_CHROMIUM."""
    for candidate in (
        os.environ.get("AMP_LESSONS_CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` from this interpreter's environment, on 127.0.0.1, serving ``root``."""

    def __init__(self, root: Path, home: Path):
        self.root = Path(root)
        self.home = Path(home)
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.home / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> LabServer:
        settings = self.home / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(self.home / "config"),
            JUPYTER_DATA_DIR=str(self.home / "data"),
            JUPYTER_RUNTIME_DIR=str(self.home / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(self.home / "workspaces"),
            JUPYTER_PLATFORM_DIRS="1",
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        env.pop("MPLBACKEND", None)  # the kernel picks the inline backend as it does for a learner
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser", "--allow-root",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=None",
            # a safety net should a test run be killed before its finalizer runs
            "--ServerApp.shutdown_no_activity_timeout=900",
            "--MappingKernelManager.cull_idle_timeout=900",
        ]  # fmt: skip
        log = open(self.log_path, "w")  # closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise LabError(
                    f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise LabError(
                        f"jupyter lab did not answer in {timeout:.0f} s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.25)

    def api(self, method: str, path: str):
        req = urllib.request.Request(
            self.base + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def url(self, notebook: str, workspace: str) -> str:
        return f"{self.base}/lab/workspaces/{workspace}/tree/{notebook}?token={self.token}"

    def shutdown_kernels(self) -> None:
        """End every kernel (each lesson's kernel holds torch in memory)."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server and its kernels: SIGTERM to its process group, SIGKILL after 15 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.shutdown_kernels()
            except Exception:  # stopping anyway
                pass
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        self.proc = None


def launch_chromium(playwright, executable: str, user_data_dir: Path):
    """A persistent Chromium context on a fresh profile folder."""
    return playwright.chromium.launch_persistent_context(
        str(user_data_dir),
        executable_path=executable,
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1280, "height": 1000},
    )


# --- the page ------------------------------------------------------------------------

# Installed in every page. ``amp.arm(box)`` snapshots a widget's views (its HTML and Image
# widgets) and watches them; the first input event after arming starts the clock.
_PAGE_JS = r"""
(() => {
  if (window.__amp) return;
  const amp = window.__amp = {armed: null};
  for (const type of ['click', 'keydown', 'input', 'change']) {
    document.addEventListener(type, () => {
      if (amp.armed && amp.armed.firstInput === null) amp.armed.firstInput = performance.now();
    }, true);
  }
  // Views: what a widget shows. Not views: the red render-error line and the busy cue.
  amp.views = (box) => Array.from(box.querySelectorAll(
      '.widget-html:not(.amp-render-error):not(.amp-busy), img'));
  amp.cues = (box) => Array.from(box.querySelectorAll('.amp-busy'));
  amp.content = (view) => {
    if (view.tagName === 'IMG') return view.getAttribute('src') || '';
    const inner = view.querySelector('.widget-html-content');
    return (inner || view).textContent;
  };
  amp.errors = () => Array.from(document.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
    .map((e) => e.textContent);
  // Output of a widget callback (an error, a warning) goes to JupyterLab's log console.
  amp.logCount = () => {
    const item = document.querySelector('.jp-LogConsoleStatusItem [title]');
    const m = item && /(\d+) log entr/.exec(item.getAttribute('title'));
    return m ? Number(m[1]) : 0;
  };
  amp.arm = (box, expect) => {
    const views = amp.views(box);
    const st = amp.armed = {
      firstInput: null, views, before: views.map(amp.content), changedAt: views.map(() => null),
      expect: expect === null ? views.map((_, i) => i) : expect,
      errorsBefore: amp.errors().length, logBefore: amp.logCount(), cueAt: null,
    };
    amp.cues(box).forEach((c) => {
      const obs = new MutationObserver(() => {
        if (st.cueAt === null && c.textContent.trim()) { st.cueAt = performance.now(); obs.disconnect(); }
      });
      obs.observe(c, {subtree: true, childList: true, characterData: true, attributes: true});
    });
    views.forEach((v, i) => {
      const obs = new MutationObserver(() => {
        if (st.changedAt[i] === null && amp.content(v) !== st.before[i]) {
          st.changedAt[i] = performance.now();
          obs.disconnect();
        }
      });
      obs.observe(v, {subtree: true, childList: true, characterData: true, attributes: true});
    });
    return {before: st.before, kinds: views.map(v => v.tagName === 'IMG' ? 'image' : 'html')};
  };
  amp.done = () => {
    const st = amp.armed;
    return st.expect.every(i => st.changedAt[i] !== null)
      || amp.errors().length > st.errorsBefore || amp.logCount() > st.logBefore;
  };
  amp.digest = async (view) => {
    if (!view.getAttribute('src')) return '';
    await view.decode();
    if (!view.naturalWidth) return '';
    const buf = await (await fetch(view.src)).arrayBuffer();
    const d = await crypto.subtle.digest('SHA-256', buf);
    return Array.from(new Uint8Array(d)).map(b => b.toString(16).padStart(2, '0')).join('');
  };
})();
"""

_PROMPTS_JS = "() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')).map(e => e.textContent.trim())"

_STATUS = ".jp-StatusBar-Item:has-text('ipykernel) |')"
IDLE_MS = 1500  # a kernel idle this long, with no cell pending, has finished Run All


def _is_timeout(exc: Exception) -> bool:
    return "Timeout" in type(exc).__name__


def open_notebook(context, server: LabServer, notebook: str, timeout: float = 90):
    """Open ``notebook`` in its own workspace and wait for its kernel to be idle."""
    page = context.new_page()
    page.add_init_script(_PAGE_JS)
    page.goto(server.url(notebook, workspace=Path(notebook).stem.replace(".", "_")))
    try:
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=timeout * 1000)
        page.locator(_STATUS).filter(has_text="Idle").wait_for(timeout=timeout * 1000)
    except Exception as exc:
        if not _is_timeout(exc):
            raise
        dialogs = page.locator(".jp-Dialog").all_inner_texts()
        raise LabError(
            f"{notebook} did not open with an idle kernel within {timeout:.0f} s"
            + (f"; a dialog is open: {dialogs}" if dialogs else "")
            + f"\nserver log:\n{server.log_tail()}"
        ) from None
    return page


def run_all(page, timeout: float = 120) -> float:
    """Run > Run All Cells, wait for every cell to finish; return the seconds taken.

    Fails when Run All did not reach the last cell (JupyterLab stops at the first error),
    naming the error it stopped at.
    """
    page.evaluate(
        """() => {
          window.__amp.runStarted = false;
          const obs = new MutationObserver(() => {
            if (Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
                .some(e => e.textContent.includes('*'))) { window.__amp.runStarted = true; obs.disconnect(); }
          });
          obs.observe(document.querySelector('.jp-Notebook'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    start = time.monotonic()
    page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    page.wait_for_function("() => window.__amp.runStarted", timeout=15_000)
    # Done when the kernel has been idle, with no cell pending, for a while: the status
    # flickers to idle between queued cells, and after an error in a cell tagged
    # raises-exception JupyterLab blanks the prompts of the queued cells, which still run.
    done = f"""() => {{
      const a = window.__amp, prompts = ({_PROMPTS_JS})(), sig = prompts.join(' ');
      const idle = Array.from(document.querySelectorAll('.jp-StatusBar-Item'))
        .some(e => e.textContent.includes('ipykernel) | Idle'));
      if (!idle || sig.includes('*') || sig !== a.runSig) {{
        a.runSig = sig; a.idleSince = performance.now(); return false;
      }}
      return performance.now() - a.idleSince > {IDLE_MS};
    }}"""
    try:
        page.wait_for_function(done, timeout=timeout * 1000, polling=100)
    except Exception as exc:
        if not _is_timeout(exc):
            raise
        raise LabError(
            f"Run All Cells had not finished after {timeout:.0f} s: {page.evaluate(_PROMPTS_JS)}"
        ) from None
    seconds = time.monotonic() - start - IDLE_MS / 1000
    prompts = page.evaluate(_PROMPTS_JS)
    not_run = [i for i, p in enumerate(prompts) if not p.strip("[]: ").isdigit()]
    if not_run:
        stopped_at = page.locator(".jp-Notebook .jp-CodeCell").nth(max(not_run[0] - 1, 0))
        error = stopped_at.evaluate(
            "c => Array.from(c.querySelectorAll('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]'))"
            ".map(e => e.textContent).join('\\n')"
        )
        raise LabError(
            f"Run All Cells did not run code cells {not_run} of {len(prompts)} (prompts {prompts}). "
            "JupyterLab stops Run All at an error (a cell that fails on purpose wraps its code in "
            f"amp_lessons.show.expect_error); code cell {not_run[0] - 1} shows:\n{error[-1500:] or '(no error output)'}"
        )
    return seconds


def cell_output(page, source_line: str) -> str:
    """The text output of the code cell whose source contains ``source_line``."""
    cells = page.locator(".jp-Notebook .jp-CodeCell").filter(
        has=page.locator(".jp-InputArea").get_by_text(source_line, exact=False)
    )
    if cells.count() != 1:
        raise LabError(f"expected one code cell containing {source_line!r}, found {cells.count()}")
    return cells.locator(".jp-OutputArea-output").first.evaluate("e => e.textContent")


def widgets_on_page(page) -> list[str]:
    """The labels of every control inside a rendered widget (for error messages)."""
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('.jp-OutputArea-output .widget-box label.widget-label'))"
        ".map(e => e.textContent.trim()).filter(Boolean)"
    )


def find_widget(page, control: str, timeout: float = 20):
    """The rendered widget (an output's top box) holding a control labelled ``control``.

    Fails, never passes vacuously, when no rendered widget has that control (the cell did
    not run, the widget shows its text repr, the label changed) or when it has no view
    (an HTML or Image widget) to check.
    """
    boxes = page.locator(".jp-OutputArea-output > .widget-box").filter(
        has=page.locator("label.widget-label").get_by_text(control, exact=True)
    )
    deadline = time.monotonic() + timeout
    while boxes.count() == 0:
        if time.monotonic() > deadline:
            raise LabError(
                f"no rendered widget with a control labelled {control!r} after {timeout:.0f} s; "
                f"controls on the page: {widgets_on_page(page)}"
            )
        page.wait_for_timeout(200)
    if boxes.count() > 1:
        raise LabError(f"{boxes.count()} widgets have a control labelled {control!r}; expected one")
    box = boxes.first
    if not box.evaluate("b => window.__amp.views(b).length"):
        raise LabError(f"the widget with {control!r} has no HTML or Image view")
    return box


def control_labels(box) -> dict[str, int]:
    """Each control's label in a rendered widget, with how many values a learner can pick
    there (buttons of a ToggleButtons, options of a Dropdown; 0: a slider or a text box,
    which always offer another value)."""
    return box.evaluate(
        """b => Object.fromEntries(Array.from(b.querySelectorAll('label.widget-label'))
             .filter(l => l.textContent.trim())
             .map(l => {
               const c = l.parentElement;
               const n = c.querySelectorAll('button.widget-toggle-button, option').length;
               return [l.textContent.trim(), n];
             }))"""
    )


@dataclass
class Change:
    """A widget's views (HTML text or Image src, in page order) before and after a change."""

    kinds: list[str]
    before: list[str]
    after: list[str]
    latency_s: float  # input event -> the last expected view updated
    digests: list[str]  # SHA-256 of each Image view's PNG after the change ('' for HTML)
    before_digests: list[str]  # and before it
    cue_s: float | None = None  # input event -> the busy cue showed (None: no cue shown)

    def text(self, i: int = 0) -> str:
        """The i-th HTML view's text."""
        return [a for k, a in zip(self.kinds, self.after, strict=True) if k == "html"][i]

    def images(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "image"]


def change_control(page, box, act, expect: list[int] | None = None, timeout: float = 10) -> Change:
    """Do ``act(box)`` (real input events) and wait for the widget's views to show new content.

    ``expect``: indices of the views that must change (default: all of them). The latency is
    measured in the browser, from the first input event to the mutation that put new
    content in the last expected view. Fails when a view does not change within ``timeout``
    seconds, or when an error output or a log-console entry appears meanwhile.
    """
    before_digests = box.evaluate(
        "b => Promise.all(window.__amp.views(b).map(v => v.tagName === 'IMG' ? window.__amp.digest(v) : ''))"
    )
    state = box.evaluate("(b, expect) => window.__amp.arm(b, expect)", expect)
    act(box)
    try:
        page.wait_for_function("() => window.__amp.done()", timeout=timeout * 1000, polling=50)
    except Exception as exc:
        if not _is_timeout(exc):
            raise
        st = page.evaluate(
            "() => ({changedAt: window.__amp.armed.changedAt, firstInput: window.__amp.armed.firstInput})"
        )
        still = [
            i
            for i, t in enumerate(st["changedAt"])
            if t is None and (expect is None or i in expect)
        ]
        raise LabError(
            f"view(s) {still} did not change within {timeout:.0f} s after the control changed "
            f"(input seen: {st['firstInput'] is not None}); they still show: "
            f"{[state['before'][i][:200] for i in still]}"
        ) from None
    st = page.evaluate(
        "() => { const a = window.__amp, st = a.armed; return {changedAt: st.changedAt, firstInput: st.firstInput,"
        " expect: st.expect, errors: a.errors().slice(st.errorsBefore), log: a.logCount() - st.logBefore,"
        " cueAt: st.cueAt}; }"
    )
    if st["errors"]:
        raise LabError(
            "an error output appeared after the control changed:\n"
            + "\n".join(st["errors"])[-2000:]
        )
    if st["log"]:
        raise LabError(
            "the widget's callback wrote to JupyterLab's log console after the control changed "
            f"(a learner does not see it there):\n{log_console_text(page)[-2000:]}"
        )
    if st["firstInput"] is None:
        raise LabError("the view changed, but no input event (click, key, input) was seen first")
    latency = (max(st["changedAt"][i] for i in st["expect"]) - st["firstInput"]) / 1000
    cue = None if st["cueAt"] is None else max(0.0, st["cueAt"] - st["firstInput"]) / 1000
    page.locator(_STATUS).filter(has_text="Idle").wait_for(timeout=timeout * 1000)
    page.wait_for_timeout(100)
    after = page.evaluate("() => window.__amp.armed.views.map(window.__amp.content)")
    digests = page.evaluate(
        "() => Promise.all(window.__amp.armed.views.map(v => v.tagName === 'IMG' ? window.__amp.digest(v) : ''))"
    )
    return Change(state["kinds"], state["before"], after, latency, digests, before_digests, cue)


def log_console_text(page) -> str:
    """Open the log console from the status bar and return what it shows."""
    try:
        page.locator(".jp-LogConsoleStatusItem").click()
        panel = page.locator(".jp-LogConsolePanel").first
        panel.wait_for(timeout=5000)
        page.wait_for_timeout(500)
        return panel.inner_text()
    except Exception as exc:  # the failure is reported either way
        return f"(the log console could not be read: {exc})"


# --- ways to change a control --------------------------------------------------------


def toggle(label: str, option: str):
    """Click the ToggleButtons option ``option`` of the control labelled ``label``."""

    def act(box):
        control = box.locator(".widget-toggle-buttons").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        control.locator("button.widget-toggle-button").get_by_text(option, exact=True).click()

    act.__doc__ = f"{label} -> {option}"
    act.label = label
    return act


def slider_key(label: str, key: str = "ArrowRight"):
    """Focus the slider labelled ``label`` and press ``key`` once (one step; PageUp: a page)."""

    def act(box):
        control = box.locator(".widget-slider").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        handle = control.locator(".noUi-handle, .ui-slider-handle").first
        handle.focus()
        handle.press(key)

    act.__doc__ = f"{label}: {key}"
    act.label = label
    act.walks = key in ("ArrowRight", "ArrowLeft", "ArrowUp", "ArrowDown")  # again: one step further
    return act


def type_text(label: str, text: str):
    """Replace the text of the Text box labelled ``label`` with ``text`` (one input event)."""

    def act(box):
        control = box.locator(".widget-text").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        control.locator("input").fill(text)

    act.__doc__ = f"{label} <- {text!r}"
    act.label = label
    return act


def dropdown(label: str, option: str):
    """Choose ``option`` in the Dropdown labelled ``label``."""

    def act(box):
        control = box.locator(".widget-dropdown").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        control.locator("select").select_option(label=option)

    act.__doc__ = f"{label} -> {option}"
    act.label = label
    return act
