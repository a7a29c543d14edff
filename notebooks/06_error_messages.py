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
# # 06 · The messages you will meet
#
# What you search for, when mixed precision goes wrong, is an error message. This lesson
# makes the twelve that fill PyTorch's and Hugging Face's issue trackers about AMP, on
# purpose, each from a loop a few lines long: the message as torch prints it, the loop that
# makes it, why, and the fix running. Then a checker, `python -m amp_lessons lint`, that
# reads a training loop's source and names the mistakes it can see without running it.
#
# Every loop here runs on the CPU (a tiny 8 -> 16 -> 4 network, milliseconds each), so the
# messages are the same on every machine. Two of them belong to CUDA: those are *replayed*
# (CUDA autocast's real dispatch, on fake CUDA tensors) or *simulated* (a T4's device
# queries), and labelled so; on a GPU, `python -m amp_lessons selfcheck` checks them for real.
# The messages are printed verbatim: their wording is the same in torch 2.11, 2.13 and 2.14,
# the releases this course is tested on.

# %%
# Setup, the same in every lesson: on Colab, install the course package first.
import importlib.util
import shutil
import subprocess
import sys

REPO = "https://github.com/amp-lessons/amp-lessons"
if "google.colab" in sys.modules and importlib.util.find_spec("amp_lessons") is None:
    # Colab already has torch, numpy, matplotlib, ipywidgets 7.7.1, tqdm and scikit-learn.
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

# %%
import inspect
import textwrap

from amp_lessons import errors
from amp_lessons.show import expect_error

# %% [markdown]
# ## 1. "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
#
# The common loop steps the lr scheduler on every iteration (pytorch/pytorch#55585):

# %%
print(inspect.getsource(errors.train_stepping_scheduler_always))

# %% [markdown]
# `scheduler_run` runs it for 4 batches with AdamW and a `StepLR` that halves the lr at
# every step; one batch holds an inf, so GradScaler skips that step. **Predict**: the
# skipped step is the first one. What does PyTorch say?

# %%
run = errors.scheduler_run(errors.train_stepping_scheduler_always, skip_at=0)
print(run)
print(textwrap.fill(run.warnings[0], 90))

# %% [markdown]
# And when the skipped step is the third one?

# %%
print(errors.scheduler_run(errors.train_stepping_scheduler_always, skip_at=2))

# %% [markdown]
# No warning, and the same harm: the schedule is a step ahead of the training. Why: when a
# scheduler is created it wraps `optimizer.step` to note that it ran, and its first
# `step()` warns if it never did. GradScaler skips a step by not calling `optimizer.step`.
# Only the scheduler's first call is checked, so a later skip moves the schedule on in
# silence. Lesson 03 shows the skipped steps themselves. The fix steps the scheduler only
# when the scale did not drop:

# %%
fixed = errors.train_stepping_scheduler_after_real_steps
print(errors.fix_diff(errors.train_stepping_scheduler_always, fixed))
for skip_at in (0, 2):
    print(f"skip at {skip_at}:", errors.scheduler_run(fixed, skip_at))

# %% [markdown]
# ## 2. "unscale_() has already been called on this optimizer since the last update()"
#
# Gradient accumulation with a clip, and `unscale_` inside the micro-batch loop
# (huggingface/transformers#23905: there, accelerate's `clip_grad_norm_` unscaled on every
# micro-batch). **Predict**: which micro-batch raises?

# %%
print(inspect.getsource(errors.accumulate_unscaling_every_micro_batch))

# %%
with expect_error(RuntimeError):
    errors.accumulation_run(errors.accumulate_unscaling_every_micro_batch)

# %% [markdown]
# The second. `unscale_` divides the gradients by the scale in place and records that it
# did; a second call before `update()` would divide them again, so GradScaler refuses.
# After the first micro-batch nothing is wrong yet. The fix is lesson 04's recipe,
# `clipping.accumulate`: backward on every micro-batch, `unscale_` and the clip once,
# after the last one.

# %%
from amp_lessons import clipping

print(errors.fix_diff(errors.accumulate_unscaling_every_micro_batch, clipping.accumulate))
print(errors.accumulation_run(clipping.accumulate))

