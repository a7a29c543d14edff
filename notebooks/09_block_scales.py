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
# # 09 · Block scales: MXFP8, NVFP4, and training below 8 bits
#
# Lesson 08 gave every tensor, or every row, one float32 scale. The recipes that came next
# scale small **blocks** of values along the dimension a matmul sums over:
#
# - **MXFP8**: blocks of 32 e4m3 (or e5m2) values, each block with a power-of-two scale
#   stored in one byte as **e8m0**. **MXFP4** is the same with 4-bit **e2m1** values.
# - **NVFP4**: blocks of 16 e2m1 values, each block scaled by an e4m3 number, under one
#   float32 scale for the whole tensor.
# - **1x128 and 128x128**: DeepSeek-V3's fp8 recipe: e4m3 values, a float32 scale per 1x128
#   tile of activations and per 128x128 block of weights.
#
# Blackwell GPUs run MXFP8 and NVFP4 natively; Hopper runs fp8 with a scale per tensor or
# per row, and the 1x128 and 128x128 scales through cuBLAS (the table at the end). Here
# every scheme is emulated: e2m1 and e8m0 as integer codes, e4m3 by torch's own
# `float8_e4m3fn` cast, the arithmetic in float32, so every number below is real on any
# device, and the exact ones are the same on every device. You will see e2m1 and e8m0 bit by
# bit, your network's tensors and an outlier feature under seven schemes, the block-scaled
# matmul, delayed against current scaling, and MXFP8 and NVFP4 layers trained against bf16
# (fp16 on a GPU without bf16), with and without stochastic rounding.

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
# ## e2m1: sixteen values
#
# fp4's **e2m1** has a sign bit, 2 exponent bits and 1 mantissa bit: 16 codes in all.
# **Predict:** how many different magnitudes is that, and what is the largest?

# %%
from amp_lessons.blockscale import e2m1_values

values = e2m1_values()
for code in range(16):
    print(f"code {code:>2}  bits {code:04b}  value {values[code].item():g}")

# %% [markdown]
# Eight magnitudes (one of them zero, twice: +0 and -0), up to 6, with 0.5 the only
# subnormal. Between 4 and 6 there is nothing. Here a value is rounded to the nearest of
# them, a tie going to the even code, and anything above 6 saturates to 6: the rounding of
# PTX's `cvt.rn.satfinite.e2m1x2.f32` (`.rn`: to nearest, ties to even; `.satfinite`: clamp
# to the largest finite value). torch 2.13 has no cast from float to e2m1 that could do it
# for us (the cell after the packing one, below, asks this release):

# %%
from amp_lessons.blockscale import round_e2m1

ties = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 6.5, 100.0])
print("in: ", ties.tolist())
print("out:", round_e2m1(ties).tolist())

# %% [markdown]
# Two 4-bit codes go in one byte. torch's dtype for that byte is `float4_e2m1fn_x2`: the
# first value of each pair in the low four bits, the second in the high four
# (`c10/util/Float4_e2m1fn_x2.h`; `torch/headeronly/util/` in newer releases).
# **Predict** the byte for the pair (1.0, -6.0):

# %%
from amp_lessons.blockscale import as_float4_x2, e2m1_codes, pack_fp4, unpack_fp4

codes = e2m1_codes(torch.tensor([1.0, -6.0]))
packed = pack_fp4(codes)
print("codes", codes.tolist(), "-> byte", f"0x{packed.item():02X}", f"= {packed.item():08b}")
print("unpacked again:", unpack_fp4(packed).tolist())
fp4 = as_float4_x2(packed)
print("as torch's dtype:", "not in this release" if fp4 is None else f"{fp4.dtype}, {fp4.element_size()} byte for 2 values")

# %%
# NBVAL_IGNORE_OUTPUT
try:
    print("cast to", torch.tensor([1.0, -6.0]).to(torch.float4_e2m1fn_x2).dtype)
except (AttributeError, NotImplementedError, RuntimeError, TypeError) as err:
    print(f"floats to float4_e2m1fn_x2, torch {report.torch_version}: {type(err).__name__}: {err}")

# %% [markdown]
# ## e8m0: a scale that is only an exponent
#
# An MX block's scale is **e8m0**: 8 exponent bits, no sign, no mantissa. Code `c` means
# `2^(c - 127)`; code 255 is NaN, and there is no zero. torch has the dtype
# (`float8_e8m0fnu`); `e8m0_decode` builds the same values from float32 bit patterns:

# %%
from amp_lessons.blockscale import as_float8_e8m0, e8m0_decode

