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
# makes AMP mistakes on purpose, each from a loop a few lines long: the message as torch
# prints it (most with an issue thread where someone met it), the loop that makes it, why,
# and the fix running. Six print no message at all (the "(none)" rows of the index at the
# end): the ones to fear. Then a checker, `python -m amp_lessons lint`, that names the
# mistakes it can see in a training loop's source without running it.
#
# Every loop runs on the CPU (a tiny 8 -> 16 -> 4 network), so the messages are the same on
# every machine. CUDA's are replayed on fake CUDA tensors, simulated, or quoted from the
# torch file that prints them; on a GPU, `python -m amp_lessons selfcheck` runs sections 8
# and 10 there (11 on a pre-Ampere GPU).

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

# %%
import inspect
import textwrap

from amp_lessons import errors
from amp_lessons.show import expect_error

# %% [markdown]
# ## 1. "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
#
# The common loop steps the lr scheduler on every iteration, skipped step or not
# (pytorch/pytorch#55585); lesson 03 showed that PyTorch checks the order only at the
# scheduler's first `step()`, so a later skip goes unwarned. `scheduler_run` runs 4 batches
# with AdamW and a `StepLR` halving the lr at every step, an inf in batch 0, with and without
# `fused=True`. A fused optimizer skips inside its kernel, so GradScaler calls its `step`
# even on a skipped step (the table after the run). **Predict** which run warns:

# %%
print(inspect.getsource(errors.train_stepping_scheduler_always))
runs = {fused: errors.scheduler_run(errors.train_stepping_scheduler_always, 0, fused=fused) for fused in (False, True)}
for fused, run in runs.items():
    print(f"skip at 0{', fused' * fused}:", run)
print(textwrap.fill(runs[False].warnings[0], 90))

# %% [markdown]
# One warning, and the same harm in both: the schedule a step ahead of the training. What
# a skipped step does, by optimizer (torch 2.13; Sources):
#
# | optimizer | GradScaler calls its `step` | scheduler warning at a skipped first step | step post-hooks fire | a step count the skip leaves unchanged |
# |---|---|---|---|---|
# | not fused (and `fused=True` Adagrad in torch 2.11) | no | yes | no | not needed |
# | `fused=True` Adam, AdamW, Adagrad | yes, without `unscale_`; it skips in its kernel | no | yes | `opt.state[p]["step"]` (copy its value before the step: the tensor is updated in place) |
# | `fused=True` SGD | the same, but with momentum a skipped first step leaves its momentum buffer uninitialised (below) | no | yes | none |
#
# Fused SGD with momentum makes its momentum buffers at its first step
# (`momentum_buffer_list[i] = torch.empty_like(g)` in `_fused_sgd`, `torch/optim/sgd.py`,
# torch 2.11 and 2.13) for its kernel to fill. When that step is skipped, the kernel writes
# nothing (Sources): the buffers stay in its state unwritten, and the next step starts from
# whatever that memory held. Not fused, a skipped step leaves no state; with `momentum=0`,
# there is no buffer:

# %%
for fused, momentum in ((False, 0.9), (True, 0.9), (True, 0.0)):
    keys = errors.state_after_a_skipped_first_step(fused, momentum)
    print(f"SGD(momentum={momentum:g}{', fused=True' * fused}), state after a skipped first step: {keys or 'none'}")

# %% [markdown]
# Under a GradScaler, use SGD with momentum not fused, or fused with `momentum=0`.
#
# With one optimizer, the fix steps the scheduler only when the scale did not drop, fused
# or not (several optimizers: section 3); it reads `get_scale()`, a sync on CUDA (Sources),
# once per step:

# %%
fixed = errors.train_stepping_scheduler_after_real_steps
print(errors.fix_diff(errors.train_stepping_scheduler_always, fixed))
for fused in (False, True):
    print(f"skip at 0{', fused' * fused}:", errors.scheduler_run(fixed, 0, fused=fused))

