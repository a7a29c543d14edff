# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Beyond one device: mixed precision under DDP and FSDP2
#
# On one device, mixed precision asks which dtype each op runs in. Once a model is trained on
# several devices, two more questions come up: which dtype is *communicated* between them, and
# which dtype each one *keeps*. The answers decide how many bytes each collective moves, how much
# memory each device needs, and how accurate the summed gradients are.
#
# This lesson uses PyTorch's own engine, `torch.distributed`, with two real processes
# (*ranks*) on this machine. On CPUs they talk through the gloo backend; with
# `DEVICE = "cuda"` the same launch uses NCCL, one GPU per rank (the stored outputs come
# from CPU ranks). It covers DDP, which keeps a full copy of the model on
# every rank, and FSDP2 (`fully_shard`), which shards the model across ranks.

# %%
# Setup, the same in every lesson: on Colab, install the course package first.
import importlib.util
import shutil
import subprocess
import sys

REPO = "https://github.com/amp-lessons/amp-lessons"
if "google.colab" in sys.modules and importlib.util.find_spec("amp_lessons") is None:
    # --no-deps: the runtime's own torch and ipywidgets stay as they are.
    pip = (subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"git+{REPO}"],
                          capture_output=True, text=True) if shutil.which("git") else None)
    if pip is None or pip.returncode:
        said = "" if pip is None else pip.stdout + pip.stderr
        print(said[-3000:])
        if pip is None:
            todo = "Git is not installed here: run `!apt-get install -y git` in a cell, then this one again."
        elif any(s in said for s in ("Could not resolve host", "Failed to connect", "Network is unreachable")):
            todo = ("This runtime cannot reach GitHub (offline?): reconnect it (Runtime > Reconnect), "
                    "then run this cell again.")
        elif any(s in said for s in ("not found", "could not read Username", "Authentication failed")):
            todo = (f"{REPO} was not found, or is private: open the lesson from the course's README "
                    "('Open in Colab'), or set REPO above to the course's new address.")
        else:
            todo = "pip's message is above; run this cell again, and if it fails the same way, report that message."
        raise RuntimeError(f"The course package did not install. {todo}") from None

import torch

import amp_lessons

amp_lessons.seed_everything(0)

# %%
# NBVAL_IGNORE_OUTPUT
device = amp_lessons.pick_device()
report = amp_lessons.hardware_report()
print(f"device {device} ({report.name}), torch {report.torch_version}")

# %% [markdown]
# ## Two processes, started from a notebook
#
# `torch.multiprocessing.spawn` sends each new process the function to run by its module and
# name. A function *defined in a notebook* lives in the kernel's `__main__`, which a fresh
# process cannot import, so its ranks fail with `Can't get attribute ... on <module
# '__main__'>` (Python's `multiprocessing` docs: the `__main__` module must be importable by
# the children). So `launch` starts one Python process per rank on a module,
# `amp_lessons.dist_worker`, with some of the environment variables `torchrun` would set (RANK,
# LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and a
# directory (RUN_DIR) that holds the plan and the data; each rank writes what it saw to a
# file there, which `launch` reads back.
#
# The first run trains the course's digits MLP with DDP for 20 steps, once in float32 and once
# under bf16 autocast. Each rank trains on its own batches.

# %%
from amp_lessons import distributed as D

DEVICE = "cpu"  # "cuda" runs NCCL, one GPU per rank: 2 GPUs here (one T4 is not enough)
ddp = D.launch([D.ddp_job("DDP fp32", precision="fp32"), D.ddp_job("DDP + autocast bf16", precision="bf16")],
               nproc=2, device=DEVICE)
print(D.describe_ranks(ddp))
print("the ranks were started as:", ddp.command)

# %% [markdown]
# ## DDP + autocast: what DDP all-reduces
#
# During `backward()`, DDP averages the gradients over the ranks with an all-reduce. It
# packs them into *buckets* and passes each bucket to a *comm hook*. The course's spy is
# a hook that records the bucket DDP hands it and the tensor it passes to
# `dist.all_reduce`; then it runs `allreduce_hook`, which does what DDP does without a hook
# (its docstring: the results are expected to be the same as with no hook registered).
#
# **Predict:** under bf16 autocast the matmuls run in bf16. Which dtype does DDP all-reduce?

# %%
print(D.ddp_table(ddp))