probe = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
mine = e8m0_decode(probe)
for c, v in zip(probe.tolist(), mine.tolist()):
    print(f"code {c:>3}: {v:g}" + (f" = 2^{c - 127}" if c < 255 else ""))
theirs = as_float8_e8m0(probe)
print("torch's float8_e8m0fnu reads the same:",
      "no such dtype here" if theirs is None else torch.equal(theirs.float().nan_to_num(-1), mine.nan_to_num(-1)))

# %% [markdown]
# A block's scale `X` is chosen from its largest magnitude (amax). The exact choice,
# `X = amax / 6` for e2m1, puts amax on 6. A power of two can only come near it, and the
# rule that picks it matters. The OCP MX spec v1.0 takes `2^(floor(log2(amax)) - 2)` (2 is
# the exponent of e2m1's largest value, 8 for e4m3's 448), which follows amax's own power of
# two: `amax / X` lands between 4 and 8, so X can fall either side of the exact one, and
# from 7 on `amax / X` saturates to 6 (below 7 it rounds to 6). cuBLAS's rule, "rceil", takes the smallest power of two at or above
# the exact X: amax lands at or below the element's largest value, never above it. **Predict** what each does to this block of values:

# %%
from amp_lessons.blockscale import quantize, with_scales

block = torch.tensor([[7.0, 5.0, 2.5, 1.0, 0.3, -0.2]])
for scheme in ("MXFP4", with_scales("MXFP4", "e8m0", "rceil"), with_scales("MXFP4", "fp32")):
    q = quantize(block, scheme)
    print(f"{q.scheme.name:<26} X = {q.scales.item():<9.6g} stored {q.values.tolist()}, "
          f"read back {[round(v, 4) for v in q.dequantize().flatten().tolist()]}, saturated {q.saturated}")

# %% [markdown]
# The OCP rule keeps X = 1 and clamps 7 to 6. rceil takes X = 2: nothing saturates, but
# 7 / 2 = 3.5 is a tie that rounds to 4 (read back as 8), and 0.3 and -0.2 fall to zero.
# NVFP4 stores its block scales in e4m3 instead: 3 mantissa bits, so a stored scale is
# within 1/16 of the exact one (while it stays in e4m3's normal range), not within a factor
# of 2. Here two blocks of 16, the second with amax 1.3:

# %%
two_blocks = torch.cat([torch.full((16,), 5.0), torch.full((16,), 1.3)]).reshape(1, 32)
q = quantize(two_blocks, "NVFP4")
exact = two_blocks.reshape(2, 16).amax(dim=1) / 6
stored = q.scales.flatten().double() * q.tensor_scale
ratio = stored / exact.double()
print(f"tensor scale {q.tensor_scale:.6g} = amax / (448 * 6); e4m3 block scales {q.scales.flatten().tolist()}")
print("stored / exact block scale:", [round(r, 4) for r in ratio.tolist()],
      "within 1/16:", bool(((ratio - 1).abs() <= 1 / 16).all()))

# %% [markdown]
# ## Your network's tensors under seven schemes
#
# The digits MLP of the earlier lessons, with 256 hidden units so that 128-wide tiles fit
# its hidden layers (the 64 pixels make one partial tile), trains 30 steps in float32.
# Then `record_operands` (lesson 08) keeps, for one batch and every `Linear`, its input,
# weight and output gradient. The first layer's input is the pixels; the later layers'
# inputs are the activations.

# %%
from amp_lessons.claims import measured
from amp_lessons.data import digits
from amp_lessons.fp8 import record_operands
from amp_lessons.models import mlp
from amp_lessons.training import Trainer

data = digits()
trainer = Trainer(mlp(64, 256, 10, depth=2), data, precision="fp32", device=device, lr=5e-3)
history = trainer.fit(30)
x, y = (t.to(device) for t in data.batch(50, 64))
operands = record_operands(trainer.model, x, y)
groups = {"inputs": [operands[0].input], "activations": [o.input for o in operands[1:]],
          "weights": [o.weight for o in operands], "gradients": [o.grad_output for o in operands]}
for kind, tensors in groups.items():
    print(f"{kind:<12} {[tuple(t.shape) for t in tensors]}")

