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
# # 04 · Clipping with a GradScaler: `unscale_` first
#
# The card's warning on clipping: *"If you clip gradients with a scaler, call
# `scaler.unscale_(opt)` before clipping."* After `scaler.scale(loss).backward()` every
# gradient is multiplied by the loss scale. A clip that runs before `unscale_` compares
# that inflated norm with your `max_norm`, so it clips far too hard. This lesson measures
# how hard, on a training run beside the right order and a float32 reference; then it
# does the same for gradient accumulation, where `unscale_`, `step` and `update` are
# easy to put in the wrong place.

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
# ## One step, two orders
#
# One batch of the 8x8 digits, one small MLP, one backward pass in float16 with a
# GradScaler, then `clip_grad_norm_(params, max_norm=1.0)`. `one_clipped_step` runs it
# in either order and measures the true (unscaled) gradient norm, the norm the clip saw,
# and the norm of the gradient the optimizer would apply.
#
# **Predict**: clipping *before* `unscale_`, which norm will the clip see, and what will
# be left of the gradient?

# %%
from amp_lessons.clipping import lesson_model, one_clipped_step
from amp_lessons.data import digits

data = digits()
x, y = data.batch(0, 64)
MAX_NORM = 1.0
CASES = [("fp32", "unscale_first"), ("fp16", "unscale_first"), ("fp16", "before_unscale")]

# %%
from amp_lessons.claims import at_least, at_most, between, measured

results = {}
print(f"{'':<22}{'scale':>7}{'true norm':>11}{'clip saw':>11}{'applied':>11}")
for precision, order in CASES:
    r = one_clipped_step(lesson_model().to(device), x, y, precision, max_norm=MAX_NORM, order=order)
    results[precision, order] = r
    print(f"{precision + ', ' + order:<22}{r.scale:>7g}{measured(r.true_norm, '.6f'):>11}"
          f"{measured(r.seen, '.4g'):>11}{measured(r.applied_norm, '.3g'):>11}")

# %% [markdown]
# The two fp16 runs start from the same gradient (the "true norm" column; float32's differs
# from it in the fifth digit, by float16's rounding in the forward and backward matmuls). The right order
# compares that true norm with `max_norm`, as float32 does, and applies the same gradient.
# The wrong order saw the true norm times the scale, far above `max_norm`, and cut the
# gradient down to a norm of `max_norm / scale`:

# %%
from amp_lessons.clipping import effective_threshold

r = results["fp16", "before_unscale"]
print(f"clip saw, wrong order / clip saw, right order: {r.seen / results['fp16', 'unscale_first'].seen:g}"
      f"   (the scale: {r.scale:g})")
print(f"applied norm:          {measured(r.applied_norm, '.4g')}")
print(f"max_norm / scale:      {effective_threshold(MAX_NORM, r.scale, 'before_unscale'):.4g}")
print(between("the applied norm is max_norm / scale, to float32 rounding",
              r.applied_norm / effective_threshold(MAX_NORM, r.scale, "before_unscale"), 0.999, 1.001))

# %% [markdown]
# So clipping before `unscale_` does not clip at `max_norm`: its **effective threshold is
# `max_norm / scale`**, and with the default scale of 2^16 nearly every gradient's norm is
# above it.
#
# ## A training run, three ways
#
# Now the same training, from the same seed, with `clip_norm=1.0` and plain SGD:
# float32 (the reference), float16 + GradScaler clipping after `unscale_`, and float16 +
# GradScaler clipping before it (`clip_order="before_unscale"`: the `Trainer` runs it as
# asked and warns with a `UserWarning` unless `teaching=True`, which these runs pass).
# **Predict**: which of the two fp16 runs tracks float32?

# %%
from amp_lessons.clipping import clipping_table
from amp_lessons.training import Trainer

RUNS = {
    "fp32": ("fp32", "unscale_first"),
    "fp16, unscale_ then clip": ("fp16", "unscale_first"),
    "fp16, clip then unscale_": ("fp16", "before_unscale"),
}
runs = {}
for label, (precision, order) in RUNS.items():
    trainer = Trainer(lesson_model(), data, precision=precision, device=device, optimizer="sgd",
                      lr=0.5, clip_norm=MAX_NORM, clip_order=order, teaching=True, seed=0)
    runs[label] = trainer.fit(100)
print(clipping_table(runs, MAX_NORM))

