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
# # 08 · fp8: a scale for every tensor
#
# NVIDIA's Ada, Hopper and Blackwell GPUs have tensor cores for 8-bit floats, and large
# models are trained with them. Two formats: **e4m3** (4 exponent bits, 3 mantissa bits)
# and **e5m2**. Their range is short: cast as they are, e4m3 flushes most of this network's
# gradients to zero, e5m2 fewer (below; how many depends on the batch and the loss).
# So the recipe this lesson builds multiplies every tensor by a *scale* first, computed
# from the tensor itself so that its largest value lands on the format's largest value
# (*current* scaling; torchao's `Float8LinearConfig(round_scales_to_power_of_2=True)` rounds
# that scale down to a power of two, landing within a factor of 2 below it). That is lesson
# 03's loss scale again, with two differences: it is computed rather than searched for, and
# every tensor (or every row) gets its own. Other recipes differ: delayed scaling (below)
# and lesson 09's block scales.
#
# Everything here runs on a CPU or a CUDA GPU; on a Mac, on the CPU (`fp8_device`: torch has
# no `float8_e5m2` on Apple's GPU). `torch._scaled_mm`, the fp8 matmul, runs on a CPU too
# and on fp8 GPUs; on an older GPU (a T4, an A100) it refuses, and the lesson emulates it
# and says so. You will see:
#
# - the two fp8 formats beside bf16 and fp16, and what a cast does with a value too large;
# - your own network's tensors against them: unscaled, scaled per tensor, scaled per row;
# - `torch._scaled_mm` checked against dequantize-then-matmul, where it runs;
# - an outlier channel, and why per-row scales help;
# - a small fp8 linear layer, written out, trained against 16-bit autocast;
# - which GPUs run fp8 fast.

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
from amp_lessons.hardware import fp8_device

device = fp8_device()  # pick_device()'s choice, except the CPU instead of Apple's GPU
report = amp_lessons.hardware_report(device)
print(f"device {device} ({report.name}), torch {report.torch_version}")

# %% [markdown]
# ## Two fp8 formats
#
# **Predict:** e4m3 has one exponent bit fewer than e5m2 and one mantissa bit more.
# Which of the two has the smaller smallest value? Which one has the larger largest value?

# %%
from amp_lessons.formats import format_info, formats_table

print(formats_table(("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")))

# %% [markdown]
# Range and precision side by side: from the smallest subnormal to the largest value, in
# powers of two, and how many values each format has between one power of two and the next
# in its normal range (2 to the number of mantissa bits; e4m3's top one holds one fewer, 256
# to 448, as its all-ones pattern is NaN).

# %%
import math

for name in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"):
    f = format_info(name)
    span = math.log2(f.max / f.smallest_subnormal)
    top = 2 ** math.floor(math.log2(f.max))  # the top binade runs from here to the largest value
    in_top = int((f.max - top) / (top * 2.0**-f.mantissa_bits)) + 1
    print(f"{name:<9} 2^{math.log2(f.smallest_subnormal):.0f} to {f.max:<9g} {span:5.1f} powers of two, "
          f"{2**f.mantissa_bits:>4} values in each normal one"
          + (f" ({in_top} in the top one)" if in_top != 2**f.mantissa_bits else ""))

# %% [markdown]
# e4m3 covers fewer than half the powers of two fp16 covers. Its name ends in **fn**, in
# the LLVM/MLIR naming torch follows: **f** for finite (no infinities), **n** for a special
# NaN encoding (only the all-ones pattern, `S.1111.111`, is NaN; ml_dtypes' README). So the
# top exponent holds numbers instead of inf, which is why its largest value is 448. e5m2
# is a shortened fp16: same exponent, 2 mantissa bits, with inf. Between 1 and 2, each
# keeps only these values:

# %%
from amp_lessons.formats import round_to_format

between = torch.arange(64) / 64 + 1  # 64 evenly spaced values from 1 to 2
for name in ("fp8_e4m3", "fp8_e5m2"):
    print(f"{name}: {sorted(set(round_to_format(between, name).tolist()))}")

