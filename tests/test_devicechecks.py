"""The device checks of `selfcheck` (make gpu-check): lesson 02's simulation against the real
device, its CUDA statements, and the registry every device check is run from."""

import torch

from amp_lessons import devicechecks
from amp_lessons.devicechecks import compare_simulated
from amp_lessons.hardware import resolve_machine

# --- lesson 02: simulated against real, and the CUDA statements -------------------------------


def test_compare_simulated_on_a_cpu_checks_the_replay_and_the_cuda_statements():
    verdicts = compare_simulated("cpu")
    assert verdicts and all(v.holds for v in verdicts), [v.line() for v in verdicts if not v.holds]
    matches = [v for v in verdicts if "the simulation of cpu autocast" in v.claim]
    statements = [v for v in verdicts if v.claim.startswith("cuda")]
    assert len(matches) == 2 * 4 and len(statements) + len(matches) == len(verdicts)
    assert all(v.claim.startswith("cuda (simulated), ") for v in statements)
    assert {v.claim.split(",")[1].split(":")[0].strip() for v in statements} == {"bf16", "fp16"}
    assert any("mean stays 16-bit" in v.claim for v in statements)
    only = compare_simulated("cpu", dtypes=["fp16"])
    assert {v.claim.split(",")[1].split(":")[0].strip() for v in only} == {"fp16"}


def _pretend_cuda(monkeypatch, real):
    """A CUDA machine, as far as compare_simulated can tell: ``real`` gives its traces."""

    cuda = torch.device("cuda")
    monkeypatch.setattr(devicechecks, "pick_device", lambda d=None: cuda if d in (None, "cuda", cuda) else torch.device(d))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a T4: fp16 only
    original = devicechecks._real_trace

    def real_trace(case, dtype, device):
        if torch.device(device).type == "cpu":
            return original(case, dtype, device)
        return real(case, dtype)

    monkeypatch.setattr(devicechecks, "_real_trace", real_trace)


def _as_real(tr):
    tr.simulated = False
    return tr


def test_compare_simulated_on_cuda_compares_real_and_simulated_traces(monkeypatch):

    # the "real" GPU, played by the replay itself but not labelled simulated: everything matches
    _pretend_cuda(monkeypatch, lambda case, dtype: _as_real(devicechecks._simulated_trace(case, dtype, "cuda")))
    verdicts = compare_simulated()
    assert verdicts and all(v.holds for v in verdicts), [v.line() for v in verdicts if not v.holds]
    matches = [v for v in verdicts if "the simulation of cuda autocast" in v.claim]
    assert len(matches) == 4 and all(v.claim.startswith("cuda, fp16: ") for v in matches)
    statements = [v for v in verdicts if v not in matches]
    assert statements and all(v.claim.startswith("cuda, fp16: ") for v in statements)  # real, not "(simulated)"
    assert not any("bf16" in v.claim for v in verdicts)  # no bfloat16 on this GPU


def test_compare_simulated_on_cuda_fails_when_the_device_disagrees(monkeypatch):

    # a "GPU" whose autocast behaves like a CPU's: the replay and the statements must fail
    _pretend_cuda(monkeypatch, lambda case, dtype: _as_real(devicechecks._simulated_trace(case, dtype, "cpu")))
    verdicts = compare_simulated()
    failed = [v for v in verdicts if not v.holds]
    assert any("(TransformerBlock)" in v.claim and "_softmax" in v.figures for v in failed)
    assert any("(all 17 single calls)" in v.claim for v in failed)
    assert any("softmax of a 16-bit input produces float32" in v.claim for v in failed)
    assert any("mean stays 16-bit" in v.claim for v in failed)


def test_every_device_check_runs_from_one_machine(monkeypatch):
    seen = []
    checks = (("one", lambda m: seen.append(m) or [devicechecks.check("a fact", True)]),
              ("two", lambda m: seen.append(m) or 1 / 0))
    machine = resolve_machine("cpu", measure=False)
    found = devicechecks.device_checks(machine, checks)
    assert seen == [machine, machine]  # the same object, resolved once, passed down
    assert [t for t, _ in found] == ["one", "two"] and found[0][1][0].holds
    assert not found[1][1][0].holds and "ZeroDivisionError" in found[1][1][0].figures
