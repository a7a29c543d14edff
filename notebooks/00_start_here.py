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
# loss and skipping bad steps, and the gradient-clipping trap. Every claim is a cell you run.
#
# | lesson | what you will see |
# |---|---|
# | 00 start here | this machine's report, the precision to use here and why |
# | 01 number formats | fp32, tf32, bf16, fp16, fp8: range, precision, and your gradients against them |
# | 02 autocast | which op ran in which dtype, traced on this device |
# | 03 grad scaler | fp16 gradients flushed to zero; GradScaler scaling, unscaling, skipping |
# | 04 clipping | clipping before `unscale_`: the threshold 65536x too strict, measured |
# | 05 putting it together | fp32 / tf32 / bf16 / fp16 side by side: accuracy, speed, memory |
#
# Every lesson opens with the same setup cell. On Colab it installs the course package;
# elsewhere `make lab` already did.

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

# %% [markdown]
# ## This machine
#
# The report below is what the package found here. Its output is not compared by the
# tests (it differs from machine to machine); everything after it is.

# %%
# NBVAL_IGNORE_OUTPUT
report = amp_lessons.hardware_report()
print(report.table())

# %% [markdown]
# Three facts decide which precision to train in:
#
# - **the device**: a GPU with tensor cores runs 16-bit matmuls many times faster than
#   float32; a CPU does so only with AMX tile units.
# - **native or emulated bfloat16**: a T4 (compute capability 7.5) *reports* bf16 support
#   through `torch.cuda.is_bf16_supported()`, but only by emulation, which is slow.
#   `is_bf16_supported(including_emulation=False)` tells the truth.
# - **whether float16 needs a GradScaler**: it always does (lesson 03); bfloat16 never does.
#
# The recommendation for this machine, and why:

# %%
# NBVAL_IGNORE_OUTPUT
print(report.recommended, "+ GradScaler" if report.use_scaler else "(no GradScaler)")
print(report.reason)

# %% [markdown]
# The same rules, applied to the devices learners use most. `recommend` is a pure
# function, so this table is the same on every machine:

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
# tensor cores), while bf16 and fp16 autocast both run:

# %%
from amp_lessons.hardware import supported_precisions

{name: why or "runs" for name, why in supported_precisions("cpu").items()}

# %% [markdown]
# Precision names are parsed in one place. Predict: what does `"half"` mean, and what
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
# - **Headless**: `python -m amp_lessons doctor` prints the report above.
#
# Stored outputs come from a CPU run. On a GPU, the numbers you get will differ; the
# lessons' prose reads the numbers your cells print, so it stays true on your machine.