# %% [markdown]
# ## 3. Several optimizers, one scaler: `update()` once per iteration
#
# No message this time, which is the trouble. Two models, two optimizers, one GradScaler,
# and `update()` after each optimizer's step (huggingface/accelerate#439: accelerate's
# wrapped optimizers each called `update()` in their `step`):

# %%
print(inspect.getsource(errors.step_two_optimizers_updating_each))

# %% [markdown]
# `two_optimizer_run` starts the scale at 2^10 with `growth_interval=1`, so that it grows
# after every clean step (the default waits 2000 steps). A hook keeps the gradient backward
# produced, and the run compares the gradient each optimizer applied with the true one.
# **Predict**: what happens to model 2's gradient?

# %%
print(errors.describe_two_optimizer_run(errors.two_optimizer_run(errors.step_two_optimizers_updating_each)))

# %% [markdown]
# `update()` doubled the scale between the two `step` calls, so model 2's gradients, made
# at the old scale, were divided by the new one: every step of model 2 is half as large as
# it should be, and the scale grows twice per iteration instead of once. With the default
# interval the same happens whenever the scale changes, after 2000 clean steps or at any
# overflow. The PyTorch AMP examples' rule: `scaler.step(opt)` for each optimizer, then
# `scaler.update()` once.

# %%
print(errors.fix_diff(errors.step_two_optimizers_updating_each, errors.step_two_optimizers))
print(errors.describe_two_optimizer_run(errors.two_optimizer_run(errors.step_two_optimizers)))

# %% [markdown]
# ## 4. "Attempting to unscale FP16 gradients."
#
# The model converted to float16 with `model.half()`, then trained with a GradScaler
# (pytorch/pytorch#74739):

# %%
print(inspect.getsource(errors.train_half_model))

# %%
with expect_error(ValueError):
    errors.train_half_model(errors.tiny_model(), errors.tiny_batches())

# %% [markdown]
# After `model.half()` the weights, and so their gradients, are float16. GradScaler's
# `unscale_` (which `step` calls when you have not) refuses float16 gradients: it assumes
# float32 master weights, as the recipe keeps them. Lesson 05 shows what `model.half()`
# costs besides: updates smaller than half a float16 step vanish. The fix is the card's
# recipe: float32 weights, autocast around the forward.

# %%
print(errors.fix_diff(errors.train_half_model, errors.train_recipe))
model = errors.tiny_model()
opt, scaler = errors.train_recipe(model, errors.tiny_batches())
print(f"weights {next(model.parameters()).dtype}; scaler on: {scaler.is_enabled()}, scale {scaler.get_scale():g}")

# %% [markdown]
# ## 5. "mat1 and mat2 must have the same dtype"
#
# A 16-bit activation leaves the autocast block and meets a float32 layer outside it. Here
# the network's body runs under autocast and its head after the `with` block
# (the same happens in a custom op that mixes a 16-bit input with float32 weights):

# %%
print(inspect.getsource(errors.head_outside_autocast))
body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
head = torch.nn.Linear(16, 4)
x = torch.randn(4, 8)

# %% [markdown]
# **Predict** the dtype of `h`, and what `head(h)` does with it:

# %%
with expect_error(RuntimeError):
    errors.head_outside_autocast(body, head, x, dtype=torch.bfloat16)

# %% [markdown]
# Inside autocast, `linear` casts both of its inputs to 16 bits. Outside, nothing is cast:
# a bfloat16 activation meets a float32 weight and the matmul refuses. The words to search
# for are "mat1 and mat2" and "same dtype"; other ops and devices word it a little
# differently. Two fixes: run the head under autocast too, or cast at the edge
# (`head(h.float())`) when the head must stay float32.

# %%
print(errors.fix_diff(errors.head_outside_autocast, errors.head_inside_autocast))
print(errors.head_inside_autocast(body, head, x, dtype=torch.bfloat16).dtype)
with torch.autocast("cpu", dtype=torch.bfloat16):
    h = body(x)
print(h.dtype, "->", head(h.float()).dtype)  # cast at the edge

# %% [markdown]
# ## 6. inf in float16, then a NaN loss
#
# Attention scores are dot products over the head dimension: long sums. Take queries and
# keys of 16.0 in 512 dimensions. **Predict**: does their dot product fit in float16?

# %%
d, value = 512, 16.0
print(f"dot product {value * value * d:g}; float16's largest value {torch.finfo(torch.float16).max:g}")

