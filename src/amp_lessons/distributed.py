"""Mixed precision under DDP and FSDP2, run for real on N processes: lesson 07's launcher.

:func:`launch` starts N ranks of ``python -m amp_lessons.dist_worker`` (gloo on CPU,
NCCL when every rank has a GPU), waits for them, and returns what each rank wrote to its
JSON file as a :class:`Run`. It gives each rank the environment ``torchrun --nproc-per-node N -m
amp_lessons.dist_worker RUN_DIR`` would (``via="torchrun"`` runs that instead), without
torchrun's own process; ``torch.multiprocessing.spawn`` cannot be used from a
notebook (it pickles functions by name from ``__main__``, which a kernel does not have).

Failures raise a :class:`LaunchError` whose message says what to do: a busy port
(:class:`PortInUseError`), a rank that raised or died (:class:`RankFailedError`), a run
past its time (:class:`LaunchTimeoutError`), a device with no backend
(:class:`BackendUnavailableError`). Every rank is stopped whatever happens: each runs in
its own process group, killed as a whole, and the processes carrying the run's marker are
swept up after.

The jobs (:func:`ddp_job`, :func:`fsdp_job`, :func:`reduce_job`, :func:`fail_job`) and
what the ranks record are described in :mod:`amp_lessons.dist_worker`. The rest of this
module reads the records for the lesson (tables of dtypes, the scaler's decisions), does
the memory arithmetic per rank (:func:`memory_table`) and simulates a ring's reduction
order (:func:`ring_errors`). ``selfcheck(device)`` runs it on a GPU (NCCL, one rank) for
``make gpu-check``. Used in 07_beyond_one_device; ``python -m amp_lessons dist``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .claims import check
from .data import digits
from .hardware import pick_device
from .precision import dtype_of, parse_precision
from .progress import bar
from .training import History, StepRecord

DEFAULT_TIMEOUT = 180.0
MARKER_ENV = "AMP_LESSONS_DIST_RUN"
WORKER = "amp_lessons.dist_worker"
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HOOKS = ("allreduce", "bf16", "fp16")
SCALERS = ("sharded", "amp")
LOOPBACK = {"linux": "lo", "darwin": "lo0"}
KILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL


# --- errors that say what to do -------------------------------------------------------------


class LaunchError(RuntimeError):
    """A distributed run could not start or finish. ``pids``: the processes it started (all
    stopped); ``marker``: the run's marker in their environment (see :func:`marked_pids`)."""

    pids: tuple = ()
    marker: str = ""


class BackendUnavailableError(LaunchError):
    """No torch.distributed backend for the device asked for."""


class PortInUseError(LaunchError):
    """The rendezvous port is taken."""


class LaunchTimeoutError(LaunchError):
    """The ranks did not finish in time."""


class RankFailedError(LaunchError):
    """A rank raised or died. ``rank``, ``stage``, ``error_type``, ``traceback`` and
    ``stderr`` (the end of its output) say where and why."""

    def __init__(self, message, rank=None, stage=None, error_type=None, traceback="", stderr=""):
        super().__init__(message)
        self.rank, self.stage, self.error_type = rank, stage, error_type
        self.traceback, self.stderr = traceback, stderr


# --- jobs ----------------------------------------------------------------------------------


def _precision_or_none(value):
    if value is None or value == "None":
        return None
    name = parse_precision(value)
    if name == "tf32":
        raise ValueError("tf32 is a matmul mode, not a dtype torch.distributed keeps or sends: use fp32")
    return name


def ddp_job(name: str, precision="bf16", hook: str = "allreduce", steps: int = 20, inf_at=None) -> dict:
    """DDP training of the lesson's MLP under autocast(``precision``) (fp32: no autocast; fp16:
    with a GradScaler), with the comm hook ``hook``: ``allreduce`` (what DDP does without one),
    ``bf16`` or ``fp16`` (``bf16_compress_hook``/``fp16_compress_hook``). ``inf_at=(rank, step)``
    makes that rank's loss inf at that step, before backward."""
    if hook not in HOOKS:
        raise ValueError(f"hook must be one of {', '.join(HOOKS)}; got {hook!r}")
    return {"kind": "ddp", "name": name, "precision": _precision_or_none(precision) or "fp32",
            "hook": hook, "steps": _positive(steps, "steps"), "inf_at": _inf_at(inf_at)}


def fsdp_job(name: str, param_dtype=None, reduce_dtype=None, steps: int = 20, scaler=None,
             inf_at=None) -> dict:
    """FSDP2 training of the lesson's MLP with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``
    (None: the parameter's own dtype). ``scaler``: ``"sharded"`` (ShardedGradScaler) or
    ``"amp"`` (torch.amp.GradScaler); ``inf_at=(rank, step)`` puts an inf in that rank's own
    gradient shard at that step, after the reduce-scatter."""
    if scaler not in (None, *SCALERS):
        raise ValueError(f"scaler must be None, 'sharded' (ShardedGradScaler) or 'amp' "
                         f"(torch.amp.GradScaler); got {scaler!r}")
    return {"kind": "fsdp", "name": name, "param_dtype": _precision_or_none(param_dtype),
            "reduce_dtype": _precision_or_none(reduce_dtype), "steps": _positive(steps, "steps"),
            "scaler": scaler, "inf_at": _inf_at(inf_at)}


