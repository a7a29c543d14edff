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
# # 05 · Putting it together: speed, memory, master weights, TF32
#
# The card opens with a promise: *"Mixed precision typically gives 2-3x faster training
# and halves activation memory on modern GPUs."* This lesson trains one model in every
# precision your device runs, side by side in one process, and sets both numbers against
# what the card says. Then it shows the two rules that keep mixed precision correct, not
# just fast: keep the weights in float32 (no `model.half()`), and what
# `torch.set_float32_matmul_precision("high")` really changes.
#
# Every verdict below is computed from this run's measurements, so it stays true on a
# laptop CPU, a Colab T4 or an H100.

# %%
# Setup, the same in every lesson: on Colab, install the course package first.
import importlib.util
import subprocess
import sys

REPO = "https://github.com/amp-lessons/amp-lessons"
if "google.colab" in sys.modules and importlib.util.find_spec("amp_lessons") is None:
    # Colab already has torch, numpy, matplotlib, ipywidgets 7.7.1, tqdm and scikit-learn.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"git+{REPO}"], check=True)

import torch

import amp_lessons

amp_lessons.seed_everything(0)

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons import bench

device = amp_lessons.pick_device()
print(bench.device_line(device))

# %% [markdown]
# ## One model, every precision
#
# The precisions this device can run, and the reason for each one it cannot:

# %%
from amp_lessons.hardware import supported_precisions

why_not = supported_precisions(device)
runnable = [p for p, why in why_not.items() if why is None]
print("runs here:", ", ".join(runnable))
for p, why in why_not.items():
    if why:
        print(f"not here: {p}: {why}")

# %% [markdown]
# One small MLP on the 8x8 handwritten digits, trained through the course's `Trainer`
# in each of them: fp32, bf16 (no scaler), fp16 with a `GradScaler`, and tf32 where it
# exists. Every run starts from the same weights and sees the same batches; the runs take
# their optimizer steps in turn, so a busy machine slows them all alike.
#
# **Predict**: will the 16-bit runs reach a lower test accuracy than fp32? Which run will
# take the least time per step?

# %%
from amp_lessons.data import digits
from amp_lessons.models import mlp

data = digits()
result = bench.train_side_by_side(lambda: mlp(64, 128, 10, depth=2), data, runnable, steps=150,
                                  device=device, lr=1e-3, batch_size=64)
print(result.quality_table())

# %% [markdown]
# The accuracy column answers the first question; the largest gap to fp32, in accuracy
# and in the mean loss of the last 20 steps:

# %%
fp32_run = result.runs["fp32"]
for p, run in result.runs.items():
    if p != "fp32":
        acc = round(run.accuracy - fp32_run.accuracy, 2) + 0.0  # + 0.0: no "-0.00"
        tail = round(sum(run.losses[-20:]) / 20 - sum(fp32_run.losses[-20:]) / 20, 2) + 0.0
        print(f"{p}: accuracy {acc:+.2f}, late loss {tail:+.2f} vs fp32")

# %% [markdown]
# `skipped` counts the steps fp16's `GradScaler` threw away (lesson 03). `act MB` is the
# memory the next section is about. The step times are in the figure's middle panel:

# %%
from amp_lessons import plots

plots.side_by_side(result)

# %% [markdown]
# ## Memory: "halves activation memory"
#
# Activation memory is what autograd keeps from the forward pass for the backward pass:
# each layer's input, the softmax output, and so on. `amp_lessons.measure` counts those
# bytes exactly, on any device, with `torch.autograd.graph.saved_tensors_hooks`: every
# tensor saved for backward passes through a hook, and each storage is counted once.
#
# Under autocast, the 16-bit *copies of the weights* that the matmuls use are saved too.
# They are not activations (their size does not grow with the batch), so they are counted
# apart. Per dtype, for one batch of 64:

# %%
from amp_lessons.measure import saved_memory

x, y = (t.to(device) for t in data.batch(0, 64))
for p, run in result.runs.items():
    print(f"--- {p}\n{saved_memory(run.trainer.model, x, y, p).table()}")

# %% [markdown]
# In the 16-bit runs almost every activation is stored in 16 bits. The float32 bytes
# that remain are the loss: autocast keeps `log_softmax` and the loss in float32, and the
# labels are int64. The ratio to fp32, and the card's claim against it:

# %%
for p in result.runs:
    if p in ("bf16", "fp16"):
        print(bench.memory_verdict(result.memory_ratio(p), p))