# %%
q = k = v = torch.full((4, d), value)
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.float16)))

# %% [markdown]
# The matmul runs in float16 under autocast and its result overflows to inf. Softmax
# subtracts each row's largest score before exponentiating, and inf minus inf is NaN; from
# there every value downstream is NaN, the loss too. With a GradScaler, every step is then
# skipped and the scale falls step after step (lesson 03's `Trainer` stops such a run). A
# long reduction outside autocast overflows the same way:

# %%
ones = torch.ones(70_000, dtype=torch.float16)
print(ones.sum(), ones.sum(dtype=torch.float32))

# %% [markdown]
# Two fixes: bfloat16, whose range is float32's; or keep the sum small, here by scaling
# the queries by 1/sqrt(d) *before* the matmul rather than after. For a reduction, ask for
# a float32 accumulator and result (`sum(dtype=torch.float32)`).

# %%
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.bfloat16)))
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.float16, scale_first=True)))

# %% [markdown]
# ## 7. "`torch.cuda.amp.autocast(args...)` is deprecated"
#
# The older spellings still work, and warn (a `FutureWarning`, which this course's tests,
# like many projects', turn into errors). **Predict** what each one suggests instead:

# %%
for spelling, message in errors.deprecated_spellings():
    print(f"{spelling:<28} {message}")

# %% [markdown]
# On a machine without CUDA, `torch.cuda.amp.autocast()` and `torch.cuda.amp.GradScaler()`
# also warn that CUDA is not available and disable themselves; those warnings depend on
# the machine and are left out above. The `torch.amp` spellings take the device as their
# first argument and do not warn:

# %%
print("FutureWarnings from torch.amp.autocast, torch.autocast, torch.amp.GradScaler:",
      errors.current_spellings_warnings())

# %% [markdown]
# ## 8. `GradScaler()` without a device: silently off
#
# `torch.amp.GradScaler()` takes the device type as its first argument, and its default is
# `"cuda"`. On a machine without CUDA, it warns and switches itself off. **Predict**
# what `scaler.scale(loss)` returns then. (On a machine with CUDA, this cell hides it
# first, so that it shows the same everywhere.)

# %%
print(errors.default_scaler_report())

# %% [markdown]
# The loss comes back unscaled and training goes on in float16 without a scaler: lesson
# 03's flushed gradients, with no error and one warning that is easy to miss in a log. Pass
# the device, as every lesson does:

# %%
scaler = torch.amp.GradScaler("cpu")
print(f"enabled: {scaler.is_enabled()}; scale(0.5) = {scaler.scale(torch.tensor(0.5)).item():g} "
      f"(get_scale(): {scaler.get_scale():g})")

# %% [markdown]
# ## 9. A gradient penalty computed from scaled gradients
#
# A gradient penalty adds the gradients' norm to the loss, so the loss needs the gradients
# during the forward pass: `torch.autograd.grad(..., create_graph=True)`. With a GradScaler
# those gradients come out multiplied by the scale. PyTorch's AMP examples unscale them by
# hand before computing the penalty:

# %%
print(inspect.getsource(errors.penalty_step))

# %% [markdown]
# **Predict**: with `unscale=False`, how much larger is the penalty, and what does
# GradScaler do with the loss that carries it?

# %%
from amp_lessons.claims import check, measured

right, right_scales = errors.penalty_run(unscale=True)
wrong, wrong_scales = errors.penalty_run(unscale=False)
print(f"penalty at step 0: unscaled {measured(right[0], '.3f')}, forgotten {measured(wrong[0], '.4g')}")
check("forgetting to unscale multiplies the penalty by the scale, 65536",
      abs(wrong[0] / right[0] / 65536 - 1) < 1e-3, f"ratio {measured(wrong[0] / right[0], '.6g')}")

# %%
def scales(values):
    return "scale after each step: " + ", ".join(f"{s:g}" for s in values)


print(check("unscaled, GradScaler skipped none of the 4 steps", right_scales == [65536.0] * 4, scales(right_scales)))
print(check("forgotten, it skipped every one and halved the scale each time",
            wrong_scales == [65536.0 / 2**i for i in range(1, 5)], scales(wrong_scales)))

