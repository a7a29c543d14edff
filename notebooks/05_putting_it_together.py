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
# Every verdict below is computed from this run's measurements on the device it runs on, so
# on another device it reports what that device does. The stored outputs come from a CPU;
# on a GPU, run the lesson to see its own.

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
from amp_lessons import bench, benchcli

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
# The accuracy column answers the first question. Checked, against fp32, in accuracy and
# in the mean loss of the last 20 steps:

# %%
from amp_lessons.claims import at_least, at_most, between, check, measured

fp32_run = result.runs["fp32"]
for p, run in result.runs.items():
    if p != "fp32":
        print(at_most(f"{p} reaches fp32's test accuracy within 0.02", abs(run.accuracy - fp32_run.accuracy), 0.02))
        late = abs(sum(run.losses[-20:]) - sum(fp32_run.losses[-20:])) / 20
        print(at_most(f"{p}'s late loss is within 0.05 of fp32's", late, 0.05))

# %% [markdown]
# The test accuracy comes from `Trainer.evaluate`, which runs the test set under the same
# autocast as training, inside `torch.no_grad()`. Evaluation needs no GradScaler (there is
# no backward to scale), and its 16-bit activations are not even kept. The logits of the
# test set, evaluated that way:

# %%
from amp_lessons.precision import dtype_of

for p in [p for p in result.runs if p in ("bf16", "fp16")]:
    model = result.runs[p].trainer.model
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype_of(p)):
        logits = model(data.x_test.to(device))
    model.train()
    print(f"{p}: logits {logits.dtype}, autograd graph recorded: {logits.requires_grad}")

# %% [markdown]
# `skipped` counts the steps fp16's `GradScaler` threw away (lesson 03). `act MB` is the
# memory the next section is about. The step times are in the figure's lower left panel;
# the lower right one stacks everything a training step holds, and only the activations
# shrink:

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
# that remain belong to the loss (the logits cast to float32 for it, lesson 02), and the
# labels are int64. The ratio to fp32 (exact byte counts, the same on every CPU; a GPU's
# autocast lists can differ, lesson 02), and the card's claim against it:

# %%
for p in result.runs:
    if p in ("bf16", "fp16"):
        print(between(f"{p} keeps half of fp32's activation bytes, as the card says (0.45 to 0.55)",
                      result.memory_ratio(p), 0.45, 0.55, ".2f"))

# %% [markdown]
# That holds for these MLPs, whose saved tensors are almost all matmul inputs. Lesson 02's
# `TransformerBlock` (layer norms, softmax attention, GELU), for one batch of 8 sequences of
# 16 tokens, under this device's autocast lists (CUDA's differ, lesson 02):

# %%
from amp_lessons.models import TransformerBlock

block, tokens = TransformerBlock().to(device), torch.zeros(8, 16, 64, device=device)
block_fp32 = saved_memory(block, tokens).activation_bytes
for p in [p for p in result.runs if p in ("bf16", "fp16")]:
    kept = saved_memory(block, tokens, precision=p)
    print(f"{p}: the block keeps {kept.activation_bytes / block_fp32:.2f} of fp32's activation bytes, "
          f"{kept.by_dtype.get('float32', 0) / kept.activation_bytes:.0%} of them float32")

# %% [markdown]
# Which layers save those float32 bytes? The same hook, now noting which of the block's
# layers was running when each activation was saved (the weights left out):

# %%
running, by_layer, seen = ["block"], {}, set()
weights = {w.data_ptr() for w in block.parameters()}


def left(module, args, output):
    running.pop()  # and return None, so the layer's output stays as it is


hooks = [h for name, m in block.named_children()
         for h in (m.register_forward_pre_hook(lambda m, a, name=name: running.append(name)),
                   m.register_forward_hook(left))]


def note(t):
    if t.data_ptr() not in weights | seen:
        seen.add(t.data_ptr())
        by_layer[running[-1], str(t.dtype)] = by_layer.get((running[-1], str(t.dtype)), 0) + t.nbytes
    return t


low16 = next(p for p in result.runs if p in ("bf16", "fp16"))
with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t), torch.autocast(device.type, dtype=dtype_of(low16)):
    out = block(tokens)
for h in hooks:
    h.remove()
print(f"{low16}, saved activation bytes by layer and dtype:", dict(sorted(by_layer.items())))
print(f"the block's output under {low16} autocast: {out.dtype}; a {low16} tensor plus a float32 one: "
      f"{(torch.ones(1, dtype=dtype_of(low16)) + torch.ones(1)).dtype}")