# %% [markdown]
# ## 2. "unscale_() has already been called on this optimizer since the last update()"
#
# Gradient accumulation with a clip, and `unscale_` inside the micro-batch loop (Hugging
# Face's Trainer raised it in fp16 when accumulation ran across an epoch boundary:
# huggingface/transformers#23935). **Predict**: which micro-batch raises?

# %%
print(inspect.getsource(errors.accumulate_unscaling_every_micro_batch))

# %%
fed = []  # the micro-batches the loop took
with expect_error(RuntimeError):
    errors.accumulation_run(errors.accumulate_unscaling_every_micro_batch, fed=fed)
print(f"raised in micro-batch {len(fed)} of 4")

# %% [markdown]
# `unscale_` divides the gradients by the scale in place and records that it did, and
# GradScaler refuses a second call before `update()`. By then the second backward has added
# gradients multiplied by the scale onto the first micro-batch's unscaled ones, and the
# first clip measured that micro-batch's share alone. The fix is lesson 04's recipe,
# `clipping.accumulate`: backward on every micro-batch, `unscale_` and the clip once, after
# the last one.

# %%
from amp_lessons import clipping

print(errors.fix_diff(errors.accumulate_unscaling_every_micro_batch, clipping.accumulate))
print(errors.accumulation_run(clipping.accumulate))

# %% [markdown]
# ## 3. Several optimizers, one scaler: `update()` once, after the last `step`
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
# at the old scale, were divided by the new one: half what they should be (with SGD, as
# here, so is its step), and the scale grows twice per iteration. With the default interval
# (2000) growth is rare, but an overflow changes the scale too, the other way: one step with
# the default interval and an inf in model 1's gradient only, then in both:

# %%
for overflow in ((0,), (0, 1)):
    rows = errors.two_optimizer_run(errors.step_two_optimizers_updating_each, steps=1,
                                    growth_interval=2000, overflow=overflow)
    print(errors.describe_two_optimizer_run(rows))

# %% [markdown]
# Model 1's step is skipped and `update()` halves the scale before model 2's `step`:
# model 2, made at 1024 and unscaled by 512, takes a step twice as large as it should. When
# both overflow, both are skipped and the scale drops 4x in one iteration. The PyTorch AMP
# examples' rule: `scaler.step(opt)` for each optimizer, then `scaler.update()` once. Here
# with model 1's inf at the first step again:

# %%
print(errors.fix_diff(errors.step_two_optimizers_updating_each, errors.step_two_optimizers))
print(errors.describe_two_optimizer_run(errors.two_optimizer_run(errors.step_two_optimizers, overflow=(0,))))

# %% [markdown]
# Model 2 stepped at its true gradient, yet the scale dropped: one optimizer's inf lowers
# it for all, so the scale cannot say which optimizer stepped.
#
# Step each lr scheduler when its own optimizer did: `opt.register_step_post_hook(fn)`
# calls `fn` after each step that ran; for a fused optimizer, section 1's table says what
# to compare instead. Fused SGD keeps no step count: there, with `momentum=0` (section 1),
# give each optimizer its own GradScaler, with its own loss and backward, and each is
# section 1's one-optimizer case.
#
# ## 4. "Attempting to unscale FP16 gradients."
#
# The model converted to float16 with `model.half()`, then trained with a GradScaler
# (pytorch/pytorch#74739):

# %%
print(inspect.getsource(errors.train_half_model))
with expect_error(ValueError):
    errors.train_half_model(errors.tiny_model(), errors.tiny_batches())

# %% [markdown]
# After `model.half()` the weights, and so their gradients, are float16. GradScaler's
# `unscale_` (which `step` calls when you have not) refuses float16 gradients: it assumes
# float32 master weights, as the recipe keeps them (its author, in pytorch/pytorch#26512).
# (With a fused optimizer, `scaler.step` runs without `unscale_`, section 1's table: only
# an explicit `scaler.unscale_(opt)`, as in lesson 04's clip, raises this.) Lesson 05 shows
# what `model.half()` costs besides:
# updates smaller than half a float16 step vanish. The fix is the recipe of lesson 00's
# card: float32 weights, autocast around the forward.