# %% [markdown]
# A penalty 65536 times too large, scaled once more by GradScaler, overflows float16 in
# the backward pass: every step is skipped, with no message at all.
#
# ## 10. "binary_cross_entropy ... unsafe to autocast"
#
# A sigmoid, then `F.binary_cross_entropy` (or `nn.BCELoss`). On a CPU, under autocast,
# **predict** the dtypes of the probabilities and of the loss:

# %%
print(errors.bce_under_autocast(torch.bfloat16))

# %% [markdown]
# CPU autocast puts `binary_cross_entropy` on its float32 list: the 16-bit probabilities
# are cast up and it runs. CUDA autocast refuses it (pytorch/pytorch#61098). PyTorch's
# autocast notes give the reason: its backward can produce gradients that float16 cannot
# represent, and casting the input up to float32 does not help, since backward reverses
# that cast. No GPU is needed to see the refusal: lesson 02's tracer replays CUDA autocast
# here (`trace_fn(..., simulate=True)`). It switches CUDA autocast on and gives the call
# fake CUDA tensors (shapes and dtypes, no data, no GPU), so each op goes through CUDA
# autocast's real dispatch. Replayed:

# %%
print(errors.cuda_bce("bce"))

# %% [markdown]
# The message names the fix: fuse the sigmoid into the loss. `binary_cross_entropy_with_logits`
# (`nn.BCEWithLogitsLoss`) takes the logits and is on CUDA's float32 list (replayed again):

# %%
print(errors.cuda_bce("logits"))

# %% [markdown]
# The verdict below runs the real thing when this machine has a CUDA GPU (and checks that
# the replay says the same); without one it reports the replay. Its words name which, so
# they differ between machines and the tests do not compare them.

# %%
# NBVAL_IGNORE_OUTPUT
errors.cuda_bce_raises(device)

# %% [markdown]
# ## 11. bfloat16 "supported" on a T4
#
# Colab's free T4 (compute capability 7.5) has no bfloat16 hardware, yet
# `torch.cuda.is_bf16_supported()` says True (pytorch/pytorch#148322 discusses it).
# `simulated_t4` makes torch's device queries answer as a T4 does; `is_bf16_supported`
# itself is left alone, so its own logic gives the answers. **Predict** both:

# %%
for question, answer in errors.t4_bf16_answers().items():
    print(f"{question:<58} {answer}")

# %% [markdown]
# Below compute capability 8.0, `is_bf16_supported()` tries to make a bfloat16 tensor on
# the GPU; a T4 can hold one (its math is emulated, through float32, and slow), so the
# answer is True. `including_emulation=False` asks about the hardware. The course's
# hardware report (`python -m amp_lessons doctor`, lesson 00) asks that way and
# recommends float16 with a GradScaler there. On a pre-Ampere GPU the verdict below runs
# for real:

# %%
# NBVAL_IGNORE_OUTPUT
errors.t4_bf16_verdict(device)

# %% [markdown]
# ## 12. Gradient accumulation with a scaler, done wrong
#
# Lesson 04 measures both ways of getting it wrong against one large batch: `unscale_`,
# `step` and `update` on every micro-batch, and the loss not divided by the number of
# micro-batches. Neither raises, so the loop checker below is the one that names them:

# %%
from amp_lessons.lint import check_loop

for loop in (clipping.accumulate_stepping_every_micro_batch, clipping.accumulate_without_dividing,
             clipping.accumulate):
    print(f"{loop.__name__}:", *check_loop(inspect.getsource(loop)).codes or ["no findings"])

# %% [markdown]
# ## The loop checker
#
# `check_loop` reads a loop's source with Python's own parser (`ast`), never running it,
# and follows the calls in order: which scaler, optimizer and scheduler each call is on,
# inside which loop, `with` block and `if`. It names ten mistakes, each with its line and
# the lesson that shows it. Here is lesson 04's exercise loop, numbered as the checker
# counts. **Predict** what it finds:

# %%
from amp_lessons.exercises import broken_clipping_loop
from amp_lessons.lint import listing

source = inspect.getsource(broken_clipping_loop)
print(listing(source))

# %%
check_loop(source)

# %% [markdown]
# Lesson 04's three bugs, and one *note*: `backward()` inside autocast gives the same
# gradients (04 measured it) and only breaks the convention. The same check runs from a
# shell, on files: `python -m amp_lessons lint train.py` prints one line per finding and
# exits with 1 when it finds something, 2 when a file cannot be read or parsed:

# %%
import contextlib
import tempfile
from pathlib import Path

from amp_lessons.__main__ import main

with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
    Path("train.py").write_text(inspect.getsource(errors.train_stepping_scheduler_always))
    print("exit status", main(["lint", "train.py"]))
    Path("pasted.py").write_text("with torch.autocast('cuda'):\nloss = model(x)\n")
    with contextlib.redirect_stderr(sys.stdout):
        print("exit status", main(["lint", "pasted.py"]))

# %% [markdown]
# What it cannot see is what happens at run time: an overflow (6), a dtype at the autocast
# edge (5), a penalty built from scaled gradients (9), a device's autocast lists (10, 11).
# For those, the messages above.
#
# ## The index
#
# | message or symptom | cause | revisit |
# |---|---|---|
# | Detected call of `lr_scheduler.step()` before `optimizer.step()` | the first step was skipped and the scheduler stepped anyway; later skips say nothing | 03, section 1 |
# | `unscale_() has already been called on this optimizer since the last update()` | `unscale_` inside the micro-batch loop, or twice per step | 04, section 2 |
# | (none) second optimizer's updates off by a power of two | `scaler.update()` after each optimizer's step | section 3 |
# | `Attempting to unscale FP16 gradients.` | `model.half()` with a GradScaler | 05, section 4 |
# | `mat1 and mat2 must have the same dtype, but got BFloat16 and Float` | a 16-bit activation meets float32 weights outside autocast | 02, section 5 |
# | inf, then NaN loss; every step skipped | float16 overflow in a long sum (attention scores, a reduction) | 01, 03, section 6 |
# | `torch.cuda.amp.autocast(args...) is deprecated` (FutureWarning) | the old `torch.cuda.amp` spelling | section 7 |
# | `torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.` | `GradScaler()` without a device on a machine without CUDA | 03, section 8 |
# | (none) every step skipped, scale falling | a gradient penalty from scaled gradients | section 9 |
# | `binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast` | sigmoid + BCE under CUDA autocast | 02, section 10 |
# | (none) bf16 "supported" yet slow on a T4 | `is_bf16_supported()` counts emulation | 00, section 11 |
# | (none) updates k times too large, or k small steps | accumulation without `/ k`, or stepping every micro-batch | 04, section 12 |
#
# ## Remember
#
# - Step the lr scheduler only when the scale did not drop; the warning only comes when
#   the *first* step is skipped.
# - `unscale_` once per optimizer step, after the last backward; `scaler.step(opt)` for
#   each optimizer, `scaler.update()` once per iteration.
# - Keep float32 weights with a GradScaler; let autocast do the casting, and keep a
#   16-bit activation inside autocast or cast it at the edge.
# - Always `torch.amp.GradScaler(device.type)`; always the `torch.amp` spellings.
#
# ## Watch out
#
# - Some of these mistakes print nothing: a later skipped step, `update()` per optimizer,
#   a disabled scaler, an unscaled penalty, undivided accumulation. Run
#   `python -m amp_lessons lint` on your training script.
# - A NaN loss in float16 often starts as an inf in a long sum; look for the first inf
#   before blaming the learning rate.
# - On CUDA, use `BCEWithLogitsLoss`; on a T4, ask `is_bf16_supported(including_emulation=False)`.

# %% [markdown]
# ## Exercise: three mistakes, one loop
#
# Two models trained together in float16, with one GradScaler and an lr scheduler each.
# Three lines are wrong, each one of this lesson's mistakes:

# %%
from amp_lessons.exercises import check_two_model_loop, two_model_loop_as_given

print(listing(inspect.getsource(two_model_loop_as_given)))

# %% [markdown]
# Copy it into the cell below as `def my_loop(models, optimizers, schedulers, batches):`
# and fix it. The checker runs your loop on two tiny networks for four batches, the first
# holding an inf, as on a machine without CUDA (so that it says the same on every machine),
# records the GradScaler and its calls, compares each scheduler's steps with its optimizer's,
# and reads your source with `check_loop`. As given, it checks the loop above:

# %%
my_loop = two_model_loop_as_given  # replace with your own: def my_loop(models, optimizers, schedulers, batches): ...

check_two_model_loop(my_loop)