# %% [markdown]
# An fp8 tensor is storage for a matmul, not a number type you compute with. It takes one
# byte per value, and torch's CPU kernels refuse arithmetic such as `add` on it:

# %%
from amp_lessons.show import expect_error

a8 = torch.tensor([1.0, 2.0, 3.0]).to(torch.float8_e4m3fn)
print(a8.dtype, a8.element_size(), "byte per value:", a8.float().tolist())
print("a8 * a8 runs, to", (a8 * a8).dtype)
with expect_error(NotImplementedError):
    a8 + a8

# %% [markdown]
# ## A value too large for e4m3
#
# e4m3 has no inf. So what does a cast store for `1e6`? **Predict**, then run
# (`e4m3_overflow` casts `1e6` and `inf` once, eagerly on this device, and reads them back):

# %%
# NBVAL_IGNORE_OUTPUT
# The answer depends on the release and the build: see Sources.
from amp_lessons.formats import e4m3_overflow

print(e4m3_overflow(device))

# %% [markdown]
# Clamp to the largest value before casting (torchao's `to_fp8_saturated` and
# `saturating_cast` do): that stores 448 for `1e6` on every release and build; a plain cast
# may store NaN. e5m2 has inf:

# %%
from amp_lessons.fp8 import saturating_cast

print("e5m2, plain cast:", round_to_format(torch.tensor([1e6, -1e6]), "fp8_e5m2").tolist())
too_large = torch.tensor([1e6, -1e6, math.inf])
for name in ("fp8_e4m3", "fp8_e5m2"):
    print(f"{name}, saturating_cast:", saturating_cast(too_large, name).float().tolist())

# %% [markdown]
# ## Your network's tensors against fp8
#
# A linear layer's matmul has three operands that fp8 training casts: the **input** and
# the **weight** in the forward pass, and the **gradient of the output** in the backward
# pass. Below, the digits MLP of lesson 01 trains 50 steps in float32 on this machine;
# then `record_operands` runs one more batch and keeps, for every `Linear`, those three
# tensors (in float32: what fp8 would have to hold).

# %%
from amp_lessons.claims import measured
from amp_lessons.data import digits
from amp_lessons.fp8 import record_operands
from amp_lessons.models import mlp
from amp_lessons.training import Trainer

data = digits()
trainer = Trainer(mlp(64, 64, 10, depth=2), data, precision="fp32", device=device, lr=5e-3)
history = trainer.fit(50)
x, y = (t.to(device) for t in data.batch(50, 64))
operands = record_operands(trainer.model, x, y)
print(f"loss {measured(history['loss'][0])} -> {measured(history['loss'][-1])}")
for o in operands:
    print(f"layer {o.layer}: input {tuple(o.input.shape)}, weight {tuple(o.weight.shape)}, "
          f"grad_output {tuple(o.grad_output.shape)}")

# %% [markdown]
# How many powers of two does each kind span, from its smallest nonzero magnitude to its
# largest? First all layers pooled: the span one factor for every tensor of a kind would
# have to cover, as a loss scale does for the gradients. Compare with the spans above.

# %%
def span(tensors):
    """log2 of the smallest and the largest nonzero magnitude in ``tensors``."""
    mags = torch.cat([t.flatten() for t in tensors]).abs()
    return mags[mags > 0].min().log2().item(), mags.max().log2().item()


groups = {kind: [getattr(o, kind) for o in operands] for kind in ("input", "weight", "grad_output")}
spans = {}
for kind, tensors in groups.items():
    lo, hi = span(tensors)
    spans[kind] = hi - lo
    print(f"{kind:<12} 2^{measured(lo, '.1f')} to 2^{measured(hi, '.1f')}: {measured(hi - lo, '.1f')} powers of two")
e4m3 = format_info("fp8_e4m3")
e4m3_span = math.log2(e4m3.max / e4m3.smallest_subnormal)
amp_lessons.claims.at_least("the output gradients, pooled, span more powers of two than e4m3 holds",
                            spans["grad_output"], round(e4m3_span, 1), ".1f")

# %% [markdown]
# A scale per tensor (below) has to cover only one tensor's span. The output gradients,
# layer by layer (layer 4, the 10-class head, stays out of fp8 below):

