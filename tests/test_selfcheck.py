"""`python -m amp_lessons selfcheck` (make gpu-check): lessons run as scripts, verdicts collected."""

import os
import textwrap

import pytest
import torch
from test_hardware import simulate_cpu, simulate_gpu

from amp_lessons import devicechecks, hardware, matmul, selfcheck
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
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    monkeypatch.setattr(devicechecks, "CHECKS", (("hardware", devicechecks.hardware_verdicts),))
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
    monkeypatch.setattr(devicechecks, "CHECKS", ())
    folder = _lessons(tmp_path)
    (folder / "98_test.py").write_text((folder / "98_test.py").read_text().replace(
        "import ipywidgets_that_is_not_here  # noqa", "pass"))
    assert main(["selfcheck", "--notebooks", str(folder), "--no-bench", "--device", "cpu"]) == 0
    assert "1 verdicts, 1 held, 0 did not" in capsys.readouterr().out


def test_no_lessons_is_a_clear_error_that_says_where_to_get_them(tmp_path, capsys):
    assert main(["selfcheck", "--notebooks", str(tmp_path), "--no-bench"]) == 2
    err = capsys.readouterr().err
    assert "no lessons" in err and f"git clone {selfcheck.repository_url()}" in err
    assert selfcheck.repository_url() == "https://github.com/amp-lessons/amp-lessons"  # pyproject's Repository


def test_an_install_without_lessons_says_so_and_where_to_get_them(tmp_path, monkeypatch, capsys):
    """A pip or wheel install: the package has no notebooks/ beside it."""
    monkeypatch.setattr(selfcheck, "default_notebooks", lambda: tmp_path / "site-packages" / "notebooks")
    assert main(["selfcheck", "--no-bench"]) == 2
    err = capsys.readouterr().err
    assert "installed without its lessons" in err and "git clone https://github.com/" in err
    assert "site-packages" not in err  # no odd path: what to do instead


def test_a_relative_notebooks_folder_works(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devicechecks, "CHECKS", ())
    folder = _lessons(tmp_path / "nbcopy")
    (folder / "98_test.py").write_text((folder / "98_test.py").read_text().replace(
        "import ipywidgets_that_is_not_here  # noqa", "pass"))
    monkeypatch.chdir(tmp_path)
    assert main(["selfcheck", "--notebooks", "nbcopy", "--no-bench", "--device", "cpu"]) == 0
    assert "1 verdicts, 1 held, 0 did not" in capsys.readouterr().out
    assert os.getcwd() == str(tmp_path)  # put back after the lesson ran in its own folder
    run = selfcheck.run_lesson(folder.relative_to(tmp_path) / "98_test.py")
    assert run.ok and run.cells == 3


def test_hardware_facts_checked_on_simulated_gpus(monkeypatch):
    hardware_selfcheck = devicechecks.hardware_verdicts
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
    assert err(2.3e-3).medium_level == "bf16"  # oneDNN's bf16 matmul (AMX)
    assert err(3e-4).medium_level == "tf32"  # an Ampere+ GPU: "medium" is TF32 there, not bf16
    assert err(6e-4).medium_level == "tf32"  # TF32 that truncates errs about twice as much
    assert err(2e-5).medium_level == "between"


def test_medium_levels_follow_torchs_source():
    def machine(kind, tf32):
        return hardware.Machine(torch.device(kind), "x", (8, 0) if tf32 else (7, 5), tf32, False, True, tf32,
                                "cpu", "AVX2", False, False)

    assert matmul.medium_levels(machine("cuda", True)) == ("tf32",)
    assert matmul.medium_levels(machine("cuda", False)) == ("float32",)
    assert matmul.medium_levels(machine("cpu", False)) == ("float32", "bf16")


def test_matmul_statements_hold_on_this_cpu():
    verdicts = devicechecks.matmul_verdicts("cpu")
    assert len(verdicts) == 3 and all(v.holds for v in verdicts), [str(v) for v in verdicts]
    assert matmul.tf32_input_bits("cpu") is None


# -- one recommendation: doctor and selfcheck's header say the same on every device class -------

CLASSES = {
    "CPU with AMX": lambda mp: simulate_cpu(mp, avx512_bf16=True, amx=True, isa="AVX512"),
    "CPU with AVX512-BF16, no AMX": lambda mp: simulate_cpu(mp, avx512_bf16=True, isa="AVX512"),
    "CPU with AVX2 only": lambda mp: simulate_cpu(mp),
    "Ampere+ GPU": lambda mp: simulate_gpu(mp, "NVIDIA A100", (8, 0)),
    "T4": lambda mp: simulate_gpu(mp, "Tesla T4", (7, 5)),
    "MPS": lambda mp: (simulate_cpu(mp), mp.setattr(torch.backends.mps, "is_available", lambda: True)),
}
EXPECTED = {"CPU with AMX": "bf16", "CPU with AVX512-BF16, no AMX": "bf16", "CPU with AVX2 only": "fp32",
            "Ampere+ GPU": "bf16", "T4": "fp16 + GradScaler", "MPS": "fp32"}


def _recommendation_lines(out):
    return [line for line in out.splitlines() if line.startswith(("recommended precision", "why "))]


@pytest.mark.parametrize("kind", CLASSES)
def test_doctor_and_selfcheck_recommend_the_same(kind, tmp_path, monkeypatch, capsys):
    CLASSES[kind](monkeypatch)
    measured = []
    real = hardware.matmul_speedups
    monkeypatch.setattr(hardware, "matmul_speedups", lambda device=None, **k: measured.append(1) or real(device, **k))
    monkeypatch.setattr(devicechecks, "CHECKS", ())
    folder = _lessons(tmp_path)
    (folder / "98_test.py").write_text("# %%\nx = 1\n")
    assert main(["doctor"]) == 0
    doctor = _recommendation_lines(capsys.readouterr().out)
    assert main(["selfcheck", "--notebooks", str(folder), "--no-bench"]) == 0
    header = _recommendation_lines(capsys.readouterr().out)
    assert doctor == header and len(doctor) == 2
    assert doctor[0].split(maxsplit=2)[2] == EXPECTED[kind]
    assert hardware.hardware_report().reason == doctor[1].split(maxsplit=1)[1]  # lessons' setup: the same
    cpu = hardware.resolve_machine().type == "cpu"
    assert len(measured) == (3 if cpu else 0)  # once per entry point, on CPUs only
