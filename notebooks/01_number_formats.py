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
# # 01 · Number formats: where your gradients fit, and where they vanish
#
# A 16-bit float has to split its bits between **range** (exponent bits: how small and
# how large a number can get) and **precision** (mantissa bits: how finely numbers are
# spaced). float16 and bfloat16 split them in opposite ways. In this lesson you will see
# what that does to real gradients from a training run on this machine:
#
# - the formats side by side: bits, largest value, smallest normal and subnormal, spacing;
# - what each format keeps of `1 + 1e-4` and of `1e-8`;
# - the histogram of your gradients with float16's and bfloat16's ranges drawn over it, and a
#   loss-scale slider that moves it (what `GradScaler` does in lesson 03).

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
print(f"training on {device.type}:", amp_lessons.hardware_report(measure=True).recommended, "is recommended here")

# %% [markdown]
# That is the precision lesson 00's rule recommends for training here (on a CPU it decides
# by a bf16 matmul rate measured each time). This lesson trains in
# float32 whatever it says: it records gradients at full range, to see where each 16-bit
# format would put them.

# %% [markdown]
# ## The formats side by side
#
# Every *normal* float is `sign x 1.mantissa x 2^(exponent - bias)`. More exponent bits
# reach further from 1 in both directions; more mantissa bits put the numbers closer
# together. Below the smallest normal number a format still has *subnormals*, stored with
# an exponent field of 0 and read as `0.mantissa x 2^(1 - bias)`: they reach further down
# but with fewer significant bits.
#
# **Predict:** float16 and bfloat16 both have 16 bits. Which one has more mantissa bits?
# Which one reaches smaller numbers?

# %%
from amp_lessons.formats import FORMATS, format_info, formats_table

print(formats_table())

# %% [markdown]
# The figures come from `torch.finfo` for every format torch has a dtype for (the smallest
# subnormal is its `smallest_normal x eps`). TF32 is not a dtype: an NVIDIA tensor core
# (Ampere and newer) keeps 10 of each float32 input's 23 mantissa bits when PyTorch lets it
# (off by default for matmuls, on for cuDNN convolutions: the numerical-accuracy note), so
# its row follows from that layout. PyTorch's notes differ on whether the rest is cut or
# rounded (Sources); this course rounds to nearest. The two fp8 formats are a preview of
# lesson 08.
#
# The same ranges on a number line, in powers of two:

# %%
from amp_lessons.plots import format_ranges

format_ranges()

# %% [markdown]
# bfloat16 keeps float32's 8 exponent bits: its normal numbers start at float32's smallest
# normal, 2^-126, and end near its largest; only its subnormals stop sooner (2^-133, against
# 2^-149). float16 spends its bits on mantissa instead, so its range is the short bar.
#
# ## Two numbers in every format
#
# **Predict:** which formats can tell `1 + 1e-4` from `1`? Which ones keep `1e-8` at all?

# %%
from amp_lessons.formats import round_to_format

values = torch.tensor([1 + 1e-4, 1e-8], dtype=torch.float64)
for name in FORMATS:
    stored = round_to_format(values, name).tolist()
    print(f"{name:<9} 1 + 1e-4 -> {stored[0]:<12.10g} 1e-8 -> {stored[1]:.6g}")

# %% [markdown]
# `1 + 1e-4` rounds to 1 unless the spacing next to 1 (`eps` in the table) is under `2e-4`,
# so that `1e-4` is more than half a step: only float32's is. `1e-8` needs range: float32,
# tf32 and bfloat16 keep it, with the error their mantissa allows, while float16 and the fp8
# formats round it to zero.
# Here are its bits in bfloat16 and in float16:

# %%
from amp_lessons.formats import bits_of

print(bits_of(1e-8, "bf16"))
print(bits_of(1e-8, "fp16"))

# %% [markdown]
# ## The bottom of float16
#
# float16's smallest subnormal is a single 1 in the last mantissa bit:

# %%
tiny = format_info("fp16").smallest_subnormal
print(tiny, tiny == 2.0**-24)
print(bits_of(tiny, "fp16"))