# %%
per_layer = {o.layer: span([o.grad_output]) for o in operands}
for layer, (lo, hi) in per_layer.items():
    print(f"layer {layer}: grad_output spans {measured(hi - lo, '.1f')} powers of two")
widest = max(hi - lo for layer, (lo, hi) in per_layer.items() if layer != operands[-1].layer)  # not the head
amp_lessons.claims.at_least("even one fp8 layer's output gradient can span more powers of two than e4m3 holds",
                            widest, round(e4m3_span, 1), ".1f")

# %% [markdown]
# **Predict:** cast as they are, what share of each kind does e4m3 flush to zero? e5m2?
#
# `census_table` runs lesson 01's census (`amp_lessons.formats.census`) on every kind
# and format: the share of the nonzero values flushed to zero, kept as subnormals (fewer
# significant bits), and too large.

# %%
from amp_lessons.fp8 import census_table, fp8_census

print(census_table(groups))

# %%
unscaled = {n: fp8_census(groups["grad_output"], n) for n in ("fp8_e4m3", "fp8_e5m2")}
flushed = {n: c.fraction("flushed") for n, c in unscaled.items()}
print(amp_lessons.claims.at_least("unscaled, e4m3 flushes more than half of the output gradients",
                                  flushed["fp8_e4m3"], 0.5))
print(amp_lessons.claims.at_most("e5m2's wider range flushes at most half as many as e4m3",
                                 flushed["fp8_e5m2"] / flushed["fp8_e4m3"], 0.5))
inputs_weights = max(fp8_census(groups[k], "fp8_e4m3").fraction("flushed") for k in ("input", "weight"))
print(amp_lessons.claims.at_most("inputs and weights fit e4m3 nearly as they are: at most 2% flushed",
                                 inputs_weights, 0.02))

# %% [markdown]
# These shares are for a batch of 64 and a mean loss, whose gradients are 1/64 of a summed
# loss's. The share of the output gradients e4m3 flushes with a summed loss on the same
# batch, and with a mean loss on a batch of 16:

# %%
def summed_loss(out, target):
    return torch.nn.functional.cross_entropy(out, target, reduction="sum")


x16, y16 = (t.to(device) for t in data.batch(50, 16))
for label, ops in [("a summed loss, batch 64", record_operands(trainer.model, x, y, loss_fn=summed_loss)),
                   ("a mean loss, batch 16", record_operands(trainer.model, x16, y16))]:
    share = fp8_census([o.grad_output for o in ops], "fp8_e4m3").fraction("flushed")
    print(amp_lessons.claims.check(f"{label}: e4m3 flushes fewer than with a mean loss, batch 64",
                                   share < flushed["fp8_e4m3"],
                                   f"{measured(share, '.0%')} against {measured(flushed['fp8_e4m3'], '.0%')}"))

# %% [markdown]
# The gradients are lesson 03's problem, only worse. A loss scale multiplies every gradient
# by one factor: it can move their span, but not narrow it to fit e4m3's.
#
# ## A scale per tensor
#
# So each tensor gets its own scale, computed from its largest magnitude, its **amax**:
# `scale = 448 / amax` for e4m3. Multiply, cast, and keep the scale next to the fp8 values;
# to read them back (**dequantize**), multiply by `1 / scale`. Here is layer 2's output
# gradient:

# %%
from amp_lessons.fp8 import amax, quantize

g = operands[1].grad_output
q = quantize(g, "fp8_e4m3")
print(f"amax {measured(amax(g).item())}, scale = 448 / amax = {measured(q.scale.item())} "
      f"= 2^{measured(q.scale.log2().item(), '.2f')}")
print(f"{q.data.dtype}, largest stored value {q.data.float().abs().max().item():g}")
err = ((q.dequantize() - g).norm() / g.norm()).item()
print(amp_lessons.claims.at_most("dequantized, the gradient is back within half of e4m3's eps",
                                 err, e4m3.eps / 2))

