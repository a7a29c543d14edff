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
# # 00 · Start here: what this machine can do
#
# This course teaches mixed-precision training in PyTorch by letting you **see** it
# happen on your own hardware: gradients that vanish in float16 but survive in bfloat16,
# the dtype each operation really runs in under `torch.autocast`, `GradScaler` scaling the
# loss and skipping bad steps, and the gradient-clipping trap. Every claim is shown by a
# cell you run, on this machine.
#
# | lesson | what you will see |
# |---|---|
# | 00 start here | this machine's report, the precision to use here and why |
# | 01 number formats | fp32, tf32, bf16, fp16, fp8: range, precision, and your gradients against them |
# | 02 autocast | which op ran in which dtype, traced on this device and, simulated, on CUDA |
# | 03 grad scaler | fp16 gradients flushed to zero; GradScaler scaling, unscaling, skipping |
# | 04 clipping | clipping before `unscale_`: the threshold divided by the scale, measured |
# | 05 putting it together | fp32 / tf32 / bf16 / fp16 side by side: accuracy, speed, memory |
# | 06 error messages | the AMP errors and warnings you will meet, reproduced, explained, fixed |
# | 07 beyond one device | DDP and FSDP2 in mixed precision, with two real processes |
# | 08 fp8 | e4m3 and e5m2, per-tensor and per-row scales, a small fp8 layer trained |
#
# ## The card
#
# The course teaches one page of advice, the kind that gets pinned above a desk. Lessons
# quote it as *the card*; each of its sentences is shown happening somewhere:
#
# > Mixed precision typically gives 2-3x faster training and halves activation memory on
# > modern GPUs. *(measured in 05)*
# >
# > Mixed precision keeps weights in float32 but runs most computation in a 16-bit type.
# > Tensor cores on modern GPUs are much faster in 16-bit, and activations take half the
# > memory. *(02, 05)*
# >
# > `torch.autocast(device_type, dtype)` is a context manager around the forward pass and
# > loss. Inside it, ops that benefit (matmul, convolutions) run in low precision, while
# > numerically sensitive ones (softmax, losses, reductions) are kept in float32
# > automatically. Run `backward()` outside the context. *(traced in 02)*
# >
# > - bfloat16 has float32's exponent range, so it rarely underflows. It is the default
# >   choice on Ampere-or-newer GPUs and TPUs, and needs no extra machinery. *(01, 03)*
# > - float16 has more mantissa but a narrow range; small gradients underflow to zero. Use
# >   `torch.amp.GradScaler`, which multiplies the loss by a large factor before
# >   `backward()`, unscales before the step, and skips steps that produced inf or NaN. *(01, 03)*
# >
# > If you clip gradients with a scaler, call `scaler.unscale_(opt)` before clipping. *(04)*
# >
# > `torch.set_float32_matmul_precision("high")` lets float32 matmuls use TF32 tensor cores
# > on NVIDIA GPUs, a near-free speedup for code you do not convert. *(05)*
# >
# > Keep the model's weights in float32 (do not call `model.half()` for training); autocast
# > handles the casts. *(05)*
#
# Its code example runs, as written, in lesson 02. Some sentences turn out to hold only on
# some devices (softmax stays float32 under CUDA's autocast, not a CPU's); the lessons
# show where.
#
# Every lesson opens with the same setup cell. On Colab it installs the course package;
# elsewhere `make lab` already did.

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

# %% [markdown]
# ## This machine
#
# The report below is what the package found here. Its output is not compared by the
# tests (it differs from machine to machine); almost everything after it is.

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.hardware import matmul_speedups

device = amp_lessons.pick_device()
speedups = matmul_speedups(device)  # one small matmul per precision (see below)
report = amp_lessons.hardware_report(device, measure=speedups)
print(report.table())

# %% [markdown]
# Three facts decide which precision to train in:
#
# - **the device**: a GPU with tensor cores runs 16-bit matmuls many times faster than
#   float32; a CPU does so only with fast 16-bit kernels (AMX tile units, or AVX512-BF16
#   instructions that torch's kernels use well).
# - **native or emulated bfloat16**: a T4 (compute capability 7.5) *reports* bf16 support
#   through `torch.cuda.is_bf16_supported()`, but only by emulation, which is slow.
#   `is_bf16_supported(including_emulation=False)` tells the truth.
# - **whether float16 needs a GradScaler**: when some gradients fall below float16's range,
#   which is the usual case for large networks and happens even to small ones (lesson 01
#   counts how many of yours do; lesson 03 trains with and without a scaler). Some networks
#   do train in float16 without one, when all their gradients fit. bfloat16 has float32's
#   range, so it rarely needs one.
#
# Rather than trust a rule for the first fact, the report measured it: one small matmul per
# precision, timed here. (The rates are printed with `≈`: see "Reading the outputs" below.)

# %%
from amp_lessons.claims import measured

for p, r in speedups.items():
    print(f"{p} matmul: {measured(r, '.2g')}x float32's rate on {device.type}")

# %% [markdown]
# The recommendation for this machine, and why; on a CPU it cites the measurement above:

# %%
# NBVAL_IGNORE_OUTPUT
print(report.recommended, "+ GradScaler" if report.use_scaler else "(no GradScaler)")
print(report.reason)

# %% [markdown]
# The same rules, applied to the devices learners use most. `recommend` is a pure
# function of a device's facts, so this table is the same on every machine (CPUs without a
# measurement fall back to their class's rule):

# %%
from amp_lessons.hardware import recommend