def _inf_at(inf_at):
    if inf_at is None:
        return None
    if len(inf_at) != 2 or not all(isinstance(v, int) and v >= 0 for v in inf_at):
        raise ValueError(f"inf_at must be (rank, step), two integers >= 0; got {inf_at!r}")
    return list(inf_at)


def reduce_job(name: str = "reduce", n: int = 100_000) -> dict:
    """Reduction pitfalls on real all-reduces: 1.0 + 0.001 in bf16, 40000 + 40000 in fp16,
    and the relative error of ``n`` gradients of size ~1e-3 all-reduced in each dtype."""
    return {"kind": "reduce", "name": name, "n": _positive(n, "n")}


def fail_job(name: str = "fail", rank: int = 1, how: str = "raise", seconds: float = 3600) -> dict:
    """A rank that fails on purpose: ``how`` = ``raise``, ``kill`` (SIGKILL), ``exit`` or
    ``hang`` (sleeps ``seconds``) while the other ranks wait at a barrier; or
    ``abort_after_record``: it finishes, then dies of SIGABRT once its record is written, as
    gloo's teardown can (the run's results are whole)."""
    hows = ("raise", "kill", "exit", "hang", "abort_after_record")
    if how not in hows:
        raise ValueError(f"how must be one of {', '.join(hows)}; got {how!r}")
    return {"kind": "fail", "name": name, "rank": rank, "how": how, "seconds": seconds}


JOB_KINDS = ("ddp", "fsdp", "reduce", "fail")


def _seconds(what, value) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number of seconds; got {value!r}")
    return float(value)


def _positive(value, what):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive integer; got {value!r}")
    return value


# --- the result ----------------------------------------------------------------------------


@dataclass
class Run:
    """What the ranks of one launch wrote: ``ranks[r]`` is rank r's record; ``run[name]`` the
    records of job ``name``, one per rank (each with its ``rank``). ``command``: what started
    the ranks (:func:`started_as`)."""

    ranks: list[dict]
    backend: str
    device: str
    command: str
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    marker: str = ""
    exit_codes: list[int | None] = field(default_factory=list)  # a rank may die exiting, after its record

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def __getitem__(self, name: str) -> list[dict]:
        if name not in self.names:
            raise KeyError(f"this run has the jobs {', '.join(self.names)}; got {name!r}")
        return [{"rank": r["rank"], **r["jobs"][name]} for r in self.ranks]

    def __repr__(self) -> str:
        return f"Run({self.world_size} ranks, {self.backend} on {self.device}, jobs {self.names})"


# --- backend, port, environment -------------------------------------------------------------