# %% [markdown]
# **Predict:** what does float16 store for `0.75 x tiny`, `0.5 x tiny` and `0.49 x tiny`?

# %%
for f in (1.0, 0.75, 0.5, 0.49):
    print(f"{f:>4} x 2^-24 is stored as {bits_of(f * tiny, 'fp16').stored:.6g}")

# %% [markdown]
# Rounding goes to the nearest float16. Exactly half of `tiny` is a tie between 0 and
# `tiny`, and ties go to the neighbour whose last bit is even: 0. Anything smaller
# **underflows to zero**: the value is gone, not just imprecise. The course calls such a
# value *flushed*; that is rounding, not the hardware "flush-to-zero" mode (FTZ), which
# also zeroes subnormals: here subnormals are kept. Between `tiny` and the smallest normal,
# values survive as subnormals with fewer significant bits:

# %%
print(bits_of(1e-6, "fp16"))

# %% [markdown]
# The top end fails the other way: the largest float16 is 65504, and the next step up
# would be 65536 (`2^16`). Values below 65520, halfway between the two, still round down to
# 65504; from 65520 on, they are `inf`. (That is rounding once, as the course's functions
# do. torch's own cast of a *float64* tensor rounds to float32 first: 65519.999 becomes
# 65520 there, exactly the tie, which then goes to `inf`: the last line below.)

# %%
for v in (65504.0, 65519.0, 65520.0):
    print(f"{v:g} is stored as {bits_of(v, 'fp16').stored}")
print("torch's cast of the float64 65519.999:", torch.tensor(65519.999, dtype=torch.float64).half().item())

# %% [markdown]
# ### Try it: any value, any format
#
# Pick a format and type a value (`1e-4`, `3.14159`, `2^-24` or `2**-24` for powers of
# two). The view shows the bits, the value kept and the relative error. Try `1e-8`,
# `70000` and `0.1` in each format.

# %%
from amp_lessons.widgets import format_explorer

format_explorer("1e-8", "fp16")

# %% [markdown]
# ## Your gradients
#
# So far, single numbers. What matters in training is where the **gradients** lie. Below,
# a small MLP learns the 8x8 handwritten digits in float32 for 51 steps (numbered 0 to 50)
# on this machine, and `GradientRecorder` keeps the gradients of the last one, step 50:
# every parameter's gradient (weights and biases), and the gradients that flow between the
# layers during backward (the `grad_output` of each `Linear`). float32's range holds them
# all, so these are the values a 16-bit backward pass would have to hold.

# %%
from amp_lessons.data import digits
from amp_lessons.models import mlp
from amp_lessons.training import GradientRecorder, Trainer

from amp_lessons.claims import at_least, check, measured

recorder = GradientRecorder(steps={50})
trainer = Trainer(mlp(64, 64, 10, depth=2), digits(), precision="fp32", device=device,
                  lr=5e-3, callbacks=[recorder])
history = trainer.fit(steps=51)
print(f"loss {measured(history['loss'][0], '.3f')} -> {measured(history['loss'][-1], '.3f')}, "
      f"test accuracy {measured(trainer.evaluate(), '.3f')}")

# %%
grads = torch.cat([recorder.weight_grads, recorder.activation_grads])
print(f"{recorder.weight_grads.numel():,} parameter-gradient and "
      f"{recorder.activation_grads.numel():,} activation-gradient values")
print(f"{measured((grads == 0).sum().item(), ',')} are exactly zero")

# %% [markdown]
# Why exactly zero? Two causes give exact zeros here (the cells below count the first and
# show the second; they do not sort every zero by cause). The first layer's weight gradient is the batch's input
# pixels times the gradient flowing back, so every weight that reads a pixel which is blank
# in every image of the batch gets a gradient of exactly 0. And ReLU passes back exactly 0
# wherever its input was not positive. Counting the first:

# %%
x50, _ = digits().batch(50 * trainer.accum_steps, trainer.batch_size, trainer.seed)
blank_pixels = (x50 == 0).all(dim=0)
blank = int(blank_pixels.sum())
first = trainer.model[0]
print(f"{blank} of the 64 pixels are blank in all {len(x50)} images of step 50's batch: "
      f"{blank} x {first.out_features} = {blank * first.out_features} first-layer weights with a gradient of exactly 0")