# %% [markdown]
# The all-reduce is float32 in both runs, and it is handed as many bytes. Autocast casts each
# weight to bf16 inside `forward`, and that cast is part of the autograd graph. Its backward
# casts the gradient back to the weight's dtype, so a gradient has its parameter's dtype
# (unless the parameter's `grad_dtype` is set to another one). The parameters are float32
# master weights, so DDP's buckets are float32: 4 bytes per parameter. Each rank computes
# its own loss on its own batch; the averaged gradients make every rank take the same step.
#
# These byte counts, here and below, are the sizes of the tensors each rank hands to a
# collective, not what crosses the wire: a ring all-reduce over W ranks sends about
# 2(W-1)/W times its tensor from each rank, a ring all-gather or reduce-scatter (W-1)/W of
# the full tensor; the backend picks the algorithm.

# %%
n_params = ddp["DDP fp32"][0]["n_params"]
print(f"{n_params:,} parameters x 4 bytes = {4 * n_params:,} bytes all-reduced per step by each rank")
print("every rank ends with bit-identical weights:", all(D.ranks_agree(ddp, name) for name in ddp.names))

# %% [markdown]
# ## Compress hooks: half the bytes, at a price
#
# `bf16_compress_hook` and `fp16_compress_hook` cast each bucket to 16 bits, divide it by
# the world size, all-reduce it, and copy the result back into the float32 bucket. The
# weights and gradients stay float32; only the message shrinks. Below they run on the float32
# model, so the only rounding in each run is the hook's. At the first step, the spy also
# all-reduces every bucket in float32 beside the hook, for reference.
#
# **Predict:** how many bytes is each hook's all-reduce handed? Which one adds more error:
# bf16 (8 significant bits, float32's range) or fp16 (11 bits, a narrow range)?

# %%
hooks = D.launch([D.ddp_job(f"{h} hook", precision="fp32", hook=h) for h in D.HOOKS], device=DEVICE)
print(D.ddp_table(hooks))

# %%
from amp_lessons.claims import at_least, at_most, between, check, measured

errors = D.hook_errors(hooks)
for name in ("bf16 hook", "fp16 hook"):
    print(f"{name}: error against a float32 all-reduce {measured(errors[name][1], '.1e')}")
check("the allreduce hook adds no error against the spy's float32 all-reduce", errors["allreduce hook"][1] == 0.0)

# %%
at_least("on this model's gradients, bf16_compress_hook adds at least 4x the error of fp16_compress_hook",
         errors["bf16 hook"][1] / errors["fp16 hook"][1], 4, ".0f")

# %%
at_most("fp16_compress_hook's error stays below 1e-3 of the gradients' size", errors["fp16 hook"][1], 1e-3)

# %% [markdown]
# A compress hook rounds every gradient to 16 bits before the sum, and the sum again. Both
# hooks also cast *before* they divide by the world size
# (`buffer.to(dtype).div_(world_size)`). For fp16, with its narrow range, a gradient at or
# below half its smallest subnormal, 2^-25 (a tie, which rounds to even: 0), rounds to 0
# before the sum starts, and the division pushes more into subnormals, where the ranking
# above flips: on tiny gradients fp16 is the worse hook. The hooks' cast and divide for 8
# ranks, on three float32 gradients (one rank's part, before any sum):

# %%
g = torch.tensor([1e-3, 1e-6, 1e-8])
exact = g / 8
by = {name: g.to(dtype).div_(8).float() for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))}
for i, grad in enumerate(g.tolist()):
    print(f"gradient {grad:g}: float32 {exact[i]:.3g}; relative error of the cast and divide in fp16 "
          f"{abs(by['fp16'][i] - exact[i]) / exact[i]:.1%}, in bf16 {abs(by['bf16'][i] - exact[i]) / exact[i]:.1%}")