def backend_for(device, nproc: int) -> str:
    """gloo for CPU ranks, NCCL when every rank has a GPU; anything else raises
    :class:`BackendUnavailableError` saying what to use instead."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank); got {device!r}") from None
    if not torch.distributed.is_available():
        raise BackendUnavailableError("this torch build has no torch.distributed (torch.distributed."
                                      "is_available() is False): install a build from pytorch.org")
    if dev.type == "cpu":
        if not torch.distributed.is_gloo_available():
            raise BackendUnavailableError("this torch build has no gloo backend, which CPU ranks use: "
                                          "install a build from pytorch.org")
        return "gloo"
    if dev.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise BackendUnavailableError("device 'cuda' was asked for, but torch sees no GPU here: use "
                                          "device='cpu' (gloo)")
        if have < nproc:
            raise BackendUnavailableError(f"NCCL needs one GPU per rank: {nproc} ranks, {have} GPU(s) here; "
                                          f"use nproc={have}, or device='cpu' (gloo)")
        if not torch.distributed.is_nccl_available():
            raise BackendUnavailableError("this torch build has no NCCL backend: use device='cpu' (gloo)")
        return "nccl"
    raise BackendUnavailableError(f"torch.distributed has no backend for {dev.type!r} devices in this "
                                  "lesson: use device='cpu' (gloo) or 'cuda' (NCCL)")


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port(port: int) -> int:
    """``port`` if rank 0 can listen on it, else :class:`PortInUseError`. Both the wildcard
    address (where the rendezvous store listens) and 127.0.0.1 (where the ranks connect) are
    tried: a socket bound to 127.0.0.1 alone blocks the first on Linux, the second on macOS."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer from 1 to 65535, or None for a free one; got {port!r}")
    for host in ("", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store does
            try:
                s.bind((host, port))
                s.listen(1)
            except OSError as err:
                raise PortInUseError(_port_message(port, err.strerror)) from None
    return port


MAX_CPU_RANKS = max(8, os.cpu_count() or 1)
PORT_TRIES = 20  # free ports tried when each chosen one is claimed by another launch


def _lock_path(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"amp-lessons-port-{port}.lock"


def _try_lock(f) -> bool:
    """An exclusive lock on the open file ``f`` without waiting: True when taken. The OS drops
    it when the file is closed or its process dies, so a crashed launch leaves none behind."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def claim_port(port=None):
    """The rendezvous port of one launch and the open lock file that reserves it for that
    launch: close the file when the ranks are done. Two launches at once can never share a
    port: the second one asking for a port the first holds is refused at once with
    :class:`PortInUseError` (``port`` given), or gets another free port (``port=None``).
    A port another program listens on is refused as :func:`check_port` does."""
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        check_port(port)  # refuses the value itself, with what to pass
    for _ in range(1 if port is not None else PORT_TRIES):  # the lock first, then the bind check:
        # a port another launch holds is refused for that reason, whether or not its ranks listen yet
        chosen = free_port() if port is None else port
        f = open(_lock_path(chosen), "a+b")
        if _try_lock(f):
            try:
                return check_port(chosen), f
            except PortInUseError:
                f.close()
                if port is not None:
                    raise
                continue
        f.close()
        if port is not None:
            raise PortInUseError(_port_message(port, "another launch of this course holds it until "
                                                     "its ranks finish"))
    raise PortInUseError(f"no free port could be reserved in {PORT_TRIES} tries: every one the OS "
                         "offered was taken by another launch or program at once. Wait for the other "
                         "launches to finish, then run again")


def _port_message(port, why) -> str:
    return (f"port {port} is in use ({why}): another distributed run (an earlier cell's, still "
            "running?) or another program listens there. Pass port=None and the launcher picks a "
            "free one, or choose another port")


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _rank_env(rank, nproc, port, marker, threads) -> dict:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS=str(threads),
               **{MARKER_ENV: marker, "AMP_LESSONS_DIST_LAUNCHER": str(os.getpid())})
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    if sys.platform in LOOPBACK:  # all ranks are on this machine: gloo talks over loopback
        env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK[sys.platform])
    paths = [_package_root(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def started_as(nproc: int, via: str) -> str:
    """07: the command that started a launch's ranks, for a reader: RUN_DIR is the launch's
    temporary directory (``plan.json``, ``data.pt``), PORT its rendezvous port."""
    if via == "torchrun":
        return (f"python -m torch.distributed.run --nproc-per-node={nproc} --master-addr=127.0.0.1 "
                f"--master-port=PORT -m {WORKER} RUN_DIR")
    return (f"python -m {WORKER} RUN_DIR, once per rank, with RANK=0..{nproc - 1} WORLD_SIZE={nproc} "
            "MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT")


def torchrun_command(nproc: int, port: int, run_dir) -> list[str]:
    """The same launch with torchrun: ``python -m torch.distributed.run --nproc-per-node N ...``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port}", "-m", WORKER, str(run_dir)]


# --- launch --------------------------------------------------------------------------------


def launch(jobs, nproc: int = 2, device="cpu", *, port=None, timeout: float = DEFAULT_TIMEOUT,
           via: str = "direct", threads: int = 1, collective_timeout: float = 60.0, progress=None) -> Run:
    """Run ``jobs`` on ``nproc`` ranks and return what they recorded, as a :class:`Run`.

    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank). ``port``: the
    rendezvous port (None: a free one), reserved for this launch until its ranks are done
    (:func:`claim_port`): a second launch on it is refused at once. ``timeout``: seconds for
    the whole run.
    ``via="torchrun"`` starts the ranks with ``python -m torch.distributed.run``;
    ``"direct"`` starts them itself, with the same environment torchrun gives them.
    ``threads``: torch threads per rank (torchrun's default, 1). The ranks' output is kept
    out of the notebook; it appears in the error when a rank fails. A progress bar counts the
    jobs the ranks have finished (``progress=False``, or ``AMP_LESSONS_PROGRESS=0``: none).
    """
    if not isinstance(jobs, (list, tuple)) or not all(isinstance(j, dict) and j.get("kind") in JOB_KINDS
                                                        for j in jobs):
        raise ValueError("jobs must be a list of jobs built by ddp_job, fsdp_job, reduce_job or fail_job; "
                         f"got {jobs!r:.80}")
    jobs = [dict(j) for j in jobs]
    names = [j.get("name") for j in jobs]
    if not jobs or len(set(names)) != len(names) or None in names:
        raise ValueError(f"jobs need distinct names (built by ddp_job, fsdp_job, ...); got {names}")
    _positive(nproc, "nproc")
    _seconds("timeout", timeout)
    _seconds("collective_timeout", collective_timeout)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= (os.cpu_count() or 1):
        raise ValueError(f"threads (torch threads per rank) must be from 1 to {os.cpu_count() or 1}, this "
                         f"machine's CPU threads; got {threads!r}")
    if nproc > MAX_CPU_RANKS and torch.device(device).type == "cpu":
        raise ValueError(f"nproc must be from 1 to {MAX_CPU_RANKS} on the CPU: each rank is a process "
                         f"with its own torch (some 300 MB); got {nproc}")
    if via not in ("direct", "torchrun"):
        raise ValueError(f"via must be 'direct' or 'torchrun'; got {via!r}")
    backend = backend_for(device, nproc)
    port, reserved = claim_port(port)  # held until the ranks are done: no other launch can join them
    marker = uuid.uuid4().hex
    with reserved, tempfile.TemporaryDirectory(prefix="amp-lessons-dist-") as tmp:
        run_dir = Path(tmp)
        _write_inputs(run_dir, jobs, torch.device(device).type, backend, threads, collective_timeout)
        command = torchrun_command(nproc, port, run_dir)
        start = time.monotonic()
        procs = _start(run_dir, nproc, port, marker, threads, via, command)
        shown = bar(len(jobs) * nproc, f"{nproc} ranks, jobs done", progress)
        try:
            _wait(procs, run_dir, nproc, port, timeout, via, shown)
            ranks = _read_records(run_dir, nproc, procs)
            _settle(procs)
            codes = [p.poll() for p in procs]
        except LaunchError as err:
            err.marker = marker
            raise
        finally:
            _stop(procs, marker, via)
            if shown is not None:
                shown.close()
        return Run(ranks, backend, ranks[0]["device"].split(":")[0], started_as(nproc, via),
                   time.monotonic() - start, names, marker, codes)


@functools.lru_cache(maxsize=1)
def _digits_train():
    data = digits()
    return {"x": data.x_train, "y": data.y_train}


def _write_inputs(run_dir, jobs, device_type, backend, threads, collective_timeout) -> None:
    torch.save(_digits_train(), run_dir / "data.pt")  # the ranks need no scikit-learn
    plan = {"jobs": jobs, "device": device_type, "backend": backend, "threads": threads,
            "collective_timeout": collective_timeout}
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))