# %% [markdown]
# Each tensor is cut into blocks along its last dimension and quantized under each scheme:
# per tensor and per row (lesson 08's, e4m3), 1x128 tiles and 128x128 blocks (e4m3, float32
# scales), MXFP8 and MXFP4 (1x32 e4m3 or e2m1, e8m0 scales by the OCP floor rule) and NVFP4
# (1x16 e2m1, e4m3 scales, float32 tensor scale). The error is the **signal-to-quantization-
# noise ratio**, `10 log10(sum x² / sum (x - x̂)²)` in dB: higher is better, and one bit of
# precision is worth about 6 dB (halving the error: 20 log10 2 ≈ 6.02).
#
# A value counts as **saturated** when the cast clamps it. Values just past the largest
# element still round back down to it and are not counted: for e4m3 up to 464, the tie
# between 448 and 480, and for e2m1 below 7, the tie between 6 and 8 (to nearest, ties to
# even). **Predict:** which schemes come out on top, and by how much does 4 bits trail 8?

# %%
from amp_lessons.blockscale import SCHEMES, error_table, round_element, saturates

for element, values in (("e4m3", [448.0, 464.0, 464.5]), ("e2m1", [6.0, 6.99, 7.0])):
    v = torch.tensor(values)
    print(f"{element}: {values} round to {round_element(v, element).tolist()}; "
          f"counted saturated: {saturates(v, element).tolist()}")

table = error_table(groups)
print(f"{'':<12}" + "".join(f"{s:>12}" for s in SCHEMES))
for kind, row in table.items():
    print(f"{kind:<12}" + "".join(f"{measured(e.sqnr, '.1f') + ' dB':>12}" for e in row.values()))

# %%
from amp_lessons.blockplots import scheme_bars

scheme_bars(table)

# %% [markdown]
# Among these seven schemes the element format sets the level: the e2m1 schemes trail every
# e4m3 one by more than a bit's 6 dB (the verdicts below). (A scale that underflows can drop
# a scheme far below its level: NVFP4 without its tensor scale, further down.) (The inputs are pixels, multiples of 1/16, which e4m3
# holds exactly under a power-of-two scale: MXFP8 errs there only where it saturates.) A
# float's rounding error is relative to the value, so for e4m3 a finer scale changes little
# while the values stay in its normal range. What it changes is the bottom and the top of
# the range: the values flushed to zero, and those saturated:

# %%
for what in ("flushed", "saturated"):
    print(f"{what + ', %':<12}" + "".join(f"{s:>12}" for s in SCHEMES))
    for kind, row in table.items():
        print(f"{kind:<12}" + "".join(f"{measured(100 * getattr(e, what) / e.nonzero, '.2f') + '%':>12}"
                                      for e in row.values()))

# %%
from amp_lessons.blockscale import error
from amp_lessons.claims import at_least, at_most, between, check

grads = table["gradients"]
print(at_most("MXFP8's 32-value blocks flush at most half as many gradient values as one scale per tensor",
              grads["MXFP8"].flushed / max(grads["per tensor"].flushed, 1), 0.5))
nv_minus_mx = min(row["NVFP4"].sqnr - row["MXFP4"].sqnr for row in table.values())
print(at_least("NVFP4 keeps at least 0.25 dB more than MXFP4 for every kind of tensor", nv_minus_mx, 0.25, ".2f"))
gap = min(min(e.sqnr for s, e in row.items() if SCHEMES[s].element == "e4m3")
          - max(e.sqnr for s, e in row.items() if SCHEMES[s].element == "e2m1") for row in table.values())
print(at_least("for every kind, the worst e4m3 scheme beats the best e2m1 one by at least 6 dB", gap, 6.0, ".1f"))
print(at_most("NVFP4 saturates at most 0.1% of any kind",
              max(row["NVFP4"].saturated / row["NVFP4"].nonzero for row in table.values()), 1e-3, ".2g"))

# %% [markdown]
# MXFP8's blocks are finer than one scale per tensor, yet by the OCP floor rule it trails
# per tensor on the activations, weights and gradients: that rule saturates about 1% of each
# (the table above). The MXFP8 recipes of torchao 0.18 (its training and inference configs)
# and of Transformer Engine round the scale up instead, by rceil (Sources). The same blocks:

# %%
rceil = with_scales("MXFP8", "e8m0", "rceil")
mx_rceil = {kind: error(ts, rceil) for kind, ts in groups.items()}
print(f"{'MXFP8 by':<12}{'OCP rule':>12}{'rceil':>12}{'per tensor':>12}")
for kind, e in mx_rceil.items():
    sqnr = "exact" if e.sqnr == float("inf") else measured(e.sqnr, ".1f") + " dB"
    print(f"{kind:<12}{measured(table[kind]['MXFP8'].sqnr, '.1f') + ' dB':>12}{sqnr:>12}"
          f"{measured(table[kind]['per tensor'].sqnr, '.1f') + ' dB':>12}")
print(check("by the OCP rule MXFP8 trails per tensor on the activations, weights and gradients",
            all(table[k]["MXFP8"].sqnr < table[k]["per tensor"].sqnr for k in ("activations", "weights", "gradients"))))