# %% [markdown]
# In fp16 the 1e-8 gradient is gone, and 1e-6 / 8 is off by about 5%; bf16 keeps both to
# its usual rounding. Under fp16 autocast with a
# GradScaler, DDP all-reduces during `scaler.scale(loss).backward()` (each bucket's reduction
# "can potentially overlap with backward computation": the `DistributedDataParallel`
# docstring), before `unscale_`. So the hook casts gradients still multiplied by the loss
# scale, which lifts small ones above fp16's subnormals; a scaled gradient from 65520 on
# (lesson 01) would become an inf in the cast, and the scaler would skip the step. In float32 or bf16
# training nothing lifts them. Whether a compress hook saves time depends on how long the
# step waits for the all-reduce: measure your step time with it and without it.
#
# ## FSDP2: sharded, with a policy for each dtype
#
# FSDP2 keeps 1/W of every parameter on each of the W ranks: a `DTensor` sharded on dimension
# 0 by default (padded where W does not divide it, `_fsdp_param.py`; it divides this
# model's). Just before a layer runs, the ranks *all-gather* its full parameters. As each
# layer's backward ends, they *reduce-scatter* its gradients, so each rank receives the averaged gradient of its own
# shard. `MixedPrecisionPolicy(param_dtype, reduce_dtype)` sets the dtype of the gathered
# parameters (so of the layer's computation) and of the reduce-scatter. Its
# `cast_forward_inputs=True` (the default) also casts each sharded module's floating-point
# inputs to `param_dtype` before its forward. The spy here is a
# custom all-gather and reduce-scatter (`set_custom_all_gather`, `set_custom_reduce_scatter`)
# that records each tensor before sending it the usual way.
#
# Each policy below trains the same MLP for 30 steps, with each Linear sharded.
# **Predict:** with `(bf16, None)` (param_dtype bf16, reduce_dtype left at None), which dtype
# is reduce-scattered? Which dtype does the gradient end up in?

# %%
POLICIES = {"(fp32)": (None, None), "(bf16, fp32)": ("bf16", "fp32"), "(bf16, bf16)": ("bf16", "bf16"),
            "(fp16, fp32)": ("fp16", "fp32")}
fsdp = D.launch([D.fsdp_job(name, p, r, steps=30) for name, (p, r) in POLICIES.items()]
                + [D.fsdp_job("(bf16, None)", "bf16", None, steps=1), D.fsdp_job("exercise", "fp16", None, steps=1)],
                device=DEVICE)
print(D.policy_table(fsdp, POLICIES))

# %% [markdown]
# Read the table by column:
#
# - The **sharded parameter** is float32 here, as the model was built in float32. It holds
#   the master weights that AdamW updates, whatever the policy.
# - **In forward**, and **all-gathered**, the parameter is in `param_dtype`.
# - The **reduce-scatter** runs in `reduce_dtype`.
# - The **gradient** that lands in the sharded parameter is float32 again, for the optimizer.
#
# And `(bf16, None)`, with reduce_dtype left at None? The answer depends on the torch
# release: torch 2.15 changed the default (2.15's `reduce_dtype` docstring says so, under
# `versionchanged:: 2.15`, in `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`; 2.13's
# says None "uses the compute dtype"). Both defaults, and a check that this
# release's run did what its default says:

# %%
print(D.reduce_none_defaults("bf16"))
seen = D.policy_stages(fsdp["(bf16, None)"][0])["reduce_scatter"]
check("(bf16, None) reduce-scattered in the dtype this torch release's default names",
      seen == D.reduce_dtype_when_none("bf16"))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"(bf16, None) reduce-scattered here in: {seen}")  # bfloat16 in torch 2.13, float32 from 2.15

# %% [markdown]
# **Predict:** how many bytes is a bf16 all-gather handed, next to a float32 one? And a
# float32 reduce-scatter, next to a bf16 one? Here is what rank 0 handed to them in one step:

# %%
print(D.comm_bytes(fsdp, POLICIES))
n = fsdp["(fp32)"][0]["n_params"]
print(f"\nrank 0's float32 shard: {4 * n // fsdp.world_size:,} bytes; the whole float32 gradient: {4 * n:,} bytes")

# %% [markdown]
# Each all-gather is handed this rank's shard, and with the default `reshard_after_forward`
# (True for every module but the root, which holds no parameters here: the `fully_shard`
# docstring) a layer is gathered
# twice per step: for forward, and again for backward, after FSDP2 freed the gathered
# weights. So a float32
# all-gather total is twice the float32 shard. A reduce-scatter is handed the whole unsharded
# gradient and gives back this rank's shard of the average: its float32 total is the whole
# gradient. The two 35,880s are equal because W = 2: the all-gathers total 2 x 4 N / W, the
# reduce-scatters 4 N.

# %% [markdown]
# And here is what rank 0 holds of the first layer's weight under `(bf16, fp32)`:

# %%
print(D.fsdp_stages(fsdp["(bf16, fp32)"][0]))