# %%
print(errors.fix_diff(errors.train_half_model, errors.train_recipe))
model = errors.tiny_model()
opt, scaler = errors.train_recipe(model, errors.tiny_batches())
print(f"weights {next(model.parameters()).dtype}; scaler on: {scaler.is_enabled()}, scale {scaler.get_scale():g}")

# %% [markdown]
# ## 5. "mat1 and mat2 must have the same dtype"
#
# A 16-bit activation leaves the autocast block and meets a float32 layer outside it. Here
# the network's body runs under autocast and its head after the `with` block. **Predict**
# what `head(h)` does:

# %%
print(inspect.getsource(errors.head_outside_autocast))
body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
head = torch.nn.Linear(16, 4)
x = torch.randn(4, 8)
with expect_error(RuntimeError):
    errors.head_outside_autocast(body, head, x, dtype=torch.bfloat16)

# %% [markdown]
# Inside autocast, `linear` casts its input, weight and bias to 16 bits. Outside, nothing
# is cast: a bfloat16 activation meets a float32 weight and the matmul refuses. Two fixes:
# run the head under autocast too, or cast at the edge (`head(h.float())`) when it must
# stay float32.

# %%
print(errors.fix_diff(errors.head_outside_autocast, errors.head_inside_autocast))
print(errors.head_inside_autocast(body, head, x, dtype=torch.bfloat16).dtype)
with torch.autocast("cpu", dtype=torch.bfloat16):
    h = body(x)
print(h.dtype, "->", head(h.float()).dtype)  # cast at the edge

# %% [markdown]
# Other layers word the same mistake their own way (the index lists them). The cell runs
# three: `linear` on the `h` above with the head's weight and no bias; a convolution with a
# bias; one without, with oneDNN off. With oneDNN on (the default), a CPU on which oneDNN
# takes bfloat16 (Sources says which) prints oneDNN's wording for that last one instead.

# %%
conv_body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
image = torch.randn(1, 3, 8, 8)
with expect_error(RuntimeError):
    torch.nn.functional.linear(h, head.weight)
with expect_error(RuntimeError):
    errors.head_outside_autocast(conv_body, torch.nn.Conv2d(4, 2, 3), image, dtype=torch.bfloat16)
with errors.without_onednn(), expect_error(RuntimeError):
    errors.head_outside_autocast(conv_body, torch.nn.Conv2d(4, 2, 3, bias=False), image)

# %% [markdown]
# ## 6. inf in float16, then a NaN loss
#
# Attention scores are dot products over the head dimension: long sums. Take queries and
# keys of 32.0 in 128 dimensions. **Predict**: does their dot product fit in float16?

# %%
d, value = 128, 32.0
print(f"dot product {value * value * d:g}; float16's largest value {torch.finfo(torch.float16).max:g}")

# %%
q = k = v = torch.full((4, d), value)
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.float16)))

# %% [markdown]
# The matmul runs in float16 under autocast and overflows to inf before `attention`
# divides the scores by sqrt(d) after it (`F.scaled_dot_product_attention`'s math path
# scales q and k before its matmul instead; Sources). Softmax turns rows of inf into NaN
# weights (the line above), and the loss is NaN too. With a GradScaler, that batch's step
# is skipped and the scale halved. The scale multiplies only the loss, after the forward, so
# halving it does not undo an overflow in the forward: an inf on every batch skips every
# step and the scale falls and falls (lesson 03's `Trainer` stops that). A long float16 sum
# overflows the same way. CPU autocast leaves `sum` in 16 bits, so here it overflows inside
# autocast too; CUDA autocast runs `sum` in float32 (Sources):

# %%
ones = torch.ones(70_000, dtype=torch.float16)
with torch.autocast("cpu", dtype=torch.float16):
    print(ones.sum(), ones.sum(dtype=torch.float32))

