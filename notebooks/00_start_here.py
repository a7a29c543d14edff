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
# cell you run, on this machine, or names its source (the torch file, docs page or paper) in
# the "Sources" list at the end of its lesson.
#
# | lesson | what you will see |
# |---|---|
# | 00 start here | this machine's report, a matmul timed per precision, the precision the course recommends and why |
# | 01 number formats | fp32, tf32, bf16, fp16, fp8: range, precision, and your gradients against them |
# | 02 autocast | which op ran in which dtype, traced on this device and, simulated, on CUDA |
# | 03 grad scaler | fp16 gradients flushed to zero; GradScaler scaling, unscaling, skipping |
# | 04 clipping | clipping before `unscale_`: the threshold divided by the scale, measured |
# | 05 putting it together | fp32 / tf32 / bf16 / fp16 side by side: accuracy, speed, memory |
# | 06 error messages | the AMP errors and warnings you will meet, reproduced, explained, fixed |
# | 07 beyond one device | DDP and FSDP2 in mixed precision, with two real processes |
# | 08 fp8 | e4m3 and e5m2, per-tensor and per-row scales, a small fp8 layer trained |
# | 09 block scales | MXFP8, MXFP4, NVFP4 and 128-element blocks, delayed scaling, training below 8 bits |
#
# Every lesson opens with the same setup cell. On Colab it installs the course package;
# elsewhere the README's install did.

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

# %% [markdown]
# ## This machine
#
# The report below is what the package found here, its recommendation last. It differs
# from machine to machine, so the tests do not compare it.

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.hardware import resolve_machine

machine = resolve_machine()  # this device, once: what it runs, and what it measures (below)
device, speedups = machine.device, machine.speedups  # one matmul per precision
report = machine.report()
print(report.table(width=100))

# %% [markdown]
# ## Reading the outputs: `≈` figures and `✓` verdicts
#
# Figures that come out of float kernels (a loss, a timing, a norm) differ by CPU, thread
# count, torch release and GPU. The lessons print them with a leading `≈` (the matmul rates
# below), except in a few cells that show only this machine's raw timings and errors. A
# sentence drawn from such figures is checked in its cell by a **verdict**, which states its
# margin: `✓ holds` or `✗ did not hold here`, with the figures it used. One: bf16 keeps 7
# stored mantissa bits, so rounding a float32 value in bf16's normal range to it moves that
# value by at most 2^-8 ≈ 0.4% (lesson 01); the product, also rounded to bf16, is asked to stay within 1% of
# float32's, measured in norm over the whole matrix. Single entries can be off by more, where
# their terms cancel (the second line):

# %%
from amp_lessons.claims import at_least, at_most

a = torch.randn(64, 64)
exact = a @ a
with torch.autocast("cpu", dtype=torch.bfloat16):
    got = (a @ a).float()
error = (got - exact).norm() / exact.norm()  # relative, over the whole matrix
print(at_most("a bf16 autocast matmul's result is within 1% of float32's, in norm over the whole matrix; figures in %",
              100 * error, 1, ".2g"))
worst = ((got - exact).abs() / exact.abs())[exact != 0].max()  # entry by entry
print(at_least("some single entry is off by more than 1%; figures in %", 100 * worst, 1, ".3g"))

# %% [markdown]
# ## What decides the precision
#
# - **a GPU**: its compute capability. An A100's tensor cores peak at 16x its plain float32
#   rate in bf16 and fp16 matmuls, 2x its TF32 rate (its datasheet's dense peak figures,
#   Sources).
# - **bf16, native or emulated**: a T4 (compute capability 7.5) *reports* bf16 support
#   through `torch.cuda.is_bf16_supported()`, but only by emulation: bf16 tensor cores start
#   at compute capability 8.0 (Sources), and `is_bf16_supported(including_emulation=False)`
#   says False there.
# - **a CPU**: its measured bf16 rate. torch's source gives the instruction sets its oneDNN
#   matmul needs for a 16-bit path (Sources), not that path's speed, so the report times a
#   256 x 256 matmul per precision.
#
# fp16 comes with a GradScaler on every device: whether one is needed depends on the
# gradients, which lesson 01 counts against float16's range, not on the device.

# %%
from amp_lessons.claims import measured

for p, r in speedups.items():
    print(f"{p} matmul: {measured(r, '.3g')}x float32's rate on {device.type}")

# %% [markdown]
# A rate below 1 is a slowdown. `recommend`, the rule behind every lesson's report, gives
# the table below. On a CPU only the measured bf16 rate decides: three CPU classes, asked at
# the threshold and just below it, give the same two answers (checked, then one row):

# %%
from amp_lessons.claims import check
from amp_lessons.hardware import CPU_BF16_MIN_SPEEDUP, recommend