# %% [markdown]
# FSDP2's policy is not autocast. It casts each parameter's shard to `param_dtype` before
# the all-gather (`_get_param_all_gather_inputs`, `_fsdp_collectives.py`) and, with
# `cast_forward_inputs`, the module's inputs; each op then runs in the dtype of what it is
# given, as without autocast: the ops after a bf16 Linear run in bf16, including the ones
# autocast would keep in float32. This MLP's output is bf16, so the course's ranks
# compute the loss from `logits.float()`. `MixedPrecisionPolicy(output_dtype=torch.float32)`
# casts a sharded module's *outputs* instead, and leaves the ops inside (a softmax in
# attention, a norm) in 16 bits. To have those in float32, cast inside the module, or wrap
# the forward in `torch.autocast` as on one device (on CUDA, `softmax` and `layer_norm` then
# compute in float32; lesson 02). This lesson's ranks do not combine the two.
#
# ### Accumulating gradients: `no_sync` and `set_requires_gradient_sync`
#
# With gradient accumulation, every `backward()` under DDP all-reduces. Inside
# `with ddp_model.no_sync():` DDP skips it and the gradients add up locally; the first
# backward after the block all-reduces the sum (the forward must be inside the block too:
# `DistributedDataParallel.no_sync`'s docstring). With a GradScaler, nothing else changes:
# `scaler.scale(loss).backward()` for each micro-batch, then `unscale_`, the clip, `step` and
# `update` once (lesson 04's recipe). FSDP2's counterpart is
# `model.set_requires_gradient_sync(False)` for all micro-batches but the last. While sync is
# off, FSDP2 accumulates the gradients in `reduce_dtype`, and `reduce_dtype=None` means the
# compute dtype (both in `MixedPrecisionPolicy`'s docstring, torch 2.13): so in 2.13, with
# `param_dtype=torch.bfloat16` and reduce_dtype left at None, the micro-batches' gradients
# add up in bf16. Neither is run here.
#
# ## Why `reduce_dtype=torch.float32`
#
# A reduction adds up numbers that come from different ranks. In 16 bits, that sum can lose a
# small contribution, or overflow. Two ranks, for real: rank 0 holds 1.0 and rank 1 holds
# 0.001. Then both hold 40000.
#
# **Predict** each sum in bf16 and in fp16.

# %%
red = D.launch([D.reduce_job()], device=DEVICE)
pit = red["reduce"][0]
print(D.pitfalls(pit, red.world_size))
print(f"1.0 + 0.001 in float32: {measured(pit['swamp']['fp32'], '.4f')}")
print(f"bf16's spacing next to 1.0: {torch.finfo(torch.bfloat16).eps}; "
      f"fp16's largest value: {torch.finfo(torch.float16).max:g}")

# %% [markdown]
# Next to 1.0, bf16's numbers are 0.0078 apart, so 0.001 rounds away. fp16's largest value
# is 65504, so 80000 overflows to inf. Dividing before the sum keeps it finite here. bf16 has
# nearly float32's range and does not overflow here, but it rounds.
#
# FSDP2 divides an fp16 reduce-scatter in two parts: by a power of two `pre` before the sum,
# by `W / pre` after, with `pre` about the square root of W. At 2 ranks all of it comes
# before, as in the line above. The comment beside this rule says the split is "to avoid
# overflow/underflow": it trades one for the other (less overflow than dividing after the
# sum, less underflow than dividing before it) and rules out neither (one case of each after
# the loop). The loop below is the rule in `_get_gradient_divide_factors`
# (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`, torch 2.13), for the 2 ranks
# run here and larger world sizes:

# %%
for world in (2, 4, 8, 64):
    pre = 1
    while world % pre == 0 and world / pre > pre:  # torch's loop, as written there
        pre *= 2
    print(f"W = {world:>2}: divide by {pre} before the fp16 reduce-scatter, by {world / pre:g} after")

# %% [markdown]
# One underflow and one overflow that this split lets through, in fp16 arithmetic in this
# process, each rank's gradient added one rank after another (`ring_sum`):

# %%
fp16 = torch.float16
tiny = torch.tensor(2.0**-24, dtype=fp16)  # fp16's smallest subnormal
print(f"W =  2, 2^-24 on each rank: divided by 2, then summed: {D.ring_sum([tiny / 2] * 2, fp16).item():g}; "
      f"summed, then divided by 2: {(D.ring_sum([tiny] * 2, fp16) / 2).item():.3g}")