# %% [markdown]
# Columns:
#
# - `scale`: the loss scale;
# - `clip saw`: the median norm the clip compared with `max_norm`;
# - `threshold`: the threshold the clip applied to the true gradients, `max_norm` times the
#   true norm over the norm it saw (median over steps). For the wrong order that is
#   `max_norm / scale`: the norm it saw is the true norm times the scale;
# - `clipped`: the share of steps it clipped;
# - `applied`: the median norm of the gradient the optimizer applied;
# - `loss`: the mean loss of the last 10 steps.
#
# The figure shows them step by step: the norm the clip saw (top), the applied gradient
# with each run's threshold as a black line (middle), and the loss (bottom). Its title
# compares the updates on the steps where fp32 clipped too, where both runs' updates are
# set by their thresholds; on the other steps fp32's update is below `max_norm`, and the
# ratio is smaller.

# %%
from amp_lessons.plots import clipping_runs

clipping_runs(runs, MAX_NORM)

# %% [markdown]
# Two checks against the figure. First, the norm of the gradient the optimizer applied,
# measured at every step of the wrong order after the clip and `unscale_`, against
# `max_norm / scale` at that step:

# %%
wrong, right, ref = runs["fp16, clip then unscale_"], runs["fp16, unscale_ then clip"], runs["fp32"]
ratios = [r.applied_norm / effective_threshold(MAX_NORM, r.scale, "before_unscale") for r in wrong]
print(f"applied norm / (max_norm / scale), over {len(ratios)} steps: "
      f"{measured(min(ratios), '.6f')} .. {measured(max(ratios), '.6f')}")
print(at_most("every step of the wrong order applied max_norm / scale: |ratio - 1| at most 0.001",
              max(abs(q - 1) for q in ratios), 1e-3, ".1e"))

# %% [markdown]
# Second, does the right order track float32, and does the wrong one barely move from
# where it started? "Tracks" is about the whole run, so the measure is the median of the
# step-by-step gaps (the largest gap is printed too):

# %%
import statistics

gaps = [abs(a - b) for a, b in zip(right["loss"], ref["loss"])]
print(f"loss gap, right order vs fp32: median {measured(statistics.median(gaps), '.4f')}, "
      f"largest {measured(max(gaps), '.3f')}")
print(at_most("the right order tracks float32: median loss gap at most 0.03", statistics.median(gaps), 0.03))
start, end = wrong["loss"][0], sum(wrong["loss"][-10:]) / 10
print(f"wrong order: loss {measured(start, '.3f')} at step 0, {measured(end, '.3f')} over its last 10 steps")
print(at_least("the wrong order barely moves: its last 10 steps keep at least 90% of its first loss",
               end / start, 0.9))

# %% [markdown]
# ## Does Adam hide it?
#
# Adam divides each update by a running average of the gradient's own size, so gradients
# all shrunk by one constant factor give almost the same steps. The wrong clip is not quite
# that: it rescales every step's gradient to the same norm, `max_norm / scale`. **Predict**: with AdamW
# instead of SGD, does the wrong order still crawl?

# %%
adam_runs = {}
for label in ("fp16, unscale_ then clip", "fp16, clip then unscale_"):
    precision, order = RUNS[label]
    trainer = Trainer(lesson_model(), data, precision=precision, device=device, optimizer="adamw",
                      lr=3e-3, clip_norm=MAX_NORM, clip_order=order, teaching=True, seed=0)
    adam_runs[label] = trainer.fit(60)
print(clipping_table(adam_runs, MAX_NORM))

# %% [markdown]
# Adam carries on training, although the `clipped` column shows that the clip cut every
# step's gradient, down to a norm of `max_norm / scale` (the `applied` column).
# The trap is hidden, not gone: the two runs do not end at the same loss. Two things differ
# from the right order. Every step's gradient had the same norm, so Adam's running averages
# no longer tell a large gradient from a small one; and Adam's `eps` (1e-8, meant to be
# negligible) now sits next to gradient values this small:

# %%
n_params = sum(p.numel() for p in lesson_model().parameters())
typical = statistics.median(adam_runs["fp16, clip then unscale_"]["applied_norm"]) / n_params**0.5
print(f"typical |gradient| after the wrong clip: {measured(typical, '.1e')}   Adam's eps: {1e-8:.0e}")

# %% [markdown]
# How much of the gap is `eps`? Adam's step does not change when its gradients and `eps`
# are multiplied by one factor (its `m` grows by it, `sqrt(v)` too, and the step is their
# ratio; checked next). The wrong order's gradients are the true ones rescaled to norm
# `max_norm / scale`; so the wrong order once more with `eps / scale` is AdamW with the
# default `eps` on gradients rescaled to norm `max_norm` at every step:

# %%
p, g = torch.randn(50, generator=torch.Generator().manual_seed(0)), torch.randn(50, generator=torch.Generator().manual_seed(1))
steps = {}
for c in (1.0, 2.0**-16):
    w = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([w], lr=3e-3, eps=1e-8 * c)
    for _ in range(3):
        w.grad = g * c
        opt.step()
    steps[c] = w.detach()
print("three AdamW steps, gradients and eps times 2^-16 against times 1: the same weights bit for bit:",
      torch.equal(steps[1.0], steps[2.0**-16]))

# %%
def adamw_eps(eps):
    return lambda params: torch.optim.AdamW(params, lr=3e-3, eps=eps)


wrong_adam = Trainer(lesson_model(), data, precision="fp16", device=device, optimizer=adamw_eps(1e-8 / 2**16),
                     clip_norm=MAX_NORM, clip_order="before_unscale", teaching=True, seed=0).fit(60)
loss = {label: statistics.fmean(h["loss"][-10:]) for label, h in
        (*adam_runs.items(), ("fp16, clip then unscale_, eps / scale", wrong_adam))}
for label, value in loss.items():
    print(f"{label:<40} mean loss of the last 10 steps {measured(value, '.3f')}")
share = (loss["fp16, clip then unscale_"] - loss["fp16, clip then unscale_, eps / scale"]) / (
    loss["fp16, clip then unscale_"] - loss["fp16, unscale_ then clip"])
print(between("eps / scale closes part of the gap, not all of it: between 10% and 90%", share, 0.1, 0.9, ".0%"))

# %% [markdown]
# So, in this seeded run, the rest of the gap is the equal norms. Either way the loss is the wrong place to look for this bug: look at what the clip saw
# (below, a check that does it for you).
#
# ## `clip_grad_value_` has the same trap
#
# `clip_grad_value_(params, clip_value)` clamps each gradient value to
# `[-clip_value, clip_value]`. **Predict**: what does a clamp at 0.01 become when the values
# are still multiplied by the scale?

# %%
CLIP_VALUE = 0.01
for precision, order in CASES:
    r = one_clipped_step(lesson_model().to(device), x, y, precision, clip_value=CLIP_VALUE, order=order)
    print(f"{precision + ', ' + order:<22} largest |g| {measured(r.true_max, '.4f')}, clip saw "
          f"{measured(r.seen, '.4g')} after {r.applied_max:.3g}")
print(f"clip_value / scale: {CLIP_VALUE / r.scale:.3g}")

# %% [markdown]
# The same division: the effective clip value is `clip_value / scale`, and every gradient
# value is clamped into a band 65,536 times narrower than the one you asked for.
#
# ## `unscale_` once per step
#
# `unscale_` divides the gradients by the scale in place. A second call before `update()`
# would divide them again, so GradScaler refuses. **Predict** what happens:

# %%
from torch.nn import functional as F

model = lesson_model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device.type)
with torch.autocast(device.type, dtype=torch.float16):
    loss = F.cross_entropy(model(x.to(device)), y.to(device))
scaler.scale(loss).backward()
scaler.unscale_(opt)

# %%
from amp_lessons.show import expect_error

with expect_error(RuntimeError):
    scaler.unscale_(opt)

# %% [markdown]
# One way to reach it: gradient accumulation with `unscale_` inside the micro-batch loop
# and `step`, `update` after it.
#
# ## Gradient accumulation
#
# Accumulating k micro-batches per optimizer step should give the update one batch k times
# larger would give. The recipe: every micro-batch's loss divided by k and its backward
# scaled; `unscale_`, clip, `step`, `update` and `zero_grad` once, after the last
# micro-batch:

# %%
import inspect

from amp_lessons import clipping

print(inspect.getsource(clipping.accumulate))

# %% [markdown]
# Two common ways to get it wrong: `unscale_`, clip, `step` and `update` inside the
# micro-batch loop (it runs: `update()` resets `unscale_`'s check each time), and
# forgetting to divide each loss by k. `accumulation_rows` runs each version for one
# optimizer step of k = 4 micro-batches of 16 digits, from the same weights, beside one
# large batch of the same 64 digits, and compares the first update (the change in the
# weights), with SGD and with AdamW, whose step sees the gradient's overall size only
# through `eps`.
# **Predict** which version matches the large batch, and by how much each of the others is off.

# %%
from amp_lessons.clipping import accumulation_rows, accumulation_table