# %% [markdown]
# The scale comes from the tensor being cast (*current*, or dynamic, scaling, as everywhere
# in this lesson), so the largest value lands on 448 by construction (for an amax above the
# 1e-12 floor that keeps an all-zero tensor's scale finite; below it, under 448) and nothing
# can overflow. *Delayed* scaling (NVIDIA Transformer Engine's `DelayedScaling` recipe) takes
# the amax from earlier steps instead; a tensor larger than they were can overflow, which
# is why its cast must saturate. **Predict** the census now:

# %%
print(census_table(groups, "tensor"))
per_tensor = fp8_census(groups["grad_output"], "fp8_e4m3", "tensor").fraction("flushed")
print(amp_lessons.claims.at_most("scaled per tensor, e4m3 flushes at most 5% of the output gradients",
                                 per_tensor, 0.05))

# %% [markdown]
# ## A scale per row
#
# One scale for a whole tensor is set by its single largest value; a row of small values
# in the same tensor still lands low. Per-row scaling gives every row its own amax (for a
# matmul `A @ B`, every row of `A` and every column of `B`, along the dimension the product
# sums over). A row's amax is never larger than the tensor's, so its scale is never
# smaller: per row never flushes more.

# %%
print(census_table(groups, "row"))
fewer = all(fp8_census(t, n, "row").flushed <= fp8_census(t, n, "tensor").flushed
            for t in groups.values() for n in ("fp8_e4m3", "fp8_e5m2"))
print("per row flushes no more than per tensor, for every kind and format:", fewer)

# %% [markdown]
# ## `torch._scaled_mm`: dequantize, then matmul
#
# The fp8 matmul takes the two fp8 operands and their inverse scales (`1 / scale`, per
# tensor or per row) and returns `(A8 / scale_A) @ (B8 / scale_B)` in the `out_dtype` it is
# given (`scaled_mm` below, with per-tensor scales as here, gives float32). On a CPU, torch
# computes exactly that, a float32 matmul of the dequantized values, except where oneDNN
# takes the call (Sources).
# `scaled_mm(a, b)` computes `a @ b.T` from two `quantize` results.
#
# **Predict:** with inputs fp8 holds exactly (small multiples of 1/4) and power-of-two
# scales, is the result bit for bit the float32 product?

# %%
from amp_lessons.fp8 import reference_mm, scaled_mm, scaled_mm_support

emulate = scaled_mm_support(device)["tensor"] is not None  # a GPU older than fp8: emulate
mm = "reference_mm (emulate=True)" if emulate else "_scaled_mm"
A = ((torch.arange(16 * 32) % 9 - 4) / 4).reshape(16, 32).to(device)
B = ((torch.arange(16 * 32) % 7 - 3) / 4).reshape(16, 32).to(device)
qa, qb = quantize(A, power_of_2=True), quantize(B, power_of_2=True)
print("dequantize gives A back exactly:", torch.equal(qa.dequantize(), A))
print(f"{mm} equals A @ B.T exactly:", torch.equal(scaled_mm(qa, qb, emulate=emulate), A @ B.T))

# %% [markdown]
# On the layer's real operands (scales that are not powers of two), against dequantize +
# matmul computed by hand, and against the float32 product of the unquantized tensors:

# %%
o = operands[1]
qa, qb = quantize(o.input.to(device)), quantize(o.weight.to(device))
fp8_out, by_hand = scaled_mm(qa, qb, emulate=emulate), reference_mm(qa, qb)
exact = o.input.to(device) @ o.weight.to(device).T
gap = ((fp8_out - by_hand).norm() / by_hand.norm()).item()
if device.type == "cuda" and not emulate:  # fp8 tensor cores accumulate their own way (lesson 09)
    print(f"{mm} against dequantize + matmul on this GPU: {measured(gap, '.2g')}")
elif emulate:  # reference_mm against itself: nothing to check
    print("emulated on this GPU: _scaled_mm is not checked here")
else:
    print(amp_lessons.claims.at_most(f"{mm} is dequantize + matmul, up to float32 rounding", gap, 1e-5, ".2g"))
err = ((fp8_out - exact).norm() / exact.norm()).item()
print(amp_lessons.claims.at_most("the fp8 product is within e4m3's eps of the float32 one", err, e4m3.eps))