def _start(run_dir, nproc, port, marker, threads, via, command) -> list[subprocess.Popen]:
    def popen(args, env, name):
        with open(run_dir / f"{name}.out", "wb") as out:  # the rank keeps its own copy of the file
            return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=run_dir, start_new_session=True)

    if via == "torchrun":
        return [popen(command, _rank_env(None, nproc, port, marker, threads), "torchrun")]
    args = [sys.executable, "-m", WORKER, str(run_dir)]
    return [popen(args, _rank_env(r, nproc, port, marker, threads), f"rank{r}") for r in range(nproc)]


def _jobs_done(run_dir) -> int:
    done = 0
    for path in run_dir.glob("rank*.progress"):
        try:
            done += int(path.read_text() or 0)
        except (OSError, ValueError):
            pass
    return done


def _wait(procs, run_dir, nproc, port, timeout, via, shown=None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if shown is not None and (done := _jobs_done(run_dir)) > shown.n:
            shown.update(done - shown.n)
        codes = [p.poll() for p in procs]
        if _all_recorded(run_dir, nproc):
            return  # every rank passed the last barrier and wrote its record: the results are whole
        if any(c not in (None, 0) for c in codes):
            time.sleep(0.2)  # let the other ranks' error files land, to name the first failure
            if _all_recorded(run_dir, nproc):
                return
            raise _failure(procs, run_dir, nproc, port, via)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            err = LaunchTimeoutError(
                f"the {nproc} ranks did not finish within {timeout:g} s, so they were stopped. A rank may "
                "be waiting at a collective for another that never comes, or this machine is busy: "
                "raise timeout=, or run fewer steps")
            err.pids = tuple(p.pid for p in procs)
            raise err
        time.sleep(0.05)


def _all_recorded(run_dir, nproc: int) -> bool:
    """Every rank wrote its record (atomically, after the final barrier). A rank that then dies
    while exiting (gloo's teardown can abort a finished process) has lost nothing."""
    return all((run_dir / f"rank{r}.json").exists() for r in range(nproc))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


SECONDARY = ("DistNetworkError", "DistBackendError", "DistStoreError")  # a peer went away
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _secondary(error: dict) -> bool:
    """A rank that failed because another rank was gone first (its socket closed)."""
    text = error["message"].lower()
    return error["type"] in SECONDARY or any(p in text for p in PEER_GONE)


def _failure(procs, run_dir, nproc, port, via) -> LaunchError:
    """The error for the first failure: a rank's own error first, then a rank that died without
    writing one (killed), then a rank that only lost its connection to a dead one."""
    errors = []
    for path in run_dir.glob("rank*.error.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    primary = [e for e in errors if not _secondary(e)]
    written = {e["rank"] for e in errors}
    codes = [p.poll() for p in procs]
    silent = [i for i, c in enumerate(codes) if c not in (None, 0) and (via == "torchrun" or i not in written)]
    if primary or (errors and not silent):
        first = min(primary or errors, key=lambda e: e["time"])
        err = _rank_error(first, run_dir, nproc, port, via)
    else:
        i = silent[0]
        code = codes[i]
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        who = "torchrun" if via == "torchrun" else f"rank {i} of {nproc}"
        out = _tail(run_dir / ("torchrun.out" if via == "torchrun" else f"rank{i}.out"))
        err = RankFailedError(f"{who} {how} {_how_far(run_dir, i, via)} without writing an error (out of "
                              f"memory? killed?). The other ranks were stopped. Its output ends with:\n"
                              f"{out or '(nothing)'}",
                              None if via == "torchrun" else i, None, None, "", out)
    err.pids = tuple(p.pid for p in procs)
    return err


def _how_far(run_dir, rank: int, via: str) -> str:
    """Where a rank that died silently had got to: its jobs done, and whether its record was
    written (then it died while exiting, after its work)."""
    if via == "torchrun":
        return "while its ranks ran"
    if (run_dir / f"rank{rank}.json").exists():
        return "while exiting, after writing its record"
    try:
        done = int((run_dir / f"rank{rank}.progress").read_text() or 0)
    except (OSError, ValueError):
        done = 0
    return f"after {done} job{'s' if done != 1 else ''}"


def _rank_error(first: dict, run_dir, nproc, port, via) -> LaunchError:
    r = first["rank"]
    out = run_dir / ("torchrun.out" if via == "torchrun" else f"rank{r}.out")
    message = first["message"].strip().splitlines()[0] if first["message"].strip() else ""
    if first["stage"] == "init_process_group" and ("EADDRINUSE" in first["message"]
                                                   or "address already in use" in first["message"].lower()):
        return PortInUseError(_port_message(port, f"rank {r} could not listen on it"))
    lost = " (it lost its connection to another rank, which failed first)" if _secondary(first) else ""
    return RankFailedError(
        f"rank {r} of {nproc} failed in {first['stage']} with {first['type']}: {message}{lost}. "
        "The other ranks were stopped; the traceback is in this error's .traceback",
        r, first["stage"], first["type"], first["traceback"], _tail(out))


def _settle(procs, seconds: float = 30.0) -> None:
    """Give ranks that have written their records time to exit on their own (they do at once,
    unless a machine is very busy); the launcher then stops any left."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def _read_records(run_dir, nproc, procs) -> list[dict]:
    ranks = []
    for r in range(nproc):
        path = run_dir / f"rank{r}.json"
        if not path.exists():
            err = RankFailedError(f"rank {r} of {nproc} exited cleanly without writing its record "
                                  f"(rank{r}.json); its output ends with:\n{_tail(run_dir / f'rank{r}.out')}", r)
            err.pids = tuple(p.pid for p in procs)
            raise err
        ranks.append(json.loads(path.read_text()))
    return ranks


def _stop(procs, marker, via) -> None:
    """Kill every rank's process group and reap it, then sweep up anything left with the marker.
    torchrun gets a SIGTERM first, which it passes on to its ranks."""
    for p in procs:
        if p.poll() is None:
            _kill_group(p.pid, signal.SIGTERM if via == "torchrun" else KILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(p.pid, KILL)
            p.wait(timeout=5)
    for pid in marked_pids(marker):
        try:
            os.kill(pid, KILL)
        except OSError:
            pass


def _kill_group(pid, sig) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(pid, sig)
        else:  # pragma: no cover - Windows
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries this run's marker (Linux /proc; [] elsewhere)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found


# --- reading the records for the lesson -----------------------------------------------------


def _table(headers, rows) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def describe_ranks(run: Run) -> str:
    """One line per rank: its id, the world size, backend and device, as each rank reported them."""
    return "\n".join(f"rank {r['rank']} of {r['world_size']}: {run.backend} on {r['device'].split(':')[0]}"
                     for r in run.ranks)


def ddp_table(run: Run, names=None) -> str:
    """DDP runs side by side (rank 0's record; the ranks agree): weights, forward output, the
    bucket DDP hands the comm hook, what the hook all-reduces, bytes, the gradients."""
    rows = []
    for name in names or run.names:
        d = run[name][0]
        rows.append([name, d["weights"], d["output"], ",".join(d["bucket"]), ",".join(d["sent"]),
                     f"{d['sent_bytes']:,}", d["grad"]["dtype"]])
    return _table(["run", "weights", "forward output", "bucket", "all-reduced", "bytes/step", "grads"], rows)


def hook_errors(run: Run, names=None) -> dict:
    """``{name: (bytes all-reduced per step, relative error vs a float32 all-reduce)}``."""
    return {n: (run[n][0]["sent_bytes"], run[n][0]["hook_error"]) for n in names or run.names}


def ranks_agree(run: Run, name: str) -> bool:
    """True when every rank of a DDP run ends with bit-identical weights (lesson 07).

    The weights are the evidence: the loss a rank records is already the mean over the
    ranks (an all-reduce), the same on every rank by construction.
    """
    recs = run[name]
    digests = [r.get("digest") for r in recs]
    if None in digests:
        raise ValueError(f"{name!r} has no weight digest: ranks_agree compares the weights of a DDP run")
    return len(set(digests)) == 1


def policy_label(record: dict) -> str:
    """``"(bf16, fp32)"``: MixedPrecisionPolicy(param_dtype, reduce_dtype) in short."""
    p, r = record["param_dtype"], record["reduce_dtype"]
    return "(fp32)" if p is None and r is None else f"({p or 'fp32'}, {r})"


# torch 2.15 changed what MixedPrecisionPolicy(reduce_dtype=None) reduces in: the
# "versionchanged:: 2.15" note of reduce_dtype's docstring in
# torch/distributed/fsdp/_fully_shard/_fsdp_api.py.
REDUCE_NONE_CHANGED = (2, 15)
DTYPE_NAMES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(2, 15)`` for ``"2.15.0+cu132"`` or ``"2.15.0a0+git..."``; this torch's by default."""
    version = str(version or torch.__version__)
    major, minor, *_ = version.split("+")[0].split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def reduce_dtype_when_none(param_dtype, version: str | None = None) -> str:
    """The dtype FSDP2 reduce-scatters float32 parameters' gradients in under
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype=None)`` on torch ``version`` (this one by
    default): ``param_dtype`` before 2.15, the parameters' own float32 from 2.15 on (see
    :data:`REDUCE_NONE_CHANGED`). Used in 07_beyond_one_device and :func:`selfcheck`."""
    if param_dtype is None or torch_release(version) >= REDUCE_NONE_CHANGED:
        return "float32"
    return DTYPE_NAMES[parse_precision(param_dtype)]


def reduce_none_defaults(param_dtype="bf16") -> str:
    """Both defaults of ``reduce_dtype=None``, by torch release, for lesson 07."""
    since = ".".join(map(str, REDUCE_NONE_CHANGED))
    old, new = (reduce_dtype_when_none(param_dtype, v) for v in ("2.14", since))
    return "\n".join([
        f"MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype=None) reduce-scatters in:",
        f"  before torch {since}: param_dtype, {old}",
        f"  from torch {since} on: the parameters' own dtype, {new} (reduce_dtype={param_dtype} keeps the old way)"])


def policy_stages(record: dict) -> dict:
    """One FSDP2 record's dtypes at each stage: sharded parameter, parameter in forward,
    all-gathered, reduce-scattered (what was sent, or the reduce buffer with one rank),
    the reduce op, and the gradient left in the sharded parameter."""
    reduce = record["reduce"]
    return {"sharded": record["sharded"]["dtype"], "forward": record["forward"]["dtype"],
            "all_gather": ",".join(record["gather"]["sent"] or record["gather"]["buffer"]),
            "reduce_scatter": ",".join(reduce["sent"] or reduce["buffer"]),
            "op": ",".join(reduce["ops"]) or "(1 rank: none)", "gradient": record["grad"]["dtype"]}


def policy_table(run: Run, names=None) -> str:
    """FSDP2 policies side by side: the dtype at each stage (rank 0; every rank's are checked equal)."""
    rows = []
    for name in names or run.names:
        recs = run[name]
        stages = [policy_stages(r) for r in recs]
        if any(s != stages[0] for s in stages):
            raise RuntimeError(f"the ranks of {name!r} disagree on the dtypes: {stages}")
        s = stages[0]
        rows.append([name, s["sharded"], s["forward"], s["all_gather"], s["reduce_scatter"], s["op"],
                     s["gradient"]])
    return _table(["policy", "sharded param", "in forward", "all-gathered", "reduce-scattered", "op",
                   "grad"], rows)


def comm_bytes(run: Run, names=None) -> str:
    """Bytes rank 0 sent in one step of each FSDP2 run: all-gathers (forward and backward)
    and reduce-scatters, with their dtypes."""
    lines = []
    width = max(len(n) for n in names or run.names)
    for name in names or run.names:
        r = run[name][0]
        g, s = r["gather"], r["reduce"]
        lines.append(f"{name:<{width}}  all-gathers {g['sent_bytes']:>6,} bytes ({','.join(g['sent'])}), "
                     f"reduce-scatters {s['sent_bytes']:>6,} bytes ({','.join(s['sent'])})")
    return "\n".join(lines)


def fsdp_stages(record: dict) -> str:
    """What one rank holds of the first Linear's weight at each stage, with shapes and types."""
    s, f, g = record["sharded"], record["forward"], record["grad"]
    return "\n".join([
        f"kept between steps: {s['type']}, {s['dtype']}, this rank's shard {s['local_shape']} of {s['shape']}",
        f"in forward:         {f['type']}, {f['dtype']} (the layer's input: {f['input']})",
        f"gradient:           {g['type']}, {g['dtype']}",
        f"model output:       {record['output']}, loss {record['loss']}"])


def scaler_table(run: Run, name: str) -> str:
    """Step by step and rank by rank: own gradients inf?, the scale before the step, skipped
    (AdamW's step count did not move)?, AdamW's step count."""
    rows = []
    recs = run[name]
    for step in range(len(recs[0]["steps"])):
        for r in recs:
            s = r["steps"][step]
            rows.append([s["step"], r["rank"], s["own_inf"], f"{s['scale']:g}", s["skipped"], s["optimizer_steps"]])
    return _table(["step", "rank", "inf in own grads", "scale", "skipped", "AdamW steps"], rows)


def skipped_steps(run: Run, name: str) -> dict:
    """``{rank: [steps skipped]}``: the steps after which that rank's AdamW step count had not moved."""
    return {r["rank"]: [s["step"] for s in r["steps"] if s["skipped"]] for r in run[name]}


def inf_steps(run: Run, name: str) -> dict:
    """``{rank: [steps]}``: the steps at which that rank found inf/NaN in its own gradients (its
    shard, under FSDP2), before the scaler looked; for lesson 07."""
    return {r["rank"]: [s["step"] for s in r["steps"] if s["own_inf"]] for r in run[name]}


def loss_history(record: dict):
    """A job's loss curve as a :class:`amp_lessons.training.History`, for ``plots.loss_curves``."""
    nan = float("nan")
    return History(StepRecord(s["step"], s["loss"], s["scale"], s["skipped"], nan, nan, nan, nan, nan, nan)
                   for s in record["steps"])


def pitfalls(record: dict, world_size: int) -> str:
    """The exact outcomes of the reduction pitfalls one rank saw (rank 0 held 1.0, the others
    0.001; then every rank held 40000)."""
    sw, ov = record["swamp"], record["overflow"]
    others = ", ".join(f"rank {r}" for r in range(1, world_size)) or "no other rank"
    return "\n".join([
        f"1.0 on rank 0 + 0.001 on {others}, all-reduced (sum):",
        f"  bfloat16 gives exactly 1.0, the 0.001 is lost: {sw['bf16'] == 1.0}",
        f"  float16 and float32 give more than 1.0: {sw['fp16'] > 1.0 and sw['fp32'] > 1.0}",
        f"40000 on each of {world_size} ranks, all-reduced (sum): float32 {ov['fp32']:g}, "
        f"bfloat16 {ov['bf16']:g}, float16 {ov['fp16']:g}",
        f"  40000 cast, / {world_size} on each rank, then summed (FSDP2's fp16 pre-divide): float16 {ov['fp16 /world']:g}"])


# --- a ring's order of additions, in one process --------------------------------------------


def ring_sum(values, dtype=torch.bfloat16) -> torch.Tensor:
    """Sum ``values`` (one tensor per rank) one rank after another, rounding to ``dtype`` after
    each addition, as a ring reduction does hop by hop."""
    acc = values[0].to(dtype)
    for v in values[1:]:
        acc = (acc + v.to(dtype)).to(dtype)
    return acc


def ring_errors(world_sizes=(2, 8, 64), n: int = 10_000, dtypes=("fp32", "fp16", "bf16"), seed: int = 0) -> dict:
    """``{(world_size, dtype): relative error}`` of :func:`ring_sum` against float64, for ``n``
    gradients of size ~1e-3 per rank. Simulated in this process (no ranks are started)."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    for w in world_sizes:
        grads = [torch.randn(n, generator=g) * 1e-3 for _ in range(w)]
        exact = torch.stack(grads).double().sum(0)
        for d in dtypes:
            got = ring_sum(grads, dtype_of(d)).double()
            out[(w, d)] = float((got - exact).norm() / exact.norm())
    return out


# --- memory per rank ------------------------------------------------------------------------


SETUPS = {  # name: (strategy, dtype of the weight copy while computing, formulas: kept, copy)
    "DDP, fp32": ("ddp", None, "16 N", "0"),
    "DDP + autocast bf16": ("ddp", "bf16", "16 N", "2 N at most"),
    "FSDP2 (fp32)": ("fsdp", "fp32", "16 N / W", "2 x 4 L"),
    "FSDP2 (bf16, fp32)": ("fsdp", "bf16", "16 N / W", "2 x 2 L"),
}


def memory_per_rank(n_params: int, setup: str, world_size: int = 1, layer_params: int = 0) -> dict:
    """Bytes one rank holds for ``n_params`` parameters trained with AdamW, exact integers.

    Kept all the time: float32 weights (4 B), float32 gradients (4 B) and Adam's m and v
    (4 + 4 B): 16 B per parameter, on every rank with DDP, divided by ``world_size`` with
    FSDP2 (each rank keeps 1/world_size of every tensor; here n_params must divide evenly).
    Mixed precision changes none of that. It adds a copy of weights while computing:
    autocast's bf16 copies of the weights its matmuls use, saved for backward (DDP +
    autocast: at most 2 B per parameter, counted as 2 N), or FSDP2's unsharded layer
    (``layer_params`` of them, at 4 B in fp32 or 2 B with param_dtype=bf16) twice: its
    parameters and the flat all-gather output they are copied out of, both alive while the
    layer runs forward (``FSDPParamGroup.wait_for_unshard``, torch 2.13). Prefetching and
    activations are not counted.
    """
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {', '.join(SETUPS)}; got {setup!r}")
    strategy, copy, _, _ = SETUPS[setup]
    if strategy == "fsdp" and n_params % world_size:
        raise ValueError(f"{n_params:,} parameters do not split evenly over {world_size} ranks")
    share = n_params if strategy == "ddp" else n_params // world_size
    copied = n_params if strategy == "ddp" else 2 * layer_params
    transient = 0 if copy is None else BYTES[copy] * copied
    return {"weights": 4 * share, "grads": 4 * share, "adam": 8 * share, "kept": 16 * share,
            "while computing": transient}


UNITS = {1: "bytes", 10**9: "GB", 2**30: "GiB"}


def memory_table(n_params: int, world_size: int, layer_params: int, unit: int = 1) -> str:
    """Every setup of :data:`SETUPS` for one model: bytes per rank, the formula, then the numbers
    (N parameters, W ranks, L parameters in the largest layer), in ``unit`` (1, 10**9 or 2**30)."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(map(str, UNITS))} ({', '.join(UNITS.values())}); got {unit!r}")

    def fmt(b):
        return f"{b:,}" if unit == 1 else f"{b / unit:,.1f}"

    rows = []
    for setup, (_, _, kept, copy) in SETUPS.items():
        m = memory_per_rank(n_params, setup, world_size, layer_params)
        rows.append([setup, kept, fmt(m["kept"]), copy, fmt(m["while computing"])])
    name = UNITS[unit]
    return _table(["setup", "kept: weights+grads+Adam", name, "+ weights while computing", name], rows)


def largest_layer(shapes) -> int:
    """Parameters of the largest sharded unit (one Linear: weight + bias), from ``[[out, in], [out]]``."""
    return max(out * inp + out for out, inp in shapes)


# --- the GPU self-check ---------------------------------------------------------------------


def selfcheck(device=None) -> list:
    """Lesson 07's facts on ``device`` (``make gpu-check``): CUDA runs NCCL with one rank
    (world size 1), a CPU runs gloo with two. Returns the verdicts."""
    dev = pick_device(device)
    if dev.type == "mps":
        return [check("lesson 07 runs on mps", False, "torch.distributed has no mps backend; run on cpu")]
    nproc = 1 if dev.type == "cuda" else 2
    low = "bf16" if dev.type == "cpu" or torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    jobs = [ddp_job("ddp", precision=low, steps=2),
            fsdp_job("reduce fp32", low, "fp32", steps=2), fsdp_job("reduce none", low, None, steps=2),
            fsdp_job("scaler", "fp16", "fp32", steps=3, scaler="sharded", inf_at=(nproc - 1, 1))]
    run = launch(jobs, nproc=nproc, device=dev.type)
    wanted = DTYPE_NAMES[low]
    where = f"{run.backend}, {run.world_size} rank(s) on {run.device}"
    ddp = run["ddp"][0]
    out = [check(f"{nproc} rank(s) ran and reported ranks 0..{nproc - 1} ({where})",
                 sorted(r["rank"] for r in run.ranks) == list(range(nproc))
                 and all(r["world_size"] == nproc for r in run.ranks)),
           check(f"DDP under {low} autocast all-reduces float32 buckets and keeps float32 grads ({where})",
                 ddp["bucket"] == ["float32"] and ddp["sent"] == ["float32"] and ddp["grad"]["dtype"] == "float32",
                 f"bucket {ddp['bucket']}, sent {ddp['sent']}, grads {ddp['grad']['dtype']}")]
    for name, reduce in (("reduce fp32", "float32"), ("reduce none", reduce_dtype_when_none(low))):
        s = policy_stages(run[name][0])
        out.append(check(f"FSDP2 ({low}, {name.split()[1]}): sharded float32, forward {wanted}, reduced in "
                         f"{reduce}, grads float32 ({where})",
                         (s["sharded"], s["forward"], s["reduce_scatter"], s["gradient"])
                         == ("float32", wanted, reduce, "float32"), str(s)))
    skipped = skipped_steps(run, "scaler")
    out.append(check(f"ShardedGradScaler skips step 1 on every rank after an inf in rank {nproc - 1}'s shard "
                     f"({where})", all(v == [1] for v in skipped.values()), str(skipped)))
    return out


# --- command line -----------------------------------------------------------------------------


MAX_CLI_STEPS = 1000  # each of the 6 jobs trains this many steps before the tables print


def main(args) -> int:
    """``python -m amp_lessons dist``: the lesson's DDP and FSDP2 tables from a real run."""
    if args.selfcheck:
        verdicts = selfcheck(args.device)
        for v in verdicts:
            print(v.line())
        return 0 if all(v.holds for v in verdicts) else 1
    device = args.device or "cpu"
    if not 1 <= args.steps <= MAX_CLI_STEPS:
        raise ValueError(f"--steps must be from 1 to {MAX_CLI_STEPS}; got {args.steps}")
    jobs = [ddp_job("DDP fp32", "fp32", steps=args.steps), ddp_job("DDP bf16 autocast", "bf16", steps=args.steps),
            *(fsdp_job(n, p, r, steps=args.steps) for n, p, r in
              (("(fp32)", None, None), ("(bf16, fp32)", "bf16", "fp32"), ("(bf16, None)", "bf16", None),
               ("(fp16, fp32)", "fp16", "fp32")))]
    run = launch(jobs, nproc=args.nproc, device=device, via=args.via)
    if args.json:
        print(json.dumps(run.ranks, indent=1))
        return 0
    print(describe_ranks(run), "\n")
    print(ddp_table(run, run.names[:2]), "\n")
    print(policy_table(run, run.names[2:]))
    print(f"\n{run.world_size} ranks in {run.seconds:.1f} s, started as: {run.command}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("dist", help="DDP and FSDP2 under mixed precision on N real processes (lesson 07)")
    p.add_argument("--device", default=None, help="cpu (gloo, the default) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps per job (default 3)")
    p.add_argument("--via", choices=("direct", "torchrun"), default="direct",
                   help="start the ranks directly (default) or with python -m torch.distributed.run")
    p.add_argument("--json", action="store_true", help="print every rank's record as JSON")
    p.add_argument("--selfcheck", action="store_true", help="check lesson 07's facts on this device")
    p.set_defaults(run=main)
