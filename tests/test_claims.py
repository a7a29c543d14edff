"""Measured figures and verdicts (amp_lessons.claims): what nbval compares, and what it masks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from amp_lessons import claims
from amp_lessons.claims import ClaimFailed, at_least, at_most, between, check, measured

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ROOT / "notebooks" / "sanitize.cfg"


def _sanitize(text: str) -> str:
    from nbval.plugin import get_sanitize_patterns

    for regex, replace in get_sanitize_patterns(SANITIZE.read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_measured_marks_the_figure():
    assert measured(1.32049, ".3f") == "≈1.320"
    assert measured(0.25, ".0%") == "≈25%"
    assert measured(0.284, "6.1%") == "≈28.4%"  # padding would leave the digits outside the mask


def test_verdict_lines_hold_and_fail():
    v = at_least("fp16 ends with at least 2x fp32's loss", 6.1, 2)
    assert v.holds and str(v) == "✓ holds: fp16 ends with at least 2x fp32's loss (≈6.1; needs >= 2)"
    w = at_least("fp16 ends with at least 2x fp32's loss", 1.4, 2)
    assert not w.holds and str(w).startswith("✗ did not hold here: fp16 ends with")
    assert at_most("small", 0.01, 0.05).holds and not at_most("small", 0.1, 0.05).holds
    assert between("near half", 0.5, 0.45, 0.55).holds and not between("near half", 0.6, 0.45, 0.55).holds


def test_a_nan_figure_never_holds():
    assert not at_least("x", float("nan"), 1).holds
    assert not at_most("x", float("nan"), 1).holds
    assert not between("x", float("inf"), 0, 1).holds


def test_a_verdict_needs_a_claim():
    with pytest.raises(ValueError, match="needs the claim"):
        check("  ", True)


def test_strict_mode_prints_then_raises(monkeypatch, capsys):
    monkeypatch.setenv(claims.STRICT_ENV, "1")
    assert check("holds anyway", True).holds  # a holding verdict never raises
    with pytest.raises(ClaimFailed, match="did not hold here: the loss falls"):
        at_most("the loss falls", 2.0, 1.0)
    assert "✗ did not hold here: the loss falls" in capsys.readouterr().out


def test_every_verdict_is_recorded_and_logged(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(log))
    monkeypatch.setenv("AMP_LESSONS_CONFIG", "avx2")
    before = len(claims.RECORDED)
    at_least("a", 3.0, 2.0)
    between("b", 5.0, 0.0, 1.0)
    assert [v.claim for v in claims.RECORDED[before:]] == ["a", "b"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["claim"], r["holds"], r["value"], r["config"]) for r in rows] == [
        ("a", True, 3.0, "avx2"), ("b", False, 5.0, "avx2")]
    assert rows[1]["bound"] == [0.0, 1.0]
    assert "1 did not" in claims.summary(claims.RECORDED[before:])


def test_sanitize_masks_figures_but_not_words():
    a = str(at_least("fp16 ends with at least 2x fp32's loss", 6.1, 2, figures=f"loss {measured(1.32)} vs {measured(0.216)}"))
    b = str(at_least("fp16 ends with at least 2x fp32's loss", 12.25, 2, figures=f"loss {measured(2.5)} vs {measured(0.2)}"))
    assert a != b and _sanitize(a) == _sanitize(b)
    c = str(at_least("fp16 ends with at least 2x fp32's loss", 1.5, 2, figures=f"loss {measured(1.32)} vs {measured(0.88)}"))
    assert _sanitize(a) != _sanitize(c)  # holds vs did not hold: compared
    table1 = f"{'fp32':<6}{measured(0.916, '.3f'):>9}  exact 28\n{'fp16':<6}{measured(10.5, '.3f'):>9}  exact 3"
    table2 = f"{'fp32':<6}{measured(0.9, '.3f'):>9}  exact 28\n{'fp16':<6}{measured(1.25, '.3f'):>9}  exact 3"
    assert _sanitize(table1) == _sanitize(table2)
    assert _sanitize(table1) != _sanitize(table2.replace("exact 3", "exact 4"))  # exact counts compared


def _notebook(path: Path, stored_value: float) -> None:
    """A one-cell lesson whose stored output is the verdict at ``stored_value``."""
    source = ("import os\nfrom amp_lessons.claims import at_least\n"
              "at_least('the figure is at least 2', float(os.environ['FIGURE']), 2)")
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.v4.new_output(
        "execute_result", {"text/plain": str(at_least("the figure is at least 2", stored_value, 2))},
        execution_count=1)]
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _nbval(path: Path, figure: float) -> int:
    env = {**__import__("os").environ, "FIGURE": str(figure)}
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval", str(path), "--sanitize-with",
                           str(SANITIZE), "-q", "-p", "no:cacheprovider", "--rootdir", str(path.parent)],
                          env=env, capture_output=True, text=True, timeout=180).returncode


def test_a_verdict_that_fails_makes_the_notebook_test_fail(tmp_path):
    path = tmp_path / "lesson.ipynb"
    _notebook(path, stored_value=3.0)
    assert _nbval(path, 2.5) == 0   # other digits, same verdict: passes
    assert _nbval(path, 1.5) == 1   # the claim does not hold here: nbval fails


def test_the_log_folder_is_made_when_missing(tmp_path, monkeypatch):
    log = tmp_path / "new" / "folder" / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(log))
    at_least("logged", 1.0, 0.5)
    assert json.loads(log.read_text())["claim"] == "logged"
