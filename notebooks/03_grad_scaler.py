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
# # 03 · GradScaler: scale the loss, unscale, skip the bad steps
#
# The card: *"float16 has more mantissa but a narrow range; small gradients underflow to
# zero. Use `torch.amp.GradScaler`, which multiplies the loss by a large factor before
# `backward()`, unscales before the step, and skips steps that produced inf or NaN."*
# And: *"bfloat16 ... rarely underflows ... and needs no extra machinery."*
#
# This lesson trains the same small network in fp32, in fp16 without a scaler, in fp16
# with one, and in bf16, and shows each of those sentences happen: the gradients fp16
# flushes to zero, the run that falls behind, the scale GradScaler picks and changes, the
# steps it skips, and two things that go wrong around it in real loops.

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
# ## A network with small gradients
#
# A 4-layer MLP learns the 8x8 handwritten digits with AdamW. Other networks have far
# smaller gradients: in NVIDIA's *Mixed Precision Training* paper (section 3.2 and its
# Figure 3), many activation gradients of a Multibox SSD detector lay below 2^-24,
# float16's smallest subnormal, and became zeros. To see what fp16 does to gradients that
# small, this lesson multiplies the loss by `LOSS_WEIGHT`, which shrinks every gradient by
# the same factor (what that costs in fp32 is measured after the four runs below).

# %%
import math

from amp_lessons.scaling import LESSON_SETTINGS, LOSS_WEIGHT, lesson_model

print(lesson_model())
print(LESSON_SETTINGS, f"| loss = cross-entropy x 2^{math.log2(LOSS_WEIGHT):.0f}")

# %% [markdown]
# ## Step 0, the same batch, three precisions
#
# `first_step_gradients` runs step 0 (same weights, same batch) and keeps every parameter's
# gradient, in float32 after the backward pass, divided by the loss scale if there is one.
# Comparing two precisions value by value, `flush_report` counts the gradients float32
# computed as nonzero that the other precision made exactly zero.
#
# **Predict:** fp16 without a scaler, what share of the gradients does it lose?

# %%
from amp_lessons.hardware import supported_precisions
from amp_lessons.scaling import first_step_gradients, flush_report

can_run = supported_precisions(device)
fp32 = first_step_gradients("fp32", device=device)
fp16 = first_step_gradients("fp16", scaler=False, device=device)
print(flush_report(fp32, fp16, "fp16"))

# %% [markdown]
# Some gradients are zero in fp32 too (the first share above). A weight's gradient is a sum
# over the batch of its input times the gradient flowing back, so it is exactly zero when no
# example has both nonzero: among others, the weights that read a pixel blank in the whole
# batch (lesson 01 counted them), and those of a unit whose ReLU was off for every example.
# Nearly all that fp16 adds to that is lost to its range (a scaler will show it). Why? Compare the
# sizes. (Lesson 01 showed the edge: a value at or below 2^-25, half of fp16's
# smallest subnormal, rounds to 0; one between 2^-25 and 2^-24 rounds up to 2^-24.)

# %%
from amp_lessons.claims import at_least, at_most, check, measured

nonzero = fp32[fp32 != 0].abs()
print(f"median |gradient| in fp32:     {measured(nonzero.median().item(), '.2e')}")
print(f"fp16 smallest normal:          {torch.finfo(torch.float16).tiny:.2e}")
print(f"fp16 smallest subnormal 2^-24: {2.0**-24:.2e}")
print(f"fp32's nonzero gradients at or below 2^-25 (fp16 rounds them to 0): "
      f"{measured((nonzero <= 2.0**-25).float().mean().item(), '.1%')}")

# %% [markdown]
# That last share need not equal the share fp16 flushed: it compares fp32's values with
# fp16's range, while the flush report counts what fp16's own backward produced, in which
# every gradient passed from layer to layer was rounded to fp16 too.
#
# bfloat16 has float32's exponent range (its smallest normal is float32's), and a loss
# scale moves fp16's gradients up into its range. **Predict** both reports:

# %%
print(f"bf16 smallest normal: {torch.finfo(torch.bfloat16).tiny:.2e} (fp32: {torch.finfo(torch.float32).tiny:.2e}); "
      f"smallest subnormal: {torch.finfo(torch.bfloat16).tiny * 2.0**-7:.1e}")