# %% [markdown]
# On a GPU the allocator also reports the peak memory of a whole step
# (`measure.cuda_peak_memory`); `python -m amp_lessons bench` prints it there as
# `peak MB`. The saved-tensor count above is the part of that peak which mixed precision
# halves.
#
# ## Speed: "2-3x faster"
#
# **Predict**: the card says 2-3x *on modern GPUs*. What will the ratio be on the device
# this notebook runs on?
#
# The digits runs' median milliseconds per optimizer step, their speed against fp32
# (above 1 is faster), and the matmul work they got done per second. Timings change from
# run to run, so these cells are not compared by the tests:

# %%
# NBVAL_IGNORE_OUTPUT
print(result.speed_table())

# %% [markdown]
# Why that ratio? A training step is mostly matrix multiplications, so the speed a
# precision can reach is set by how fast this device multiplies matrices in it. The
# bench runs a larger MLP and a matmul microbenchmark, every precision side by side. Then
# both MLPs are set against the card's 2-3x, with the reasons read from these
# measurements and this device's hardware report:

# %%
# NBVAL_IGNORE_OUTPUT
b = bench.run_bench(("mlp",), runnable, device, warmup=2, repeats=5)
print(b.table())
digits_rate = {"the digits MLP": result.runs["fp32"].gflops}
for p in [p for p in result.runs if p != "fp32"]:
    print(f"\ndigits MLP: {bench.speed_verdict(result.speedup(p), p)}")
    print(f"bench MLP:  {bench.speed_verdict(b.row('mlp', p).speedup, p)}\nWhy:")
    print("\n".join("  - " + reason for reason in bench.speed_reasons(b, p, digits_rate)))

# %% [markdown]
# The timings move from run to run; the memory column of the same table does not. The
# larger MLP's activation bytes, against fp32:

# %%
{p: round(b.row("mlp", p).activation_ratio, 2) for p in runnable}

# %%
plots.matmul_rates(b)

# %% [markdown]
# How to read it:
#
# - **Tensor cores** (NVIDIA Volta and newer) and **AMX tile units** (Intel Sapphire Rapids
#   and newer CPUs) multiply 16-bit matrices several times faster than float32. The
#   card's 2-3x comes from them. Without them, 16-bit matmuls run on the same vector
#   units as float32: native bf16 instructions (AVX512-BF16) can still win a little,
#   emulation loses, and a CPU may have a fast bf16 kernel but no fast fp16 kernel at
#   all, which the matmul block shows as a tiny fp16 rate.
# - **Small models are not compute-bound**: when the fp32 step reaches only a small share
#   of the matmul rate, time goes to launching small kernels, elementwise ops, the
#   autocast casts and the optimizer, none of which 16-bit makes faster.
# - **Memory is saved everywhere.** Whatever the speed verdict, the activation bytes halve:
#   on a device where memory is the limit, that buys a batch twice as large.
#
# From a terminal, `python -m amp_lessons bench` (or `make bench`) prints the same table
# for an MLP and a transformer; `--json` for scripts, `--help` for the sizes.
#
# ## Master weights: why not `model.half()`?
#
# The card: *"Keep the model's weights in float32 (do not call model.half() for
# training); autocast handles the casts."* A float16 number near 0.05 has 10 mantissa
# bits: the next float16 above it is a fixed step away. An update smaller than half that
# step rounds back to the same weight. The step, in float16 and in float32:

# %%
from amp_lessons.master import spacing

w = torch.tensor([0.05, 0.5])
{str(dt): [f"{s:.2e}" for s in spacing(w, dt).tolist()] for dt in (torch.float16, torch.float32)}

# %% [markdown]
# So in float16, 0.05 minus 1e-5 is still 0.05:

# %%
w16 = torch.tensor(0.05, dtype=torch.float16)
(w16 - 1e-5 == w16).item(), (torch.tensor(0.05) - 1e-5 == torch.tensor(0.05)).item()

# %% [markdown]
# **Predict**: SGD with `lr=1e-3` multiplies gradients of about 1e-4 to 1e-2. What share
# of the weights will one step leave unchanged, in float16? In float32?
#
# `lost_updates` takes the gradients of one batch on the fp32 model trained above, then
# applies one optimizer step to float32 master weights and to a `.half()` copy. It counts
# the weights whose exact update is nonzero but which did not move, and, as `predicted`,
# those whose update is below half their spacing:

# %%
from amp_lessons.master import gradients, lost_fraction_by_lr, lost_updates

trained = result.runs["fp32"].trainer.model
grads = gradients(trained, x, y)
for r in lost_updates(trained, grads, lr=1e-3, optimizer="sgd").values():
    print(r.line())

# %% [markdown]
# The half-spacing rule predicts almost exactly which updates vanish. float32 loses only
# updates below 2^-24 of the weight. Across learning rates:

# %%
lrs = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]
plots.lost_updates(lrs, lost_fraction_by_lr(trained, grads, lrs))