print(check("with rceil scales MXFP8 saturates nothing, beats its OCP-rule self, and comes within 0.5 dB of "
            "per tensor (or above it) on every kind",
            all(e.saturated == 0 and e.sqnr > table[k]["MXFP8"].sqnr and e.sqnr >= table[k]["per tensor"].sqnr - 0.5
                for k, e in mx_rceil.items())))

# %% [markdown]
# NVFP4 differs from MXFP4 in three ways: half the block size, block scales in e4m3 instead
# of powers of two, and a float32 scale over the whole tensor. How much of MXFP4's loss is
# the power-of-two scale alone? The same 1x32 e2m1 blocks with float32 scales `amax / 6`
# ("exact": the scale itself unrounded, though not always the best scale for a block), and
# NVFP4 without its tensor scale:

# %%
exact_scales = with_scales("MXFP4", "fp32")
cost = {kind: error(ts, exact_scales).sqnr - table[kind]["MXFP4"].sqnr for kind, ts in groups.items()}
print("dB lost to e8m0 against exact scales:", {k: measured(v, ".2f") for k, v in cost.items()})
print(check("on this network, a power-of-two scale costs MXFP4 between 0 and 6.02 dB on every kind",
            all(0 <= v <= 6.02 for v in cost.values()),
            f"{measured(min(cost.values()), '.2f')} to {measured(max(cost.values()), '.2f')} dB"))
no_tensor_scale = with_scales("NVFP4", "e4m3")
g = error(groups["gradients"], no_tensor_scale)
zero = torch.cat([quantize(t, no_tensor_scale).scales.flatten() == 0 for t in groups["gradients"]]).float().mean()
print(check("without its tensor scale NVFP4 flushes over 90% of the gradients", g.flushed > 0.9 * g.nonzero,
            f"{measured(100 * g.flushed / g.nonzero, '.0f')}%, {measured(g.sqnr, '.1f')} dB against "
            f"{measured(table['gradients']['NVFP4'].sqnr, '.1f')} dB with it; block scales stored as 0: "
            f"{measured(100 * zero.item(), '.0f')}%"))

# %% [markdown]
# The gradients' block scales, `amax / 6`, are small enough that e4m3 (smallest subnormal
# 2^-9) stores most of them as 0, and their blocks with them; NVFP4's tensor scale lifts
# them into e4m3's range.
#
# ## An outlier feature
#
# Dettmers et al. (LLM.int8()) found that transformer language models grow a few feature
# dimensions far larger than the rest, and that from about 6.7B parameters these outlier
# features appear systematically: in every layer and in about 75% of the sequence
# positions. Here a 64 x 256 activation of exact values
# (`±(1 + k/8) * 2^e`, e from -8 to 0, drawn from integers, so the counts below are the same
# on every device) whose feature 5 is `2^12` times each row's own value, so its size varies
# from row to row. **Predict:** per-row scales rescued lesson 08's outlier *row*; do they
# rescue an outlier *column* like this one? The counts are of the
# other 16,320 values:

# %%
from amp_lessons.blockscale import outlier_features

acts, feature = outlier_features()
outlier = {s: error(acts, s, leave_out=feature) for s in SCHEMES}
for s, e in outlier.items():
    print(f"{s:<11} flushed {e.flushed:>5} of {e.nonzero}, saturated {e.saturated:>4}")

# %%
print(check("per row flushes more than 1x128 tiles, those more than MXFP8, which flushes under 1% (per tensor over 20%)",
            outlier["per tensor"].flushed > 0.2 * 16320 and 0.01 * 16320 > outlier["MXFP8"].flushed
            and outlier["per row"].flushed > outlier["1x128"].flushed > outlier["MXFP8"].flushed))
mx_rceil_outlier = error(acts, rceil, leave_out=feature)
print(check("MXFP8 also saturates values here, all from the OCP rule: with rceil scales none saturate",
            outlier["MXFP8"].saturated > 0 and mx_rceil_outlier.saturated == 0,
            f"OCP rule {outlier['MXFP8'].saturated} saturated, rceil {mx_rceil_outlier.saturated} "
            f"(and {mx_rceil_outlier.flushed} flushed, against {outlier['MXFP8'].flushed})"))
q = quantize(acts, "MXFP8")
lost = (acts != 0) & (q.dequantize() == 0) & ~feature
over = q.saturated_mask & ~feature
for what, mask in (("flushed", lost), ("saturated", over)):
    print(f"MXFP8's {what} values in the outlier's block (features 0-31, the outlier left out): "
          f"{int(mask[:, :32].sum())}, in the other 7 blocks: {int(mask[:, 32:].sum())}")