# %% [markdown]
# On CUDA, `_scaled_mm` is stricter (`ScaledBlas.cpp`, not run here; Sources): compute
# capability 8.9 or 9.0+, and
#
# - on an H100, the first operand row-major and the second column-major (cuBLASLt's fp8
#   "TN" rule; a comment in torch's `ScaledBlas.cpp` says "H100 only supports row-major x
#   column-major"); what other fp8 GPUs take depends on the GPU and the torch release
#   (Sources);
# - the second operand's two dimensions, and the first operand's inner one, multiples of 16;
# - never e5m2 times e5m2: e5m2 is for gradients, paired with e4m3.
#
# ## One outlier channel: per tensor against per row
#
# Large language models have a few channels far larger than the rest, in the *input
# features* of a layer: a few columns of the activations `A` (Sources). Such a column is in
# every row of `A`, so per-row scales cannot isolate it in the forward matmul (the weight
# gradient's matmul takes `A.T`, where it is one row). The demo here takes the case per-row
# scales do fix: a 64 x 64 layer whose output channel 0 (row 0 of the weight) is `2^k`
# times larger than the others. The error is measured on the *other* outputs. **Predict:**
# does a 2^8 outlier hurt per-tensor scaling?

# %%
from amp_lessons.fp8 import outlier_sweep

rows = outlier_sweep()
print(f"{'outlier':>8} {'error per tensor':>17} {'error per row':>14} {'weight flushed per tensor':>26} "
      f"{'subnormal per tensor':>21}")
for r in rows:
    print(f"{'2^' + str(r['k']):>8} {measured(r['tensor']):>17} {measured(r['row']):>14} "
          f"{measured(100 * r['flushed'], '.1f') + '%':>26} {measured(100 * r['subnormal'], '.1f') + '%':>21}")

# %%
by_k = {r["k"]: r for r in rows}
print(amp_lessons.claims.at_most("a 2^8 outlier costs per-tensor scaling nothing: error within 10% of none",
                                 by_k[8]["tensor"] / by_k[0]["tensor"], 1.1))
print(amp_lessons.claims.at_most("with a 2^16 outlier, per-row error is at most half of per-tensor's",
                                 by_k[16]["row"] / by_k[16]["tensor"], 0.5))

# %% [markdown]
# A float's error is relative to the value, so the outlier costs little while the other
# channels stay in or near e4m3's normal range. Once it pushes them further below it, they
# turn subnormal and then flush to zero, and the per-tensor error climbs to the whole
# output. Per-row
# scales give channel 0 its own scale and leave the others where they were.
#
# ## A minimal fp8 linear layer
#
# Here is the whole layer as a custom autograd function: three matmuls, each with both
# operands quantized along the dimension it sums over. The forward casts to e4m3; the
# backward casts the output gradient to e5m2 (the `tensorwise` recipe, as torchao names it).

# %%
import inspect

from amp_lessons.fp8 import Fp8Matmul

print(inspect.getsource(Fp8Matmul))

# %% [markdown]
# `convert_to_fp8` swaps every `nn.Linear` that `fits_fp8` (CUDA's rules above) for an
# `Fp8Linear` sharing its float32 parameters (master weights); the head stays as it is.

# %%
import copy

from amp_lessons.fp8 import convert_to_fp8

reference = mlp(64, 64, 10, depth=2).to(device)
model8 = convert_to_fp8(copy.deepcopy(reference), "tensorwise", emulate=emulate)
print(model8)

# %% [markdown]
# **Predict:** on one batch, how far are the fp8 layer's outputs and gradients from
# float32's? e5m2 keeps two mantissa bits, and the first layer's gradients pass through
# two fp8 matmuls in backward.

# %%
from torch.nn import functional as F

x, y = (t.to(device) for t in data.batch(0, 64))
for m in (reference, model8):
    F.cross_entropy(m(x), y).backward()
with torch.no_grad():
    out_err = ((model8(x) - reference(x)).norm() / reference(x).norm()).item()