# %% [markdown]
# The float32 bytes are the layer norms' (each saves its input and its per-token mean and
# 1/std). They are float32 not because of an autocast list (on a CPU, `layer_norm` is on
# none, lesson 02) but because of the residual stream: the block's input is float32, and
# `x + attn(ln1(x))` adds a 16-bit result to it, which type promotion makes float32. So both
# layer norms read float32 and save float32. On a GPU, where `layer_norm` is on the float32
# list, it would save float32 even from a 16-bit input.

# %% [markdown]
# ### What a batch twice as large costs
#
# Half the activation bytes is not twice the batch. A training step holds more than its
# activations: the float32 weights, their gradients and AdamW's two moments stay float32
# under autocast, and autocast adds its 16-bit copies of the weights.
#
# **Predict**: in the memory fp32 needs for a batch of 64, how large a batch fits in bf16?
#
# `doubled_batch` counts every kind of bytes at the batch and at twice it. These are exact
# byte counts, not timings: the same on every CPU.

# %%
from amp_lessons.measure import doubled_batch

low = [p for p in result.runs if p != "fp32"]
cost = doubled_batch(result.runs["fp32"].trainer.model, x, y, low)
print(cost.table())
print("\n".join(cost.fits_lines()))

# %% [markdown]
# Only the activations column halves. Whether 16 bits fits a larger batch at all depends
# on the activations against the weight copies, which grow with the weights and not with
# the batch. The bench's larger MLP at its batch:

# %%
big_model, big_x, big_y = bench.build("mlp", bench.default_sizes("mlp", device), device)
big = doubled_batch(big_model, big_x, big_y, low)
print(big.table())
print("\n".join(big.fits_lines()))

# %%
ratios = [c.batch_in_fp32_memory(p) / c.batch for c in (cost, big) for p in low]
print(check("for these two MLPs at these batches, no 16-bit step fits a batch twice as large in fp32's "
            "memory: only the activations halve (a larger batch, whose activations outweigh the "
            "weights, can)",
            all(r < 2 for r in ratios), f"largest: {measured(max(ratios), '.2f')}x"))

# %% [markdown]
# On a GPU the allocator also keeps the peak of a whole step, short-lived tensors included
# (`measure.cuda_peak_memory`; `python -m amp_lessons bench` prints it as `peak MB`). On a
# CPU torch keeps no such counter, and the byte counts above are what there is to show:

# %%
print(cost.peak_line())

# %% [markdown]
# ## Speed: "2-3x faster"
#
# **Predict**: the card says 2-3x *on modern GPUs*. What will the ratio be on the device
# this notebook runs on?
#
# The digits runs' median milliseconds per optimizer step, their speed against fp32
# (above 1 is faster), and the matmul work they got done per second. Timings change from
# run to run (the `≈`, here and in the bench below):

# %%
print(result.speed_table())

# %% [markdown]
# Why that ratio? The matrix multiplications are the part of a training step that 16 bits
# speeds up most, so the speed a precision can reach is set largely by how fast this
# device multiplies matrices in it. The bench runs a larger MLP and a matmul
# microbenchmark, every precision side by side. Then both MLPs are set against the card's
# 2-3x, with the reasons read from these measurements and this device's hardware report:

# %% jupyter={"outputs_hidden": true}
# NBVAL_IGNORE_OUTPUT
b = bench.run_bench(("mlp",), runnable, device, warmup=1, repeats=5, breakdown=True, profile_steps=3)
print(benchcli.table(b, breakdown=False))

# %% [markdown]
# The bench's table and matmul block are collapsed above (the figure after the next cell
# draws the matmul block). Its verdicts, and the reasons read from it:

# %%
# NBVAL_IGNORE_OUTPUT
digits_rate = {"the digits MLP": result.runs["fp32"].gflops}
for p in [p for p in result.runs if p != "fp32"]:
    print(f"digits MLP: {bench.speed_verdict(result.speedup(p), p)}")
    print(f"bench MLP:  {bench.speed_verdict(b.row('mlp', p).speedup, p)}\nWhy:")
    print("\n".join("  - " + reason for reason in bench.speed_reasons(b, p, digits_rate, with_shares=False)))
print("And for both steps:")
print("\n".join("  - " + reason for reason in bench.share_reasons(b, result.runs, digits_rate)))