devices = {
    "laptop CPU, no bf16 instructions": ("cpu", None, False, False, False),
    "CPU with AVX512-BF16, no AMX": ("cpu", None, True, True, False),
    "CPU with AMX (Sapphire Rapids)": ("cpu", None, True, True, True),
    "Colab T4 (7.5)": ("cuda", (7, 5), False, False, False),
    "V100 (7.0)": ("cuda", (7, 0), False, False, False),
    "A100 (8.0)": ("cuda", (8, 0), True, False, False),
    "H100 (9.0)": ("cuda", (9, 0), True, False, False),
}
for label, facts in devices.items():
    precision, scaler, _ = recommend(*facts)
    print(f"{label:<34} {precision}{' + GradScaler' if scaler else ''}")

# %% [markdown]
# Why not bf16 on a T4? Here is the reason the package gives for Colab's free GPU:

# %%
print(recommend("cuda", (7, 5), bf16_native=False)[2])

# %% [markdown]
# Not every precision exists everywhere. On any CPU, TF32 does not (it is a format of NVIDIA's
# tensor cores), while bf16 and fp16 autocast both run. **Predict**: does float16 really
# run on a CPU, or is it refused?

# %%
from amp_lessons.hardware import supported_precisions

{name: why or "runs" for name, why in supported_precisions("cpu").items()}

# %%
a = torch.randn(64, 64)
for dtype in (torch.bfloat16, torch.float16):
    with torch.autocast("cpu", dtype=dtype):
        print(f"autocast {dtype} on the CPU: the matmul's result is {(a @ a).dtype}")

# %% [markdown]
# Both run. Whether they run *fast* is what the measurement above said: a CPU may have
# quick bf16 kernels and slow fp16 ones, or neither.
#
# Precision names are parsed in one place. **Predict**: what does `"half"` mean, and what
# happens with a typo?

# %%
[amp_lessons.parse_precision(n) for n in ("float16", "half", torch.bfloat16, "FP32", "tf32")]

# %% [markdown]
# A cell that fails on purpose runs its code inside `expect_error`, which prints the error
# as the last line of a traceback would and lets "Run all" go on, in Colab too:

# %%
from amp_lessons.show import expect_error

with expect_error(ValueError):
    amp_lessons.parse_precision("fp61")

# %% [markdown]
# ## Reading the outputs: `≈` figures and `✓` verdicts
#
# Some numbers come out of float kernels: a loss after 100 steps, a timing, a norm. Another
# CPU (AVX2 or AVX-512, with or without AMX), another thread count, another torch release or
# a GPU prints other digits for them. The lessons print such a figure with a leading `≈`
# (`measured` above). The course's tests compare every output except those digits.
#
# A sentence the text draws from such figures ("fp16 without a scaler falls behind") is
# checked, in the cell, by a **verdict** with its margin in the words: `✓ holds` on this
# machine, or `✗ did not hold here`, with the figures it used. Two verdicts on the figures
# above, one exact and one with a margin:

# %%
from amp_lessons.claims import Verdict, at_least, check

with torch.autocast("cpu", dtype=torch.float16):
    print(check("float16 autocast runs matmuls in float16 on this CPU", (a @ a).dtype == torch.float16))
ratio = 1.0 if report.recommended in ("fp32", "tf32") else speedups[report.recommended]
print(at_least("the precision recommended here multiplies matrices at least 0.8x as fast as float32",
               ratio, 0.8))

# %% [markdown]
# And what a refused claim looks like (built by hand here, so that it is not counted as a
# finding; a lesson's own verdicts are computed, never built):

# %%
Verdict("a float16 matmul runs at least 1000x float32's rate here", speedups["fp16"] >= 1000,
        f"{measured(speedups['fp16'], '.2g')}; needs >= 1000")

# %% [markdown]
# A lesson never keeps a sentence that its verdict refuses on the machines it was tested
# on. If one prints `✗` on yours, the claim does not hold there: that is a finding worth
# reporting.
#
# ## How the widgets work
#
# Lessons 01-05 have widgets: controls wired to the same functions the cells call, so
# moving one re-runs a small computation and redraws. Click a precision below: the
# text shows the dtype autocast computes in, whether a GradScaler is needed, and whether
# this device can run it. (In a static view, such as GitHub's, widgets do not render:
# open the notebook in JupyterLab or Colab.)

# %%
from amp_lessons.widgets import precision_picker

precision_picker()

# %% [markdown]
# The text under the buttons is computed by `describe_precision`; here it is for fp16
# on the CPU, which every machine has:

# %%
from amp_lessons.widgets import describe_precision

print(describe_precision("fp16", "cpu"))

# %% [markdown]
# ## Running the lessons
#
# - **Locally**: `make lab` creates `.venv`, installs the course and opens JupyterLab here;
#   `make test` re-runs every lesson and compares its outputs with the stored ones.
# - **Colab**: open a lesson from the README's "Open in Colab" links. The setup cell installs
#   the package. *Runtime → Change runtime type → T4 GPU* gives you a GPU: the lessons then
#   train on it, in fp16 with a GradScaler, as recommended above for a T4.
# - **Headless**: `python -m amp_lessons doctor` prints the report above;
#   `make gpu-check` runs every lesson as a script and prints every verdict, with the
#   statements the lessons make about CUDA checked for real when a GPU is there.
#
# The stored outputs come from a CPU run. On another machine the `≈` digits differ and the
# verdicts are computed again from yours. The lessons were written on CPUs: where they say
# what CUDA does (lesson 02's autocast lists, say), it comes from PyTorch's source and a
# simulation of CUDA's autocast on the CPU, and `make gpu-check` checks it on a real GPU.