pairs = [(p8.grad.flatten(), p.grad.flatten()) for p8, p in zip(model8.parameters(), reference.parameters())]
grad_err = max(((g8 - g).norm() / g.norm()).item() for g8, g in pairs)
cosine = min(F.cosine_similarity(g8, g, dim=0).item() for g8, g in pairs)
print(amp_lessons.claims.at_most("the fp8 outputs are within e4m3's eps of float32's", out_err, e4m3.eps))
print(amp_lessons.claims.at_least("the gradients differ more: their error is at least 2x the outputs'",
                                  grad_err / out_err, 2))
print(amp_lessons.claims.at_least("yet every fp8 gradient points the way float32's does: cosine >= 0.95",
                                  cosine, 0.95))

# %% [markdown]
# ## Training in fp8 against 16-bit autocast
#
# The same MLP from the same weights, the same batches, 300 steps: once in bf16 autocast
# (`baseline`: fp16 on a GPU that only emulates bf16), once with the fp8 layers (their
# weights and the head in float32). `ScaleHistory` keeps each fp8 operand's scale at every
# step. **Predict:** does fp8 keep up?

# %%
from amp_lessons.fp8 import ScaleHistory
from amp_lessons.hardware import supported_precisions

baseline = "bf16" if supported_precisions(device)["bf16"] is None else "fp16"
start = mlp(64, 64, 10, depth=2)  # both runs start from these weights
scales = ScaleHistory()
runs, accuracy = {}, {}
for label, model, precision, callbacks in [
        (baseline, copy.deepcopy(start), baseline, []),
        ("fp8 (tensorwise)", convert_to_fp8(copy.deepcopy(start), emulate=emulate), "fp32", [scales])]:
    t = Trainer(model, data, precision=precision, device=device, lr=5e-3, callbacks=callbacks)
    runs[label] = t.fit(300)
    accuracy[label] = t.evaluate()
    print(f"{label:<17} loss {measured(runs[label]['loss'][-1])}, test accuracy {measured(accuracy[label])}")

# %%
print(amp_lessons.claims.at_least(f"fp8 reaches at least 90% of {baseline}'s test accuracy",
                                  accuracy["fp8 (tensorwise)"] / accuracy[baseline], 0.9))
ends = {k: sum(h["loss"][-20:]) / 20 for k, h in runs.items()}
print(amp_lessons.claims.at_most(f"fp8's final loss (mean of the last 20 steps) is at most 1.5x {baseline}'s",
                                 ends["fp8 (tensorwise)"] / ends[baseline], 1.5))

# %%
from amp_lessons.plots import fp8_training

fp8_training(runs, scales.series())

# %% [markdown]
# In the right-hand panel, every operand finds its own scale at every step (layer 0's input,
# the pixels, keeps one). A scale is `fmt.max / amax`, so part of the gap between the
# gradients' (e5m2) and the weights' (e4m3) is the formats'. How far apart are the tensors
# themselves, by their amaxes?

# %%
import statistics

series = scales.series()
fmt_max = {".weight": format_info("fp8_e4m3").max, ".grad_output": format_info("fp8_e5m2").max}
log2_amax = {kind: statistics.median(math.log2(top) - v for k, s in series.items() if k.endswith(kind) for v in s)
             for kind, top in fmt_max.items()}
print(f"the formats' share of the scales' gap: log2(57344 / 448) = "
      f"{math.log2(fmt_max['.grad_output'] / fmt_max['.weight']):g}")
print(amp_lessons.claims.at_least("the weights' amax is at least 2^4 times the gradients'",
                                  log2_amax[".weight"] - log2_amax[".grad_output"], 4, ".1f"))
print("layer 0's input scale at every step is 448 / 1 (a pixel at 1 in every batch):",
      set(series["0.input"]) == {math.log2(448)})

# %% [markdown]
# ## The same with torchao
#
# torchao's `convert_to_float8_training` runs the same tensorwise recipe, with
# `torch.compile` support. One difference we found in its `config.py`: its forward matmul
# sets `use_fast_accum=True`, "fast accumulation in lower precision" on an fp8 GPU. It is
# optional (`pip install -e ".[fp8]"`); where it is installed, this cell trains
# the same model with it, keeping the same layers (`module_filter_fn`).