by_rceil = quantize(acts, rceil)
print(f"the outlier itself (one value in each of {acts.shape[0]} rows) saturated: by the OCP rule in "
      f"{int((q.saturated_mask & feature).sum())} rows, by rceil in {int((by_rceil.saturated_mask & feature).sum())}")

# %% [markdown]
# Only the blocks that hold the outlier lose their small values: for MXFP8, one block of
# 32 in 8 along each row (the counts above). A per-row scale helps only as far as the
# outlier's size varies by row: here it is each row's own value times 2^12 (so it varies by
# up to 2^8 x 1.875), which is why per row flushes far fewer than per tensor. Besides the
# outlier itself, MXFP8's saturated values lie in the other blocks; the OCP rule saturates
# the outlier too, in some rows, and rceil in none. DeepSeek-V3's report gives outliers as the
# reason for its 1x128 activation tiles.
#
# ## The block-scaled matmul, exactly
#
# A block-scaled kernel computes, in effect: the stored element values multiplied block by
# block along K, each block's partial product scaled by its two scales, and the sum.
# `block_mm` computes exactly that in float32; the reference is dequantize-then-matmul.
# With values MXFP8 holds exactly (rceil scales, so nothing saturates) and power-of-two
# scales, every product and sum below is exact, so **predict**: bit for bit?

# %%
from amp_lessons.blockscale import accumulation_bound, block_mm, exact_values, reference_mm

A, B = exact_values((64, 256), -4, 0, seed=1), exact_values((32, 256), -4, 0, seed=2)
qa, qb = quantize(A, rceil), quantize(B, rceil)
print("MXFP8 holds A exactly:", torch.equal(qa.dequantize(), A))
print("block_mm equals dequantize-then-matmul bit for bit:", torch.equal(block_mm(qa, qb), reference_mm(qa, qb)))

# %% [markdown]
# On the network's real operands, the sums happen in another order and float32 rounds each
# one differently, so the two differ in the last bits, within twice the standard bound for
# a float32 sum of K products, `γ_K sum |a||b|` with `γ_K = Ku / (1 - Ku)`, about `K u`,
# u = 2^-24 (Higham, below; `accumulation_bound` counts 4 more roundings, the scales'):

# %%
o = operands[1]
for scheme in ("MXFP8", "NVFP4"):
    qa, qb = quantize(o.input, scheme), quantize(o.weight, scheme)
    diff = (block_mm(qa, qb) - reference_mm(qa, qb)).abs()
    print(check(f"{scheme}: block by block is dequantize-then-matmul, within the float32 accumulation bound",
                bool((diff <= accumulation_bound(qa, qb)).all()), f"largest difference {measured(diff.max().item(), '.2g')}"))

# %% [markdown]
# On an NVIDIA GPU of compute capability 10.0+ (Blackwell), `python -m amp_lessons
# selfcheck` (`make gpu-check`) runs torch's MXFP8 kernel (`F.scaled_mm`, 1x32 e8m0 scales)
# on exact inputs against the reference. (torch also has MX kernels for ROCm's gfx950, which
# this check does not run.) Here:

# %%
from amp_lessons.blockscale import block_kernel_check

result = block_kernel_check(device)
print("skipped:" if result.skipped else "ran:", result.skipped or result)

# %% [markdown]
# ## Delayed against current scaling
#
# Lesson 08 scales **currently**: it reads the tensor's amax, then casts. That is one more
# pass over the tensor before the cast. Transformer Engine's `DelayedScaling` recipe casts
# with a scale computed from the amaxes of earlier steps, and records this step's amax as
# it goes: `scale = fmt.max / max(amax history) / 2^margin`, with a history of
# `amax_history_len` steps (1024 by default) and `margin` 0. Below, 40 steps of activations
# (512 exact values each, all below 2, spread over 15 powers of two) of which step 20 holds
# one outlier token: 4 values of ±32. **Predict:** on which steps does delayed scaling
# saturate, and what happens after?

# %%
from amp_lessons.delayed import run_current, run_delayed, spike_sequence

seq = spike_sequence(steps=40, spike_at=20, factor=16)
casts = {"current": run_current(seq),
        "delayed, history 16": run_delayed(seq, history_len=16),
        "delayed, history 16, margin 5": run_delayed(seq, history_len=16, margin=5),
        "delayed, history 4": run_delayed(seq, history_len=4)}
