"""What the loop checker reads and how it runs: notebooks cell by cell, directories, any source
Python accepts, a clear message for what it cannot read (the run goes on), JSON, exit codes,
no torch import, and work in proportion to the size of the file."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import amp_lessons.lint as lint
from amp_lessons.lint import LintError, check_loop
from amp_lessons.lint.cli import run

ROOT = Path(__file__).resolve().parents[1]
LINT_DIR = str(Path(lint.__file__).parent)

CLIP_FIRST = """\
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
"""


def notebook(*cells) -> str:
    """A minimal .ipynb: each cell is (cell_type, source)."""
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": kind, "metadata": {}, "source": src, **({"outputs": [], "execution_count": None}
                                                               if kind == "code" else {})}
        for kind, src in cells]})


def lint_cli(*paths, fmt="text"):
    """``run`` on paths: (status, stdout, stderr)."""
    import io

    out, err = io.StringIO(), io.StringIO()
    status = run([str(p) for p in paths], out=out, err=err, fmt=fmt)
    return status, out.getvalue(), err.getvalue()


# --- notebooks --------------------------------------------------------------------------------


def test_a_notebook_is_checked_cell_by_cell(tmp_path):
    path = tmp_path / "loop.ipynb"
    path.write_text(notebook(("markdown", "# A loop"), ("code", "import torch\n%matplotlib inline"),
                             ("code", CLIP_FIRST)))
    (f,) = check_loop(path)
    assert (f.code, f.cell, f.line) == ("clip-before-unscale", 2, 5)
    as_py = tmp_path / "loop.py"
    as_py.write_text(CLIP_FIRST)
    assert check_loop(as_py).codes == check_loop(path).codes
    status, out, _ = lint_cli(path)
    assert status == 1 and f"{path}:cell 2:5: mistake: [clip-before-unscale]" in out


def test_a_magic_is_a_statement_where_it_stands(tmp_path):
    path = tmp_path / "setup.ipynb"
    path.write_text(notebook(("code", "if colab:\n    !pip install amp-lessons\nelif local:\n    %pip install -e .\n"
                                      "model?\n" + CLIP_FIRST)))
    (f,) = check_loop(path)
    assert (f.cell, f.line, f.code) == (1, 10, "clip-before-unscale")


def test_a_notebook_cell_that_is_not_python_is_named_and_the_others_checked(tmp_path):
    path = tmp_path / "loop.ipynb"
    path.write_text(notebook(("code", "with torch.autocast('cuda'):\nloss = model(x)"), ("code", "%%bash\nls -l"),
                             ("code", CLIP_FIRST.replace("1.0)\n", "1.0)  # amp-lint: ignore\n"))))
    status, out, err = lint_cli(path)
    assert status == 2
    assert f"cannot parse {path}, cell 1: expected an indented block" in err
    assert f"{path}: no findings" in out


def test_a_file_that_is_not_a_notebook_says_so(tmp_path):
    path = tmp_path / "broken.ipynb"
    path.write_text("{not json")
    with pytest.raises(LintError, match=r"cannot read .*broken.ipynb as a notebook .*Jupyter"):
        check_loop(path)


# --- directories and encodings ----------------------------------------------------------------


def test_directories_are_read_recursively_leaving_out_environments(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "train.py").write_text(CLIP_FIRST)
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n")
    (tmp_path / ".venv" / "lib" / "bad.py").write_text(CLIP_FIRST)
    status, out, err = lint_cli(tmp_path)
    assert status == 1 and not err
    assert "sub/train.py:5: mistake: [clip-before-unscale]" in out and "ok.py: no findings" in out
    assert ".venv" not in out


def test_an_empty_directory_is_named(tmp_path):
    status, _, err = lint_cli(tmp_path)
    assert status == 2 and f"{tmp_path}: no Python files" in err


@pytest.mark.parametrize("encoding,head", [("latin-1", b"# -*- coding: latin-1 -*-\n"), ("utf-8-sig", b"")])
def test_source_python_accepts_is_read(tmp_path, encoding, head):
    path = tmp_path / "train.py"
    path.write_bytes(head + "# Schrittweite: é\n".encode(encoding) + CLIP_FIRST.encode())
    (f,) = check_loop(path)
    assert f.code == "clip-before-unscale" and f.line == 5 + 1 + bool(head)


UNREADABLE = {  # name: (bytes, the message naming what is wrong)
    "a NUL byte": (b"x = 1\n\0y = 2\n", r"holds a NUL byte \(line 2\)"),
    "bad UTF-8": (b"x = '\xff'\n", r"byte 0xff at line 1 is not utf-8"),
    "a wrong coding line": (b"# -*- coding: no-such-codec -*-\nx = 1\n", r"unknown encoding"),
    "a syntax error": (b"def f(:\n", r"cannot parse .*: invalid syntax"),
    "nesting Python's parser refuses": (b"x = " + b"(" * 300 + b"1" + b")" * 300 + b"\n", r"cannot parse"),
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_unreadable_files_are_named_and_the_run_goes_on(tmp_path, name):
    data, message = UNREADABLE[name]
    bad, good = tmp_path / "a_bad.py", tmp_path / "b_good.py"
    bad.write_bytes(data)
    good.write_text(CLIP_FIRST)
    status, out, err = lint_cli(bad, good)
    assert status == 2
    assert str(bad) in err and pytest.importorskip("re").search(message, err), err
    assert f"{good}:5: mistake: [clip-before-unscale]" in out


def test_a_long_expression_python_parses_is_checked():
    source = "total = " + "+".join(["1"] * 1500) + "\n" + CLIP_FIRST
    assert check_loop(source).codes == ["clip-before-unscale"]


def test_a_directory_named_like_a_file_is_read_as_a_directory(tmp_path):
    folder = tmp_path / "train.py"
    folder.mkdir()
    (folder / "loop.py").write_text(CLIP_FIRST)
    status, out, _ = lint_cli(folder)
    assert status == 1 and "loop.py:5" in out
    with pytest.raises(LintError, match="it is a directory"):
        check_loop(folder)


def test_a_missing_path_is_named(tmp_path):
    status, _, err = lint_cli(tmp_path / "missing.py")
    assert status == 2 and "missing.py: no such file or directory" in err


# --- output and exit codes --------------------------------------------------------------------


def test_json_output(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(CLIP_FIRST)
    bad.write_bytes(b"\0")
    status, out, err = lint_cli(good, bad, fmt="json")
    report = json.loads(out)
    assert status == 2 and not err
    (f,) = report["findings"]
    assert f == {"file": str(good), "cell": None, "line": 5, "code": "clip-before-unscale", "kind": "mistake",
                 "message": f["message"], "lesson": "04_clipping"}
    assert [e["file"] for e in report["errors"]] == [str(bad)]


def test_exit_codes(tmp_path):
    paths = {name: tmp_path / f"{name}.py" for name in ("clean", "note", "mistake")}
    paths["clean"].write_text("x = 1\n")
    paths["note"].write_text("with torch.autocast('cuda', dtype=torch.bfloat16):\n    model(x).sum().backward()\n")
    paths["mistake"].write_text(CLIP_FIRST)
    assert [lint_cli(paths[n])[0] for n in ("clean", "note", "mistake")] == [0, 0, 1]


def test_list_rules_prints_the_table(capsys):
    from amp_lessons.__main__ import main

    assert main(["lint", "--list-rules"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [r.name for r in lint.RULES]


def test_pre_commit_hook_runs_the_checker():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "id: amp-lint" in text and "entry: python -m amp_lessons lint" in text
    assert "types_or: [python, jupyter]" in text


# --- no torch for a static check --------------------------------------------------------------


def test_lint_leaves_torch_unimported(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(CLIP_FIRST)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": ""}
    run_ = subprocess.run([sys.executable, "-X", "importtime", "-m", "amp_lessons", "lint", str(path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert run_.returncode == 1, run_.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in run_.stderr.splitlines() if "|" in line]
    assert "amp_lessons.lint.rules" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "numpy")]
    probe = subprocess.run([sys.executable, "-c", "import sys, amp_lessons.lint; print('torch' in sys.modules)"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_the_package_exports_still_import():
    import amp_lessons
    from amp_lessons import (
        PRECISIONS,
        hardware_report,
        parse_precision,
        pick_device,
        seed_everything,
    )

    assert callable(hardware_report) and callable(pick_device) and callable(seed_everything)
    assert parse_precision("bf16") in PRECISIONS
    assert set(amp_lessons.__all__) <= set(dir(amp_lessons))
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        amp_lessons.nothing  # noqa: B018


# --- work in proportion to the size -----------------------------------------------------------


def _benchmark():
    spec = importlib.util.spec_from_file_location("lint_speed", ROOT / "benchmarks" / "lint_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lines_run(source: str) -> int:
    """The lines of the checker's own code (and of :mod:`ast`) executed on ``source``: its work."""
    count = 0
    watched = (LINT_DIR, str(Path(__import__("ast").__file__)))

    def trace(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(watched):
            return None
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        check_loop(source)
    finally:
        sys.settrace(None)
    return count


NESTED = "for a in x:\n" + "".join("    " * (d + 1) + f"for v{d} in y:\n" for d in range(18)) + \
    "\n".join("    " * 19 + line for line in CLIP_FIRST.splitlines()[1:]) + "\n"


@pytest.mark.parametrize("shape", ["functions", "loop", "nested"])
def test_the_work_grows_in_proportion_to_the_file(shape):
    """About four times the source, at most 1.1 times that ratio in work (the cubic growth of comparing
    event records by value, or a loop followed twice per enclosing loop, would show here)."""
    if shape == "nested":
        small, large = NESTED * 2, NESTED * 8
    else:
        make = _benchmark().generated
        small, large = make(10_000, shape), make(40_000, shape)
    ratio = len(large) / len(small)
    assert 3.5 < ratio < 4.5
    assert lines_run(large) <= 1.1 * ratio * lines_run(small)