if can_run["bf16"] is None:
    bf16 = first_step_gradients("bf16", device=device)
    print(flush_report(fp32, bf16, "bf16"))
    lost = fp32[(bf16 == 0) & (fp32 != 0)].abs()
    print(check("every value bf16 made 0 lies above its smallest normal: "
                "rounding, not range", bool((lost > torch.finfo(torch.bfloat16).tiny).all()),
                f"values it made 0: {measured(lost.numel(), 'd')}" + (f", the smallest ≈{lost.min():.1e}" if lost.numel() else "")))
else:
    print("bf16 on this device:", can_run["bf16"])
print(flush_report(fp32, first_step_gradients("fp16", scaler=True, device=device), "fp16+scaler"))

# %% [markdown]
# ## Does it matter for training?
#
# The same 100 steps in four ways. A weight whose gradient stays exactly zero gets
# nothing from its gradient (AdamW's weight decay, 1e-2 by default, still shrinks it):
# Adam can rescale a tiny gradient, but not a missing one. **Predict** which run falls
# behind.

# %%
from amp_lessons.scaling import lesson_trainer

runs, final, accuracy = {}, {}, {}
for label, precision, scaler in [("fp32", "fp32", None), ("fp16, no scaler", "fp16", False),
                                 ("fp16 + GradScaler", "fp16", True), ("bf16, no scaler", "bf16", None)]:
    if can_run[precision] is None:
        trainer = lesson_trainer(precision, scaler, device)
        runs[label] = trainer.fit(100)
        final[label] = sum(runs[label]["loss"][-10:]) / 10 / LOSS_WEIGHT  # mean of the last 10 steps
        accuracy[label] = trainer.evaluate()
        print(f"{label:<18} zero gradients at step 0: {measured(runs[label][0].zero_frac, '6.1%')}, "
              f"at step 99: {measured(runs[label][-1].zero_frac, '6.1%')}   final loss {measured(final[label], '.3f')}   test accuracy {measured(accuracy[label], '.3f')}")

# %%
from amp_lessons.plots import loss_curves

loss_curves(runs, LOSS_WEIGHT)

# %% [markdown]
# What the figures say, checked (the final loss is the mean of the last 10 steps):

# %%
ref = final["fp32"]
print(at_least("fp16 without a scaler ends with at least 2x fp32's loss", final["fp16, no scaler"] / ref, 2))
print(at_least("fp16 without a scaler ends at least 0.2 below fp32's test accuracy",
               accuracy["fp32"] - accuracy["fp16, no scaler"], 0.2))
ratios = [a / b for a, b in zip(runs["fp16, no scaler"]["zero_frac"], runs["fp32"]["zero_frac"])]
print(at_least("at every one of the 100 steps, fp16 without a scaler has at least 1.2x fp32's share of zero "
               "gradients", min(ratios), 1.2))
for label in ("fp16 + GradScaler", "bf16, no scaler"):
    if label in final:
        print(at_most(f"{label} ends within 0.05 of fp32's loss", abs(final[label] - ref), 0.05))

# %% [markdown]
# And the weight itself. Adam divides each step by `sqrt(v) + eps`, `v` a running average of
# the squared gradients and `eps` 1e-8, so a constant factor on the gradients cancels, except
# next to `eps`; the weighted gradients (their median is printed above) are as small as
# `eps`. The fp32 run again with the plain cross-entropy (no `LOSS_WEIGHT`), and the
# weighted one with `eps` times `LOSS_WEIGHT`:

# %%
from torch.nn import functional as F

plain = lesson_trainer("fp32", device=device, loss_fn=F.cross_entropy)
plain_loss = sum(plain.fit(100)["loss"][-10:]) / 10
small_eps = lesson_trainer("fp32", device=device, optimizer=lambda params: torch.optim.AdamW(
    params, lr=LESSON_SETTINGS["lr"], eps=1e-8 * LOSS_WEIGHT))
small_eps_loss = sum(small_eps.fit(100)["loss"][-10:]) / 10 / LOSS_WEIGHT
print(f"fp32, weighted, eps 1e-8:   final loss {measured(final['fp32'], '.3f')}")
print(f"fp32, weighted, eps x 2^-15: final loss {measured(small_eps_loss, '.3f')}")
print(f"fp32, plain, eps 1e-8:      final loss {measured(plain_loss, '.3f')}")
print(at_most("with eps x LOSS_WEIGHT the weighted run ends within 0.005 of the plain run's loss",
              abs(small_eps_loss - plain_loss), 0.005))
