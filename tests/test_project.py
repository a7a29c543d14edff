"""The course as a learner meets it: the README's commands, the setup cell, the environments."""

import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REPO_URL = PYPROJECT["project"]["urls"]["Repository"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def first_code_cell(path):
    nb = nbformat.read(path, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


def test_there_are_lessons():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_start_here.ipynb"]


def test_setup_cell_is_identical_in_every_notebook():
    cells = {p.name: first_code_cell(p) for p in NOTEBOOKS}
    reference = cells["00_start_here.ipynb"]
    assert "google.colab" in reference and "seed_everything(0)" in reference
    different = [name for name, src in cells.items() if src != reference]
    assert not different, f"setup cell differs from 00_start_here's in: {different}"


def test_setup_cell_installs_from_the_declared_repository_without_pinning_widgets():
    src = first_code_cell(NOTEBOOKS[0])
    urls = re.findall(r'REPO = "([^"]+)"', src)
    assert urls == [REPO_URL]
    assert "ipywidgets==" not in src and "ipywidgets>" not in src
    assert "--no-deps" in src  # Colab's torch and ipywidgets stay as they are


GIT_SAYS = {  # what git prints when a clone fails, by cause
    "offline": "fatal: unable to access '{url}/': Could not resolve host: github.com",
    "renamed": "remote: Repository not found.\nfatal: repository '{url}/' not found",
    "private": "fatal: could not read Username for 'https://github.com': No such device or address",
}


def _setup_cell_on_colab(tmp_path, git=None):
    """Run 00's setup cell as Colab would, before the package is installed: google.colab
    imported, no amp_lessons to find (python -S: no site-packages), and a `git` that fails
    the way ``git`` says (None: no git at all). pip is the real one; it installs into a
    scratch folder, if ever it gets that far."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if git is not None:
        said = GIT_SAYS[git].format(url=REPO_URL).replace("'", "'\\''")
        (bin_dir / "git").write_text('#!/bin/sh\nif [ "$1" = version ]; then echo "git version 2.39.2"; exit 0; fi\n'
                                    f"printf '%s\\n' '{said}' >&2\nexit 128\n")
        (bin_dir / "git").chmod(0o755)
    code = ("import sys, types; sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
            + first_code_cell(NOTEBOOKS[0]))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PIP_TARGET": str(tmp_path / "target"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("git, says", [
    (None, "Git is not installed here: run `!apt-get install -y git`"),
    ("offline", "This runtime cannot reach GitHub (offline?): reconnect it (Runtime > Reconnect)"),
    ("renamed", f"{REPO_URL} was not found, or is private: open the lesson from the course's README"),
    ("private", f"{REPO_URL} was not found, or is private"),
])
def test_a_failed_colab_install_says_what_to_do(tmp_path, git, says):
    done = _setup_cell_on_colab(tmp_path, git)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: The course package did not install. ") and says in last, done.stderr
    assert "CalledProcessError" not in done.stderr
    if git is not None:  # pip's own account is shown above the advice, git's line in it
        assert "git clone" in done.stdout and GIT_SAYS[git].splitlines()[-1].format(url=REPO_URL) in done.stdout
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("how", ["amp-lessons", "python -m amp_lessons"])
def test_help_names_the_command_it_was_run_by(how):
    script = Path(sys.executable).parent / "amp-lessons"
    if how == "amp-lessons" and not script.exists():
        pytest.skip(f"no {script}: this environment did not install the package's command")
    argv = [str(script)] if how == "amp-lessons" else [sys.executable, "-m", "amp_lessons"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {how} [-h]"), done.stdout + done.stderr


def test_readme_links_every_lesson_in_colab():
    readme = (ROOT / "README.md").read_text()
    slug = REPO_URL.removeprefix("https://github.com/")
    for nb in NOTEBOOKS:
        link = f"https://colab.research.google.com/github/{slug}/blob/main/notebooks/{nb.name}"
        assert link in readme, f"README has no Open-in-Colab link for {nb.name}"


def test_readme_commands_are_the_makefile_targets_ci_calls():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert re.search(r"^make lab\b", first_block, re.M) and re.search(r"^make test\b", first_block, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^make test TORCH_SPEC="\$TORCH_SPEC"$', ci, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lab:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def _requirements_of_pyproject():
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    return set(project["dependencies"]) | set(extras["dev"]) | set(extras["lab"])


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {r for r in pip_section if not r.startswith("-e")}
    assert listed == _requirements_of_pyproject()
    assert "-e .[lab]" in pip_section
    assert any(str(d).startswith("python") for d in env["dependencies"])


def test_every_notebook_has_a_kernelspec_and_a_jupytext_pair():
    for nb_path in NOTEBOOKS:
        nb = nbformat.read(nb_path, as_version=4)
        assert nb.metadata["kernelspec"]["name"] == "python3", nb_path.name
        assert nb_path.with_suffix(".py").exists(), f"{nb_path.name} has no .py pair"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_lesson_stops_run_all(path):
    """"Run all" stops at the first error unless the frontend honours the raises-exception
    tag, which not every one does (Colab does not document it): a cell that fails on
    purpose uses expect_error and prints instead."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [i + 1 for i, c in enumerate(code) if any(o.output_type == "error" for o in c.outputs)]
    tagged = [i + 1 for i, c in enumerate(code) if "raises-exception" in c.metadata.get("tags", [])
              or "NBVAL_RAISES_EXCEPTION" in c.source]
    assert not errors and not tagged, f"code cells with an error output {errors}, tagged to raise {tagged}"


@pytest.mark.parametrize("job, python", [("matrix-unit-colab", "PYTHON_COLAB"), ("matrix-lessons-newest", "PYTHON_NEWEST"),
                                         ("test-colab", "PYTHON_COLAB")])
def test_a_matrix_job_without_its_python_is_skipped_saying_so(tmp_path, job, python):
    skipped = tmp_path / "skipped.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-s", "--no-print-directory", job, f"{python}=", f"SKIPPED={skipped}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    version = "3.12" if python == "PYTHON_COLAB" else "3.13"
    line = f"!! SKIPPED {job}: no Python {version} here"
    assert done.returncode == 0 and done.stdout.startswith(line), done.stdout + done.stderr
    assert f"make {job} {python}=/path/to/python{version}" in done.stdout
    assert skipped.read_text() == done.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, deadline, proc):
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(1)


@pytest.mark.skipif(not (Path(sys.prefix) / ".installed").exists() and not os.environ.get("CI"),
                    reason="make lab is checked where the Makefile built this environment")
@pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None,
                    reason="no JupyterLab in this environment (make lab installs the lab extra; Colab's has none)")
