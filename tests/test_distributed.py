"""Lesson 07's launcher and what its ranks record: 2 real processes on gloo.

Tests that start ranks are marked ``distributed`` (``pytest -m distributed`` runs them
alone); the others check the arithmetic, the job builders and the errors without starting
anything.
"""

import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from amp_lessons import distributed as D
from amp_lessons.exercises import check_policy_prediction

ROOT = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (read from /proc, or by signal 0 elsewhere)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.is_dir():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def assert_nothing_left(err_or_run):
    time.sleep(0.2)
    assert not [p for p in getattr(err_or_run, "pids", ()) if alive(p)]
    assert D.marked_pids(err_or_run.marker) == []


# --- no ranks started ------------------------------------------------------------------------


def test_memory_arithmetic_is_exact():
    n, w, layer = 8970, 2, 4160
    assert D.memory_per_rank(n, "DDP, fp32") == {"weights": 4 * n, "grads": 4 * n, "adam": 8 * n,
                                                 "kept": 16 * n, "while computing": 0}
    assert D.memory_per_rank(n, "DDP + autocast bf16")["while computing"] == 2 * n
    fsdp = D.memory_per_rank(n, "FSDP2 (bf16, fp32)", w, layer)
    assert fsdp["kept"] == 16 * n // w == 71_760 and fsdp["while computing"] == 2 * 2 * layer
    assert D.memory_per_rank(n, "FSDP2 (fp32)", w, layer)["while computing"] == 2 * 4 * layer
    seven = 7_000_000_000
    assert D.memory_per_rank(seven, "DDP, fp32")["kept"] == 112_000_000_000
    assert D.memory_per_rank(seven, "FSDP2 (fp32)", 8)["kept"] == 14_000_000_000


def test_started_as_names_what_started_the_ranks():
    torchrun = " ".join(["python", *D.torchrun_command(2, 29501, "/tmp/run")[1:]])
    assert D.started_as(2, "torchrun") == torchrun.replace("29501", "PORT").replace("/tmp/run", "RUN_DIR")
    direct = D.started_as(3, "direct")
    assert direct.startswith("python -m amp_lessons.dist_worker RUN_DIR, once per rank")
    assert "RANK=0..2 WORLD_SIZE=3" in direct and "torch.distributed.run" not in direct


def test_memory_table_shows_formula_and_numbers():
    table = D.memory_table(8970, 2, 4160)
    assert "16 N / W" in table and "71,760" in table and "143,520" in table and "2 x 2 L" in table and "16,640" in table
    assert "104.3" in D.memory_table(7_000_000_000, 8, 7_000_000_000 // 32, unit=2**30)
    with pytest.raises(ValueError, match="unit must be one of"):
        D.memory_table(10, 2, 2, unit=1000)


def test_memory_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="setup must be one of"):
        D.memory_per_rank(10, "ZeRO")
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        D.memory_per_rank(10, "FSDP2 (fp32)", 3)


def test_reduce_dtype_none_follows_the_torch_release():
    assert D.torch_release("2.15.0+cu132") == (2, 15) and D.torch_release("2.16.0a0+git1234") == (2, 16)
    assert D.torch_release("2.9.1") == (2, 9) and D.torch_release() == tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert [D.reduce_dtype_when_none(p, "2.14.1") for p in ("bf16", "fp16", None)] == ["bfloat16", "float16", "float32"]
    assert [D.reduce_dtype_when_none(p, "2.15.0") for p in ("bf16", "fp16", None)] == ["float32"] * 3
    text = D.reduce_none_defaults("bf16")
    assert "before torch 2.15: param_dtype, bfloat16" in text and "from torch 2.15 on: the parameters' own dtype, float32" in text


def test_ring_sum_loses_small_contributions_in_bf16_only():
    values = [torch.tensor(1.0)] + [torch.tensor(1e-3)] * 63
    assert D.ring_sum(values, torch.bfloat16).item() == 1.0
    assert D.ring_sum(values, torch.float32).item() == pytest.approx(1.063, abs=1e-4)


def test_ring_errors_grow_with_ranks_and_order_the_dtypes():
    errs = D.ring_errors((2, 64), n=4000)
    for w in (2, 64):
        assert errs[(w, "fp32")] < 1e-6 < errs[(w, "fp16")] < errs[(w, "bf16")] < 0.05
    assert errs[(64, "bf16")] > 2 * errs[(2, "bf16")]