# %% [markdown]
# The memory column of the same table does not move from run to run. The larger MLP's
# activation bytes, against fp32:

# %%
{p: round(b.row("mlp", p).activation_ratio, 2) for p in runnable}

# %%
plots.matmul_rates(b)

# %% [markdown]
# How to read it:
#
# - **Tensor cores** (NVIDIA: fp16 from Volta on, bf16 from Ampere on) and **AMX tile
#   units** (Intel: bf16 from Sapphire Rapids on, fp16 from Granite Rapids on) multiply
#   16-bit matrices several times faster than float32: the card's 2-3x comes from them.
#   A CPU with **AVX512-BF16** but no AMX runs bf16 dot products on its vector units; how
#   much faster than float32 that is, the matmul block measures (the reasons above print
#   it). Without either, bf16 math is converted in software.
#   fp16 on a CPU is as fast as the kernel the torch build has for it.
# - **Amdahl's law estimates the gain**: with a matmul share *f* of the fp32 step and
#   matmuls *r* times faster, 1 / ((1 - f) + f / r), if nothing else changed. It is no cap:
#   elementwise ops on 16-bit tensors move half the bytes and run faster where memory
#   bandwidth limits them (NVIDIA's mixed-precision guide says so of GPUs; this CPU's are
#   measured below), autocast's casts add work, and a step's own matmuls run at their
#   shapes' rates, not at the best size's.
#
# `python -m amp_lessons bench` (or `make bench`) prints the same table from a terminal,
# for an MLP and a transformer.
#
# ## Why not 2-3x here? Where one step's time goes
#
# Besides its matmuls, a step runs elementwise ops, autocast's casts, the optimizer (on
# float32 master weights in every precision), the Trainer's bookkeeping and the batch
# fetch. The bench profiled Trainer steps of its MLP with `torch.profiler` and added each
# op's own time to one category (`amp_lessons.breakdown` has the mapping). The table is
# collapsed below (click to open); the figure after it draws the same breakdown.
#
# **Predict**: which categories will be as long in bf16 as in fp32?

# %% jupyter={"outputs_hidden": true}
# NBVAL_IGNORE_OUTPUT
print("\n".join(benchcli.breakdown_lines(b, "mlp")))

# %%
plots.step_breakdown(b, "mlp")

# %% [markdown]
# The lines under the table put the matmul share *f* into Amdahl's law twice: at the best
# sizes' ratio and at the ratio the step's own matmuls ran. The profiler adds a little time
# to every op; the categories still account for each profiled step:

# %%
fp32_step = b.breakdown("mlp", "fp32")
print(between("the categories account for each profiled fp32 step", fp32_step.coverage, 0.9, 1.1, ".2f"))
print(at_least("matmuls are a large part, at least 20%, of the bench MLP's fp32 step",
               fp32_step.matmul_share, 0.2, ".2f"))

# %% [markdown]
# The rest of the step in each 16-bit precision the bench profiled, and the step's measured
# speedup against the Amdahl figure from *f* and the best matmul rates (a precision too
# slow here to time has no line: which ones that is depends on the device, so the cell's
# output is not compared). Where the rest of the step got faster, the step can beat the
# Amdahl figure:

# %%
# NBVAL_IGNORE_OUTPUT
for p in [p for p in runnable if p != "fp32" and b.breakdown("mlp", p) is not None]:
    step = b.breakdown("mlp", p)
    print(f"{p}: the rest of the step takes {measured(step.rest_ms / fp32_step.rest_ms, '.2f')}x fp32's "
          f"(casts {measured(step.ms['autocast casts'], '.2f')} ms, elementwise "
          f"{measured(step.ms['forward rest'] + step.ms['backward rest'], '.2f')} ms against fp32's "
          f"{measured(fp32_step.ms['forward rest'] + fp32_step.ms['backward rest'], '.2f')} ms)")
    amdahl = b.amdahl("mlp", p)
    print(f"{p}: Amdahl's figure {measured(amdahl.bound, '.2f')}x (matmuls only, best sizes); "
          f"measured {measured(amdahl.measured, '.2f')}x without the profiler")