big = torch.tensor(10000.0, dtype=fp16)
print(f"W = 64, 10000 on each rank: divided by 8, then summed: {D.ring_sum([big / 8] * 64, fp16).item()} "
      f"(64 x 1250 = 80000 > 65504)")

# %% [markdown]
# A float32 or bf16 reduce-scatter needs neither: FSDP2 lets it average (`ReduceOp.AVG`),
# except at world size 1 or where a sum is forced, and with a custom divide factor other than
# the group's size it uses `PREMUL_SUM` (`_get_gradient_divide_factors`).
#
# The same two ranks now each hold 100,000 random gradients of size about 1e-3. How far
# off is the all-reduced sum, against a float64 one?

# %%
err = pit["error"]
for name in ("fp32", "fp16", "bf16"):
    print(f"{pit['n']:,} gradients all-reduced in {name}: relative error {measured(err[name], '.1e')}")
at_most("a float32 all-reduce is off by less than 1e-6", err["fp32"], 1e-6)

# %%
at_least("on these gradients of about 1e-3, a bf16 all-reduce is off by at least 4x an fp16 one",
         err["bf16"] / err["fp16"], 4, ".1f")

# %% [markdown]
# That ranking is for gradients of this size: on tiny ones it flips, as the compress hooks'
# cast and divide showed above.
#
# Two ranks add each gradient only once. A ring all-reduce over W ranks adds hop by hop;
# if each hop's sum is rounded to the reduce dtype (this simulation's assumption), the error
# grows with W. `ring_errors` simulates that order of additions
# in this process: no ranks are started, and the world sizes are simulated.
#
# **Predict:** does bf16's error at 64 ranks stay near its error at 2?

# %%
ring = D.ring_errors((2, 8, 64))
for w in (2, 8, 64):
    print(f"{w:>2} ranks: " + "   ".join(f"{d} {measured(ring[(w, d)], '.1e')}" for d in ("fp32", "fp16", "bf16")))
at_least("bf16's error at 64 ranks is at least 2x its error at 2 ranks", ring[(64, "bf16")] / ring[(2, "bf16")], 2)

# %% [markdown]
# A small gradient can also be lost beside a large one. Here one of 64 ranks holds 1.0 and the
# 63 others 0.001 each, added one rank after another. **Predict:** does it matter where the
# 1.0 comes in?

# %%
one, small = [torch.tensor(1.0)], [torch.tensor(1e-3)] * 63
for where, values in (("first", one + small), ("last", small + one)):
    print(f"1.0 added {where:<5}: bf16 {D.ring_sum(values, torch.bfloat16).item()}, "
          f"float32 {measured(D.ring_sum(values, torch.float32).item(), '.4f')}")
print(f"the 63 values of 0.001 alone, in bf16: {D.ring_sum(small, torch.bfloat16).item()}")

# %% [markdown]
# Added last, the 1.0 meets the small values' bf16 sum (0.0618, the last line), which counts
# beside it; added first, it meets each 0.001 alone, and each rounds away (bf16's spacing
# next to 1.0 is 0.0078).
#
# Now the loss curves from the policy run above: bf16 compute in both, reduced in bf16
# `(bf16, bf16)` or in float32 `(bf16, fp32)`. **Predict:** with 2 ranks, how far apart do
# they end?

# %%
from amp_lessons.plots import loss_curves

ends = {name: fsdp[name][0]["steps"][-1]["loss"] for name in ("(bf16, fp32)", "(bf16, bf16)")}
print("final loss: " + ", ".join(f"{name} {measured(v, '.3f')}" for name, v in ends.items()))
between("with 2 ranks, reducing in bf16 ends within 5% of reducing in float32",
        ends["(bf16, bf16)"] / ends["(bf16, fp32)"], 0.95, 1.05)

# %%
loss_curves({name: D.loss_history(fsdp[name][0]) for name in ends}, tail=1,
            title=f"FSDP2 on {fsdp.world_size} ranks, bf16 compute: reduce-scattered in float32 or in bf16")