sgd = {r.name: r for r in accumulation_rows(lesson_model, data, k=4, batch_size=16, optimizer="sgd", lr=0.5)}
adamw = {r.name: r for r in accumulation_rows(lesson_model, data, k=4, batch_size=16, optimizer="adamw", lr=1e-3)}
sgd_lines = accumulation_table(list(sgd.values())).splitlines()
adamw_lines = accumulation_table(list(adamw.values())).splitlines()
print("\n".join([*sgd_lines[:2], "SGD, lr 0.5:", *sgd_lines[2:], "AdamW, lr 1e-3:", *adamw_lines[2:]]))

# %%
print(at_most("SGD, done right: the update matches the large batch's within 1%", sgd["right"].off, 0.01))
print(at_least("SGD, stepping every micro-batch is off by at least 5%", sgd["step every micro-batch"].off, 0.05))
print(between("SGD, without / k the update is k = 4 times the large batch's", sgd["loss not divided by k"].size, 3.9, 4.1))
print(at_most("AdamW, done right: the update matches the large batch's within 3%", adamw["right"].off, 0.03))
print(at_most("AdamW, without / k the update is still within 3% of the large batch's",
              adamw["loss not divided by k"].off, 0.03))
print(at_least("AdamW, stepping every micro-batch is off by at least 50%", adamw["step every micro-batch"].off, 0.5))

# %% [markdown]
# Done right, accumulation gives the large batch's update up to rounding (within 1% with
# SGD, within 3% with AdamW, as checked), with one optimizer step and one scaler update
# (AdamW's `right` gap is not taken apart here).
# That holds here because the micro-batches are the same size, the loss is a mean over the
# samples, and the network has no BatchNorm (whose statistics would see only a
# micro-batch; the `torch.nn.BatchNorm1d` docs: statistics "over the mini-batches").
# Stepping every micro-batch takes k steps on small batches instead (what is left of the
# previous micro-batch's gradient, already unscaled, is divided by the scale again at the next
# `unscale_`, so it all but vanishes), and k scaler updates, so `growth_interval` counts k
# times too fast; with AdamW each is a full Adam step. Not dividing by k makes the summed
# gradient k times too large. With SGD that is a learning rate k times the one you set,
# unless the clip caps it; with AdamW it nearly vanishes, since only the clip and `eps` see
# the gradient's size. A loop that still trains is not proof that it accumulates correctly:
# compare one update with a large batch, as above.
#
# ## What `clip_grad_norm_` returns on a skipped step
#
# `clip_grad_norm_` returns the total norm it measured, and loops often log it. On a step
# whose gradients hold an inf or a NaN, the step GradScaler is about to skip, that norm is
# not finite either. **Predict** what a log of the mean gradient norm shows after one such
# step. The `Trainer` records the clip's norm; here its step 3's loss is made inf:

# %%
import math

from amp_lessons.training import History

trainer = Trainer(lesson_model(), data, precision="fp16", device=device, optimizer="sgd", lr=0.5,
                  clip_norm=MAX_NORM, inject_nonfinite=(3,), teaching=True, seed=0)
history = trainer.fit(6)
print(History(history[2:5]).table(columns=("step", "scale", "skipped", "grad_norm")))
norms = history["grad_norm"]
print(f"mean of every step's norm: {sum(norms) / len(norms)}")
kept = [r.grad_norm for r in history if not r.skipped]
print(f"mean over the {len(kept)} steps not skipped: {measured(sum(kept) / len(kept), '.3g')}; "
      f"finite: {math.isfinite(sum(kept) / len(kept))}")

# %% [markdown]
# One skipped step turns the logged mean into NaN (or `inf`). What to log:
# the norm of the steps that were not skipped, plus the count of skipped ones, or the
# scale, which halves on each. And do not ask the clip to raise on a non-finite norm
# (`error_if_nonfinite=True`): with a GradScaler an inf is expected now and then, and
# skipping the step is the cure. **Predict** what it does on step 3's gradients:

# %%
model = lesson_model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
scaler = torch.amp.GradScaler(device.type)
with torch.autocast(device.type, dtype=torch.float16):
    loss = F.cross_entropy(model(x.to(device)), y.to(device)) * float("inf")
scaler.scale(loss).backward()
scaler.unscale_(opt)
with expect_error(RuntimeError):
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=True)