def test_make_lab_serves_a_working_copy_of_the_lessons(tmp_path):
    """As root too: make lab passes --allow-root itself (the arguments here do not)."""
    port, token = _free_port(), secrets.token_hex(16)
    lab_dir = tmp_path / "lab"
    stored = {p: p.read_bytes() for p in NOTEBOOKS}
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    proc = subprocess.Popen(["make", "-s", "lab", f"VENV={sys.prefix}", f"LAB_DIR={lab_dir}", f"LAB_ARGS={args}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base, auth = f"http://127.0.0.1:{port}", f"?token={token}"
    try:
        deadline = time.monotonic() + 90
        body = _get(f"{base}/api/contents/00_start_here.ipynb{auth}", deadline, proc)
        assert '"name": "00_start_here.ipynb"' in body or '"name":"00_start_here.ipynb"' in body
        assert "seed_everything" in body
        listing = json.loads(_get(f"{base}/api/contents{auth}", deadline, proc))
        assert sorted(c["name"] for c in listing["content"]) == [p.name for p in NOTEBOOKS]  # each lesson once
        page = _get(f"{base}/lab{auth}", deadline, proc)
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        assert config["news"] == {"disabled": True}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(p.name for p in lab_dir.iterdir() if not p.name.startswith(".")) == [p.name for p in NOTEBOOKS]
    assert {p: p.read_bytes() for p in NOTEBOOKS} == stored  # the stored lessons untouched
