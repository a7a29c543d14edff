"""``python -m amp_lessons bench | dist | doctor`` with arguments a careless user types: each is
refused with a message that says what to pass, before any measurement, rank or query starts."""

import pytest
import torch

from amp_lessons import bench, distributed, hardware
from amp_lessons.__main__ import main

CPU_FEATURES = hardware.cpu_features


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """The first piece of work of each command fails the test if it is ever reached."""
    def started(*args, **kwargs):
        pytest.fail("the command started working before refusing its arguments")

    monkeypatch.setattr(bench, "_matmul_rows", started)
    monkeypatch.setattr(distributed, "_start", started)
    monkeypatch.setattr(hardware, "cpu_features", started)


BENCH = ["bench", "--device", "cpu"]
REFUSED = [
    (BENCH + ["--plot", "steps.png"], "--plot draws the breakdown: add --breakdown"),
    (BENCH + ["--breakdown", "--plot", "/no/such/folder/steps.png"], "its folder does not exist"),
    (BENCH + ["--breakdown", "--plot", "steps.docx"], "matplotlib cannot save that; end the name with one of"),
    (BENCH + ["--compile"], "add --breakdown"),
    (BENCH + ["--warmup", "-1"], "--warmup must be from 0 to 1000"),
    (BENCH + ["--warmup", "1000000000"], "--warmup must be from 0 to 1000"),
    (BENCH + ["--repeats", "0"], "--repeats from 1 to 1000"),
    (BENCH + ["--repeats", "1000000000"], "--repeats from 1 to 1000"),
    (BENCH + ["--matmul-sizes", "-1"], "--matmul-sizes must be from 1 to 16384"),
    (BENCH + ["--matmul-sizes", "1000000"], "--matmul-sizes must be from 1 to 16384"),
    (BENCH + ["--threads", "0"], "--threads must be from 1 to"),
    (BENCH + ["--threads", "1000000"], "--threads must be from 1 to"),
    (BENCH + ["--max-step-seconds", "nan"], "--max-step-seconds must be positive"),
    (BENCH + ["--width", "0"], "--width must be a positive integer"),
    (BENCH + ["--precisions", "fp7"], "precision must be one of"),
    (["dist", "--nproc", "0"], "nproc must be a positive integer"),
    (["dist", "--nproc", "100000"], "nproc must be from 1 to"),
    (["dist", "--steps", "0"], "--steps must be from 1 to 1000"),
    (["dist", "--steps", "1000000000"], "--steps must be from 1 to 1000"),
    (["dist", "--device", "tpu"], "device must be 'cpu' (gloo) or 'cuda' (NCCL"),
    (["dist", "--device", "mps"], "no backend for 'mps'"),
    (["doctor", "--device", "tpu"], "device must be one of auto"),
]


@pytest.mark.parametrize("argv, says", REFUSED, ids=[" ".join(argv) for argv, _ in REFUSED])
def test_a_bad_argument_is_refused_before_any_work(argv, says, capsys):
    threads = torch.get_num_threads()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert torch.get_num_threads() == threads  # state untouched


class Reached(Exception):
    pass


def test_good_arguments_reach_the_work(tmp_path, monkeypatch):
    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(bench, "_matmul_rows", reached)
    monkeypatch.setattr(distributed, "_start", reached)
    monkeypatch.setattr(hardware, "cpu_features", CPU_FEATURES)
    for argv in (BENCH + ["--breakdown", "--plot", str(tmp_path / "steps.svg"), "--threads", "1"],
                 BENCH + ["--max-step-seconds", "inf", "--precisions", "fp16,half", "--matmul-sizes", "none"],
                 ["dist", "--nproc", "1", "--steps", "1"]):
        with pytest.raises(Reached):
            main(argv)