print(at_least("with the default eps the weighted run ends at least 0.01 above the plain run's loss",
               final["fp32"] - plain_loss, 0.01))

# %% [markdown]
# So the weight costs the fp32 run some loss, all of it through `eps`. fp16 alone falls
# behind, and through the whole run more of its gradients
# are exactly zero than fp32's (checked above). With a GradScaler, fp16 follows fp32; so
# does bf16 (where this device runs it), with no scaler at all.
#
# ## GradScaler, line by line
#
# Here is one step of the recipe written out, on the same batch. First, `scaler.scale`
# multiplies the loss by the scale (65536 to start with). **Predict** the scaled loss.

# %%
from amp_lessons.scaling import lesson_data, optimizer_steps, small_loss

model = lesson_model().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=LESSON_SETTINGS["lr"])
scaler = torch.amp.GradScaler(device.type)  # always pass the device
x, y = (t.to(device) for t in lesson_data().batch(0, LESSON_SETTINGS["batch_size"]))
with torch.autocast(device.type, dtype=torch.float16):
    loss = small_loss(model(x), y)
scaled = scaler.scale(loss)
print(f"loss {measured(loss.item(), '.4e')} x scale {scaler.get_scale():g} = {measured(scaled.item(), '.4f')}")
print("scale(loss) is the loss times the scale, exactly:", scaled.item() == loss.item() * scaler.get_scale())

# %% [markdown]
# `backward()` runs on the scaled loss (outside autocast), so every gradient comes out
# multiplied by the scale, high enough in fp16's range to survive. `unscale_` divides
# them by the scale again, in float32, in place:

# %%
scaled.backward()
first = model[0].weight.grad
scaled_max = first.abs().max().item()
print(f"first layer's gradient, scaled:   largest |g| {measured(scaled_max, '.3e')}")
scaler.unscale_(opt)
print(f"first layer's gradient, unscaled: largest |g| {measured(first.abs().max().item(), '.3e')}")
print("unscale_ divided it by the scale exactly:", first.abs().max().item() == scaled_max / scaler.get_scale())
unscaled = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])
print(flush_report(fp32, unscaled, "fp16+scaler"))

# %% [markdown]
# Then `scaler.step(opt)` checks the gradients for inf/NaN (`unscale_` recorded it) and
# calls `opt.step()` only if there is none; `scaler.update()` sets the next scale.

# %%
scaler.step(opt)
scaler.update()
print(f"scale now {scaler.get_scale():g}; AdamW has taken {optimizer_steps(opt)} step")

# %% [markdown]
# ## The scale over time
#
# `update()` halves the scale after a step with inf/NaN (`backoff_factor=0.5`) and
# doubles it after `growth_interval` clean steps in a row (`growth_factor=2`; the
# default interval is 2000 steps). Below, a run with `growth_interval=10`, and the loss
# made inf on purpose at step 25 (`inject_nonfinite`, a teaching switch of the course's
# `Trainer`). The text names the step whose `update()` changed the scale; the plot draws the
# scale each step ran with, so a change after step 9 shows at step 10. **Predict** the scale
# after the last step (step 39).

# %%
from amp_lessons.scaling import describe_scale_changes

trainer = lesson_trainer("fp16", device=device, growth_interval=10, inject_nonfinite=(25,))
history = trainer.fit(40)
print(describe_scale_changes(history, trainer.current_scale()))

# %%
from amp_lessons.plots import scale_plot

scale_plot(history, trainer.current_scale(), growth_interval=10, injected=(25,))

# %% [markdown]
# ## How to tell a step was skipped
#
# GradScaler does not say so: `step` calls `optimizer.step()` only when no inf was found,
# with no warning or log otherwise (`_maybe_opt_step` in `torch/amp/grad_scaler.py`; the
# cell below records warnings around a skipped step). Three signs, all readable in your own
# loop (the cell below shows them for a plain AdamW):
#
# - the scale after `update()` is lower than before it (with one optimizer per scaler; with
#   several, a lower scale does not say which one skipped);
# - the optimizer's own step count (Adam's `state[p]["step"]`, read with `float()` before
#   the step: the tensor is updated in place) did not move;
# - the weights did not change.
#
# Most `fused=True` optimizers are the exception to "only when no inf was found" (lesson
# 06's table says which, by release): GradScaler calls their `step()` every time and the
# optimizer skips the update itself.

# %%
from amp_lessons.training import History