# %% [markdown]
# Two fixes: bfloat16, whose range is float32's; or keep the sum small, here by dividing
# the queries by sqrt(d) *before* the matmul (`scale_first=True`). For a reduction, ask for
# a float32 accumulator and result (`sum(dtype=torch.float32)`).

# %%
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.bfloat16)))
print(errors.overflow_report(*errors.attention(q, k, v, dtype=torch.float16, scale_first=True)))

# %% [markdown]
# float16's short range raises one message of its own, from attention code written for
# float32: masking scores with `-1e9`, a number float16 cannot hold (NVIDIA/apex#1052):

# %%
print(inspect.getsource(errors.masked_scores))
causal = torch.ones(4, 4, dtype=torch.bool).triu(1)  # mask the future
small = torch.randn(4, 8)
with expect_error(RuntimeError):
    errors.masked_scores(small, small, causal)

# %% [markdown]
# The fix masks with the most negative value the scores' own dtype holds (or `-inf`, where
# no row is masked entirely):

# %%
print(errors.fix_diff(errors.masked_scores, errors.masked_scores_fixed))
fixed = errors.masked_scores_fixed(small, small, causal)
print(f"{fixed.dtype}: {int((fixed == torch.finfo(fixed.dtype).min).sum())} of {fixed.numel()} scores masked, "
      f"at {torch.finfo(fixed.dtype).min:g}")

# %% [markdown]
# ## 7. "`torch.cuda.amp.autocast(args...)` is deprecated"
#
# The older spellings still work, and warn (a `FutureWarning`, which this course's tests,
# like many projects', turn into errors). **Predict** what each one suggests instead:

# %%
for spelling, message in errors.deprecated_spellings():
    print(f"{spelling:<28} {message}")
print("FutureWarnings from torch.amp.autocast, torch.autocast, torch.amp.GradScaler:",
      errors.current_spellings_warnings())

# %% [markdown]
# The `torch.amp` spellings take the device first and raise none (the last line). With
# neither CUDA nor torch_xla, the `torch.cuda.amp` ones also disable themselves: section 8.
#
# ## 8. `GradScaler()` without a device: off, with one warning
#
# `torch.amp.GradScaler()` takes the device type as its first argument, and its default is
# `"cuda"`. On a machine with neither CUDA nor torch_xla, it warns and switches itself off
# (Sources). **Predict** what `scaler.scale(loss)` returns then. (This cell hides both
# first, so that it shows the same everywhere.)

# %%
print(errors.default_scaler_report())

# %% [markdown]
# The loss comes back unscaled. Under `torch.autocast("cpu", dtype=torch.float16)`,
# training goes on in float16 without a scaler: lesson 03's flushed gradients, with one
# warning that is easy to miss in a log. Under `torch.autocast("cuda")`, autocast turns
# itself off there too, with a warning of its own (Sources), and the loop trains in
# float32. Pass the device, as every lesson does:

# %%
scaler = torch.amp.GradScaler("cpu")
print(f"enabled: {scaler.is_enabled()}; scale(0.5) = {scaler.scale(torch.tensor(0.5)).item():g} "
      f"(get_scale(): {scaler.get_scale():g})")

# %% [markdown]
# ## 9. A gradient penalty computed from scaled gradients
#
# A gradient penalty adds the gradients' norm to the loss, so it needs the gradients during
# the forward pass: `torch.autograd.grad(..., create_graph=True)`. With a GradScaler they
# come out multiplied by the scale, and PyTorch's AMP examples unscale them by hand first.
# **Predict**: with `unscale=False`, how much larger is the penalty, and what does
# GradScaler do with the loss that carries it? `penalty_run` takes 24 steps each way, beside
# each the true penalty (the same weights and batch, in float32, without a scaler):

# %%
print(inspect.getsource(errors.penalty_step))

# %%
from amp_lessons.claims import at_least, between, check, measured