first_grad = recorder.weight_grads[:first.weight.numel()].view_as(first.weight)  # recorded in parameter order
print("all of them 0 in the recorded gradients:", bool((first_grad[:, blank_pixels] == 0).all()))

# %% [markdown]
# The second. Each hidden `Linear` here feeds a ReLU, so the gradient flowing into it (its
# `grad_output`, one of the activation gradients) is 0 wherever the ReLU was off. A unit
# that was off for every image of the batch gives a gradient of 0 to its own weights, and,
# its output being 0 in every image, to the next layer's weights that read it too.
# ReLU's own gradient, at three inputs, and the zeros of each kind:

# %%
z = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
torch.relu(z).sum().backward()
print("ReLU's gradient at -1, 0, 2:", z.grad.tolist())
zeros = {"parameter": recorder.weight_grads, "activation": recorder.activation_grads}
for kind, g in zeros.items():
    print(f"exact zeros among the {kind} gradients: {measured(int((g == 0).sum()), ',')} of {g.numel():,}")

# %% [markdown]
# **Predict:** what share of the nonzero values would float16 flush to zero? And bfloat16?
#
# `census` classifies every value for a format: flushed to zero, subnormal (kept, less
# precise), normal, or overflowed. Shares are of the nonzero values.

# %%
from amp_lessons.formats import census

fp16, bf16 = census(grads, "fp16", measured=True), census(grads, "bf16", measured=True)
print(fp16)
print(bf16)
print(at_least("float16 flushes some of your gradients at scale 1", fp16.flushed, 1, ","))
print(check("bfloat16 flushes none of them", bf16.flushed == 0, f"{measured(bf16.flushed, 'd')} flushed"))

# %% [markdown]
# Which gradients are the small ones? Compare the two kinds, then the layers. The
# activation gradients start at the logits, where the gradient of the loss is
# `(softmax - onehot) / batch size`: for a class the model is sure is wrong, its softmax
# probability is tiny, and so is that gradient.

# %%
parts = {"parameters": census(recorder.weight_grads, "fp16"), "activations": census(recorder.activation_grads, "fp16")}
for label, c in parts.items():
    print(f"{label:<12} flushed {measured(c.fraction('flushed'), '.3%')}  subnormal {measured(c.fraction('subnormal'), '.2%')}")
print(check("the activation gradients lose more to float16 than the parameter gradients",
            parts["activations"].fraction("flushed") + parts["activations"].fraction("subnormal")
            > parts["parameters"].fraction("flushed") + parts["parameters"].fraction("subnormal")))

# %% [markdown]
# The activation gradients, layer by layer. Backward reaches the last `Linear` first, so
# the recorded values come in that order, one block per layer; the logits' block is the
# one whose rows each sum to 0, as `softmax - onehot` does:

# %%
linears = [m for m in trainer.model if isinstance(m, torch.nn.Linear)]
sizes = [m.out_features * trainer.batch_size for m in reversed(linears)]  # one batch: accum_steps is 1
names = ("logits", "second hidden layer's output", "first hidden layer's output")
layers = dict(zip(names, recorder.activation_grads.split(sizes)))
row_sums = layers["logits"].view(trainer.batch_size, -1).sum(dim=1)
print(check("the first block's rows each sum to 0 (within 1e-6): it is the logits' gradient",
            bool(row_sums.abs().max() < 1e-6)))
flushed = {name: census(g, "fp16").flushed for name, g in layers.items()}
for name, n in flushed.items():
    print(f"{name:<30} {layers[name].numel():>5,} values, {measured(n, 'd')} flushed in float16")
print(check("the logits' gradient holds most of the activation values float16 flushes",
            flushed["logits"] > sum(flushed.values()) / 2))

