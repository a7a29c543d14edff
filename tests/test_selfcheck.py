"""`python -m amp_lessons selfcheck` (make gpu-check): lessons run as scripts, verdicts collected."""

import textwrap

from amp_lessons import selfcheck
from amp_lessons.__main__ import main

LESSON = textwrap.dedent('''\
    # %% [markdown]
    # # 98 · a test lesson

    # %%
    from amp_lessons.claims import at_least
    x = 3

    # %%
    # NBVAL_IGNORE_OUTPUT
    at_least("x is at least 2", x, 2)

    # %% [markdown]
    # prose

    # %%
    import ipywidgets_that_is_not_here  # noqa
''')


def _lessons(tmp_path, fail=False):
    text = LESSON.replace("x = 3", "x = 1") if fail else LESSON
    (tmp_path / "98_test.py").write_text(text)
    return tmp_path


def test_code_cells_drop_markdown_and_header():
    cells = selfcheck.code_cells(LESSON)
    assert len(cells) == 3 and cells[0].startswith("from amp_lessons.claims")


def test_a_lesson_runs_and_its_verdicts_are_collected(tmp_path):
    run = selfcheck.run_lesson(_lessons(tmp_path) / "98_test.py")
    assert run.error is not None and "ipywidgets_that_is_not_here" in run.error  # not a frontend package
    assert [v.claim for v in run.verdicts] == ["x is at least 2"] and run.verdicts[0].holds


def test_frontend_packages_missing_skip_the_cell(tmp_path):
    path = tmp_path / "98_test.py"
    path.write_text(LESSON.replace("ipywidgets_that_is_not_here", "ipywidgets.not_a_module"))
    run = selfcheck.run_lesson(path)
    assert run.error is None and run.skipped and "needs ipywidgets" in run.skipped[0]
    assert run.ok


def test_the_command_fails_when_a_verdict_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(selfcheck, "_DEVICE_CHECKS", (("hardware", "hardware", "selfcheck"),))
    folder = _lessons(tmp_path, fail=True)
    (folder / "98_test.py").write_text((folder / "98_test.py").read_text().replace(
        "import ipywidgets_that_is_not_here  # noqa", "pass"))
    status = main(["selfcheck", "--notebooks", str(folder), "--no-bench", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 1
    assert "✗ did not hold here: x is at least 2" in out
    assert "verdicts" in out and " 1 did not" in out
    assert "bf16 and fp16 autocast both run" in out  # the device checks ran


def test_the_command_passes_when_everything_holds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(selfcheck, "_DEVICE_CHECKS", ())
    folder = _lessons(tmp_path)
    (folder / "98_test.py").write_text((folder / "98_test.py").read_text().replace(
        "import ipywidgets_that_is_not_here  # noqa", "pass"))
    assert main(["selfcheck", "--notebooks", str(folder), "--no-bench", "--device", "cpu"]) == 0
    assert "1 verdicts, 1 held, 0 did not" in capsys.readouterr().out


def test_no_lessons_is_a_clear_error(tmp_path, capsys):
    assert main(["selfcheck", "--notebooks", str(tmp_path), "--no-bench"]) == 2
    assert "no lessons" in capsys.readouterr().err


def test_hardware_facts_checked_on_simulated_gpus(monkeypatch):
    import pytest
    from test_hardware import simulate_gpu

    from amp_lessons.hardware import selfcheck as hardware_selfcheck

    for name, cc, precision in (("Tesla T4", (7, 5), "fp16"), ("NVIDIA H100", (9, 0), "bf16")):
        with pytest.MonkeyPatch.context() as mp:
            simulate_gpu(mp, name, cc)
            verdicts = hardware_selfcheck("cuda")
        assert all(v.holds for v in verdicts), [str(v) for v in verdicts]
        assert any(f"recommended precision here is {precision}" in v.claim for v in verdicts)


def test_medium_precision_is_classified_by_its_error():
    from amp_lessons.matmul import TF32Error

    def err(medium):
        return TF32Error(256, 2e-7, 3e-4, 2.3e-3, False, None, medium=medium, highest=2e-7)

    assert err(2.9e-7).medium_level == "float32"  # another kernel, same precision (AVX512-BF16 here)
    assert err(2.3e-3).medium_level == "bf16"  # AMX, or an Ampere+ GPU
    assert err(5e-5).medium_level == "between"


def test_matmul_statements_hold_on_this_cpu():
    from amp_lessons import matmul

    verdicts = matmul.selfcheck("cpu")
    assert len(verdicts) == 3 and all(v.holds for v in verdicts), [str(v) for v in verdicts]
    assert matmul.tf32_input_bits("cpu") is None
