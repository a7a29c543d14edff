"""Measured figures and verdicts (amp_lessons.claims): what nbval compares, and what it masks."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from amp_lessons import claims
from amp_lessons.claims import (
    RECORDED,
    ClaimFailed,
    at_least,
    at_most,
    between,
    check,
    measured,
    summary,
)

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


def test_the_bounds_are_included():
    """``at_least``/``at_most``/``between`` hold at their bounds, and just past them do not."""
    assert at_least("x", 2.0, 2.0).holds and not at_least("x", math.nextafter(2.0, 0), 2.0).holds
    assert at_most("x", 2.0, 2.0).holds and not at_most("x", math.nextafter(2.0, 3), 2.0).holds
    assert between("x", 1.0, 1.0, 2.0).holds and between("x", 2.0, 1.0, 2.0).holds
    assert between("x", 1.0, 1.0, 1.0).holds  # a range of one value
    assert not between("x", math.nextafter(1.0, 0), 1.0, 2.0).holds
    assert not between("x", math.nextafter(2.0, 3), 1.0, 2.0).holds


def test_the_verdict_shows_and_logs_its_figures(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("AMP_LESSONS_CLAIMS_LOG", str(log))
    monkeypatch.setenv("AMP_LESSONS_LESSON", "lesson_x")
    assert str(at_least("a", 2.5, 2, ".2f", "loss ≈1")) == "✓ holds: a (≈2.50; needs >= 2; loss ≈1)"
    assert str(at_most("b", 3.0, 2)) == "✗ did not hold here: b (≈3; needs <= 2)"
    assert str(between("c", 0.5, 0.25, 0.75, ".1%")) == "✓ holds: c (≈50.0%; needs 0.25 to 0.75)"
    assert str(check("d", True)) == "✓ holds: d" and repr(check("d", False)) == "✗ did not hold here: d"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["claim"], r["holds"], r["value"], r["bound"], r["lesson"]) for r in rows] == [
        ("a", True, 2.5, [2, None], "lesson_x"), ("b", False, 3.0, [None, 2], "lesson_x"),
        ("c", True, 0.5, [0.25, 0.75], "lesson_x"), ("d", True, None, None, "lesson_x"),
        ("d", False, None, None, "lesson_x")]
    assert at_least("t", torch.tensor(3.0), 2).holds and at_least("n", np.float32(1.0), 2).holds is False
    assert check("bool tensor", torch.tensor(True)).holds and not check("numpy", np.bool_(False)).holds


def test_summary_counts_and_lists_what_did_not_hold(monkeypatch):
    monkeypatch.setenv("AMP_LESSONS_LESSON", "lesson_y")
    verdicts = [check("kept", True), check("broken", False), at_least("small", 0.5, 1)]
    assert summary(verdicts) == ("3 verdicts, 1 held, 2 did not\n  lesson_y: ✗ did not hold here: broken\n"
                                 "  lesson_y: ✗ did not hold here: small (≈0.5; needs >= 1)")
    assert summary([]) == "0 verdicts, 0 held, 0 did not"
    assert RECORDED[-3:] == verdicts


BAD_CLAIMS = [
    (lambda: check("c", "no"), "holds must be True or False"),
    (lambda: check("c", None), "holds must be True or False"),
    (lambda: check("c", 1), "holds must be True or False"),
    (lambda: check("c", torch.tensor([True, False])), "holds must be True or False"),
    (lambda: check("c", True, 3.0), "figures must be text"),
    (lambda: check("c", True, bound="x"), r"bound must be \(low, high\)"),
    (lambda: check("c", True, value="x"), "value must be a number"),
    (lambda: at_least("c", 1.0, float("nan")), "bound must be a number"),
    (lambda: at_most("c", 1.0, None), "bound must be a number"),
    (lambda: at_least("c", None, 1.0), "value must be a number"),
    (lambda: at_least("c", "3", 1.0), "value must be a number"),
    (lambda: at_least("c", True, 1.0), "value must be a number"),
    (lambda: at_least("c", 3.0, "2"), "bound must be a number"),
    (lambda: between("c", 1.5, 2.0, 1.0), "between needs low <= high.*swap them"),
    (lambda: between("c", 1.5, float("nan"), 2.0), "low must be a number"),
    (lambda: at_least("c", 1.0, 1.0, spec="zz"), "spec 'zz' cannot format"),
    (lambda: measured(None), "measured's value must be a number"),
    (lambda: measured("x"), "measured's value must be a number"),
    (lambda: measured(1.0, 3), "spec must be a format spec"),
    (lambda: summary("abc"), "summary takes verdicts"),
    (lambda: summary([1, 2]), "summary takes verdicts"),
]


@pytest.mark.parametrize("call, says", BAD_CLAIMS, ids=[s for _, s in BAD_CLAIMS])
def test_a_bad_argument_is_refused_and_nothing_recorded(call, says):
    before = list(RECORDED)
    with pytest.raises(ValueError, match=says):
        call()
    assert RECORDED == before


def test_the_default_spec_shows_three_significant_digits_in_lower_case():
    assert measured(1.23456e-5) == "≈1.23e-05" and measured(math.inf) == "≈inf"
    assert str(at_least("x", 1.23456e-5, 1)) == "✗ did not hold here: x (≈1.23e-05; needs >= 1)"
    assert str(at_most("x", 1.23456e-5, 1)) == "✓ holds: x (≈1.23e-05; needs <= 1)"
    assert str(between("x", 1.23456e-5, 0, 1)) == "✓ holds: x (≈1.23e-05; needs 0 to 1)"
    assert str(at_most("x", 0.5, 1, ".1%", "of 4")) == "✓ holds: x (≈50.0%; needs <= 1; of 4)"
    assert str(between("x", 0.5, 0, 1, ".1%", "of 4")) == "✓ holds: x (≈50.0%; needs 0 to 1; of 4)"


def test_strict_mode_is_off_unless_set_to_something_other_than_0(monkeypatch):
    for off in ("", "0"):
        monkeypatch.setenv(claims.STRICT_ENV, off)
        assert not claims.strict() and not check("quiet", False).holds  # recorded, not raised
    monkeypatch.delenv(claims.STRICT_ENV)
    assert not claims.strict()
    monkeypatch.setenv(claims.STRICT_ENV, "yes")
    assert claims.strict()
    with pytest.raises(ClaimFailed, match=r"\[lesson_z\]$"):
        monkeypatch.setenv("AMP_LESSONS_LESSON", "lesson_z")
        check("loud", False)


def test_summary_without_verdicts_reads_this_runs(monkeypatch):
    monkeypatch.setattr(claims, "RECORDED", [])
    check("one", True)
    at_most("two", 2.0, 1.0)
    assert summary() == summary(claims.RECORDED) and summary().startswith("2 verdicts, 1 held, 1 did not")


def test_the_lesson_is_the_running_scripts_name(monkeypatch):
    monkeypatch.delenv("AMP_LESSONS_LESSON", raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/somewhere/03_grad_scaler.py", raising=False)
    assert check("named", True).lesson == "03_grad_scaler"
    monkeypatch.setattr(sys.modules["__main__"], "__file__", None, raising=False)
    assert check("unnamed", True).lesson == ""


def test_figures_and_holds_from_tensors_and_arrays():
    assert at_least("x", np.array([2.0]), 1).holds and at_most("x", torch.tensor([0.5]), 1).holds
    assert not between("x", float("nan"), 0, 1).holds  # a NaN figure fails, it is not refused
    assert check("x", np.array([True])).holds and not check("x", torch.tensor([False])).holds
    for many in (np.array([1.0, 2.0]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="^value must be a number"):
            at_least("x", many, 1)
    for truth in (torch.tensor(True), np.bool_(True), np.array([True])):
        with pytest.raises(ValueError, match="^value must be a number"):
            at_least("x", truth, 1)
    for not_one in (np.array([True, False]), np.array(1.0), [True]):
        with pytest.raises(ValueError, match="^holds must be True or False"):
            check("x", not_one)
    with pytest.raises(ValueError, match="^value must be a number"):
        at_most("x", None, 1)
    with pytest.raises(ValueError, match="^value must be a number"):
        between("x", None, 0, 1)
    with pytest.raises(ValueError, match="^high must be a number"):
        between("x", 0.5, 0, None)
    with pytest.raises(ValueError, match="^summary takes verdicts"):
        summary(3)


def test_the_log_names_no_config_when_none_is_set(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(log))
    monkeypatch.delenv("AMP_LESSONS_CONFIG", raising=False)
    at_least("≈ unlogged config", 1.0, 0.5)
    row = json.loads(log.read_text(encoding="utf-8"))
    assert row["config"] == "" and row["claim"] == "≈ unlogged config"


def test_a_session_without_a_script_has_no_lesson_name(monkeypatch):
    monkeypatch.delenv("AMP_LESSONS_LESSON", raising=False)
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)  # as in an interactive session
    assert check("interactive", True).lesson == ""


def test_ipython_shows_a_verdict_as_its_line():
    from IPython.lib.pretty import pretty

    assert pretty(at_least("shown", 3.0, 2)) == "✓ holds: shown (≈3; needs >= 2)"