def test_job_builders_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="hook must be one of allreduce, bf16, fp16"):
        D.ddp_job("x", hook="powersgd")
    with pytest.raises(ValueError, match="tf32 is a matmul mode"):
        D.fsdp_job("x", param_dtype="tf32")
    with pytest.raises(ValueError, match="scaler must be None"):
        D.fsdp_job("x", scaler="sharded-ish")
    with pytest.raises(ValueError, match=r"inf_at must be \(rank, step\)"):
        D.fsdp_job("x", inf_at=(1,))
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        D.ddp_job("x", steps=0)
    with pytest.raises(ValueError, match="how must be one of raise, kill, exit, hang, abort_after_record"):
        D.fail_job(how="segfault")
    assert D.fsdp_job("x", torch.bfloat16, "float32")["param_dtype"] == "bf16"
    with pytest.raises(ValueError, match="jobs need distinct names"):
        D.launch([D.reduce_job("a"), D.reduce_job("a")])


def test_backend_for_each_device(monkeypatch):
    assert D.backend_for("cpu", 2) == "gloo"
    with pytest.raises(D.BackendUnavailableError, match="no backend for 'mps'.*device='cpu'"):
        D.backend_for("mps", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(D.BackendUnavailableError, match="no GPU here: use device='cpu'"):
        D.backend_for("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(D.BackendUnavailableError, match="one GPU per rank: 2 ranks, 1 GPU"):
        D.backend_for("cuda", 2)


def test_a_busy_port_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(D, "_start", lambda *a, **k: pytest.fail("ranks were started on a busy port"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(D.PortInUseError, match=f"port {port} is in use.*Pass port=None"):
            D.launch([D.reduce_job()], port=port)
    assert D.check_port(D.free_port()) > 0
    with pytest.raises(ValueError, match="port must be an integer"):
        D.check_port(70000)


def test_a_port_another_launch_holds_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(D, "_start", lambda *a, **k: pytest.fail("ranks were started on a held port"))
    port, held = D.claim_port(None)
    with held:  # as a launch holds it while its ranks run
        with pytest.raises(D.PortInUseError, match=f"port {port} is in use \\(another launch of this "
                                                   "course holds it until its ranks finish\\).*Pass port=None"):
            D.launch([D.reduce_job()], port=port)
    again, held = D.claim_port(port)  # released with the file: the port can be claimed again
    held.close()
    assert again == port


def test_a_chosen_port_another_launch_holds_is_passed_over(monkeypatch):
    port, held = D.claim_port(None)
    offered = iter([port, port, D.free_port()])  # the OS offers the held port twice, then another
    monkeypatch.setattr(D, "free_port", lambda: next(offered))
    with held:
        other, reserved = D.claim_port(None)
        reserved.close()
    assert other != port


BAD_LAUNCHES = [
    (dict(jobs=[None]), "jobs must be a list of jobs built by ddp_job"),
    (dict(jobs="reduce"), "jobs must be a list of jobs built by ddp_job"),
    (dict(jobs=[{"name": "x"}]), "jobs must be a list of jobs built by ddp_job"),
    (dict(jobs=[{"name": "x", "kind": "nope"}]), "jobs must be a list of jobs built by ddp_job"),
    (dict(nproc=True), "nproc must be a positive integer"),
    (dict(nproc=2.0), "nproc must be a positive integer"),
    (dict(nproc=10**6), "nproc must be from 1 to"),
    (dict(device="tpu"), "device must be 'cpu' \\(gloo\\) or 'cuda'"),
    (dict(device=None), "device must be 'cpu' \\(gloo\\) or 'cuda'"),
    (dict(timeout=0), "timeout must be a positive finite number of seconds"),
    (dict(timeout=-5), "timeout must be a positive finite number of seconds"),
    (dict(timeout=math.nan), "timeout must be a positive finite number of seconds"),
    (dict(timeout=math.inf), "timeout must be a positive finite number of seconds"),
    (dict(timeout="60"), "timeout must be a positive finite number of seconds"),
    (dict(collective_timeout=0), "collective_timeout must be a positive finite number"),
    (dict(collective_timeout=math.nan), "collective_timeout must be a positive finite number"),
    (dict(threads=0), "threads \\(torch threads per rank\\) must be from 1 to"),
    (dict(threads=10**6), "threads \\(torch threads per rank\\) must be from 1 to"),
    (dict(via="mpirun"), "via must be 'direct' or 'torchrun'"),
]


@pytest.mark.parametrize("kwargs, says", BAD_LAUNCHES, ids=[str(k) for k, _ in BAD_LAUNCHES])
def test_a_bad_launch_argument_is_refused_before_any_rank_starts(monkeypatch, kwargs, says):
    monkeypatch.setattr(D, "_start", lambda *a, **k: pytest.fail("ranks were started"))
    kwargs = {"jobs": [D.reduce_job()], **kwargs}
    with pytest.raises(ValueError, match=says):
        D.launch(kwargs.pop("jobs"), **kwargs)


def test_a_port_that_is_not_one_is_refused():
    for bad in (0, -1, 65536, True, 8080.0, "8080"):
        with pytest.raises(ValueError, match="port must be an integer from 1 to 65535"):
            D.claim_port(bad)


def test_cli_and_worker_say_what_to_do(capsys):
    from amp_lessons import dist_worker
    from amp_lessons.__main__ import main

    assert main(["dist", "--device", "mps"]) == 2
    assert "no backend for 'mps'" in capsys.readouterr().err
    assert dist_worker.main([]) == 2
    assert "usage: python -m amp_lessons.dist_worker RUN_DIR" in capsys.readouterr().err


def _record(param="fp16", reduce=None, sent="float16", op="sum"):
    return {"param_dtype": param, "reduce_dtype": reduce, "sharded": {"dtype": "float32"},
            "forward": {"dtype": "float16"}, "gather": {"sent": ["float16"], "buffer": ["float16"]},
            "reduce": {"sent": [sent], "buffer": [sent], "ops": [op]}, "grad": {"dtype": "float32"}}


def test_policy_exercise_checker():
    record = _record()
    right = {"sharded": torch.float32, "forward": "fp16", "reduce_scatter": "float16",
             "gradient": "float32", "op": "sum"}
    verdict = check_policy_prediction(right, record)
    assert verdict.passed, verdict
    wrong = dict(right, reduce_scatter="fp32", op="avg")
    verdict = check_policy_prediction(wrong, record)
    assert not verdict.passed
    assert any("reduce_scatter: not fp32" in f and "reduce_dtype=None default to in this torch release" in f for f in verdict.findings)
    assert any(f.startswith("op: not 'avg'") and "40000" in f for f in verdict.findings)
    empty = check_policy_prediction(dict.fromkeys(right), record)
    assert not empty.passed and "no answer yet" in str(empty) and "40000" not in str(empty)
    assert check_policy_prediction(dict(right, op=torch.distributed.ReduceOp.SUM), record).passed
    off_list = check_policy_prediction(dict(right, op="mean"), record)
    assert not off_list.passed and "answer 'avg' or 'sum'; got 'mean'" in str(off_list)
    misspelt = check_policy_prediction({**right, "shard": right["sharded"]}, record)
    assert not misspelt.passed and "unknown key 'shard'" in str(misspelt)
    typo = check_policy_prediction(dict(right, forward="fp61"), record)
    assert not typo.passed and "precision must be one of" in str(typo)
    assert not check_policy_prediction(None, record).passed


def test_policy_stages_with_one_rank_read_the_reduce_buffer():
    record = _record(sent=None)
    record["reduce"] = {"sent": [], "buffer": ["float32"], "ops": []}
    stages = D.policy_stages(record)
    assert stages["reduce_scatter"] == "float32" and stages["op"] == "(1 rank: none)"


# --- two ranks, for real -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run():
    return D.launch([
        D.ddp_job("ddp bf16", precision="bf16", steps=2),
        D.ddp_job("ddp bf16 hook", precision="fp32", hook="bf16", steps=1),
        D.fsdp_job("(bf16, fp32)", "bf16", "fp32", steps=2),
        D.fsdp_job("(bf16, None)", "bf16", None, steps=1),
        D.fsdp_job("(fp16, None)", "fp16", None, steps=1),
        D.fsdp_job("sharded scaler", "fp16", "fp32", steps=3, scaler="sharded", inf_at=(1, 1)),
        D.ddp_job("ddp scaler", "fp16", steps=3, inf_at=(0, 1)),
        D.reduce_job(n=1000),
    ], nproc=2, device="cpu")


@pytest.mark.distributed
def test_two_ranks_report_their_ids(run):
    assert run.world_size == 2 and run.backend == "gloo" and run.device == "cpu"
    assert [(r["rank"], r["world_size"]) for r in run.ranks] == [(0, 2), (1, 2)]
    assert len({r["pid"] for r in run.ranks}) == 2  # two processes
    assert D.describe_ranks(run) == "rank 0 of 2: gloo on cpu\nrank 1 of 2: gloo on cpu"
    assert run.command == D.started_as(2, "direct")
    assert_nothing_left(run)


@pytest.mark.distributed
def test_ddp_under_autocast_all_reduces_float32(run):
    d = run["ddp bf16"][0]
    assert (d["weights"], d["output"], d["loss"], d["grad"]["dtype"]) == ("float32", "bfloat16", "float32", "float32")
    assert d["bucket"] == ["float32"] and d["sent"] == ["float32"]
    assert d["sent_bytes"] == 4 * d["n_params"] and d["hook_error"] == 0.0
    assert D.ranks_agree(run, "ddp bf16")


@pytest.mark.distributed
def test_compress_hook_sends_half_and_adds_a_small_error(run):
    d = run["ddp bf16 hook"][0]
    assert d["bucket"] == ["float32"] and d["sent"] == ["bfloat16"] and d["grad"]["dtype"] == "float32"
    assert d["sent_bytes"] == 2 * d["n_params"]
    assert 1e-5 < d["hook_error"] < 1e-2


@pytest.mark.distributed
def test_fsdp_dtypes_follow_the_policy(run):
    table = {name: D.policy_stages(run[name][0]) for name in ("(bf16, fp32)", "(bf16, None)", "(fp16, None)")}
    assert table["(bf16, fp32)"] == {"sharded": "float32", "forward": "bfloat16", "all_gather": "bfloat16",
                                     "reduce_scatter": "float32", "op": "avg", "gradient": "float32"}
    # reduce_dtype=None: param_dtype before torch 2.15, the parameters' float32 from 2.15 on
    assert table["(bf16, None)"]["reduce_scatter"] == D.reduce_dtype_when_none("bf16")
    fp16_default = D.reduce_dtype_when_none("fp16")
    assert table["(fp16, None)"]["reduce_scatter"] == fp16_default
    assert table["(fp16, None)"]["op"] == ("sum" if fp16_default == "float16" else "avg")  # fp16 pre-divides
    rec = run["(bf16, fp32)"][0]
    assert rec["sharded"]["type"] == "DTensor Shard(0)" and rec["forward"]["type"] == "plain tensor"
    assert rec["sharded"]["local_shape"] == [32, 64] and rec["sharded"]["shape"] == [64, 64]
    assert rec["grad"]["type"] == "DTensor Shard(0)" and rec["output"] == "bfloat16"
    assert "(bf16, None)" in D.policy_table(run, ["(bf16, None)"])


@pytest.mark.distributed
def test_fsdp_bytes_per_step_follow_the_dtypes(run):
    fp32_reduce, none_reduce = run["(bf16, fp32)"][0], run["(bf16, None)"][0]
    n = fp32_reduce["n_params"]
    width = {"float32": 4, "bfloat16": 2}[D.reduce_dtype_when_none("bf16")]
    assert fp32_reduce["reduce"]["sent_bytes"] == 4 * n and none_reduce["reduce"]["sent_bytes"] == width * n
    assert fp32_reduce["gather"]["sent_bytes"] == none_reduce["gather"]["sent_bytes"]
    shard_bytes = n // 2 * 2  # each all-gather sends this rank's shard: n / 2 parameters in bf16
    assert fp32_reduce["gather"]["sent_bytes"] in (shard_bytes, 2 * shard_bytes)  # forward (+ backward)
    assert "reduce-scatters 35,880 bytes (float32)" in D.comm_bytes(run, ["(bf16, fp32)"])
    history = D.loss_history(fp32_reduce)
    assert len(history) == 2 and history["loss"] == [s["loss"] for s in fp32_reduce["steps"]]


@pytest.mark.distributed
def test_fsdp_memory_matches_the_formula(run):
    for r in run["(bf16, fp32)"]:
        mem, n = r["memory"], r["n_params"]
        assert mem["numel"] * 2 == n
        assert mem["params"] + mem["grads"] + mem["optimizer"] == D.memory_per_rank(
            n, "FSDP2 (bf16, fp32)", 2, max(r["units"]))["kept"]


@pytest.mark.distributed
def test_an_inf_on_one_rank_skips_the_step_on_all(run):
    sharded = run["sharded scaler"]
    assert [r["steps"][1]["own_inf"] for r in sharded] == [False, True]  # only rank 1's shard
    assert D.inf_steps(run, "sharded scaler") == {0: [], 1: [1]}
    assert D.skipped_steps(run, "sharded scaler") == {0: [1], 1: [1]}
    for r in sharded:
        assert [s["scale"] for s in r["steps"]] == [65536.0, 65536.0, 32768.0]
        assert [s["optimizer_steps"] for s in r["steps"]] == [1, 1, 2]
    ddp = run["ddp scaler"]
    assert [r["steps"][1]["own_inf"] for r in ddp] == [True, True]  # the all-reduce spread it
    assert D.inf_steps(run, "ddp scaler") == {0: [1], 1: [1]}
    assert D.skipped_steps(run, "ddp scaler") == {0: [1], 1: [1]}
    for r in ddp:  # skipped means AdamW did not step
        assert [s["optimizer_steps"] for s in r["steps"]] == [1, 1, 2]
        assert [s["skipped"] for s in r["steps"]] == [False, True, False]
    assert "inf in own grads" in D.scaler_table(run, "sharded scaler")


@pytest.mark.distributed
def test_reduction_pitfalls(run):
    red = run["reduce"][0]
    assert red["swamp"]["bf16"] == 1.0 and red["swamp"]["fp16"] > 1.0
    assert red["overflow"]["fp16"] == float("inf") and red["overflow"]["fp32"] == 80000.0
    assert red["overflow"]["fp16 /world"] == 40000.0
    assert red["error"]["fp32"] < 1e-6 < red["error"]["fp16"] < red["error"]["bf16"] < 1e-2
    assert "exactly 1.0, the 0.001 is lost: True" in D.pitfalls(red, 2)


@pytest.mark.distributed
def test_a_rank_that_raises_stops_the_run_and_leaves_nothing():
    with pytest.raises(D.RankFailedError, match="rank 1 of 2 failed in job 'fail' with RuntimeError") as info:
        D.launch([D.fail_job(rank=1, how="raise")])
    err = info.value
    assert err.rank == 1 and err.error_type == "RuntimeError" and "fails on purpose" in err.traceback
    assert len(err.pids) == 2
    assert_nothing_left(err)


@pytest.mark.distributed
def test_a_killed_rank_is_reported_and_the_others_stopped():
    with pytest.raises(D.RankFailedError, match="rank 0 of 2 was killed by SIGKILL after 0 jobs without writing an error") as info:
        D.launch([D.fail_job(rank=0, how="kill")])
    assert_nothing_left(info.value)


@pytest.mark.distributed
def test_a_rank_that_dies_exiting_after_its_record_loses_nothing():
    run = D.launch([D.fail_job(rank=0, how="abort_after_record"), D.reduce_job(n=100)])
    assert [r["rank"] for r in run.ranks] == [0, 1] and len(run["reduce"]) == 2
    assert run.exit_codes[0] == -signal.SIGABRT and run.exit_codes[1] == 0
    assert_nothing_left(run)


def _launch_together(ports) -> list:
    """One launch per entry of ``ports``, all started at the same moment from threads:
    each outcome is a Run or the LaunchError it raised."""
    import threading

    together = threading.Barrier(len(ports))
    outcomes = [None] * len(ports)

    def one(i):
        together.wait()
        try:
            outcomes[i] = D.launch([D.reduce_job(n=100)], port=ports[i])
        except D.LaunchError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def _whole(run) -> bool:
    return [r["rank"] for r in run.ranks] == [0, 1] and run["reduce"][0]["swamp"]["bf16"] == 1.0


@pytest.mark.distributed
def test_two_launches_on_one_port_at_once_both_finish_or_one_is_refused():
    port = D.free_port()
    outcomes = _launch_together([port, port])
    runs = [o for o in outcomes if isinstance(o, D.Run)]
    refused = [o for o in outcomes if not isinstance(o, D.Run)]
    assert runs and all(_whole(r) for r in runs)
    for err in refused:  # refused by the reservation, before it started a rank
        assert isinstance(err, D.PortInUseError) and "another launch of this course holds it" in str(err)
    for o in outcomes:
        if isinstance(o, D.Run):
            assert_nothing_left(o)


@pytest.mark.distributed
def test_two_launches_on_chosen_ports_at_once_both_finish():
    runs = _launch_together([None, None])
    assert all(isinstance(r, D.Run) and _whole(r) for r in runs), runs
    for r in runs:
        assert_nothing_left(r)


def test_a_silent_death_says_how_far_the_rank_got(tmp_path):
    assert D._how_far(tmp_path, 0, "direct") == "after 0 jobs"
    (tmp_path / "rank0.progress").write_text("1")
    assert D._how_far(tmp_path, 0, "direct") == "after 1 job"
    (tmp_path / "rank0.json").write_text("{}")  # the record is written: it died while exiting
    assert D._how_far(tmp_path, 0, "direct") == "while exiting, after writing its record"
    assert D._how_far(tmp_path, 0, "torchrun") == "while its ranks ran"


@pytest.mark.distributed
def test_a_hanging_rank_times_out_and_leaves_nothing():
    # the rank hangs for 120 s: a launch that ignored its timeout would finish without raising
    with pytest.raises(D.LaunchTimeoutError, match="did not finish within 5 s.*raise timeout=") as info:
        D.launch([D.fail_job(rank=1, how="hang", seconds=120)], timeout=5)
    assert_nothing_left(info.value)


@pytest.mark.distributed
def test_torchrun_runs_the_same_worker_and_is_stopped_on_timeout():
    run = D.launch([D.reduce_job(n=100)], via="torchrun")
    assert [r["rank"] for r in run.ranks] == [0, 1] and run["reduce"][0]["swamp"]["bf16"] == 1.0
    assert run.command == D.started_as(2, "torchrun") and "-m torch.distributed.run --nproc-per-node=2" in run.command
    with pytest.raises(D.LaunchTimeoutError) as info:
        D.launch([D.fail_job(rank=0, how="hang")], via="torchrun", timeout=6)
    assert_nothing_left(info.value)


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the launcher's children in /proc (Linux)")
def test_ranks_exit_when_the_launcher_dies(tmp_path):
    """A kernel killed mid-run (no finally runs): its ranks notice their parent is gone."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""
        from amp_lessons import distributed as D
        D.launch([D.fail_job(rank=1, how="hang")], timeout=300)
    """))
    # TMPDIR: the killed launcher cannot remove its run directory; pytest's tmp_path goes away
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(ranks := children_of(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2, "the launcher did not start its 2 ranks"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 30  # a rank still importing torch notices once it is done
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in ranks if alive(p)]


@pytest.mark.distributed
def test_selfcheck_on_cpu_holds():
    verdicts = D.selfcheck("cpu")
    assert len(verdicts) == 5
    assert all(v.holds for v in verdicts), "\n".join(v.line() for v in verdicts)
    assert "gloo, 2 rank(s) on cpu" in verdicts[0].claim


def test_ranks_agree_compares_the_weights_not_the_averaged_loss():
    def run(*digests):
        ranks = [{"rank": r, "jobs": {"ddp": {"digest": d, "steps": [{"loss": 1.0}]}}} for r, d in enumerate(digests)]
        return D.Run(ranks, "gloo", "cpu", "", names=["ddp"])

    assert D.ranks_agree(run("ab", "ab"), "ddp")
    assert not D.ranks_agree(run("ab", "ac"), "ddp")  # the same loss everywhere, different weights
    with pytest.raises(ValueError, match="no weight digest"):
        D.ranks_agree(run(None, None), "ddp")