# %% [markdown]
# ## The picture
#
# The histogram below counts your gradients by their power of two, `log2 |g|`. Behind the
# bars, float16's regions: red is flushed to zero (at or below 2^-25, half of the smallest
# subnormal, as the cells above showed), yellow is subnormal (from just above 2^-25, which
# rounds up to 2^-24, to the smallest normal 2^-14), purple overflows.
# Above them, each format's subnormal (light) and normal (dark) band, as the key on the
# right says. The exact zeros have no `log2`: the bars and the title's share leave them
# out. It is a figure like the one NVIDIA's *Mixed Precision Training* paper (Micikevicius
# et al., 2018) made famous (there, an SSD's activation gradients), drawn from your own run.

# %%
from amp_lessons.plots import gradient_histogram

gradient_histogram(grads)

# %% [markdown]
# Look where the bars sit: at the bottom of float16's range, while its top, up to 65504,
# stays empty. Is float16's range too narrow for these gradients, or just in the wrong
# place? Compare how many powers of two each spans:

# %%
nonzero = grads[grads != 0].abs()
span = (nonzero.max().log2() - nonzero.min().log2()).item()
f16 = format_info("fp16")
print(f"your gradients span {measured(span, '.1f')} powers of two; "
      f"float16 spans {torch.tensor(f16.max / f16.smallest_subnormal).log2().item():.1f}")

# %% [markdown]
# When the gradients span fewer powers of two than float16 does, they can all fit: they
# only need to be moved up. Fit counts the subnormals, though: float16's *normal* range
# spans only 30 powers of two (2^-14 to 2^16), fewer than these gradients do, so at any
# scale that overflows nothing, some stay subnormal.
#
# ## Loss scaling moves the histogram
#
# Multiply the loss by `2^k` and, by the chain rule, every gradient is multiplied by
# `2^k`: the histogram slides `k` to the right. A power of two changes only the exponent,
# so the scaling itself rounds nothing, as long as the result stays within float32's normal
# range. `GradScaler` (lesson 03) does exactly this with its default scales, powers of two,
# and divides by `2^k` again in float32 before the optimizer step.
#
# **Predict:** with the scale `2^8`, how many values still flush in float16, and does any
# overflow?

# %%
from amp_lessons.formats import scale_table

print(scale_table(grads, 2.0**8, measured=True))

# %%
gradient_histogram(grads, scale=2.0**8)

# %% [markdown]
# ### Try it: the loss-scale slider
#
# Move the scale from `2^0` to `2^24`. The table gives the shares flushed, subnormal,
# normal and overflowed in float16 and bfloat16; the histogram moves with it. Find where
# the bars leave the red region, and where they reach purple.

# %%
from amp_lessons.widgets import loss_scale_explorer

loss_scale_explorer(grads)

# %% [markdown]
# `GradScaler`'s starting scale, on these gradients:

# %%
from amp_lessons.formats import scaled_census

c16 = scaled_census(grads, "fp16", 2.0**16)
print("GradScaler starts at", torch.amp.GradScaler(device.type).get_scale())
print(check("at 2^16, GradScaler's starting scale, nothing flushes and nothing overflows",
            c16.flushed == 0 and c16.overflow == 0,
            f"flushed {measured(c16.fraction('flushed'), '.3%')}, overflow {measured(c16.fraction('overflow'), '.3%')}"))

# %% [markdown]
# Too large a scale overflows: a single `inf` makes `GradScaler` skip the step and halve
# the scale; after `growth_interval` clean steps it doubles it again (its defaults; lesson 03
# runs it).
#
# ## Why bfloat16 needs no scaler, and what it pays
#
# The census above found nothing flushed in bfloat16 at scale 1. It pays in mantissa: 7
# bits instead of float16's 10. **Predict:** what does each format store for `1 + 2^-8`
# and `1 + 2^-7`?

# %%
close_to_one = torch.tensor([1 + 2.0**-8, 1 + 2.0**-7])
for name in ("fp16", "bf16"):
    print(name, round_to_format(close_to_one, name).tolist())

# %% [markdown]
# bfloat16 cannot tell `1 + 2^-8` from 1 (an exact tie, rounded to even; a value just above
# it rounds up to `1 + 2^-7`). On your gradients: the typical relative error
# of each format, and the worst (1.0 means the value was lost entirely):

# %%
from amp_lessons.formats import rounding_error