# %% [markdown]
# With autocast, the forward pass runs in 16 bits but the optimizer adds each update to
# the float32 master weight, which keeps it. That is why mixed precision needs no
# trade-off here, and `model.half()` does.
#
# Adam has a second problem. **Predict**: its default `eps=1e-8` is added to the
# denominator `sqrt(v) + eps`. What is `1e-8` stored in each format?

# %%
from amp_lessons.master import eps_in

{p: f"{eps_in(p):.3g}" for p in ("fp32", "bf16", "fp16")}

# %% [markdown]
# In float16, `eps` is 0. Where a gradient is small, `v = g²` underflows to 0 too, and
# `m / (sqrt(v) + eps)` divides by zero. One Adam step with the same gradients:

# %%
for r in lost_updates(trained, grads, lr=1e-3, optimizer="adam").values():
    print(r.line())

# %% [markdown]
# ## TF32: `set_float32_matmul_precision("high")`
#
# The card: *"lets float32 matmuls use TF32 tensor cores on NVIDIA GPUs, a near-free
# speedup for code you do not convert."* TF32 is not a storage format: tensors stay
# float32, but an Ampere-or-newer tensor core reads each matmul input with only 10 of
# float32's 23 mantissa bits. `tf32_error` rounds the inputs the same way (round to
# nearest even), so the precision cost shows on any device; on an NVIDIA GPU with TF32 it
# also measures the real thing.
#
# **Predict**: will TF32's error be closer to float32's or to bfloat16's?

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.matmul import tf32_error

err = tf32_error(256, device)
print(err.table())

# %% [markdown]
# The exact errors depend on the machine's matmul kernels; their order does not:

# %%
from amp_lessons.formats import format_info

print("fp32 error < tf32 error < bf16 error:", err.fp32 < err.tf32_emulated < err.bf16)
print("tf32 rounds each input by at most 2^-11 of its value:", format_info("tf32").eps / 2 == 2.0**-11)
print("'high' changed this device's float32 matmul:", err.high_changes_result)

# %% [markdown]
# On a CPU, `"high"` changes nothing: TF32 is an NVIDIA tensor-core format and there is
# no TF32 on a CPU. On an NVIDIA GPU with TF32 the speedup is measured here:

# %%
from amp_lessons.matmul import tf32_speedup

speedup = tf32_speedup(device=device)
print(f"not measured: {why_not['tf32']}" if speedup is None else f"tf32 matmul: {speedup:.1f}x fp32's speed")

# %% [markdown]
# ## Remember
#
# The card's checklist, each line with the lesson that showed it:
#
# - autocast wraps forward + loss; backward goes outside:
#   [02 autocast](02_autocast.ipynb) traced which op ran in which dtype.
# - bfloat16 needs no scaler; float16 needs GradScaler: the ranges in
#   [01 number formats](01_number_formats.ipynb), the flushed gradients and the scaler
#   at work in [03 grad scaler](03_grad_scaler.ipynb).
# - Keep master weights in float32: the lost updates and Adam's zero `eps` above.
# - Activation memory halves under bf16 and fp16 on every device; the speedup needs fast
#   16-bit matmul kernels (tensor cores, AMX) and a model big enough to be compute-bound:
#   measured above, and by `python -m amp_lessons bench`.
# - `set_float32_matmul_precision("high")` means TF32 on Ampere-or-newer NVIDIA GPUs
#   only; elsewhere it changes nothing.
# - Which precision to use on a given machine: [00 start here](00_start_here.ipynb).
#
# ## Watch out
#
# - Clipping gradients that are still scaled; call `scaler.unscale_(opt)` first:
#   [04 clipping](04_clipping.ipynb) measured the threshold shrinking by the scale.
# - A speed figure is a ratio measured on one machine: time precisions side by side in
#   one process (warm-up, synchronize, median), as the bench does, before switching.
# - `model.half()` with Adam: `eps` becomes 0 and weights become inf/NaN in one step.
#
# ## Exercise: fix the setup
#
# The function below returns the pieces of a float16 mixed-precision run: model,
# optimizer, GradScaler and autocast dtype. Two of its lines are wrong. Read it:

# %%
import inspect

from amp_lessons.exercises import broken_setup, check_setup

print(inspect.getsource(broken_setup))

# %% [markdown]
# Copy it into the cell below as `def my_setup(device_type):`, fix it, and run the cell.
# The checker inspects the weights, the scaler and Adam's `eps`, then trains five steps
# on the digits with the card's recipe and looks for inf/NaN weights. As given, it checks
# the broken setup:

# %%
my_setup = broken_setup  # replace with your fixed copy: def my_setup(device_type): ...

check_setup(my_setup, device)