devices = {
    "laptop CPU, no bf16 instructions": ("cpu", None, False, False, False),
    "CPU with AVX512-BF16, no AMX": ("cpu", None, True, True, False),
    "CPU with AMX (Sapphire Rapids)": ("cpu", None, True, True, True),
    "Colab T4 (7.5)": ("cuda", (7, 5), False, False, False),
    "V100 (7.0)": ("cuda", (7, 0), False, False, False),
    "A100 (8.0)": ("cuda", (8, 0), True, False, False),
    "H100 (9.0)": ("cuda", (9, 0), True, False, False),
}
at, below = CPU_BF16_MIN_SPEEDUP, CPU_BF16_MIN_SPEEDUP - 0.01
cpu_answers = {tuple(recommend(*facts, bf16_speedup=r)[0] for r in (at, below))
               for facts in devices.values() if facts[0] == "cpu"}
print(check("the three CPU classes get the same answer", len(cpu_answers) == 1))
(fast, slow), = cpu_answers
print(f"{'any of the three CPUs':<34} {fast} where a bf16 matmul measures >= {at}x fp32's rate, else {slow}")
for label, facts in devices.items():
    if facts[0] == "cuda":
        precision, scaler, _ = recommend(*facts)
        print(f"{label:<34} {precision}{' + GradScaler' if scaler else ''}")

# %% [markdown]
# ## The card
#
# The course teaches one page of advice, quoted in the lessons as *the card*; each sentence
# is shown happening in a lesson or traced to its source (in italics):
#
# > Mixed precision typically gives 2-3x faster training and halves activation memory on
# > modern GPUs. *(PyTorch's AMP recipe says its own large linear layers "should show" 2-3x
# > on Volta, Turing and Ampere, and small networks may gain nothing, Sources; "halves" only
# > where the saved tensors are 16-bit: what stays float32, by autocast's float32 list or
# > by adding to a float32 tensor, is saved in float32; 05 measures both here)*
# >
# > Mixed precision keeps weights in float32 but runs most computation in a 16-bit type.
# > Tensor cores on modern GPUs are much faster in 16-bit, and activations take half the
# > memory. *(the weights: 02; the tensor cores: A100 datasheet, Sources; the memory: as
# > above)*
# >
# > `torch.autocast(device_type, dtype)` is a context manager around the forward pass and
# > loss. Inside it, ops that benefit (matmul, convolutions) run in low precision, while
# > numerically sensitive ones (softmax, losses, reductions) are kept in float32
# > automatically. Run `backward()` outside the context. *(02; which ops, by device, below)*
# >
# > - bfloat16 has float32's exponent range, so it rarely underflows. It is the default
# >   choice on Ampere-or-newer GPUs and TPUs, and needs no extra machinery. *(01, 03; "the
# >   default" is the course's, not torch's: CUDA autocast defaults to float16, printed
# >   below; TPUs: Sources)*
# > - float16 has more mantissa but a narrow range; small gradients underflow to zero. Use
# >   `torch.amp.GradScaler`, which multiplies the loss by a large factor before
# >   `backward()`, unscales before the step, and skips steps that produced inf or NaN. *(01,
# >   03)*
# >
# > If you clip gradients with a scaler, call `scaler.unscale_(opt)` before clipping. *(04)*
# >
# > `torch.set_float32_matmul_precision("high")` lets float32 matmuls use TF32 tensor cores
# > on NVIDIA GPUs, a near-free speedup for code you do not convert. *(on Ampere-or-newer
# > ones: PyTorch's CUDA notes, Sources; "near-free" in code changes, not in precision: the
# > same notes measure TF32's relative error on an A100 "approximately 2 orders of magnitude
# > larger" than float32's, and lesson 05 measures it; on a CPU, below)*
# >
# > Keep the model's weights in float32 (do not call `model.half()` for training); autocast
# > handles the casts. *(05)*
#
# The card ends with a code example, not quoted here, which lesson 02 runs as written.
#
# Some of its sentences hold only on some devices. "Softmax, losses, reductions are kept in
# float32", for one: the cell below traces a few ops on a bf16 tensor under autocast, on the
# CPU and in lesson 02's simulation of CUDA's autocast (`op->dtype`, each op in the order it
# ran).

# %%
from amp_lessons.trace import probe_table

print(probe_table(["softmax(x)", "layer_norm(x)", "sum(x)", "mean(x)", "mse_loss(x, x)", "cross_entropy(x, y)"],
                  torch.bfloat16,
                  ["cpu", "cuda (simulated)"], width=100))