# %% [markdown]
# ## A check to drop into your own loop
#
# While it is active, `check_clipping(scaler)` watches the clips called through
# `torch.nn.utils` (`clip_grad_norm_`, `clip_grad_value_`, `clip_grads_with_norm_`; a clip
# imported by name before it, or a library's own clip method, is not seen) and warns
# (`ScaledClipWarning`) when one runs on gradients the scaler has not unscaled yet. In your
# own loop:
#
# ```python
# from amp_lessons.clipping import check_clipping
#
# with check_clipping(scaler):
#     for x, y in batches:
#         ...  # your step, unchanged
# ```
#
# Here it watches three steps of the `Trainer` in each order; the warnings are collected
# and printed so you can read them:

# %%
import warnings

from amp_lessons.clipping import ScaledClipWarning, check_clipping

for order in ("unscale_first", "before_unscale"):
    trainer = Trainer(lesson_model(), data, precision="fp16", device=device, optimizer="sgd",
                      lr=0.5, clip_norm=MAX_NORM, clip_order=order, teaching=True)
    with warnings.catch_warnings(record=True) as caught, check_clipping(trainer.scaler):
        warnings.simplefilter("always")
        trainer.fit(3)
    found = [w for w in caught if issubclass(w.category, ScaledClipWarning)]
    print(f"{order:<15} {len(found)} warnings in 3 steps")
print(found[0].message)

# %% [markdown]
# ## Remember
#
# - After `scaler.scale(loss).backward()` the gradients are multiplied by the scale: call
#   `scaler.unscale_(opt)`, then clip, then `scaler.step(opt)` and `scaler.update()`.
# - Clipping before `unscale_` clips at `max_norm / scale` (and `clip_grad_value_` at
#   `clip_value / scale`): with SGD the run crawls.
# - Accumulating k micro-batches: divide each loss by k, scale every backward, and
#   `unscale_`, clip, `step`, `update`, `zero_grad` once, after the last micro-batch. Done
#   so, with equal-sized micro-batches, a loss averaged over samples and no BatchNorm, the
#   update is one large batch's up to rounding (within 1% with SGD, 3% with AdamW, above).
#
# ## Watch out
#
# - The loss does not always show the trap: with Adam the wrong order trains on. Look at
#   the norm the clip saw, or run your loop once inside `check_clipping(scaler)`.
# - "`unscale_() has already been called on this optimizer since the last update()`" means
#   `unscale_` ran twice in one optimizer step, e.g. inside the micro-batch loop.
# - Build the GradScaler for your device, `torch.amp.GradScaler(device.type)` (lesson 03).

# %% [markdown]
# ## Exercise: fix the broken loop
#
# The loop below trains in float16 with gradient accumulation and clipping. It has three
# bugs (one of them a bug off CUDA only), and one line that looks wrong but is not. Read it:

# %%
from amp_lessons.exercises import broken_clipping_loop, check_clipping_loop

print(inspect.getsource(broken_clipping_loop))

# %% [markdown]
# Copy it into the cell below as `def my_loop(...)`, fix the three bugs, and answer: is
# calling `backward()` inside the `autocast` block one of this loop's bugs, one that changes
# what it computes? (Lesson 02 traced backward inside and outside.) The checker runs your loop on
# the CPU, records every GradScaler and clip call, compares the weights with a reference
# loop, and says bug by bug what is fixed. As given, it runs the broken loop, and only says
# how many bugs remain and where:

# %%
my_loop = broken_clipping_loop  # replace with your fixed copy: def my_loop(model, data, ...):
backward_in_autocast_is_a_bug = None  # True or False?

check_clipping_loop(my_loop, backward_in_autocast_is_a_bug)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch without a cell computing it:
#
# - `GradScaler`'s default device `"cuda"`, its warning and self-disabling without CUDA,
#   the "already been called" check that `update()` resets, and one `update()` per
#   optimizer step: `torch/amp/grad_scaler.py` (`__init__`, `unscale_`, `update`).
# - `clip_grad_norm_` returning the total norm, and `error_if_nonfinite`:
#   `torch/nn/utils/clip_grad.py`.
# - Adam's update divided by the root of its running average of squared gradients plus
#   `eps` (default 1e-8): `torch/optim/adamw.py`, and the `torch.optim.AdamW` docs page.
# - Backward outside autocast: PyTorch's AMP docs, `docs/source/amp.md` ("Autocasting").
# - BatchNorm's statistics over the (micro-)batch it sees: the `torch.nn.BatchNorm1d` docs.
# - `get_total_norm` and `clip_grads_with_norm_`, the two halves of `clip_grad_norm_`:
#   pytorch/pytorch PR #139662 (torch 2.6), `torch/nn/utils/clip_grad.py`.