before = max(t.abs().max().item() for t in seq[:20])
print(f"the spike's amax is {seq[20].abs().max().item():g}, {seq[20].abs().max().item() / before:.4g} times the largest before it")
for label, steps in casts.items():
    saturating = [s.step for s in steps if s.saturated]
    flushing = [s.step for s in steps[1:] if s.flushed]
    print(f"{label:<30} saturates on steps {saturating}, flushes on {len(flushing)} of steps 1-39 "
          f"({sum(s.flushed for s in steps[1:])} values)")

# %%
from amp_lessons.blockplots import delayed_scaling

delayed_scaling(casts, spike_at=20)

# %%
d16, d4 = casts["delayed, history 16"], casts["delayed, history 4"]
after = {label: [s.step for s in steps[21:] if s.flushed > casts["current"][s.step].flushed]
         for label, steps in (("16", d16), ("4", d4))}
print(check("delayed scaling saturates on the spike's step, and on no other",
            [s.step for s in d16 if s.saturated] == [20], f"steps {[s.step for s in d16 if s.saturated]}"))
print(check("current scaling never saturates", not any(s.saturated for s in casts["current"])))
print(check("after the spike, delayed scaling flushes more than current scaling for exactly as many steps as its history holds",
            (len(after["16"]), len(after["4"])) == (16, 4), f"history 16: {len(after['16'])} steps, history 4: {len(after['4'])}"))
m5 = casts["delayed, history 16, margin 5"]
print(check("a margin of 5 saturates nothing, and pays with flushed values on every step",
            not any(s.saturated for s in m5) and all(s.flushed for s in m5), f"{min(s.flushed for s in m5)} to {max(s.flushed for s in m5)} a step"))

# %% [markdown]
# In the course's `run_delayed` the first step casts with scale 1 (there is no history yet),
# hence its flushes. Then, like
# current scaling, delayed scaling flushes and saturates nothing until the spike, which it
# cannot see coming: the spike saturates. For the next `amax_history_len` steps the
# history's largest amax is the spike's, so every step casts with the spike's small scale
# and flushes its smallest values.
# A margin of 5 (2^5 = 32, more than the spike's jump) keeps the spike in range, at the price
# of 5 powers of two on every step. Transformer Engine also has current scaling
# (`Float8CurrentScaling`) and block recipes, whose scales come from the tensor being cast.
#
# ## Training below 8 bits
#
# Lesson 08's fp8 linear, with blocks: `BlockLinear` quantizes both operands of each of its
# three matmuls along the dimension that matmul sums over (MXFP8: 1x32 e4m3 with e8m0
# scales by rceil, as torchao's and Transformer Engine's MXFP8 recipes pick them, gradients
# included: with a scale per 32 values e4m3's range is enough, where lesson 08's per-tensor
# recipe used e5m2; NVFP4: 1x16 e2m1 with e4m3 scales and a tensor scale),
# dequantizes, and multiplies in float32: the numbers, not the speed. The 10-class head stays float32. For NVFP4, the
# output gradient is rounded to nearest, or stochastically. A smaller MLP than above, two
# hidden layers of 64 (a multiple of both block sizes), so that four runs stay quick; the
# four start from the same weights and train 150 steps each. The loss printed is the mean of
# the last 20 steps, which smooths the step-to-step noise of one batch.
# **Predict:** does 4 bits keep up?

# %%
import copy

from amp_lessons.blocktrain import convert_to_blocks
from amp_lessons.hardware import supported_precisions

baseline = "bf16" if supported_precisions(device)["bf16"] is None else "fp16"
start = mlp(64, 64, 10, depth=2)
runs, accuracy = {}, {}
for label in (baseline, "mxfp8", "nvfp4", "nvfp4 + stochastic grads"):
    model = copy.deepcopy(start) if label == baseline else convert_to_blocks(copy.deepcopy(start), label)
    t = Trainer(model, data, precision=baseline if label == baseline else "fp32", device=device, lr=5e-3)
    runs[label] = t.fit(150)
    accuracy[label] = t.evaluate()
ends = {k: sum(h["loss"][-20:]) / 20 for k, h in runs.items()}
for label in runs:
    print(f"{label:<25} loss {measured(ends[label])}, test accuracy {measured(accuracy[label])}")
print(model)

# %%
for label in ("mxfp8", "nvfp4", "nvfp4 + stochastic grads"):
    print(at_least(f"{label} reaches at least 90% of {baseline}'s test accuracy",
                   accuracy[label] / accuracy[baseline], 0.9))
    print(at_most(f"{label}'s final loss (mean of the last 20 steps) is at most 2x {baseline}'s",
                  ends[label] / ends[baseline], 2.0))