print(History(history[23:28]).table(columns=("step", "loss", "scale", "skipped")))
print(f"{history.skipped} of {len(history)} steps skipped; AdamW took {optimizer_steps(trainer.optimizer)} steps")

# %%
from amp_lessons.errors import caught_warnings

trainer = lesson_trainer("fp16", device=device, inject_nonfinite=(3,))
trainer.fit(3)
before = [p.detach().clone() for p in trainer.model.parameters()]
caught, record = caught_warnings(trainer.step)  # every warning the step raised, whoever raised it
print(f"step {record.step}: skipped {record.skipped}, weights unchanged "
      f"{all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))}, "
      f"warnings raised during the step {len(caught)}")

# %% [markdown]
# ## Why the first steps can be skipped
#
# A scale can also be too large: a scaled gradient that fp16 holds overflows to inf from
# 65520 on, halfway between fp16's largest, 65504, and 65536 (lesson 01; here each
# parameter's gradient is computed in fp16 before its cast to float32, traced below). A loss
# summed instead of averaged (`reduction="sum"`, or a sum over the tokens of a sequence) has
# gradients as many times larger as there are terms in the sum. Here is the same
# network with the cross-entropy summed over the batch of 64. **Predict** what happens to
# steps 0 and 1.

# %%
from amp_lessons.scaling import summed_loss

trainer = lesson_trainer("fp16", device=device, loss_fn=summed_loss)
history = trainer.fit(4)
print(history.table(columns=("step", "loss", "scale", "skipped")))

# %%
from amp_lessons.trace import short, trace_model

traced_model = lesson_model().to(device)
traced = trace_model(traced_model, x, y, summed_loss, dtype=torch.float16, backward="outside")
backward = [r for r in traced.rows() if r.module == "(backward)"]
print("backward: the weights' matmuls (mm) and the biases' sums ran in",
      sorted({short(r.dtype) for r in backward if r.op in ("mm", "sum")}), "| gradients then cast to fp32:",
      sum(r.op == "_to_copy" and r.dtype == torch.float32 for r in backward),
      "of", len(list(traced_model.parameters())), "parameters")
g = first_step_gradients("fp32", device=device, loss_fn=summed_loss).abs().max().item()
print(f"largest |gradient| at step 0: {measured(g, '.3g')}")
print(at_least("the largest gradient times 65536 is above fp16's largest value, 65504",
               g * 65536, torch.finfo(torch.float16).max, ",.0f"))

# %% [markdown]
# So GradScaler starts high (`init_scale=65536`) and halves on each overflow until the
# gradients fit: a skipped first step or two is normal (GradScaler's docstring says so,
# Sources) and costs nothing but the step, in a loop that steps its lr scheduler only on
# applied steps (below; fused SGD with momentum is the exception, lesson 06). (Later, as
# the gradients change, a step can overflow again; the scale halves once more. The
# explorer below shows it.)
# A scale that keeps halving, step after step, is not normal: most likely the loss or its
# gradients are inf/NaN at any scale. Here every step's loss is made inf: **predict** how the
# `Trainer` ends this run.

# %%
from amp_lessons.show import expect_error
from amp_lessons.training import ScaleCollapseError

doomed = lesson_trainer("fp16", device=device, inject_nonfinite=range(100), min_scale=2.0**8)
with expect_error(ScaleCollapseError):
    doomed.fit(100)
print(f"{len(doomed.history)} steps run, {doomed.history.skipped} skipped; AdamW took {optimizer_steps(doomed.optimizer)}")

# %% [markdown]
# Halving from 65536 to below the floor (`min_scale`, 256 here) takes 9 skipped steps; the
# course's `Trainer` stops there with `ScaleCollapseError` instead of skipping forever, and
# says where to look. A plain `GradScaler` has no floor: it halves silently for as long as
# the steps overflow (`update()` multiplies by `backoff_factor` with no lower bound:
# `_amp_update_scale_` in `aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp`, and
# `aten/src/ATen/native/cuda/AmpKernels.cu` on CUDA). In your own loop, the same check is
# one line after `scaler.update()`:
# `if scaler.get_scale() < floor: raise RuntimeError(...)`. `get_scale()` copies the scale to
# the CPU, a CPU-GPU sync on CUDA (its docstring says so): read it once per step and keep
# the value.
#
# ## The lr scheduler and skipped steps
#
# A common loop calls `scheduler.step()` every iteration, skipped or not (as in
# pytorch/pytorch#55585, which lesson 06 cites). Three runs with
# `StepLR`: the summed-loss run above (its first steps skipped) and the small-loss run
# with its step 3 made inf, both stepping the scheduler every iteration
# (`step_scheduler_on_skip=True`); then the summed-loss run stepping it only when the
# optimizer stepped, the `Trainer`'s default. **Predict** each one's warnings, and how far
# ahead of the optimizer each schedule gets.