# %% [markdown]
# So the gap to 2-3x has two parts: how much faster this device's 16-bit matmuls are (the
# matmul block), and how much of the step is not matmuls. The last table of the collapsed
# output times three changes that shrink the second part, each as a gain over the Trainer
# as the lessons use it: `grad_stats=False` (the Trainer skips the per-step gradient
# statistics lessons 01 and 03 read), then `AdamW(foreach=True)` and `AdamW(fused=True)`
# (a few large kernels instead of a loop over tensors, where the device has them).
# `python -m amp_lessons bench --breakdown --compile` adds `torch.compile` (its first step
# compiles; on a CPU, torch.compile's default backend generates C++ and needs a C++ compiler,
# which the bench looks for and names when it is missing).
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
# **Predict**: SGD with `lr=1e-3` multiplies this model's gradients (their spread is printed
# first below). What share of the weights will one step leave unchanged, in float16? In
# float32?
#
# `lost_updates` takes the gradients of one batch on the fp32 model trained above, then
# applies one optimizer step to float32 master weights and to a `.half()` copy. It counts
# the weights whose exact update is nonzero but which did not move, and, as `predicted`,
# those whose update is below half their spacing:

# %%
from amp_lessons.master import gradients, lost_fraction_by_lr, lost_updates

trained = result.runs["fp32"].trainer.model
grads = gradients(trained, x, y)
magnitudes = torch.cat([g.abs().flatten() for g in grads]).double()
magnitudes = magnitudes[magnitudes > 0]
q10, q50, q90 = (torch.quantile(magnitudes, q).item() for q in (0.1, 0.5, 0.9))
print(f"|gradient|: 10% below {measured(q10, '.0e')}, median {measured(q50, '.0e')}, 90% below {measured(q90, '.0e')}")
lost = lost_updates(trained, grads, lr=1e-3, optimizer="sgd")
for r in lost.values():
    print(r.line())
print(at_most("the half-spacing rule predicts how many updates vanish, within 1%",
              max(abs(r.unchanged - r.predicted) / max(1, r.unchanged) for r in lost.values()), 0.01))
print(at_least("model.half() leaves at least 10x as many weights unchanged as float32 master weights",
               max(1, lost["model.half()"].unchanged) / max(1, lost["fp32 master"].unchanged), 10))

# %%
n_weights = sum(p.numel() for p in trained.parameters())
print(f"the model has {n_weights:,} weights; {measured(lost['fp32 master'].meant, ',')} of them get a nonzero "
      f"update from these gradients (the 'of' above); inf/NaN counts are out of all {n_weights:,}")

# %% [markdown]
# The half-spacing rule predicts which updates vanish. float32 loses only updates below
# 2^-24 of the weight. Across learning rates:

# %%
lrs = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]
plots.lost_updates(lrs, lost_fraction_by_lr(trained, grads, lrs), at_lr=1e-3)

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
# That was Adam's default implementation (a for-loop or `foreach`, torch's choice for the
# device). The fused one, `Adam(fused=True)`, takes the same step on the same `.half()`
# weights:

# %%
halves = [w.detach().half().requires_grad_() for w in trained.parameters()]
for w, g in zip(halves, grads):
    w.grad = g.half()
try:
    torch.optim.Adam(halves, lr=1e-3, fused=True).step()
    print("Adam(fused=True) on .half() weights: inf/NaN weights after one step:",
          sum(int((~torch.isfinite(w)).sum()) for w in halves))
except RuntimeError as err:
    print(f"torch {torch.__version__} has no fused Adam for {device.type} half tensors: {str(err).splitlines()[0]}")

# %% [markdown]
# ## TF32: `set_float32_matmul_precision("high")`
#
# The card: *"lets float32 matmuls use TF32 tensor cores on NVIDIA GPUs, a near-free
# speedup for code you do not convert."* TF32 is not a storage format: tensors stay
# float32, but an Ampere-or-newer tensor core multiplies each matmul input with only 10 of
# float32's 23 mantissa bits (lesson 01: PyTorch's CUDA notes speak of rounding the inputs to
# 10 bits, its numerical-accuracy notes of reading only the first 10 bits).
# `tf32_error` rounds the inputs to 10 bits (round to nearest even), so the precision cost
# shows on any device; on an NVIDIA GPU with TF32 it also measures the real thing.
# `make gpu-check` includes a check of whether a GPU truncates or rounds; the stored
# outputs come from a CPU, where it does not run.
#
# **Predict**: will TF32's error be closer to float32's or to bfloat16's?

# %%
from amp_lessons.matmul import tf32_error

err = tf32_error(256, device)
print(err.table())

# %% [markdown]
# The exact errors depend on the machine's matmul kernels; their order does not:

# %%
print(check("float32's error < TF32's < bf16's", err.fp32 < err.tf32_emulated < err.bf16,
            f"{measured(err.fp32, '.1e')} < {measured(err.tf32_emulated, '.1e')} < {measured(err.bf16, '.1e')}"))
amx_fp16 = getattr(torch._C._cpu, "_get_cpu_capability", dict)().get("amx_fp16", False)  # torch's CPU probe
tf32_path = amx_fp16 if device.type == "cpu" else why_not["tf32"] is None
print(check("'high' changes this device's float32 matmul only where it has a TF32 path "
            "(an NVIDIA GPU with TF32; a CPU with AMX-FP16, lesson 00, where oneDNN may take it)",
            err.high_changes_result <= tf32_path))

# %% [markdown]
# `"high"` is not only a CUDA setting: in this release it also asks oneDNN, the library
# behind many CPU matmuls, for TF32 math (`torch.backends.mkldnn.matmul.fp32_precision`,
# since torch 2.9), which torch hands to oneDNN only on x86 CPUs with AMX-FP16 (lesson 00).
# To oneDNN that is a permission, not an order ("implicit f32->tf32 conversions allowed").
# What the setting asks of each backend:

# %%
before = torch.get_float32_matmul_precision()
torch.set_float32_matmul_precision("high")
print({"cuda": torch.backends.cuda.matmul.fp32_precision, "mkldnn": torch.backends.mkldnn.matmul.fp32_precision})
torch.set_float32_matmul_precision(before)

# %% [markdown]
# `"medium"` is another matter, and not the same one everywhere. On an NVIDIA GPU it means
# TF32, exactly as `"high"` does: PyTorch's CUDA backend has no bf16 mode for float32 matmuls
# (`torch.backends.cuda.matmul.fp32_precision = "bf16"` is refused). On a CPU it sets
# oneDNN's float32 matmuls to "bf16" (both in `Context::setFloat32MatmulPrecision`,
# aten/src/ATen/Context.cpp), and two things must agree before the math is bf16. Torch
# sends a float32 matmul to oneDNN with that permission only where oneDNN's bf16 device
# check passes (`use_mkldnn_bf32_matmul`, aten/src/ATen/native/mkldnn/Matmul.cpp); oneDNN
# then uses it only in a kernel that implements it. On the CPU of the stored outputs
# (AVX512-BF16, no AMX) torch did send it, but `ONEDNN_VERBOSE=1` shows oneDNN running its
# float32 `brg_matmul:avx512_core` kernel with `attr-fpmath:bf16` attached: a different
# kernel from `"highest"`'s, with float32's error. **Predict** which error this device's
# float32 matmul has under `"medium"`:

# %%
from amp_lessons.matmul import medium_levels

print(f"float32 matmul error: 'highest' {measured(err.highest, '.1e')}, 'medium' {measured(err.medium, '.1e')}; "
      f"a bf16 matmul's: {measured(err.bf16, '.1e')}")
print(check("'medium' gives an error torch's source allows here (on a CPU float32's or bf16's, "
            "on an NVIDIA GPU with TF32 TF32's, each within 3x), nothing between",
            err.medium_level in medium_levels(device)))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"here, 'medium' gives {err.medium_level}-level error")

# %% [markdown]
# Where oneDNN does take bf16, a float32 model under `"medium"` silently computes its
# matmuls with bf16's 7-bit mantissa (on an NVIDIA GPU, with TF32's 10 bits). That is the
# trade the setting names; make it knowingly. On an NVIDIA GPU with TF32 the speedup of
# `"high"` is measured here:

# %%
from amp_lessons.matmul import tf32_speedup

speedup = tf32_speedup(device=device)
print(f"not measured: {why_not['tf32']}" if speedup is None else f"tf32 matmul: {measured(speedup, '.1f')}x fp32's speed")

# %% [markdown]
# One more thing tensor cores care about: shapes. cuBLAS feeds matmuls to tensor cores most
# efficiently when the dimensions are multiples of 16 bytes: of 8 for fp16 and bf16, of 4
# for TF32, which is why vocabularies and hidden sizes get padded (GPT-2's 50257 tokens to
# 50304, a multiple of 64, in nanoGPT). On a CUDA GPU the cell below times a 4096 matmul
# against a 4095 one in the precision recommended there; a CPU has no tensor cores:

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.matmul import matmul_gflops