# %%
# NBVAL_IGNORE_OUTPUT
import dataclasses

from amp_lessons.fp8 import fits_fp8, torchao_float8

found, why_not = torchao_float8()
if found is None:
    print(why_not)
else:
    convert_to_float8_training, Float8LinearConfig = found
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=emulate)
    model_ao = convert_to_float8_training(copy.deepcopy(start),  # the head stays float32, as above
                                          config=config,
                                          module_filter_fn=lambda module, name: fits_fp8(module))
    t = Trainer(model_ao, data, precision="fp32", device=device, lr=5e-3)
    history_ao = t.fit(300)
    print(f"torchao (tensorwise): loss {measured(history_ao['loss'][-1])}, test accuracy "
          f"{measured(t.evaluate())}; this lesson's layer: {measured(accuracy['fp8 (tensorwise)'])}")

# %% [markdown]
# ## Which hardware runs fp8 fast
#
# NVIDIA's fp8 tensor cores come with compute capability 8.9 (Ada: L4, RTX 40xx) and 9.0 or
# newer (Hopper, Blackwell); `fp8_support` follows `ScaledBlas.cpp` (Sources). AMD's MI300
# runs `_scaled_mm` on ROCm in the `fnuz` variants (`float8_e4m3fnuz`): this lesson's
# e4m3fn code and 448 do not carry over.

# %%
from amp_lessons.hardware import fp8_support

print("fp8_support's table of compute capabilities (not a measurement):")
for label, kind, cc in [("a CPU", "cpu", None), ("T4", "cuda", (7, 5)), ("A100", "cuda", (8, 0)),
                        ("L4, RTX 4090", "cuda", (8, 9)), ("H100", "cuda", (9, 0)), ("B200", "cuda", (10, 0))]:
    fast, why = fp8_support(kind, cc)
    print(f"{label:<13} {'fast' if fast else 'not fast':<9} {why}")

# %% [markdown]
# And this machine: the table's verdict, and what `_scaled_mm` takes here, probed (`None`
# means it runs; per-row scales on a CPU depend on the release, Sources):

# %%
# NBVAL_IGNORE_OUTPUT
fast, _ = fp8_support(device.type, report.cuda_capability)
print(f"{device.type}, from the table: {'fast' if fast else 'not fast'}")
print(f"torch {report.torch_version}, _scaled_mm on {device.type}:", scaled_mm_support(device))

# %% [markdown]
# ## Remember
#
# - e4m3 (here for inputs and weights, 3 mantissa bits) spans fewer than half of fp16's
#   powers of two. e5m2 (here for gradients) has fp16's exponent and 2 mantissa bits, but
#   subnormals only to 2^-16. Unscaled, e4m3 flushed most of this network's gradients
#   (batch 64, a mean loss; a summed loss or a batch of 16 flushed fewer).
# - With current scaling, each tensor gets `scale = fmt.max / amax` of itself (amax floored
#   at 1e-12), every step: nothing overflows, and, for an amax above that floor, only values
#   far below the largest one flush. Per-row scales flush no more. Delayed scaling reuses
#   past amaxes and can overflow.
# - `torch._scaled_mm` is dequantize-then-matmul (on this CPU up to float32 rounding). The
#   weights, the optimizer and the output stay in high precision.
#
# ## Watch out
#
# - Clamp before casting to e4m3 (`saturating_cast`).
# - CUDA's `_scaled_mm` wants multiples of 16: keep layers whose dimensions are not (a
#   10-class head) out of fp8, and make the batch one too (times the tokens), for the weight
#   gradient's matmul `dy.T @ x`.
#
# ## Exercise: a scale for every row
#
# The function below should return one float32 scale per row of `x` (shape `(rows, 1)`)
# that puts each row's largest magnitude on the format's largest value. One thing is wrong.

# %%
from amp_lessons.exercises import check_row_scale, row_scale_as_given

print(inspect.getsource(row_scale_as_given))