# %%
import textwrap

from amp_lessons.scaling import SCHEDULER_WARNING, scheduler_warnings


def print_schedule(name, n_warnings, trainer):
    print(f"{name + ':':<46} {n_warnings} warning{'s' * (n_warnings != 1)}; scheduler {trainer.scheduler.last_epoch} steps, "
          f"AdamW {optimizer_steps(trainer.optimizer)}, in {len(trainer.history)} iterations")


first, trainer = scheduler_warnings(step_scheduler_on_skip=True, steps=4, device=device)
first = [m for m in first if SCHEDULER_WARNING in m]  # the scheduler's warning, not any other
print_schedule("steps 0-1 skipped, scheduler every iteration", len(first), trainer)
later = lesson_trainer("fp16", device=device, inject_nonfinite=(3,), step_scheduler_on_skip=True,
                       scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10, 0.5))
caught, _ = caught_warnings(later.fit, 6)
print_schedule("step 3 skipped, scheduler every iteration",
               sum(SCHEDULER_WARNING in str(w.message) for w in caught), later)
messages, trainer = scheduler_warnings(step_scheduler_on_skip=False, steps=4, device=device)
print_schedule("steps 0-1 skipped, scheduler only if stepped",
               sum(SCHEDULER_WARNING in m for m in messages), trainer)
print(textwrap.fill("the warning: " + first[0], 90))

# %% [markdown]
# One warning, in the first run only: PyTorch checks the order once, at the scheduler's
# first step (`LRScheduler.step`); in that run no optimizer step had run yet. A step skipped
# later moves the schedule on with no warning at all, and each skipped step
# moves the warm-up or the decay on for an update that never happened. Step the scheduler
# only after a step that was not skipped (the signs above tell which), as the `Trainer` does.
#
# ## Saving and restoring the scaler
#
# The scale is state, like the optimizer's moments. Save `scaler.state_dict()` with the
# checkpoint and load it on resume. The last run above (the summed loss) halved its scale
# to where its gradients fit:

# %%
state = trainer.scaler.state_dict()
print(state)
fresh = torch.amp.GradScaler(device.type)
print(f"a new GradScaler starts at {fresh.get_scale():g}", end="; ")
fresh.load_state_dict(state)
print(f"after load_state_dict: {fresh.get_scale():g}")

# %% [markdown]
# Without it, a resumed run starts again at 65536, where a fresh scaler starts (the cell
# above), instead of at the scale its gradients had reached. The
# `Trainer` saves the scaler with the model, optimizer, scheduler, RNG and history;
# **predict**: does a run resumed halfway end exactly where an uninterrupted one does?

# %%
import tempfile
from pathlib import Path


def summed_run():
    return lesson_trainer("fp16", device=device, loss_fn=summed_loss, growth_interval=5)


whole = summed_run()
whole.fit(20)
with tempfile.TemporaryDirectory() as tmp:
    half = summed_run()
    half.fit(10)
    resumed = summed_run().load(half.save(Path(tmp) / "run.pt"))
resumed.fit(10)
print(f"same scale: {whole.current_scale() == resumed.current_scale()}; same skipped steps: "
      f"{whole.history['skipped'] == resumed.history['skipped']}; same weights: "
      f"{all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))}")
print(f"({measured(whole.history.skipped, 'd')} of 20 steps skipped, final scale {measured(whole.current_scale(), 'g')})")

# %% [markdown]
# ## Try it: the scale explorer
#
# The widget reruns a short fp16 training of the summed-loss network (40 steps) and
# redraws its scale: choose the starting scale, the growth interval, and a step whose
# loss is made inf (-1: none). Start the scale low, or high; make the interval short, and
# watch the scale grow into an overflow and back. While it retrains, a line under the
# sliders says so; a setting you have tried before redraws at once.

# %%
from amp_lessons.widgets import scale_explorer

scale_explorer(device=device)

# %% [markdown]
# The picture under the sliders is drawn by `scale_figure`; here it is with a starting
# scale of 2^20 and growth every 5 clean steps:

# %%
from amp_lessons.widgets import scale_figure

scale_figure(init_exponent=20, growth_interval=5, inject_at=-1, device=device)

# %% [markdown]
# Its title counts the skipped steps: the first ones bring 2^20 down to where the gradients
# fit; after that the scale grows every 5 clean steps, and each overflowing step is skipped
# and halves it: in this figure, some right after a growth, some at a scale that had held
# for steps before (the gradients change as the network trains).

# %% [markdown]
# ## Remember
#
# - fp16 flushes gradients at or below 2^-25 (half its smallest subnormal, 2^-24) to zero;
#   a GradScaler multiplies the loss (so every gradient) by a scale, then `unscale_`
#   divides them again in float32 before the step.
# - `scaler.step(opt)` skips a step whose gradients hold inf/NaN, `scaler.update()`
#   halves the scale after it and doubles it after `growth_interval` clean steps.
# - A skipped step leaves the weights and the optimizer's step count as they were: with one
#   optimizer per scaler, the scale dropping is how you see it (with several, lesson 06).
# - bf16 has float32's range: this network's gradients lose none to it (what it makes 0,
#   counted above where this device runs bf16, lies above its smallest normal), and need no
#   scaler.
#
# ## Watch out
#
# - The first steps of a run can be skipped while the scale falls from 65536: normal (but
#   see lesson 06 for fused SGD with momentum).
#   A scale that keeps falling most likely means inf/NaN at any scale: look at the data and
#   the lr.
# - Step the lr scheduler only when the step was not skipped: PyTorch warns at most once per
#   scheduler, at its first step, and only if no optimizer step has run since the scheduler
#   was built (above).
# - Save and load `scaler.state_dict()` with your checkpoints.
# - `torch.amp.GradScaler()` without a device means `"cuda"`: on a machine without CUDA it
#   warns and disables itself (unless `torch_xla` is installed: then it stays enabled, with no
#   warning). Pass the device: `torch.amp.GradScaler(device.type)`.

# %% [markdown]
# ## Exercise: a step that knows it was skipped
#
# The step below trains in fp16 with a GradScaler and an lr scheduler. Two lines are
# wrong: it always returns `False`, and it steps the scheduler even after a skipped step.

# %%
import inspect

from amp_lessons.exercises import amp_step_as_given, check_amp_step

print(inspect.getsource(amp_step_as_given))

# %% [markdown]
# Copy it into the cell below as `def my_step(model, opt, scaler, scheduler, x, y):`, and
# make it return `True` exactly when GradScaler skipped the step and step the scheduler
# only otherwise. The checker runs your step on seven batches: two hold an inf, and before a
# third the scale is set far too high (2^40), so that its loss is finite while its scaled
# gradients overflow. Its GradScaler grows the scale after every 2 clean steps. It checks
# what your step returns, the weights, AdamW's and the scheduler's step counts and the
# warning (a step your own code skips, on a non-finite loss, counts as skipped too). As
# given, it checks the step above:

# %%
my_step = amp_step_as_given  # replace with your own: def my_step(model, opt, scaler, scheduler, x, y): ...

check_amp_step(my_step, device)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch without a cell computing it:
#
# - `GradScaler`'s defaults (`init_scale=2**16`, `growth_factor=2`, `backoff_factor=0.5`,
#   `growth_interval=2000`), `step` skipping `optimizer.step()` when `unscale_` found
#   inf/NaN, with no warning when it skips (`_maybe_opt_step`), and `"cuda"` as the
#   default device, with its warning without CUDA: `torch/amp/grad_scaler.py`; "without
#   CUDA" means neither CUDA nor `torch_xla` (`amp_definitely_not_available` in
#   `torch/cuda/amp/common.py`). `get_scale()`'s CPU-GPU sync: its docstring, same file.
#   Skipped first steps as normal: `GradScaler`'s class docstring, same file ("The scale
#   factor often causes infs/NaNs to appear in gradients for the first few iterations as its
#   value calibrates").
# - The scheduler's order warning, checked only at its first step:
#   `LRScheduler.step` in `torch/optim/lr_scheduler.py`.
# - Adam's `eps` (default 1e-8) and AdamW's decoupled `weight_decay` (default 1e-2): `torch/optim/adamw.py`.
# - Activation gradients below float16's range: Micikevicius et al., *Mixed Precision
#   Training*, ICLR 2018 (arXiv:1710.03740), section 3.2 and Figure 3.
