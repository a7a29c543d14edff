"""JupyterLab in headless Chromium, driven the way a learner drives it.

Used by tests/test_browser.py: start a JupyterLab server on copies of the lessons, open
a lesson, Run > Run All Cells, find a widget by its control's label, change the control
with real mouse and keyboard events, and wait for the widget's view to show new content,
timing it in the browser from the input event to the view's update.
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
    for candidate in (os.environ.get("AMP_LESSONS_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
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
        log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise LabError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise LabError(f"jupyter lab did not answer in {timeout:.0f} s:\n{self.log_tail()}") from None
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
            except Exception:  # noqa: BLE001 - stopping anyway
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

# Installed in every page: remember when the last user input happened, and read views.
_PAGE_JS = r"""
(() => {
  if (window.__amp) return;
  const amp = window.__amp = {lastInput: null};
  for (const type of ['click', 'keydown', 'change']) {
    document.addEventListener(type, () => { amp.lastInput = performance.now(); }, true);
  }
  amp.content = (view) => {
    if (view.tagName === 'IMG') return view.getAttribute('src') || '';
    const inner = view.querySelector('.widget-html-content');
    return (inner || view).textContent;
  };
  amp.errors = () => Array.from(document.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
    .map((e) => e.innerText);
  // Output of a widget callback (an error, a warning) goes to JupyterLab's log console.
  amp.logCount = () => {
    const item = document.querySelector('.jp-LogConsoleStatusItem [title]');
    const m = item && /(\d+) log entr/.exec(item.getAttribute('title'));
    return m ? Number(m[1]) : 0;
  };
})();
"""

_PROMPTS_JS = "() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')).map(e => e.textContent.trim())"

_STATUS = ".jp-StatusBar-Item:has-text('ipykernel) |')"


def open_notebook(context, server: LabServer, notebook: str, timeout: float = 90):
    """Open ``notebook`` in its own workspace and wait for its kernel to be idle."""
    page = context.new_page()
    page.add_init_script(_PAGE_JS)
    page.goto(server.url(notebook, workspace=Path(notebook).stem.replace(".", "_")))
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=timeout * 1000)
    page.locator(_STATUS).filter(has_text="Idle").wait_for(timeout=timeout * 1000)
    return page


def run_all(page, timeout: float = 120) -> float:
    """Run > Run All Cells, wait for every cell to finish; return the seconds taken.

    Fails when Run All did not reach the last cell (JupyterLab stops at the first error
    unless the cell carries the ``raises-exception`` tag), naming the error it stopped at.
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
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    page.wait_for_function("() => window.__amp.runStarted", timeout=15_000)
    page.wait_for_function(
        f"""() => !({_PROMPTS_JS})().some(p => p.includes('*'))""", timeout=timeout * 1000, polling=200
    )
    page.locator(_STATUS).filter(has_text="Idle").wait_for(timeout=timeout * 1000)
    seconds = time.monotonic() - start
    prompts = page.evaluate(_PROMPTS_JS)
    not_run = [i for i, p in enumerate(prompts) if not p.strip("[]: ").isdigit()]
    if not_run:
        errors = page.evaluate("() => window.__amp.errors()")
        last = errors[-1][-1500:] if errors else "(no error output)"
        raise LabError(
            f"Run All Cells did not run code cells {not_run} of {len(prompts)} (prompts {prompts}). "
            "JupyterLab stops Run All at the first error; a cell meant to raise needs the "
            f"'raises-exception' cell tag. Last error shown:\n{last}"
        )
    return seconds


def widgets_on_page(page) -> list[str]:
    """The labels of every control inside a rendered widget box (for error messages)."""
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('.jp-OutputArea-output .widget-box label.widget-label'))"
        ".map(e => e.textContent.trim()).filter(Boolean)"
    )