# %% [markdown]
# Under CUDA's autocast softmax, layer_norm and sum come out float32 but `mean` does not,
# and `cross_entropy` runs its `_log_softmax` in bf16, casting up only for `nll_loss`; under
# a CPU's the four keep the bf16 they were given, and both losses run in float32 (lesson 02
# traces both lists).
#
# The table gives the dtype an op returns, not the one it adds in. `sums_by_order` sums one
# bf16 vector four ways: torch's `sum`, one element at a time and pairwise, both rounding to
# bf16 after every addition, and in float64, rounded to bf16 once. Its values (1, 1 + 1/128,
# ..., 1 + 127/128, repeating) are exact in bf16, and their partial sums (below 2^14, in
# steps of 1/128) are exact in float32, so no order of float32 additions changes the total.

# %%
from amp_lessons.formats import sums_by_order

x = (1 + torch.arange(10000) % 128 / 128).to(torch.bfloat16)
sums = sums_by_order(x)
for how, total in sums.items():
    print(f"{how:<22} {total:g}")
print(check("torch's bf16 sum is the float64 sum rounded once to bf16, which neither bf16 order gives",
            sums["torch's sum"] == sums["float64, rounded once"] not in (sums["one at a time"], sums["pairwise"])))

# %% [markdown]
# So here torch's `sum` matched adding in a wider type and rounding once, not either order
# of bf16 additions.
#
# ## What runs where
#
# TF32 is not a dtype but a way of multiplying float32 matrices with 10 stored mantissa
# bits, which NVIDIA's tensor cores do from Ampere on; `set_float32_matmul_precision("high")`
# asks for it. Its docstring says it affects only CUDA, yet in torch 2.13 the same call also
# sets oneDNN's float32 matmul precision (Sources); on a CPU, oneDNN's matmul takes a tf32
# path only where the CPU has AMX-FP16 (`Matmul.cpp`, Sources). **Predict**,
# from the report's AMX-FP16 row: does `"high"` change a float32 matmul's result here?

# %%
a, b = torch.randn(256, 256), torch.randn(256, 256)
exact, before = a @ b, torch.get_float32_matmul_precision()
torch.set_float32_matmul_precision("high")
changed = not torch.equal(a @ b, exact)
torch.set_float32_matmul_precision(before)
amx_fp16 = machine.amx_fp16  # torch's CPU probe, as the report read it
print(check("'high' changes this CPU's float32 matmul results only where the CPU has AMX-FP16",
            changed <= amx_fp16))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"this CPU: AMX-FP16 {amx_fp16}; 'high' changed the matmul's result: {changed}")

# %% [markdown]
# `"medium"` is another matter: it allows bf16, which oneDNN may take on a CPU that passes
# torch's bf16 check; lesson 05 measures the error it gives.
#
# **Predict**: which precisions does the course refuse on a CPU?

# %%
from amp_lessons.hardware import supported_precisions

{name: "refused" if why else "runs" for name, why in supported_precisions("cpu").items()}

# %% [markdown]
# Only tf32: the course trains in it only on Ampere-or-newer NVIDIA GPUs. On a CPU it keeps
# every precision autocast runs (both 16-bit dtypes, below) and leaves speed to the measured
# rates above; on a GPU it leaves out what runs only by emulation (bf16 on a T4).

# %%
a = torch.randn(64, 64)
for dtype in (torch.bfloat16, torch.float16):
    with torch.autocast("cpu", dtype=dtype):
        print(f"autocast {dtype} on the CPU: the matmul's result is {(a @ a).dtype}")
print("autocast's dtype when none is given:",
      {name: torch.get_autocast_dtype(name) for name in ("cuda", "cpu")})

# %% [markdown]
# Precision names are parsed in one place. **Predict**: what does `"half"` mean, and what
# happens with a typo? (A cell that fails on purpose runs inside `expect_error`, which prints
# the error's type and message and lets "Run all" go on.)

# %%
[amp_lessons.parse_precision(n) for n in ("float16", "half", torch.bfloat16, "FP32", "tf32")]

# %%
from amp_lessons.show import expect_error

with expect_error(ValueError):
    amp_lessons.parse_precision("fp61")

# %% [markdown]
# ## How the widgets work
#
# Lessons 00, 01, 02 and 03 have widgets: controls wired to the functions the cells call, which
# redraw when moved in a running notebook (JupyterLab or Colab). Click a precision: the text
# shows the dtype autocast computes in, whether the course pairs it with a GradScaler, and
# whether the course uses it on this device.

# %%
from amp_lessons.widgets import precision_picker

precision_picker()

# %% [markdown]
# The text is `describe_precision`'s; here for fp16 on the CPU, which every machine has:

# %%
from amp_lessons.widgets import describe_precision

print(describe_precision("fp16", "cpu"))