errors = {name: rounding_error(grads, name) for name in ("fp16", "bf16")}
for name, err in errors.items():
    print(f"{name}: median relative error {measured(err.median().item(), '.1e')}, worst {measured(err.max().item(), '.4f')}")
print(check("float16 stores the typical gradient more precisely than bfloat16, and loses more of the smallest",
            errors["fp16"].median() < errors["bf16"].median() and errors["fp16"].max() > errors["bf16"].max()))

# %% [markdown]
# For gradients like these, that is why autocast in bfloat16 runs without a `GradScaler`,
# and why float16 needs one; a network whose gradients all sit inside float16's range
# would not.
#
# ## Remember
#
# - bfloat16 has float32's exponent bits: none of your gradients flushed to zero in it,
#   so it needed no loss scaling. It pays with a coarse mantissa (`1 + 2^-8` is 1).
# - float16 has more mantissa but a narrow range: at half of `2^-24` and below, values
#   flush to zero; below `2^-14` they lose precision as subnormals. Small gradients (in
#   your run, above all the activation gradients) fall there.
# - A loss scale `2^k` slides every gradient `k` powers of two up. Here the gradients span
#   fewer powers of two than float16 does, so some scale can put them all in its range;
#   `GradScaler`'s starting `2^16` did (the check above). Too large a scale overflows to
#   `inf`. This lesson scales float32 gradients and then rounds, which is exact for a power
#   of two; a real float16 backward rounds along the way too (lesson 03 runs one).
#
# ## Watch out
#
# - A flushed gradient is silent: no error, no NaN, just a zero. A weight whose gradient
#   flushes at every step stops learning from it. Zeros in a float16 run cannot tell
#   flushed values from real zeros (the float32 run above has exact zeros of its own):
#   classify float32 gradients against float16's range, as `census` did, before trusting
#   float16.
# - float16 overflows from 65520 on (the cells on its top end): one `inf` in the
#   gradients and `GradScaler` skips the whole step.
# - fp8 is narrower still, and e4m3fn has no `inf`. What torch's cast stores for a value
#   too large for it depends on the release, on the CPU path: NaN in torch 2.11,
#   448 in 2.13, `inf` included (PyTorch pull request 178817,
#   "Properly saturate E4M3 on finite-overflow on CPU/C++ conversion code"). Type `1e6` in
#   the widget to see what this release does (the cell below says it too); lesson 08 shows
#   why fp8 code clamps before casting.

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.formats import e4m3_overflow

print(e4m3_overflow())

# %% [markdown]
# ## Exercise: pick a loss scale
#
# Find the smallest loss scale, a power of two, that leaves none of your run's nonzero
# gradients flushed to zero in float16, at least 99% of them in its **normal** range, and
# none overflowing. Use the slider or `scale_table`, replace `2.0**4`, and run the two cells.

# %%
my_scale = 2.0**4

# %%
from amp_lessons.exercises import check_loss_scale

check_loss_scale(my_scale, grads)

# %% [markdown]
# ## Sources
#
# - TF32 keeping 10 of float32's 23 mantissa bits: "only the first 10 bits of the input
#   mantissa are read", PyTorch's numerical-accuracy notes
#   (`docs/source/notes/numerical_accuracy.md`, "TensorFloat-32 (TF32) on Nvidia Ampere (and
#   later) devices"); "by rounding input data to have 10 bits of mantissa", the CUDA notes
#   (`docs/source/notes/cuda.md`, "TensorFloat-32 (TF32) on Ampere (and later) devices").
# - `GradScaler` skipping a step with an inf and halving its scale, doubling it after
#   `growth_interval` clean steps: `torch/amp/grad_scaler.py` (lesson 03 runs it).
# - The gradient histogram against float16's range: Micikevicius et al., *Mixed Precision
#   Training*, ICLR 2018 (arXiv:1710.03740), Figure 3.
# - What an fp8 cast stores for a value too large for e4m3fn, by release: pytorch/pytorch
#   pull request 178817 (`torch/headeronly/util/Float8_e4m3fn.h` and the CPU's vectorized cast);
#   the cell above prints this release's answer; lesson 08 names the changes.