sr, rn = "nvfp4 + stochastic grads", "nvfp4"
print(check("in this one seeded run stochastic rounding gains nothing measurable over round-to-nearest: "
            "test accuracy not 2 points higher, final loss not 5% lower",
            accuracy[sr] - accuracy[rn] < 0.02 and ends[sr] / ends[rn] > 0.95,
            f"accuracy {measured(accuracy[sr] - accuracy[rn], '+.3f')}, loss x{measured(ends[sr] / ends[rn], '.3f')}"))

# %%
from amp_lessons.blockplots import block_training

block_training(runs)

# %% [markdown]
# On this small network both 4-bit runs keep up, and in this one seeded run of 150 steps
# stochastic rounding showed no gain (the check above is one-sided: it asks only whether it
# helped). NVIDIA's NVFP4 recipe for large language models also keeps some
# layers in higher precision, applies random Hadamard transforms to the weight-gradient
# inputs and uses 16x16 blocks for weights, none of which is here (the head above stays
# float32 because its 10 outputs are no multiple of a block, not by that recipe). One ingredient is here:
# **stochastic rounding** of the gradients. What does it keep? A
# gradient block whose largest value lands on 6 and whose other values are 0.2, below half
# of e2m1's smallest step:

# %%
from amp_lessons.blocktrain import small_update_demo

demo = small_update_demo(small=0.2, large=6.0, n=15, steps=1000)
print("the block:         ", [round(v, 2) for v in demo["block"].tolist()])
print("round to nearest:  ", demo["nearest"].tolist())
print("one stochastic draw:", demo["stochastic_first"].tolist())

# %%
print(check("round-to-nearest turns all 15 small values into 0, on every step", demo["nearest_mean"] == 0.0))
print(between("stochastic rounding's mean over 1000 draws is the true 0.2, within 10%",
              demo["stochastic_mean"], 0.18, 0.22))

# %% [markdown]
# Round to nearest loses those updates every step, the way fp16 flushed lesson 03's small
# gradients. Stochastic rounding rounds 0.2 up to 0.5 with probability 0.4 and down to 0
# otherwise: each draw is coarser, but the mean is right, so the updates add up over steps.
#
# ## Which hardware runs what
#
# A lookup from the sources at the end, not a measurement:

# %%
from amp_lessons.blockscale import hardware_table

print(hardware_table())

# %% [markdown]
# What this torch release's `F.scaled_mm` says to 1x32 e8m0 block scales on a CPU (`None`
# means it ran them):

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.blockscale import cpu_block_refusal

print(f"torch {report.torch_version}:", cpu_block_refusal())

# %% [markdown]
# ## The same with torchao
#
# torchao has MX tensors (`torchao.prototype.mx_formats`), optional here (`pip install -e
# ".[fp8]"`). Whether it is installed, and what it runs on a CPU, depends on the machine,
# so this cell is not compared.

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.blocktrain import torchao_mx

MXTensor, why_not = torchao_mx()
if MXTensor is None:
    print(why_not)
else:
    w = operands[1].weight
    try:
        mx = MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
        gap = (mx.dequantize(torch.float32) - quantize(w, "MXFP8").dequantize()).abs().max().item()
        print(f"torchao's MXFP8 of a weight (its default rule, the OCP floor) against this lesson's: "
              f"largest difference {gap:g}")
    except Exception as err:  # the prototype API moves between releases
        print(f"torchao's MXTensor.to_mx did not run here: {type(err).__name__}: {err}")

# %% [markdown]
# ## Remember
#
# - e2m1 has 16 codes, 8 magnitudes up to 6; two codes share a byte (`float4_e2m1fn_x2`,
#   the first in the low nibble). e8m0 is a bare power of two, 2^-127 to 2^127, 255 = NaN.
# - The element sets the level: here every e4m3 scheme beats every e2m1 one by over 6 dB.
#   With e4m3 a finer scale rescues the small values an outlier pushes out: a 32-value block
#   confines an outlier feature; a per-row scale helps only as far as it varies by row.
# - NVFP4 beats MXFP4 here (it has 16-value blocks and e4m3 scales; measured apart: MXFP4's
#   power-of-two scales cost it less than a bit's 6 dB against exact float32 scales), and
#   needs its tensor scale for gradient-sized values.
# - Emulated in float32, a block-scaled matmul is dequantize-then-matmul, up to accumulation
#   order. A real kernel may accumulate with less: DeepSeek-V3 (section 3.3) measured about
#   14 bits on H800's fp8 tensor cores, and adds partial sums into float32 every 128 values.
# - Delayed scaling uses earlier steps' amaxes: a spike saturates, then shrinks the scale
#   for as long as the history holds it.
#
# ## Watch out
#
# - The OCP floor rule can saturate the top of a block; rceil does not. Know which one your
#   quantizer uses (torchao 0.18's `MXTensor.to_mx` defaults to `FLOOR`).
# - `margin` buys headroom for spikes with range at the bottom, on every step.
# - Round-to-nearest in 4 bits drops a block's small gradient values every step (the block
#   above). NVIDIA's NVFP4 recipe rounds gradients stochastically; in the one seeded run
#   above it gained nothing measurable, and such a result can change from seed to seed:
#   measure it on yours, over several seeds.
#
# ## Exercise: an e8m0 scale that never saturates
#
# The function below should return each block's e8m0 code: the power of two `X` that puts
# the block's largest magnitude as high as it can go without passing the element's largest
# value (e8m0's smallest, 2^-127, for a block too small for any). One thing is wrong.