# %% [markdown]
# ## Running the lessons
#
# - **Locally**: `make lab` creates `.venv`, installs the course, copies the lessons to `lab/`
#   and opens that copy in JupyterLab; `make test` re-runs every lesson and compares its
#   outputs with the stored ones.
# - **Colab**: open a lesson from the README's "Open in Colab" links. *Runtime → Change
#   runtime type → T4 GPU* gives you a GPU, which `resolve_machine` then picks; cells that
#   name the CPU, as this lesson's checks do, stay there, and so does lesson 07 (its GPU runs
#   need two).
# - **Headless**: `python -m amp_lessons doctor` prints the report above. The stored outputs
#   come from a CPU run; what the lessons say of CUDA comes from PyTorch's source and a
#   simulation, and `make gpu-check` runs every lesson on a real GPU and prints every verdict.
#
# ## Sources
#
# - The 2-3x: PyTorch's AMP recipe, "This recipe should show significant (2-3X) speedup" on
#   Volta, Turing and Ampere GPUs, for its "sequence of linear layers and ReLUs", and "Small
#   networks may be CPU bound, in which case mixed precision won't improve performance"
#   (`pytorch/tutorials`, `recipes_source/recipes/amp_recipe.py`;
#   docs.pytorch.org/tutorials/recipes/recipes/amp_recipe.html).
# - TF32 on NVIDIA GPUs from Ampere on, and what `set_float32_matmul_precision` selects:
#   PyTorch's CUDA notes (`docs/source/notes/cuda.md`, "TensorFloat-32 (TF32) on Ampere (and
#   later) devices") and the function's docstring (`torch/__init__.py`), which says "This flag
#   currently only affects one native device type: CUDA". The CUDA notes on TF32's cost: "with
#   TF32 enabled, the speed is ~7x faster on A100, and that relative error compared to double
#   precision is approximately 2 orders of magnitude larger".
# - That on a CPU the same call sets `torch.backends.mkldnn.matmul.fp32_precision`:
#   `Context::setFloat32MatmulPrecision` in `aten/src/ATen/Context.cpp`.
# - oneDNN's tf32 path on a CPU needing AMX-FP16: `use_mkldnn_tf32_matmul` in
#   `aten/src/ATen/native/mkldnn/Matmul.cpp` (`cpuinfo_has_x86_amx_fp16()`).
# - Which CPUs torch's oneDNN matmul takes its 16-bit paths on (the conditions, not the
#   speed): `mkldnn_bf16_device_check` and `mkldnn_fp16_device_check` in
#   `aten/src/ATen/native/mkldnn/Utils.h`: on x86, oneDNN's bf16 and fp16 type support, whose
#   error texts in torch 2.13 name "avx_ne_convert or avx512bw, avx512vl and avx512dq" and
#   "avx_ne_convert or avx512_fp16"; off x86, bf16 where cpuinfo reports Arm's bf16
#   instructions, fp16 never. The report reads x86's AVX512-BF16, AVX512-FP16 and AMX flags only.
# - CUDA autocast's float32 lists: the `AT_FORALL_FP32` and `AT_FORALL_FP32_SET_OPT_DTYPE`
#   macros in `aten/src/ATen/autocast_mode.h`, registered in `aten/src/ATen/autocast_mode.cpp`
#   under the key `Autocast` (`AutocastCUDA`'s alias, `c10/core/DispatchKey.h`); CPU
#   autocast's: the `AutocastCPU` registrations in `autocast_mode.cpp`. Both traced in lesson 02.
# - bf16 tensor cores from Ampere (compute capability 8.0) on: CUDA C++ Programming Guide,
#   "Alternate Floating Point" ("Tensor Cores support alternate types of floating point
#   operations on devices with compute capability 8.0 and higher").
# - bfloat16 on TPUs: Google Cloud's TPU documentation, "Improve your model's performance
#   with bfloat16" (cloud.google.com/tpu/docs/bfloat16).
# - Tensor cores' 16-bit rate against float32's: NVIDIA's A100 datasheet gives 19.5 TFLOPS
#   for float32, 156 for TF32 and 312 for bf16/fp16 on tensor cores (dense): 16x and 2x.
# - The compute capabilities in the table (V100 7.0, T4 7.5, A100 8.0, H100 9.0): NVIDIA's
#   list "CUDA GPU Compute Capability" (developer.nvidia.com/cuda-gpus). AMX in Sapphire
#   Rapids, the 4th generation of Xeon Scalable processors: Intel's "Intel Advanced Matrix
#   Extensions (Intel AMX)" overview (intel.com).
# - A T4 reporting bf16 support by emulation: `torch.cuda.is_bf16_supported` and its
#   `including_emulation` argument (`torch/cuda/__init__.py`).