def find_widget(page, control: str, timeout: float = 20):
    """The rendered live() box holding a control labelled ``control``; fails if there is none.

    A box counts only when it rendered as a widget (not its text repr) and its last child is
    a view: an HTML widget or an Image.
    """
    boxes = page.locator(".jp-OutputArea-output .widget-box").filter(
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
    box = boxes.last  # the innermost box holding the control: live()'s own box
    kind = box.evaluate(
        "b => { const v = b.lastElementChild; return v && (v.tagName === 'IMG' ? 'image'"
        " : v.classList.contains('widget-html') ? 'html' : null); }"
    )
    if kind is None:
        raise LabError(f"the widget with {control!r} has no HTML or Image view as its last child")
    return box


@dataclass
class Change:
    """What happened after a control changed: the view's content before and after."""

    kind: str  # "html" or "image"
    before: str
    after: str
    latency_s: float
    after_digest: str = ""


def change_control(page, box, act, timeout: float = 10) -> Change:
    """Do ``act(box)`` (real input events) and wait for the box's view to show new content.

    The latency is measured in the browser, from the last input event (click, keydown,
    change) to the mutation that put new content in the view. Fails when the view does
    not change within ``timeout`` seconds or when an error output appears meanwhile.
    """
    view = box.locator(":scope > :last-child")
    state = view.evaluate(
        """v => {
          const amp = window.__amp;
          amp.changedAt = null;
          amp.errorsBefore = amp.errors().length;
          amp.logBefore = amp.logCount();
          const before = amp.content(v);
          amp.before = before;
          const obs = new MutationObserver(() => {
            if (amp.content(v) !== before) { amp.changedAt = performance.now(); obs.disconnect(); }
          });
          obs.observe(v, {subtree: true, childList: true, characterData: true, attributes: true});
          return {before, kind: v.tagName === 'IMG' ? 'image' : 'html'};
        }"""
    )
    act(box)
    try:
        page.wait_for_function(
            "() => window.__amp.changedAt !== null || window.__amp.errors().length > window.__amp.errorsBefore"
            " || window.__amp.logCount() > window.__amp.logBefore",
            timeout=timeout * 1000,
            polling=50,
        )
    except Exception as exc:  # playwright's TimeoutError
        if "Timeout" not in type(exc).__name__:
            raise
        raise LabError(
            f"the view did not change within {timeout:.0f} s after the control changed; "
            f"it still shows: {state['before'][:300]!r}"
        ) from None
    result = page.evaluate(
        "() => ({changedAt: window.__amp.changedAt, lastInput: window.__amp.lastInput,"
        " errors: window.__amp.errors().slice(window.__amp.errorsBefore),"
        " log: window.__amp.logCount() - window.__amp.logBefore})"
    )
    if result["errors"]:
        raise LabError("an error output appeared after the control changed:\n" + "\n".join(result["errors"])[-2000:])
    if result["log"]:
        raise LabError(
            "the widget's callback wrote to JupyterLab's log console after the control changed "
            f"(a learner does not see it there):\n{log_console_text(page)[-2000:]}"
        )
    after = view.evaluate("v => window.__amp.content(v)")
    change = Change(state["kind"], state["before"], after, (result["changedAt"] - result["lastInput"]) / 1000)
    if change.kind == "image":
        change.after_digest = view.evaluate(
            """async v => {
              await v.decode();
              if (!v.naturalWidth) return '';
              const buf = await (await fetch(v.src)).arrayBuffer();
              const d = await crypto.subtle.digest('SHA-256', buf);
              return Array.from(new Uint8Array(d)).map(b => b.toString(16).padStart(2, '0')).join('');
            }"""
        )
    return change


def log_console_text(page) -> str:
    """Open the log console from the status bar and return what it shows."""
    try:
        page.locator(".jp-LogConsoleStatusItem").click()
        panel = page.locator(".jp-LogConsolePanel").first
        panel.wait_for(timeout=5000)
        page.wait_for_timeout(500)
        return panel.inner_text()
    except Exception as exc:  # noqa: BLE001 - the failure is reported either way
        return f"(the log console could not be read: {exc})"


def image_digest(page, box) -> str:
    """SHA-256 of the PNG an Image view shows now ('' if it shows none)."""
    return box.locator(":scope > :last-child").evaluate(
        """async v => {
          if (!v.getAttribute('src')) return '';
          await v.decode();
          const buf = await (await fetch(v.src)).arrayBuffer();
          const d = await crypto.subtle.digest('SHA-256', buf);
          return Array.from(new Uint8Array(d)).map(b => b.toString(16).padStart(2, '0')).join('');
        }"""
    )


# --- ways to change a control --------------------------------------------------------


def toggle(label: str, option: str):
    """Click the ToggleButtons option ``option`` of the control labelled ``label``."""

    def act(box):
        control = box.locator(".widget-toggle-buttons").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        control.locator("button.widget-toggle-button").get_by_text(option, exact=True).click()

    act.__doc__ = f"{label} -> {option}"
    return act


def slider_keys(label: str, key: str = "ArrowRight", times: int = 1):
    """Focus the slider labelled ``label`` and press ``key`` (each press moves one step)."""

    def act(box):
        control = box.locator(".widget-slider").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        handle = control.locator(".noUi-handle, .ui-slider-handle").first
        handle.focus()
        for _ in range(times):
            handle.press(key)

    act.__doc__ = f"{label}: {key} x{times}"
    return act


def dropdown(label: str, option: str):
    """Choose ``option`` in the Dropdown labelled ``label``."""

    def act(box):
        control = box.locator(".widget-dropdown").filter(
            has=box.page.locator("label.widget-label").get_by_text(label, exact=True)
        )
        control.locator("select").select_option(label=option)

    act.__doc__ = f"{label} -> {option}"
    return act
