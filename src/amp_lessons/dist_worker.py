"""What each rank of lesson 07 runs: ``python -m amp_lessons.dist_worker RUN_DIR``.

One process per rank, started by :func:`amp_lessons.distributed.launch` (or by hand with
``torchrun --nproc-per-node 2 -m amp_lessons.dist_worker RUN_DIR``: it reads the same
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` variables torchrun sets). It
reads the jobs from ``RUN_DIR/plan.json`` and the digits from ``RUN_DIR/data.pt``, runs
the jobs in one process group (gloo on CPU, NCCL on GPUs) and writes what it saw to
``RUN_DIR/rank{R}.json``; when it fails, it writes ``RUN_DIR/rank{R}.error.json`` and
exits with status 1. The launcher reads these files back; nobody parses a log.

The jobs (built by ``distributed.ddp_job``, ``fsdp_job``, ``reduce_job``, ``fail_job``):

- ``ddp``: DistributedDataParallel with autocast, and a comm hook wrapped in a spy that
  records the bucket DDP hands the hook and what the hook really all-reduces.
- ``fsdp``: FSDP2 (``fully_shard``) with a ``MixedPrecisionPolicy``; a custom
  reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that records what is
  reduce-scattered, and a forward pre-hook that records the unsharded parameter.
- ``reduce``: reduction pitfalls on real collectives (bf16 swamping, fp16 overflow).
- ``fail``: a rank that raises, dies or hangs, for the launcher's failure paths.

Used in 07_beyond_one_device (through ``amp_lessons.distributed``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .models import mlp

_STARTED = time.time()  # (after torch's import) for the ranks' start-up time

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL = {"d_in": 64, "hidden": 64, "classes": 10, "depth": 2, "seed": 0}
SETTINGS = {"lr": 3e-3, "batch_size": 64}


# --- version differences, in one place ---------------------------------------------------


def fsdp2():
    """``(fully_shard, MixedPrecisionPolicy, FSDPModule)`` of this torch: public from torch 2.6
    on (``torch.distributed.fsdp``), under ``torch.distributed._composable.fsdp`` before."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (
                FSDPModule,
                MixedPrecisionPolicy,
                fully_shard,
            )
        except ImportError as err:
            raise RuntimeError(f"FSDP2 (fully_shard) is not in torch {torch.__version__}; lesson 07 "
                               "needs torch >= 2.6 (the course is checked on 2.11 and newer)") from err
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"torch {torch.__version__}'s FSDP2 has no set_custom_reduce_scatter, which "
                           "lesson 07 uses to see what is reduce-scattered; use torch >= 2.11")
    return fully_shard, MixedPrecisionPolicy, FSDPModule


def _collective(new: str, old: str):
    """torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to ``*_single``
    (the old names warn); take whichever this torch has."""
    return getattr(dist, new, None) or getattr(dist, old)


def sharded_grad_scaler(device_type: str):
    """FSDP's GradScaler, which all-reduces "found inf" over the ranks."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# --- the rank's context --------------------------------------------------------------------


@dataclass
class Context:
    """This rank: its place in the group, its device, and the digits it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    x: torch.Tensor
    y: torch.Tensor
    _mesh: object = None

    def batch(self, step: int, batch_size: int):
        """This rank's batch of ``step``: ranks draw different examples (data parallel)."""
        n = len(self.x)
        g = torch.Generator().manual_seed(step * self.world_size + self.rank)
        idx = torch.randint(0, n, (batch_size,), generator=g)
        return self.x[idx].to(self.device), self.y[idx].to(self.device)

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh


def lesson_model(device):
    """07's MLP (64 -> 64 -> 64 -> 10, ReLU) from ``amp_lessons.models``, the same weights
    on every rank and every call (built under its own seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL["seed"])
        model = mlp(MODEL["d_in"], MODEL["hidden"], MODEL["classes"], depth=MODEL["depth"])
    return model.to(device)


def _global_mean(ctx: Context, value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return float(t.item()) / ctx.world_size


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _kind(t: torch.Tensor) -> str:
    """``"DTensor Shard(0)"`` or ``"plain tensor"`` (spelled the same on every torch release)."""
    if hasattr(t, "placements"):
        return "DTensor " + ",".join(f"Shard({p.dim})" if hasattr(p, "dim") else f"{type(p).__name__}()"
                                     for p in t.placements)
    return "plain tensor"


def _state_bytes(model, opt) -> dict:
    """Bytes this rank holds: parameters, gradients, optimizer state (tensors of a
    parameter's shape: Adam's m and v; the scalar step counters are left out)."""
    params = [p for p in model.parameters()]
    out = {"params": sum(_local(p).numel() * _local(p).element_size() for p in params),
           "grads": sum(_local(p.grad).numel() * _local(p.grad).element_size()
                        for p in params if p.grad is not None),
           "optimizer": 0, "numel": sum(_local(p).numel() for p in params)}
    for p in params:
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.shape == p.shape:
                out["optimizer"] += _local(v).numel() * _local(v).element_size()
    return out


def _params_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --- one training loop for DDP and FSDP2 ---------------------------------------------------


def _train(ctx: Context, model, job: dict, autocast_dtype=None, scaler=None, on_step0=None,
           plant: str = "grad") -> list:
    """``job["steps"]`` AdamW steps of the recipe (scale -> backward -> step -> update);
    returns one dict per step: the mean loss over the ranks, the scale before the step, whether
    the step was skipped (AdamW's step count did not move), AdamW's step count, and whether
    this rank's gradients held an inf after backward (and its reduce).

    ``job["inf_at"] = (rank, step)`` makes that rank's step non-finite: ``plant="loss"``
    multiplies its loss by inf before backward (DDP's all-reduce then spreads it);
    ``plant="grad"`` writes an inf into its own gradient shard after backward (FSDP2's
    reduce-scatter is over by then, so no other rank's gradients see it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=job.get("lr", SETTINGS["lr"]))
    inf_rank, inf_step = job.get("inf_at") or (None, None)
    rows = []
    for step in range(job["steps"]):
        x, y = ctx.batch(step, job.get("batch_size", SETTINGS["batch_size"]))
        with torch.autocast(ctx.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        planted = step == inf_step and ctx.rank == inf_rank
        backward_loss = loss * float("inf") if planted and plant == "loss" else loss
        (scaler.scale(backward_loss) if scaler is not None else backward_loss).backward()
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        if planted and plant == "grad":
            grads[0].view(-1)[0] = float("inf")  # in this rank's own gradient shard only
        own_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if step == 0 and on_step0 is not None:
            on_step0(logits, loss, opt)
        scale = scaler.get_scale() if scaler is not None else 1.0
        taken = _adam_steps(opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        steps = _adam_steps(opt)
        rows.append({"step": step, "loss": _global_mean(ctx, loss), "scale": scale,
                     "skipped": steps == taken, "own_inf": own_inf, "optimizer_steps": steps})
        if step < job["steps"] - 1:
            opt.zero_grad(set_to_none=True)
    job["_state"] = _state_bytes(model, opt)  # after the last step: weights, grads, m and v
    return rows


def _adam_steps(opt) -> int:
    for state in opt.state.values():
        if "step" in state:
            return int(_local(torch.as_tensor(state["step"])).item())
    return 0


def _grad_record(model) -> dict:
    p = next(model.parameters())
    return {"dtype": dtype_name(p.grad.dtype), "type": _kind(p.grad)}


# --- DDP -------------------------------------------------------------------------------------


class HookSpy:
    """DDP comm-hook state: runs a real hook (``allreduce``, ``bf16``, ``fp16``) and records
    the bucket DDP hands it, what the hook passes to ``dist.all_reduce`` (dtype, bytes), and
    at step 0 the hook's result against a float32 all-reduce of the same bucket."""

    def __init__(self, hook: str):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {"allreduce": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
                 "fp16": default_hooks.fp16_compress_hook}
        if hook not in hooks:
            raise ValueError(f"hook must be one of {', '.join(hooks)}; got {hook!r}")
        self.hook = hooks[hook]
        self.bucket_dtypes: set[str] = set()
        self.sent: list[tuple[str, int]] = []
        self.recording = True  # step 0 only
        self.err_sq = 0.0
        self.ref_sq = 0.0

    def hook_fn(self, state, bucket):
        buffer = bucket.buffer()
        if not self.recording:
            return self.hook(None, bucket)
        self.bucket_dtypes.add(dtype_name(buffer.dtype))
        reference = buffer.detach().clone().div_(dist.get_world_size())
        dist.all_reduce(reference)  # what DDP sends without a hook: float32, the same bucket
        real = dist.all_reduce

        def spy(tensor, *args, **kwargs):
            self.sent.append((dtype_name(tensor.dtype), tensor.numel() * tensor.element_size()))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = spy
        try:
            fut = self.hook(None, bucket)
        finally:
            dist.all_reduce = real

        def compare(f):
            out = f.value()
            out = out[0] if isinstance(out, (list, tuple)) else out
            self.err_sq += float((out.double() - reference.double()).pow(2).sum())
            self.ref_sq += float(reference.double().pow(2).sum())
            return out

        return fut.then(compare)


def run_ddp(ctx: Context, job: dict) -> dict:
    """DDP + autocast(``precision``) with the comm hook ``hook``: what is kept, computed and sent."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = lesson_model(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    spy = HookSpy(job.get("hook", "allreduce"))
    ddp.register_comm_hook(None, spy.hook_fn)
    precision = job.get("precision", "fp32")
    record = {"kind": "ddp", "precision": precision, "hook": job.get("hook", "allreduce")}

    def step0(logits, loss, opt):
        spy.recording = False
        record.update(weights=dtype_name(next(model.parameters()).dtype), output=dtype_name(logits.dtype),
                      loss=dtype_name(loss.dtype), grad=_grad_record(model))

    scaler = torch.amp.GradScaler(ctx.device.type) if precision == "fp16" else None
    record["steps"] = _train(ctx, ddp, job, None if precision == "fp32" else DTYPES[precision],
                             scaler, step0, plant="loss")
    record.update(bucket=sorted(spy.bucket_dtypes), sent=sorted({d for d, _ in spy.sent}),
                  sent_bytes=sum(b for _, b in spy.sent),
                  hook_error=math.sqrt(spy.err_sq / spy.ref_sq) if spy.ref_sq else 0.0,
                  n_params=sum(p.numel() for p in model.parameters()), memory=job.pop("_state"),
                  digest=_params_digest(model))
    return record


# --- FSDP2 -----------------------------------------------------------------------------------


class CommSpy:
    """A custom FSDP2 collective (``set_custom_reduce_scatter`` / ``set_custom_all_gather``)
    that records the dtype of every buffer FSDP allocates for it and of every tensor it
    sends, then runs the ordinary collective."""

    def __init__(self, reduce: bool):
        self.reduce = reduce
        self.buffers: set[str] = set()
        self.sent: list[tuple[str, int]] = []
        self.ops: set[str] = set()

    def allocate(self, size, *, dtype, device):
        self.buffers.add(dtype_name(dtype))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.sent.append((dtype_name(input_tensor.dtype), input_tensor.numel() * input_tensor.element_size()))
        if not self.reduce:
            gather = _collective("all_gather_single", "all_gather_into_tensor")
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)
        self.ops.add("avg" if op == dist.ReduceOp.AVG else "sum" if op == dist.ReduceOp.SUM else "other")
        scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def record(self) -> dict:
        sent = sorted({d for d, _ in self.sent})
        return {"buffer": sorted(self.buffers), "sent": sent, "sent_bytes": sum(b for _, b in self.sent),
                "ops": sorted(self.ops)}


def run_fsdp(ctx: Context, job: dict) -> dict:
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, each Linear sharded and
    then the root: the dtypes at each stage, the loss curve, the scaler's decisions."""
    fully_shard, MixedPrecisionPolicy, FSDPModule = fsdp2()
    param_dtype, reduce_dtype = (DTYPES.get(job.get(k)) for k in ("param_dtype", "reduce_dtype"))
    model = lesson_model(ctx.device)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = []
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            units.append(sum(p.numel() for p in layer.parameters()))
            fully_shard(layer, mesh=ctx.mesh(), mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh(), mp_policy=policy)
    gather, scatter = CommSpy(reduce=False), CommSpy(reduce=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    first = model[0]
    sharded = first.weight
    record = {"kind": "fsdp", "param_dtype": job.get("param_dtype"), "reduce_dtype": job.get("reduce_dtype"),
              "sharded": {"dtype": dtype_name(sharded.dtype), "type": _kind(sharded),
                          "local_shape": list(_local(sharded).shape), "shape": list(sharded.shape)}}

    def seen_in_forward(module, args):
        if "forward" not in record:
            record["forward"] = {"dtype": dtype_name(module.weight.dtype), "type": _kind(module.weight),
                                 "input": dtype_name(args[0].dtype)}

    handle = first.register_forward_pre_hook(seen_in_forward)

    def step0(logits, loss, opt):
        handle.remove()
        record.update(output=dtype_name(logits.dtype), loss=dtype_name(loss.dtype), grad=_grad_record(model),
                      gather=gather.record(), reduce=scatter.record())

    scaler = {None: None, "sharded": lambda: sharded_grad_scaler(ctx.device.type),
              "amp": lambda: torch.amp.GradScaler(ctx.device.type)}[job.get("scaler")]
    record["scaler"] = job.get("scaler")
    record["steps"] = _train(ctx, model, job, None, scaler() if scaler else None, step0)
    record.update(n_params=sum(p.numel() for p in model.parameters()), units=units, memory=job.pop("_state"))
    return record


# --- reduction pitfalls on real collectives --------------------------------------------------


def run_reduce(ctx: Context, job: dict) -> dict:
    """The sums a reduction in a 16-bit dtype gets wrong, all-reduced for real."""
    dev, r, w = ctx.device, ctx.rank, ctx.world_size

    def all_reduce(value, dtype, divide=1):
        t = torch.as_tensor(value, dtype=torch.float32, device=dev).to(dtype).reshape(-1).clone()
        t.div_(divide)  # after the cast, as FSDP2's foreach_reduce divides its reduce_dtype buffer
        dist.all_reduce(t)
        return t

    big_small = 1.0 if r == 0 else job.get("small", 1e-3)
    out = {"kind": "reduce", "swamp": {}, "overflow": {}, "error": {}}
    for name, dtype in DTYPES.items():
        out["swamp"][name] = float(all_reduce(big_small, dtype).item())
        out["overflow"][name] = float(all_reduce(job.get("large", 40000.0), dtype).item())
        out["overflow"][name + " /world"] = float(all_reduce(job.get("large", 40000.0), dtype, divide=w).item())
    g = torch.Generator().manual_seed(1000 + r)
    grads = torch.randn(job.get("n", 100_000), generator=g) * 1e-3
    exact = grads.double().to(dev).clone()
    dist.all_reduce(exact)
    for name, dtype in DTYPES.items():
        t = grads.to(dev).to(dtype).clone()  # .to(float32) would be grads itself
        dist.all_reduce(t)
        out["error"][name] = float((t.double() - exact).norm() / exact.norm())
    out["n"] = grads.numel()
    return out


# --- failures on purpose ---------------------------------------------------------------------


def run_fail(ctx: Context, job: dict) -> dict:
    """Rank ``job["rank"]`` raises, dies (SIGKILL), exits, hangs, or aborts once its record is
    written; the others wait at a barrier."""
    if ctx.rank == job.get("rank", 1):
        how = job.get("how", "raise")
        if how == "raise":
            raise RuntimeError(job.get("message", "this rank fails on purpose (fail_job)"))
        if how == "kill":
            os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
        if how == "hang":
            time.sleep(job.get("seconds", 3600))
        if how == "exit":
            os._exit(job.get("code", 3))
        if how == "abort_after_record":  # finishes its work, then aborts as gloo's teardown can
            record = Path(os.getcwd()) / f"rank{ctx.rank}.json"

            def abort_once_recorded():
                while not record.exists():
                    time.sleep(0.01)
                os.abort()

            threading.Thread(target=abort_once_recorded, daemon=True).start()
    dist.barrier()
    return {"kind": "fail"}


JOBS = {"ddp": run_ddp, "fsdp": run_fsdp, "reduce": run_reduce, "fail": run_fail}


# --- the rank's main -------------------------------------------------------------------------


PARENT_ENV = "AMP_LESSONS_DIST_LAUNCHER"


def _watch_parent() -> None:
    """Exit when the launcher is gone: no rank outlives its run, even when the notebook's
    kernel was killed (no ``finally`` ran there). Two signs: this process's parent changed
    (the launcher, or torchrun, died), or the launcher's pid (``AMP_LESSONS_DIST_LAUNCHER``,
    set by ``launch``) no longer exists, which also covers a launcher that died while this
    rank was still importing torch."""
    parent = os.getppid()
    launcher = int(os.environ.get(PARENT_ENV, "0") or 0)

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        if launcher:
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
        return False

    def watch():
        while not gone():
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _write(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _context(plan: dict, data: dict) -> Context:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(plan["device"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = plan["backend"]
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.get("collective_timeout", 60)),
                            **({"device_id": device} if device.type == "cuda" else {}))
    return Context(rank, world, local_rank, device, backend, data["x"], data["y"])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m amp_lessons.dist_worker RUN_DIR  (started by amp_lessons.distributed.launch "
              "or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    _watch_parent()
    stage = "start"
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        torch.set_num_threads(int(plan.get("threads", 1)))
        data = torch.load(run_dir / "data.pt")
        stage = "init_process_group"
        ctx = _context(plan, data)
        ready = time.time()
        records = {}
        started = time.perf_counter()
        for job in plan["jobs"]:
            stage = f"job {job['name']!r}"
            records[job["name"]] = JOBS[job["kind"]](ctx, dict(job))
            records[job["name"]]["seconds"] = time.perf_counter() - started
            started = time.perf_counter()
            (run_dir / f"rank{ctx.rank}.progress").write_text(str(len(records)))  # for the launcher's bar
        stage = "finish"
        dist.barrier()
        _write(run_dir / f"rank{ctx.rank}.json", {
            "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
            "backend": ctx.backend, "device": str(ctx.device), "torch": torch.__version__,
            "pid": os.getpid(), "ready_after": ready - _STARTED, "jobs": records})
        dist.destroy_process_group()
        return 0
    except BaseException as err:  # noqa: BLE001 - written down for the launcher, then exit 1
        _write(run_dir / f"rank{rank}.error.json", {
            "rank": rank, "stage": stage, "type": type(err).__name__, "message": str(err),
            "traceback": traceback.format_exc(), "time": time.time()})
        return 1


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown. The rank's record (or error) is written and
    its process group destroyed by now; what is left is finalization, where gloo's worker
    threads can still hold tensors that need the GIL, and the process aborts with
    "terminate called without an active exception" (SIGABRT) now and then, after its work is
    done. ``os._exit`` skips that; the launcher reads the record, not the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