# %%
import inspect

from amp_lessons.block_exercise import check_e8m0_code, e8m0_code_as_given

print(inspect.getsource(e8m0_code_as_given))

# %% [markdown]
# Copy it into the cell below as `def my_e8m0_code(amax, element_max=448.0):` and fix it. The
# checker runs it for e4m3 (448) and e2m1 (6) on exact amaxes, from float32 subnormals up.
# As given, it checks the function above:

# %%
my_e8m0_code = e8m0_code_as_given  # replace with your own: def my_e8m0_code(amax, element_max=448.0): ...

check_e8m0_code(my_e8m0_code)

# %% [markdown]
# ## Sources
#
# - OCP Microscaling Formats (MX) Specification v1.0 (2023): MXFP8 and MXFP4 with 32-value
#   blocks, e8m0 scales (255 = NaN), e2m1's values, the shared scale
#   `2^(floor(log2(amax)) - emax_elem)`.
# - torch: `c10/util/Float4_e2m1fn_x2.h`, `torch.float8_e8m0fnu`, `torch/nn/functional.py`'s
#   `scaled_mm` with `ScalingType` (`BlockWise1x16`, `BlockWise1x32`, `BlockWise1x128`,
#   `BlockWise128x128`) and `SwizzleType.SWIZZLE_32_4_4`, the layout cuBLAS reads block scales
#   in; `aten/src/ATen/native/cuda/ScaledBlas.cpp`'s `_check_deepseek_support` (1x128 and
#   128x128 on compute capability 9.x with cuBLASLt 12.9+ only) and `_scaled_mxfp8_mxfp8`
#   (on ROCm, "only supported on gfx950").
# - PTX ISA, `cvt` with `.e2m1x2`: `.rn` rounds to nearest even, `.satfinite` clamps; `mma`
#   (and Blackwell's `tcgen05.mma`) with `.block_scale`: the tensor core scales A and B by
#   their block scales (`scale_A`, `scale_B`) itself ("Block Scaling").
# - NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference" (blog,
#   2025); "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149).
# - cuBLAS documentation, "1D block quantization": the 128 x 4 tile layout of block scales
#   (`to_blocked`) and the rceil rule.
# - torchao 0.18: `ScaleCalculationMode` (`FLOOR`, the OCP rule; `RCEIL`) in
#   `prototype/mx_formats/config.py`; `FLOOR` is the default of `mx_tensor.py`'s `to_mx`,
#   `RCEIL` of `prototype/moe_training/config.py`'s `MXFP8TrainingOpConfig` and of
#   `prototype/mx_formats/inference_workflow.py`'s `MXDynamicActivationMXWeightConfig`.
# - Transformer Engine, Common API: `DelayedScaling(margin=0, amax_history_len=1024,
#   amax_compute_algo="max")`, the scale `fmt.max / amax / 2^margin`
#   (`nvte_delayed_scaling_recipe_amax_and_scale_update`; in PyTorch,
#   `transformer_engine/pytorch/quantization.py`'s `_default_sf_compute`, which keeps the
#   previous scale when the amax is 0 or not finite; older releases rounded the scale
#   down to a power of two), `Float8CurrentScaling`, `Float8BlockScaling`, and its MXFP8
#   page: "native hardware acceleration on Blackwell GPUs (SM 10.0+)"; each block's e8m0
#   scale from `amax_block / 448`, "rounding up if the mantissa is non-zero" (rceil).
# - Dettmers et al., "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale"
#   (arXiv 2208.07339).
# - DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 3.3.
# - The error bound of a float sum of K products, `γ_K |a|·|b|` with `γ_K = Ku / (1 - Ku)`:
#   N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. (SIAM, 2002),
#   section 3.1.