right = errors.penalty_run(unscale=True)
wrong = errors.penalty_run(unscale=False)
taken = [s for s in wrong.steps if not s.skipped]
print(between("forgetting to unscale multiplies the penalty by the scale S: |penalty / true penalty / S - 1|, "
              "largest over the first step and every step taken",
              max(abs(s.times_too_large / s.scale - 1) for s in [wrong.steps[0], *taken]), 0, 0.05, ".3f"))
print(check("forgotten, GradScaler skips the first steps, then takes most of the rest; unscaling by hand, "
            "it skips none of the 24",
            wrong.skipped()[:3] == [1, 2, 3] and len(taken) / (24 - wrong.first_taken() + 1) >= 0.5
            and right.skipped() == [],
            f"first step taken: {measured(wrong.first_taken())}, at scale "
            f"{measured(wrong.steps[wrong.first_taken() - 1].scale)}; taken from there on: "
            f"{measured(len(taken))} of {measured(24 - wrong.first_taken() + 1)}; "
            f"skipped unscaling by hand: {right.skipped()}"))
print(at_least("after 24 steps the cross entropy is at least 5x that of the run that unscales",
               wrong.final_loss / right.final_loss, 5, ".1f"))

# %% [markdown]
# Forgotten, the gradients hold an inf at the first scales, so GradScaler skips those steps
# and halves S each time until the steps go through; then training runs on a penalty S
# times too large, with no message and a few skips that look like GradScaler finding its
# scale (lesson 03).
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
# that cast. Lesson 02's tracer replays CUDA autocast here (`trace_fn(..., simulate=True)`:
# CUDA autocast's real dispatch, on fake CUDA tensors):

# %%
print(errors.cuda_bce("bce"))

# %% [markdown]
# The message names the fix: fuse the sigmoid into the loss. `binary_cross_entropy_with_logits`
# (`nn.BCEWithLogitsLoss`) takes the logits and is on CUDA's float32 list (replayed again;
# on a CUDA machine the verdict after it runs the real thing, and says which it did):

# %%
print(errors.cuda_bce("logits"))

# %%
# NBVAL_IGNORE_OUTPUT
errors.cuda_bce_raises(device)

# %% [markdown]
# ## 11. bfloat16 "supported" on a T4
#
# Colab's free T4 (compute capability 7.5) has no bfloat16 hardware, yet
# `torch.cuda.is_bf16_supported()` says True (pytorch/pytorch#148322 discusses it).
# `simulated_t4` answers torch's device queries as a T4 does, the test that makes a
# bfloat16 tensor on the GPU included (a T4 can: True); `is_bf16_supported` itself runs
# unpatched. **Predict** both:

# %%
for question, answer in errors.t4_bf16_answers().items():
    print(f"{question:<58} {answer}")

# %% [markdown]
# Below compute capability 8.0, `is_bf16_supported()` answers whether a bfloat16 tensor
# can be made, not whether the GPU computes in bfloat16: CUDA carries out bf16 math through
# float32 there. `including_emulation=False` asks about the hardware, as the course's
# hardware report does (`python -m amp_lessons doctor`, lesson 00), which recommends float16
# with a GradScaler. A bfloat16 depthwise `Conv2d` failed in one project's T4 CI (Sources).
# On a pre-Ampere GPU the verdict below runs for real:

# %%
# NBVAL_IGNORE_OUTPUT
errors.t4_bf16_verdict(device)

# %% [markdown]
# ## 12. Three more messages
#
# **"No inf checks were recorded for this optimizer."** Two models trained in turn (a GAN's
# two halves, say) with one GradScaler, and both optimizers stepped every iteration:

# %%
print(inspect.getsource(errors.train_alternating_stepping_both))
with expect_error(AssertionError):
    errors.alternating_run(errors.train_alternating_stepping_both)

# %% [markdown]
# `scaler.step(opt)` unscales the optimizer's gradients and records, per device, whether
# they hold an inf. An optimizer none of whose parameters has a gradient records nothing,
# and `step` refuses it, unless it is fused (section 1; Sources). Step only the optimizer
# whose model had a backward:

# %%
print(errors.fix_diff(errors.train_alternating_stepping_both, errors.train_alternating))
print(errors.alternating_run(errors.train_alternating))

# %% [markdown]
# **"expected scalar type BFloat16 but found Float"**: two inputs of one op in different
# dtypes, in the words several ops use (here `nll_loss`, inside `cross_entropy`). A model
# cast to bfloat16 (no autocast) meets float32 class weights in its loss:

# %%
print(inspect.getsource(errors.weighted_loss_of_bf16_model))
x, y = errors.tiny_batches(1)[0]
with expect_error(RuntimeError):
    errors.weighted_loss_of_bf16_model(errors.tiny_model(), x, y, class_weights=torch.ones(4))

# %% [markdown]
# The fix is the recipe again: float32 weights and autocast, which runs `cross_entropy` in
# float32 on the CPU (lesson 02):

# %%
print(errors.weighted_loss_under_autocast(errors.tiny_model(), x, y, class_weights=torch.ones(4)).dtype)

# %% [markdown]
# **"Current CUDA Device does not support bfloat16. Please switch dtype to float16."**
# `torch.autocast("cuda", dtype=torch.bfloat16)` raises it when
# `torch.cuda.is_bf16_supported()` says False (`torch/amp/autocast_mode.py`): with today's
# query (section 11), on a GPU that cannot even make a bfloat16 tensor, or with torch_xla
# installed and no CUDA; in older releases, on any pre-Ampere GPU (karpathy/nanoGPT#277, a
# V100). Simulated here:

# %%
with expect_error(RuntimeError):
    errors.bf16_autocast_on_gpu_without_bf16()

# %% [markdown]
# The fix is the one the message names, with a GradScaler: on such a GPU, float16.
#
# ## The loop checker
#
# `check_loop` reads a loop's source with Python's parser (`ast`), never running it, and
# follows the calls in order: on which optimizer and scheduler (one scaler is assumed),
# inside which loop,
# `with` block and arm of an `if`. Each mistake it names is one rule, with its lesson:

# %%
from amp_lessons.lint import RULES

for rule in RULES:
    print(f"{rule.name:<24} {rule.summary} ({rule.lesson[:2]})")

# %% [markdown]
# Where the checker sees that the source alone cannot decide (a scaler may live in another
# file; code that asks `torch.cuda.is_available()` may run without CUDA), the message says
# "may" and why. A guard it cannot follow (a flag computed elsewhere) can still be reported
# as a mistake: read each message against your loop. Here
# is lesson 04's exercise loop, numbered as the checker counts. **Predict** what it finds:

# %%
from amp_lessons.exercises import broken_clipping_loop
from amp_lessons.lint import check_loop, listing

source = inspect.getsource(broken_clipping_loop)
print(listing(source))

# %%
check_loop(source)

# %% [markdown]
# Lesson 04's three mistakes, and one note, line 12: lesson 04 measured the same gradients
# inside and outside for its model on the CPU; the note says where they may differ.
#
# From a shell, `python -m amp_lessons lint train.py` (files, notebooks cell by cell,
# directories) prints one line per finding. It exits with 1 on a mistake (notes alone: 0),
# 2 when a file cannot be read or parsed; `--format json` serves an editor or CI:

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
# What it cannot see is what happens at run time: a dtype at the autocast edge (5, 12), an
# overflow (6), a penalty built from scaled gradients (9), a device's autocast lists (10),
# what `is_bf16_supported()` answers (11, 12), an optimizer without gradients (12). Nor
# section 1's fix applied to several optimizers: schedulers guarded by the shared scale (3):

# %%
check_loop(errors.schedule_two_optimizers_on_the_scale)