# %% [markdown]
# Copy it into the cell below as `def my_row_scale(x, name="fp8_e4m3"):` and fix it. The
# checker runs it in e4m3 and e5m2 on exact rows such as a backward pass holds, scaled by
# 2^-36 to 2^5, an outlier, sparse ones (one all zeros), one bf16 cannot hold, one at
# 2^-124, and once all in bf16. Every row needs a finite positive scale, the all-zero row
# included; on the rows with nonzero values, except the 2^-124 one, the scale must be exact,
# `max / amax`. As given, it checks the function above:

# %%
my_row_scale = row_scale_as_given  # replace with your own: def my_row_scale(x, name="fp8_e4m3"): ...

check_row_scale(my_row_scale)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch and GPUs that no cell computes here:
#
# - The `fn` suffix: ml_dtypes' README (`float8_e4m3fn`), after LLVM's `APFloat.h`
#   (`Float8E4M3FN`).
# - The e4m3 cast's overflow: `fp8e4m3fn_from_fp32_value`, `torch/headeronly/util/Float8_e4m3fn.h`:
#   NaN in torch 2.11, 448 in 2.13 (pull request 178817). On CUDA, `cuda/Copy.cu` at commit
#   007aa8a (pull request 177870), built with CUDA 13.2 or newer, converts a float32 source
#   with `__nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)`, which saturates (CUDA's
#   `cuda_fp8.hpp`: an instruction from sm_89, software below it); fp16 and bf16 sources
#   keep torch's own conversion at that commit. `torch.compile`'s rule is not probed here.
# - `_scaled_mm`'s CUDA rules: `aten/src/ATen/native/cuda/ScaledBlas.cpp`. Layout: its
#   `_scaled_gemm` (commit 2bec3bd, for every GPU; at commit 0174dfab only where
#   `scaled_mm_arch_allowed(sm90_only)` holds, `major == 9` in `ScaledBlasDeviceUtils.cpp`,
#   pull request 190703, beside the comment "H100 only supports row-major x column-major, but
#   all permutaitons are supported on Blackwells") refuses others, "Only multiplication of
#   row-major and column-major matrices is supported by cuBLASLt" (a message in torch
#   2.11's `libtorch_cuda.so`), after cuBLASLt's fp8 rule "A must be transposed and B
#   non-transposed" (`cublasLtMatmul()`).
#   Per-row outputs: "Only bf16 and fp16 high precision output types are supported for
#   row-wise scaling." (read in torch 2.11's `libtorch_cuda.so`; pull request 187569 adds
#   fp32). e5m2 x e5m2 on ROCm: pytorch/pytorch#148228; MI300's fnuz dtypes:
#   `_scaled_mm_is_fnuz` there (gfx942), and torchao's `Float8TypeConfig`.
# - No `float8_e5m2` on Apple's GPU (MPS): pytorch/pytorch#132624 (open).
# - `_scaled_mm` on a CPU: `_scaled_mm_out_cpu` in `aten/src/ATen/native/Blas.cpp` (to
#   oneDNN with AMX-INT8, or AMX-FP16 for mixed dtypes, oneDNN on, and, at commit 457ff03,
#   per-tensor scales only; before per-row
#   support, torch 2.11's `_scaled_mm_out_cpu_emulated` asserted "Now _scaled_mm only
#   supports per-tensor scaling for CPU backend.").
# - Clamping before the cast: `to_fp8_saturated`, `torchao/float8/float8_utils.py`.
# - Delayed scaling: NVIDIA Transformer Engine's docs, "Using FP8 with Transformer Engine"
#   (`recipe.DelayedScaling`). torchao: `convert_to_float8_training`'s API page; in
#   `torchao/float8/config.py`, `Float8LinearConfig` (`emulate`, `gemm_config_output`, `round_scales_to_power_of_2`) and
#   `Float8GemmConfig` (`use_fast_accum`).
# - Outlier input features in LLMs: Dettmers et al., "LLM.int8()" (2022); Xiao et al.,
#   "SmoothQuant" (2023).
# - Which GPUs have fp8 tensor cores: NVIDIA's Ada and Hopper architecture whitepapers and
#   its Blackwell technical brief. A large model trained in fp8: DeepSeek-AI, "DeepSeek-V3
#   Technical Report" (arXiv 2412.19437), section 3.3.