# %% [markdown]
# With 2 ranks, then, a bf16 reduce costs little here. In the ring simulation above the errors
# grow with the number of ranks summed, and the order of additions decides how much of the small gradients a large one
# swamps. A float32 reduce-scatter moves twice the bytes of a bf16 one, and it is the safe
# choice: `reduce_dtype=torch.float32`.
#
# ## GradScaler across ranks
#
# fp16 needs a GradScaler (lesson 03). With FSDP2, each rank unscales only its own shard of
# the gradients, and an inf may land in just one rank's shard. If that rank skipped the step
# and the others took it, the shards of one model would come from different steps.
#
# Below, fp16 FSDP2 runs 4 steps, and at step 2 an inf is written into rank 1's own gradient
# shard, after the reduce-scatter. A DDP run with fp16 autocast gets an inf loss on rank 1 at
# step 2, before the all-reduce (its backward turns that into non-finite gradients, mostly
# NaN). **Predict:** does rank 0 skip step 2?

# %%
scalers = D.launch([D.fsdp_job("ShardedGradScaler", "fp16", "fp32", steps=4, scaler="sharded", inf_at=(1, 2)),
                    D.fsdp_job("torch.amp.GradScaler", "fp16", "fp32", steps=4, scaler="amp", inf_at=(1, 2)),
                    D.ddp_job("DDP + GradScaler", "fp16", steps=4, inf_at=(1, 2))], device=DEVICE)
print(D.scaler_table(scalers, "ShardedGradScaler"))

# %%
for name in scalers.names:
    scales = {r["rank"]: [int(s["scale"]) for s in r["steps"]] for r in scalers[name]}
    print(f"{name:<22} steps skipped (AdamW's step count did not move), by rank: {D.skipped_steps(scalers, name)}")
    print(f"{'':<22} the scale before each step, by rank: {scales}")
    print(f"{'':<22} steps with inf/NaN in the rank's own gradients, by rank: {D.inf_steps(scalers, name)}")

# %% [markdown]
# In all three runs every rank skipped step 2 and halved its scale after it, though in the
# FSDP2 runs only rank 1 saw the inf.
# `ShardedGradScaler` all-reduces its "found inf" flag over the ranks in `unscale_`
# (`torch/distributed/fsdp/sharded_grad_scaler.py`). `torch.amp.GradScaler` reaches the same
# decision under FSDP2 without being told:
# FSDP2's gradients are DTensors, and DTensor runs the check GradScaler calls
# (`_amp_foreach_non_finite_check_and_unscale_`) on each rank's shard, then reduces the
# "found inf" flag over the mesh with a max (`found_inf_reduce_handler` in
# `torch/distributed/tensor/_dispatch.py`). So in this run (one mesh, no CPU offload),
# `torch.amp.GradScaler` is enough with FSDP2.
# In DDP the non-finite values need no help: the all-reduce sums them into every rank's
# gradients before `unscale_` looks at them.
#
# ## Memory per rank
#
# With AdamW, each parameter keeps its float32 weight, its float32 gradient and Adam's two
# moments: 16 bytes. DDP keeps them on every rank, plus its buckets, a second copy of the
# gradients (4 bytes) unless `gradient_as_bucket_view=True` (the `DistributedDataParallel`
# docstring; not counted below). FSDP2 keeps 16 N / W.
#
# Mixed precision adds copies. Under DDP + autocast: the bf16 copy of each weight a matmul
# saves for backward, held from forward to backward for every layer at once, 2 bytes per
# parameter at most. Under
# FSDP2, for the layer in flight (L parameters): its gathered weights in `param_dtype`, and
# the flat all-gather output they were copied out of, both alive while the layer runs
# forward (`FSDPParamGroup.wait_for_unshard`): 2 x 2 L bytes in bf16, 2 x 4 L in fp32.
# Prefetching can hold the next layer's too, and backward adds the layer's gradients and the
# reduce-scatter's buffers (`foreach_reduce`); the table counts neither, nor activations.
# With N parameters and W ranks, this lesson's model on 2 ranks, in bytes:

# %%
fp32 = fsdp["(fp32)"][0]
N, W, L = fp32["n_params"], fsdp.world_size, max(fp32["units"])
print(f"N = {N:,}, W = {W}, L = {L:,}\n")
print(D.memory_table(N, W, L))

# %% [markdown]
# **Predict:** does what rank 0 really holds after the `(bf16, fp32)` run match the
# formula, to the byte?

# %%
mem = fsdp["(bf16, fp32)"][0]["memory"]
held = mem["params"] + mem["grads"] + mem["optimizer"]
print(f"rank 0 holds {mem['numel']:,} of {N:,} parameters: weights {mem['params']:,} + grads "
      f"{mem['grads']:,} + Adam {mem['optimizer']:,} = {held:,} bytes")