if device.type == "cuda":
    p = amp_lessons.hardware_report(device).recommended
    aligned, ragged = matmul_gflops(4096, p, device), matmul_gflops(4095, p, device)
    print(f"{p}: n=4096 {aligned:,.0f} GFLOP/s, n=4095 {ragged:,.0f} GFLOP/s ({aligned / ragged:.2f}x)")
else:
    print(f"not measured on {device.type}: no tensor cores; padding 50257 to a multiple of 64 gives "
          f"{-(-50257 // 64) * 64}")

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
# - The MLPs' activation bytes halve under bf16 and fp16 (a transformer block keeps more:
#   its float32 residual stream makes the layer norms save float32), but the weights,
#   gradients and optimizer state do not shrink, so for these MLPs a doubled batch does not
#   fit.
# - The speedup needs 16-bit matmuls faster than float32's (tensor cores, AMX, or a CPU's
#   AVX512-BF16 for bf16, by what the bench measures); the matmul share of the step,
#   through Amdahl's law, estimates it: `python -m amp_lessons bench --breakdown`.
# - `set_float32_matmul_precision("high")` means TF32 on Ampere-or-newer NVIDIA GPUs; it
#   also asks oneDNN for TF32, which torch passes on only on CPUs with AMX-FP16.
#   `"medium"` means TF32 on those GPUs too, and allows oneDNN bf16 for a CPU's float32
#   matmuls, used where oneDNN has a kernel for it.
# - Which precision to use on a given machine: [00 start here](00_start_here.ipynb).
#
# ## Watch out
#
# - Clipping gradients that are still scaled; call `scaler.unscale_(opt)` first:
#   [04 clipping](04_clipping.ipynb) measured the threshold shrinking by the scale.
# - A speed figure is a ratio measured on one machine: time precisions side by side in
#   one process (warm-up, synchronize, median), as the bench does, before switching.
# - `model.half()` with Adam's default (for-loop or foreach) implementation: `eps` becomes 0,
#   and where a gradient is small (or zero) its weight becomes inf/NaN in one step (the fused one did not, above; the weights still
#   lose the updates below half their spacing).
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
# The checker inspects the dtype, the weights and the scaler, then trains five steps on the
# digits with the card's recipe and looks for inf/NaN weights. As given, it checks
# the broken setup:

# %%
my_setup = broken_setup  # replace with your fixed copy: def my_setup(device_type): ...

check_setup(my_setup, device)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch and hardware that no cell computes here:
#
# - What `"highest"`, `"high"` and `"medium"` select: the docstring of
#   `torch.set_float32_matmul_precision` (`torch/__init__.py`, whose note still says it affects only CUDA;
#   docs page "torch.set_float32_matmul_precision"); the oneDNN side:
#   the "MKLDNN backend" notes (`docs/source/notes/mkldnn.rst`, torch 2.9 on), and
#   oneDNN's "Floating-point Math Mode" page (`dnnl_fpmath_mode_tf32`).
# - TF32's inputs: PyTorch's CUDA semantics notes ("TensorFloat-32 (TF32) on Ampere (and
#   later) devices", `docs/source/notes/cuda.rst`: "by rounding input data to have 10 bits
#   of mantissa"); its numerical-accuracy notes (`docs/source/notes/numerical_accuracy.rst`:
#   "only the first 10 bits of the input mantissa are read").
# - `"medium"` on a CPU: `use_mkldnn_bf32_matmul` and `mkldnn_gemm` in
#   `aten/src/ATen/native/mkldnn/Matmul.cpp`; oneDNN's `ONEDNN_VERBOSE` output names the
#   kernel and its `attr-fpmath`.
# - Which ops autocast runs in float32, per device: the Autocast Op Reference,
#   `docs/source/amp.md` (lesson 02 traces them).
# - Which tensor cores take fp16 and bf16: NVIDIA's Volta and Ampere architecture
#   whitepapers; AMX-BF16 and AMX-FP16: Intel's Architecture Instruction Set Extensions
#   Programming Reference.
# - Tensor cores and the 16-byte rule (multiples of 8 in fp16, of 4 in TF32): NVIDIA's "Matrix
#   Multiplication Background User's Guide" (Deep Learning Performance docs); nanoGPT's
#   vocabulary padded to 50304: karpathy/nanoGPT `train.py` / `model.py`.
# - Memory-bound ops gain from 16-bit tensors on GPUs: NVIDIA's "Train With Mixed
#   Precision" guide (Deep Learning Performance docs).
# - `AdamW(foreach=True)` and `fused=True`: the `torch.optim.AdamW` docs.