# %% [markdown]
# ## The index
#
# | message or symptom | cause | where |
# |---|---|---|
# | Detected call of `lr_scheduler.step()` before `optimizer.step()` | the first step was skipped and the scheduler stepped anyway, or the scheduler steps before the optimizer | section 1; lesson 03 |
# | (none) the schedule a step ahead of the training | a skipped step after the first (any skipped step, with a fused optimizer: section 1), and the scheduler stepped anyway | section 1; lesson 03 |
# | `unscale_() has already been called on this optimizer since the last update()` | `unscale_` inside the micro-batch loop, or twice per step | section 2; lesson 04 |
# | (none) second optimizer's gradients off by a power of two (halved when the scale grows, doubled at an overflow) | `scaler.update()` between two optimizers' `scaler.step` | section 3 |
# | (none) a scheduler falls behind its optimizer | schedulers stepped on the shared scale; one model overflowed | section 3 |
# | `Attempting to unscale FP16 gradients.` | a float16 `.grad` with a GradScaler (`model.half()`, a model loaded in float16); with a fused optimizer, only an explicit `unscale_` | section 4; lesson 05 |
# | `mat1 and mat2 must have the same dtype, but got BFloat16 and Float` (CPU; CUDA by source, 2-D input) | a 16-bit activation meets float32 weights outside autocast, at a `Linear` with a bias | section 5; lesson 02 |
# | `expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float` (CPU); `expected mat1 and mat2 to have the same dtype, but got: ...` (CUDA, by source) | the same, at a `Linear` without a bias | section 5 |
# | `Input type (c10::BFloat16) and bias type (float) should be the same` (every device, by source) | the same, at a convolution with a bias | section 5 |
# | `Input type (CPUBFloat16Type) and weight type (torch.FloatTensor) should be the same or input should be a MKLDNN tensor ...` (oneDNN, by default on a CPU where it takes bfloat16: Sources); `expected scalar type BFloat16 but found Float` (oneDNN off, or another CPU) | the same, at a convolution without a bias | section 5 |
# | (none) inf, then NaN loss; that step skipped, every step if the inf recurs | float16 overflow in a long sum (attention scores, a reduction) | section 6; lessons 01 and 03 |
# | `value cannot be converted to type c10::Half without overflow` | `masked_fill(-1e9)` on float16 scores | section 6 |
# | `torch.cuda.amp.autocast(args...) is deprecated` (FutureWarning) | the old `torch.cuda.amp` spelling | section 7 |
# | `torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.` | `GradScaler()` without a device on a machine with neither CUDA nor torch_xla | section 8; lesson 03 |
# | (none) the first steps skipped, then a penalty S times too large | a gradient penalty from scaled gradients | section 9 |
# | `binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast` | sigmoid + BCE under CUDA autocast | section 10; lesson 02 |
# | (none) bf16 "supported" on a T4, yet emulated: slow | `is_bf16_supported()` counts emulation | section 11; lesson 00 |
# | `No inf checks were recorded for this optimizer.` | `scaler.step(opt)` on an optimizer whose parameters have no gradients (not a fused one: section 1) | section 12 |
# | `expected scalar type BFloat16 but found Float` (CPU; CUDA's wording not checked) | one op's inputs in two dtypes (a `.to(torch.bfloat16)` model, float32 class weights) | section 12 |
# | `Current CUDA Device does not support bfloat16. Please switch dtype to float16.` | bf16 CUDA autocast where `is_bf16_supported()` is False | section 12 |
#
# ## Remember
#
# - Step each lr scheduler only after its own optimizer stepped (one optimizer: the scale
#   did not drop; several: ask each). Stepped after it, the warning comes only when the
#   *first* step is skipped.
# - `unscale_` once per optimizer step, after the last backward; `scaler.step(opt)` for
#   each optimizer, then `scaler.update()` once, after the last.
# - Keep float32 weights with a GradScaler; let autocast do the casting, and keep a
#   16-bit activation inside autocast or cast it at the edge.
# - Always `torch.amp.GradScaler(device.type)`; always the `torch.amp` spellings.
#
# ## Watch out
#
# - A NaN loss in float16: look for the first inf (section 6's long sums) before blaming
#   the learning rate.
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
# and fix it. The checker runs your loop without CUDA on two tiny networks for four batches
# (an inf in the first and third, in model 1's gradient alone at the fourth), counts each
# optimizer's and scheduler's steps and the order of the calls, then reads your source with
# `check_loop` (a note only, when the run finds no bug). It names the kind of each mistake
# and its section. As given, it checks the loop above:

# %%
my_loop = two_model_loop_as_given  # replace with your own: def my_loop(models, optimizers, schedulers, batches): ...

check_two_model_loop(my_loop)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch that no cell runs on this machine:
#
# - `torch/amp/grad_scaler.py`: `get_scale()` copies the scale with `.item()`; `step` calls
#   a fused optimizer's `step` (one marked `_step_supports_amp_scaling`: Adam, AdamW, SGD,
#   and Adagrad in 2.13, not 2.11) at every step, without `unscale_`, the one path that
#   refuses float16 gradients, and before the check that raises "No inf checks were recorded".
# - Step post-hooks run after each step that ran (`torch/optim/optimizer.py`); fused Adam,
#   AdamW and Adagrad take their step count back on an inf (`_fused_adam`, `_fused_adagrad`
#   in `torch/optim/`). `_fused_sgd` makes the momentum buffers with `torch.empty_like`
#   (`torch/optim/sgd.py`, l.511 in 2.13, l.512 in 2.11) before its kernel, which returns at
#   an inf without writing them (`aten/src/ATen/native/FusedSGD.cpp`; CUDA's
#   `FusedSgdMathFunctor`, `aten/src/ATen/native/cuda/FusedSgdKernel.cu`).
# - CUDA's wording of the bias-free matmul dtype mismatch: `addmm_out_cuda_impl` in
#   `aten/src/ATen/native/cuda/Blas.cpp`. A `Linear` with a bias on 2-D input calls `addmm`
#   (`aten/src/ATen/native/Linear.cpp`), whose dtype check runs for every device before its
#   kernel: `ADDMM_META`, `TORCH_META_FUNC(addmm)`, `aten/src/ATen/native/LinearAlgebra.cpp`.
# - In `aten/src/ATen/native/Convolution.cpp`, `conv1d`/`conv2d`/`conv3d` check the bias's
#   dtype before any backend is chosen; without a bias, a CPU's bfloat16 input goes to
#   oneDNN (`use_mkldnn`) where `mkldnn_bf16_device_check()` allows it (on x86, AVX-512 BW,
#   VL and DQ, or AVX-NE-CONVERT; on aarch64, `cpuinfo_has_arm_bf16()`:
#   `aten/src/ATen/native/mkldnn/Utils.h`), whose check is `check_input_same_type_as_parameters`.
# - CUDA autocast runs `sum` in float32 (`AT_FORALL_FP32_SET_OPT_DTYPE`,
#   `aten/src/ATen/autocast_mode.h`) and refuses `binary_cross_entropy` (its banned list in
#   `aten/src/ATen/autocast_mode.cpp`; the Autocast Op Reference in `docs/source/amp.md`).
# - `F.scaled_dot_product_attention`'s math path multiplies q and k by the square root of
#   the scale each, before the matmul: `_scaled_dot_product_attention_math` in
#   `aten/src/ATen/native/transformers/attention.cpp`.
# - "CUDA is not available or torch_xla is imported. Disabling autocast." and "Current CUDA
#   Device does not support bfloat16" (the same words in torch 2.11 and 2.13):
#   `torch/amp/autocast_mode.py` (`autocast.__init__`); `is_bf16_supported` and its
#   emulation test: `torch/cuda/__init__.py`. CUDA autocast and `GradScaler("cuda")` switch
#   off when `amp_definitely_not_available()` finds neither CUDA nor torch_xla installed
#   (`torch/cuda/amp/common.py`).
# - bf16 arithmetic through float32 below compute capability 8.0: CUDA's `cuda_bf16.hpp`;
#   "Software emulation is slow": the description of pytorch/pytorch#148322; the depthwise
#   `Conv2d` on a T4: huggingface/diffusers#14688.