print("equal to 16 N / W:", held == D.memory_per_rank(N, "FSDP2 (bf16, fp32)", W, L)["kept"])
whole = ddp["DDP + autocast bf16"][0]["memory"]
print("a DDP rank's weights, grads and Adam state are 16 N (its buckets come on top):",
      whole["params"] + whole["grads"] + whole["optimizer"] == 16 * N)

# %% [markdown]
# Lesson 05's meter counts the bf16 weight copies that autocast saves for backward, here for
# one forward pass of the same model:

# %%
from amp_lessons.dist_worker import lesson_model
from amp_lessons.measure import saved_memory
from amp_lessons.scaling import lesson_data

x, y = lesson_data().batch(0, 64)
copies = saved_memory(lesson_model("cpu"), x, y, "bf16").weight_copy_bytes
print(f"bf16 weight copies saved: {copies:,} bytes; at most 2 N = {2 * N:,}: {copies <= 2 * N}")
sizes = [m.weight.numel() for m in lesson_model("cpu").modules() if isinstance(m, torch.nn.Linear)]
print(f"2 bytes x the weights after the first layer {sizes[1:]}: {2 * sum(sizes[1:]):,} bytes")

# %% [markdown]
# Less than 2 N: a matmul saves its weight's bf16 copy to compute its *input's* gradient, and
# the first layer's input, the data, needs none; the biases are never saved (a bias's
# gradient needs only the output's).

# %% [markdown]
# The same arithmetic for a 7-billion-parameter model on 8 GPUs, in GiB (2^30 bytes). L is
# one of 32 equal blocks:

# %%
N7, W7 = 7_000_000_000, 8
print(D.memory_table(N7, W7, N7 // 32, unit=2**30))
gpu = 80 * 2**30
print(f"\nDDP's 16 N fits an 80 GiB GPU: {D.memory_per_rank(N7, 'DDP, fp32')['kept'] <= gpu}; "
      f"FSDP2's 16 N / 8 does: {D.memory_per_rank(N7, 'FSDP2 (bf16, fp32)', W7)['kept'] <= gpu}")

# %% [markdown]
# ## DDP and FSDP2 side by side
#
# | | DDP | FSDP2 |
# |---|---|---|
# | kept per rank | 16 N bytes, + 4 N for the buckets unless `gradient_as_bucket_view=True` | 16 N / W bytes |
# | mixed precision | autocast; the gradients and their all-reduce stay float32 | `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)` |
# | fewer bytes handed to collectives | a compress hook (16-bit all-reduce) | `param_dtype=bf16` halves the all-gather |
# | fp16 | one GradScaler per rank; the all-reduce spreads an inf or NaN | `torch.amp.GradScaler` (DTensor agrees its found-inf flag across ranks in this lesson's run: one mesh, no CPU offload) or `ShardedGradScaler` |
# | gradient accumulation | `with model.no_sync():` for all micro-batches but the last | `model.set_requires_gradient_sync(False)`, likewise |
#
# ## When a launch goes wrong
#
# If one rank raises, it writes its error and exits, and on gloo the others fail at once at
# their next collective (gloo's TCP transport says "Connection reset by peer" or "Connection
# closed by peer", `gloo/transport/tcp/pair.cc`). A rank that hangs instead leaves them
# waiting until the collective's timeout: 60 s in the course's ranks; torch's defaults are
# 10 minutes for NCCL and 30 for other backends (`init_process_group`'s docstring). `launch`
# stops the ranks still running and says which rank failed first and why:

# %%
from amp_lessons.show import expect_error

with expect_error(D.RankFailedError):
    D.launch([D.fail_job(rank=1, how="raise")], device=DEVICE)

# %% [markdown]
# ## Exercise: predict FSDP2's dtypes
#
# The policy run above had one more job, `"exercise"`: FSDP2 with
# `MixedPrecisionPolicy(param_dtype=torch.float16)`, with reduce_dtype left at None. Its
# row was not printed. Fill in the dtype at each stage (`torch.bfloat16`, `"fp32"`, `"half"`,
# ...), and its reduce-scatter's op, `"avg"` or `"sum"`. The checker compares
# your answer with what the ranks recorded.

# %%
from amp_lessons.exercises import check_policy_prediction

my_prediction = {"sharded": None, "forward": None, "reduce_scatter": None, "gradient": None, "op": None}

check_policy_prediction(my_prediction, fsdp["exercise"][0])

# %% [markdown]
# ## Remember
#
# - Under DDP + autocast, gradients have their parameters' dtype: the all-reduce is float32,
#   4 bytes per parameter. A compress hook halves the bytes handed to the all-reduce and
#   rounds every gradient.
# - FSDP2's `MixedPrecisionPolicy` keeps the sharded parameters and their gradients in the
#   parameters' own dtype (float32 here).
# - FSDP2 all-gathers and computes in `param_dtype`, and reduce-scatters in `reduce_dtype`.
# - `reduce_dtype=None` means `param_dtype` before torch 2.15. From 2.15 on it means the
#   parameter's `grad_dtype`, by default the parameter's own dtype (float32 here).
# - Reduce in float32: an explicit `reduce_dtype=torch.float32` does not depend on the
#   release's default.
# - A 16-bit reduce that rounds each partial sum (as this lesson's ring simulation does) can
#   lose a small gradient beside a large one in bf16. In fp16 a tiny one can round to 0, and
#   a large sum can overflow.
# - FSDP2 (torch 2.13) divides an fp16 reduce-scatter by a power of two before the sum and by
#   the rest after: less overflow than dividing after the sum, less underflow than dividing
#   before it; it rules out neither.
# - In this lesson's ring simulation, the error of a 16-bit reduce grew with the number of
#   ranks.
# - An inf or NaN on one rank must skip the step on every rank. DDP's all-reduce spreads
#   it; under FSDP2, `torch.amp.GradScaler` agreed across ranks through DTensor, as
#   `ShardedGradScaler` does (the run above: one mesh, no CPU offload).
# - With AdamW, float32 weights, gradients and Adam's moments take 16 bytes per parameter,
#   whatever the compute dtype: on every rank with DDP, divided by W with FSDP2.
#
# ## Watch out
#
# - `mp.spawn` of a function defined in a notebook fails. Spawn a function imported from a
#   module, or launch a module with `torchrun` (or `python -m torch.distributed.run`) and
#   read what the ranks write to files.

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch that its runs do not show:
#
# - `mp.spawn` and `__main__`: Python's `multiprocessing` docs ("Programming guidelines",
#   and the note that the examples need an importable `__main__`).
# - `gradient_as_bucket_view`, `no_sync`, and buckets reduced during backward (`bucket_cap_mb`):
#   the `DistributedDataParallel` docstring, `torch/nn/parallel/distributed.py`.
# - The compress hooks' cast, then divide, and `allreduce_hook` matching DDP with no hook:
#   `_compress_hook` and `allreduce_hook`'s docstring in
#   `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`.
# - `Tensor.grad_dtype` (a leaf tensor's gradient dtype, by default its own): `torch/_tensor_docs.py`.
# - The process-group timeouts: `init_process_group`'s docstring, `torch/distributed/distributed_c10d.py`.
# - FSDP2's divide factors and the reduce-scatter's buffers: `_get_gradient_divide_factors`
#   and `foreach_reduce`, `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`.
# - `cast_forward_inputs`, `output_dtype`, and `reduce_dtype` while gradient sync is off:
#   `MixedPrecisionPolicy`,
#   `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`; `set_requires_gradient_sync`:
#   `torch/distributed/fsdp/_fully_shard/_fully_shard.py`.
# - The flat all-gather output kept beside the gathered parameters in forward:
#   `FSDPParamGroup.wait_for_unshard`, `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`.
# - `ShardedGradScaler.unscale_` all-reduces the found-inf flag:
#   `torch/distributed/fsdp/sharded_grad_scaler.py`.
# - FSDP2's prefetching of the next all-gather: the `fully_shard` docs
#   (`FSDPModule.set_modules_to_forward_prefetch`, and the implicit prefetching they describe).
# - GradScaler's found-inf flag reduced over the mesh for DTensor gradients:
#   `found_inf_reduce_handler`, `torch/distributed/tensor/_dispatch.py`.
# - Which ops CUDA autocast runs in float32: the Autocast Op Reference, `docs/source/amp.md`.
# - A ring all-reduce sends 2(W-1)/W of its tensor per rank, an all-gather or
#   reduce-scatter (W-1)/W: NVIDIA's nccl-tests, `doc/PERFORMANCE.md` ("bus bandwidth").
