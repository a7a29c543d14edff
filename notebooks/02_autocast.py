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
# # 02 · Autocast: which op ran in which dtype
#
# The card (lesson 00) says that `torch.autocast` wraps the forward pass and the loss; that
# inside it, matmuls and convolutions run in 16-bit while numerically sensitive ops (softmax,
# losses, reductions) stay float32; that the weights stay float32; and that `backward()` goes
# outside the context. This lesson checks each claim on **this** device, by recording the
# operations PyTorch really executed and the dtype each ran in. Autocast's rules differ by
# device type, so it also replays **CUDA**'s autocast here, labelled *simulated*.

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
report = amp_lessons.hardware_report()
print(f"device {report.device} ({report.name}), torch {report.torch_version}")
print(f"lesson 00 recommends {report.recommended} here")

# %% [markdown]
# ## The card's example
#
# The card ends with an example (lesson 00 quotes the text before it), run here. It picks
# float16 on a CUDA GPU and bfloat16 otherwise, runs one training step, and prints two
# dtypes. **Predict** before you run it: what will `logits.dtype` and
# `loss.dtype` be?

# %%
import torch  # noqa: F811  (the card's example)
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.bfloat16
model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device, enabled=(dtype == torch.float16))
x = torch.randn(64, 512, device=device)
y = torch.randint(0, 10, (64,), device=device)
with torch.autocast(device_type=device, dtype=dtype):
    logits = model(x)  # matmuls in 16-bit
    loss = nn.functional.cross_entropy(logits, y)
print(logits.dtype, loss.dtype)  # 16-bit logits, float32 loss
scaler.scale(loss).backward()  # backward outside autocast
scaler.step(opt)  # unscales; skips inf/NaN steps
scaler.update()
opt.zero_grad(set_to_none=True)

# %% [markdown]
# The logits came out of a `Linear`, so they are 16-bit; the loss is float32.
#
# ## This lesson's device and dtype
#
# The example picks float16 on every CUDA GPU, although the card's text calls bfloat16 "the
# default choice on Ampere-or-newer GPUs". Lesson 00 picks by compute capability (bfloat16
# from 8.0, Ampere, on; float16 with a `GradScaler` on 7.x; float32 below). From here on the
# lesson traces on `amp_lessons.pick_device()` in lesson 00's precision, or, where that is
# fp32, in autocast's default for the device type: bfloat16 on a CPU, float16 on CUDA and
# MPS (`amp_lessons.trace.lesson_dtype`).

# %%
from amp_lessons.trace import lesson_dtype

device = amp_lessons.pick_device().type
dtype = lesson_dtype(report)
print(device, dtype)

# %% [markdown]
# ## Every op, traced
#
# `amp_lessons.trace` records the aten operations as they execute, from a `TorchDispatchMode`:
# it sits *below* autocast in PyTorch's dispatcher, so it sees each op after autocast chose
# its dtype, and the casts autocast inserted (`_to_copy`). Tables and figures leave out the
# views (such as `t` and `view`), clones and copies, which compute nothing
# (`table(layout=True)` shows them).
#
# The card's model again, as `amp_lessons.models.card_model()`, with the same batch
# shapes. **Predict**: how many casts will autocast insert, and which ops will come out float32?

# %%
from amp_lessons.trace import example, trace_model

mlp, x, y, loss_fn = example("card_model", device)
mlp_trace = trace_model(mlp, x, y, loss_fn, dtype=dtype)
print(mlp_trace.table())

# %% [markdown]
# The `cast` column says who made each `_to_copy`: `autocast`, `autograd` (in backward), or
# `explicit`, anything else: the code (`h.float()`) or the op itself (below, CUDA's softmax
# casts its own input). Here every cast is autocast's: before each `addmm` it cast the
# float32 weight and bias to 16-bit, and for the first layer the input too (the shape tells
# which). The last column marks a float32 result `<- autocast fp32` when autocast caused it
# (cast an input up, or asked for float32), `<- already fp32` when autocast neither cast its
# inputs nor asked for its dtype (it may read a float32 tensor autocast made earlier, as
# `nll_loss_forward` does above on a CPU). On a CPU `cross_entropy` is on the float32 list:
# autocast casts its input up once (the `(loss)` cast), `_log_softmax` reads that copy, and
# `nll_loss_forward` reads `_log_softmax`'s float32 result.
#
# ## A transformer block: attention, softmax, layer_norm, GELU
#
# `amp_lessons.models.TransformerBlock` is a pre-norm block: `x + attn(ln1(x))`, then
# `x + mlp(ln2(x))`, with the attention written out (`q @ k`, softmax, `@ v`) so that each
# op shows. Its loss is a mean-squared error against a random target.
# **Predict**: which of `_softmax`, `native_layer_norm`, `gelu` and the residual `add` will
# run in 16-bit here? (In a notebook a trace renders as a table: orange rows are the ops
# autocast put in float32, sand rows those that were float32 already, grey italics the casts.)

# %%
from amp_lessons.trace import trace_example

block_trace = trace_example("TransformerBlock", dtype, device)
block_trace

# %% [markdown]
# Three rules produce these dtypes:
#
# 1. Ops on the **lower-precision list** (matmul, `linear`, `bmm`, convolutions) get their
#    float32 inputs cast to 16-bit and run in 16-bit.
# 2. Ops on the **float32 list** (most losses; by device others, such as linear algebra
#    on a CPU, `softmax` and `layer_norm` on CUDA and MPS) get their 16-bit inputs cast to
#    float32 (or are asked for a float32 result). On CUDA `binary_cross_entropy` is banned
#    instead ("... unsafe to autocast"; use `binary_cross_entropy_with_logits`).
# 3. Every other op runs in the dtype its inputs give it, and so does an op on a list whose
#    inputs have that list's dtype already (autocast has nothing to cast). The residual
#    `add` of the float32 input and a 16-bit branch promotes to float32 (`<- already fp32`),
#    so the second `layer_norm` also got a float32 input. (A short `promote` list casts an op's
#    inputs to the widest among them: `cat` and `stack` on a CPU, `dot`, `cross` and
#    others on CUDA.)
#
# Not every op promotes. **Predict**: with no autocast, on a CPU, what do a 16-bit
# activation times a float32 weight, and normalizations of it with float32 weights, give?

# %%
norm = nn.functional
h16 = torch.randn(4, 16).to(dtype)  # on the CPU
w, b = torch.ones(16), torch.zeros(16)  # float32 weight and bias
print("h16 * w:   ", (h16 * w).dtype)
print("layer_norm:", norm.layer_norm(h16, (16,), w, b).dtype)
print("group_norm:", norm.group_norm(h16, 4, w, b).dtype)
print("batch_norm:", norm.batch_norm(h16, torch.zeros(16), torch.ones(16), w, b).dtype)

# %% [markdown]
# The product promotes; the CPU's normalizations keep their input's dtype.
#
# Convolutions are on the lower-precision list with the matmuls. A `Conv2d` on a float32
# image, traced on its own:

# %%
from functools import partial

from amp_lessons.trace import short, trace_fn

conv = nn.Conv2d(3, 8, 3).to(device)
image = torch.randn(2, 3, 8, 8, device=device)
print(trace_fn(conv, image, device=device, dtype=dtype).oneline())

# %% [markdown]
# ## CPU and CUDA keep different lists
#
# Each device type has its own lists, in PyTorch's `aten/src/ATen/autocast_mode.cpp`; the
# AMP docs print the CUDA and CPU ones ("Autocast Op Reference").
#
# ### Replaying CUDA's autocast here: `simulate=True`
#
# The CUDA columns below are a replay, by machinery checked against this device's real
# traces (next cell). Autocast decides every cast from the op, its arguments' devices and
# dtypes and the autocast dtype, never from the data (`is_eligible` in
# `aten/src/ATen/autocast_mode.h`: device and dtype; `cached_cast` in `autocast_mode.cpp`:
# leaf and grad flags). So with `simulate=True` the tracer
# turns the tensors into `FakeTensor`s on `"cuda"` (shape, dtype and device, no data),
# switches CUDA's autocast on, and records the ops dispatched.
#
# A replay computes nothing and has no backward; a weight used twice may show two casts
# where the device casts once (autocast's cast cache); and in a CPU-only build an op that
# has a CUDA kernel in CUDA builds and only a composite of other ops here replays as those
# ops (`rms_norm`'s `_fused_rms_norm`).
#
# The check: the tracer runs calls both ways on this device, for real and simulated, and
# compares them op by op. On a CPU this checks the replay machinery against the CPU's own
# autocast; on a CUDA GPU, the CUDA replay against real CUDA traces (`make gpu-check` runs
# it for both dtypes).

# %%
import textwrap

from amp_lessons.devicechecks import simulation_verdicts

for verdict in simulation_verdicts(device, [dtype]):
    print(textwrap.fill(str(verdict), 100, subsequent_indent="    "))

# %% [markdown]
# Single calls, on this device and replayed on CUDA, for both 16-bit dtypes. **Predict**
# which of them CUDA will run in float32.

# %%
from amp_lessons.trace import PROBE_INPUTS, probe_table

print(PROBE_INPUTS)
for d in (torch.bfloat16, torch.float16):
    print(probe_table(["relu(x)", "softmax(x)", "log_softmax(x)", "layer_norm(x)", "group_norm(x)"], d), "\n")

# %% [markdown]
# On a CPU the four ops follow their 16-bit input, like `relu`, which is on no list; on
# CUDA they come out float32 while `relu` stays 16-bit. CUDA's autocast casts the
# input of `layer_norm` and `group_norm`, but calls `softmax` and `log_softmax` with
# `dtype=float32`: the op then casts a bfloat16 input itself and reads a float16 one
# directly (`softmax` in `aten/src/ATen/native/SoftMax.cpp`).
#
# The transformer block's forward + loss, on a CPU (on every machine) and replayed on CUDA,
# one panel above the other: one cell per op in the order the ops ran, numbered within each panel
# (CUDA's extra casts shift its numbers). A grey cell is a cast:

# %%
from amp_lessons.plots import op_dtypes

cuda_block = trace_example("TransformerBlock", dtype, "cuda", simulate=True)
cpu_block = block_trace if torch.device(device).type == "cpu" else trace_example("TransformerBlock", dtype, "cpu")
op_dtypes([cpu_block, cuda_block])  # a CPU panel on every machine: the contrast is CPU against CUDA

# %% [markdown]
# On CUDA the attention's `_softmax` is orange: it computes its weights in float32 there,
# where a CPU keeps them 16-bit. If a softmax or a normalization must be float32 on every
# device, say so explicitly (the `enabled=False` section below shows how).
#
# ## The loss on CUDA, and the calls autocast skips
#
# The docs list `cross_entropy` among CUDA's float32 ops, but CUDA's autocast has no
# kernel for it: with class-index targets, as here, the loss comes out float32 because it
# decomposes into `log_softmax(x, 1, dtype=x.dtype)` and `nll_loss`, and `nll_loss` is on
# the list.
# `log_softmax` is too, but the call names its own dtype. **Predict** the CUDA column:

# %%
print(probe_table(["cross_entropy(x, y)", "softmax(x, dtype=x.dtype)"], dtype, width=100))

# %% [markdown]
# On CUDA the loss is float32 but its `_log_softmax` ran in 16-bit. Autocast skips:
#
# - in-place ops (`x.exp_()`, `c.addmm_(a, b)`) and calls with `out=`;
# - float64 tensors, and tensors that are not floating point;
# - on CUDA, calls that pass an explicit `dtype=` to an op of the `fp32_set_opt_dtype`
#   policy.
#
# The AMP docs ("Op Eligibility") state the last rule for every device, but a CPU has no
# such policy: `prod` is on its float32 list, so autocast casts the input up, and the named
# dtype makes the result 16-bit again (the last line; MPS does the same, below). Each,
# traced next to a call that autocast does handle (`exp` is on CUDA's float32 list and on
# no CPU list, so on a CPU both `exp` rows are alike):

# %%
print(probe_table(["mm(a, b)", "mm(a, b, out=c)", "addmm(c, a, b)", "c.addmm_(a, b)",
                   "mm(a64, b64)", "exp(x)", "x.exp_()"], dtype, width=100))
prod = partial(torch.prod, torch.randn(4, 16).to(dtype), 1, dtype=dtype)
print("prod(x, 1, dtype=x.dtype) on the CPU:", trace_fn(prod, device="cpu", dtype=dtype).oneline())

# %% [markdown]
# ## "Reductions stay float32"?
#
# The card says reductions are kept in float32. **Predict**: what do `sum` and `mean` of a
# 16-bit tensor produce?

# %%
print(probe_table(["sum(x)", "mean(x)"], dtype))

# %% [markdown]
# On CUDA, `sum` is on the float32 list (so are `prod`, `cumsum` and the norms) and comes out
# float32, with no separate cast (autocast sets its `dtype=`); `mean` is on no list and stays
# 16-bit. On a CPU both stay 16-bit. A trace shows the dtype each op returns, not how its
# kernel accumulates inside.
#
# ## Apple GPUs (MPS)
#
# The column below is a replay that no Apple hardware has checked:

# %%
mps_columns = [device, "mps (simulated)"]
print(probe_table(["softmax(x)", "layer_norm(x)", "sum(x)", "mean(x)", "cross_entropy(x, y)"],
                  dtype, mps_columns, width=100))

# %% [markdown]
# On MPS each float32 op gets its own cast, even under a named `dtype=`: `cross_entropy`'s
# log-softmax input goes up to float32 and straight back, a round-trip like `prod`'s on the
# CPU.
#
# ## A region that must run in float32: `autocast(enabled=False)`
#
# Sometimes a piece of the forward pass must run in float32 whatever the device (a softmax
# over huge logits, a custom numerical routine). A nested
# `torch.autocast(device, enabled=False)` turns autocast off for that region. **Predict**:
# a 16-bit activation from the autocast region reaches a float32 `Linear` inside the
# disabled region. What happens?

# %%
from amp_lessons.show import expect_error

head = nn.Linear(512, 10).to(device)
with expect_error(RuntimeError):
    with torch.autocast(device, dtype=dtype):
        h = mlp[0](x)  # 16-bit
        with torch.autocast(device, enabled=False):
            out = head(h)

# %% [markdown]
# Disabling autocast does not cast anything back: `h` is still 16-bit, the weight is
# float32, and the matmul refuses to mix them. Not every op refuses: a softmax over `h`
# there, the very op the region was for, runs in 16-bit without a word (below). The region
# needs an explicit `.float()` on every tensor that comes in from the autocast region:

# %%
with torch.autocast(device, dtype=dtype):
    h = mlp[0](x)
    with torch.autocast(device, enabled=False):
        print("softmax(h):", torch.softmax(h, -1).dtype, "| softmax(h.float()):",
              torch.softmax(h.float(), -1).dtype)
        out = head(h.float())
print("head(h.float()):", out.dtype)

# %% [markdown]
# ## Weights, gradients, and where `backward()` runs
#
# `trace_model(..., backward="outside")` calls `loss.backward()` after the `with` block, as
# the card says, and traces the backward pass too. This section and the next run in eager
# mode, as every cell here does: under `torch.compile` a compiled region's backward is
# compiled for its forward's autocast state, wherever `backward()` is called (by default;
# see Sources). **Predict**: what dtype will each `.grad` have, given that the matmuls ran
# in 16-bit?

# %%
mlp, x, y, loss_fn = example("card_model", device)
mlp_backward = trace_model(mlp, x, y, loss_fn, dtype=dtype, backward="outside")
for name, p in mlp.named_parameters():
    print(f"{name:<9} parameter {p.dtype}   grad {p.grad.dtype}")

# %% [markdown]
# With autocast off, each backward op runs in the dtype its forward op chose, so the
# backward matmuls ran in 16-bit too (the `(backward)` row of the summary below). A forward
# cast of a tensor that needs a gradient has a backward, a cast the other way (`autograd`),
# so a weight's gradient arrives in float32; the input `x` needs no gradient, and its cast
# has none. The summary, then every cast:

# %%
print(mlp_backward.summary(), "\n")
for r in mlp_backward.casts:
    print(f"{r.module:<10} {short(r.inputs[0])} -> {short(r.dtype)}  {str(list(r.shape)):<10} {r.cast_by}")

# %% [markdown]
# Called inside the context, `backward()` runs with autocast on, and autocast acts on the
# ops of its lists there. The transformer block, twice from the same weights, with
# `loss.backward()` after the `with` block and inside it:

# %%
from amp_lessons.trace import differences

block_out, xb, yb, block_loss = example("TransformerBlock", device)
block_in, *_ = example("TransformerBlock", device)
outside = trace_model(block_out, xb, yb, block_loss, dtype=dtype, backward="outside")
inside = trace_model(block_in, xb, yb, block_loss, dtype=dtype, backward="inside")
diff = differences(outside, inside, module="(backward)")
grads = [(a.grad, b.grad) for a, b in zip(block_out.parameters(), block_in.parameters())]
print("backward ops that differ, inside vs outside:", len(diff))
print("\n".join(diff[:4]) or "(none)")
print("identical gradients:", all(torch.equal(a, b) for a, b in grads),
      "| gradient dtypes:", {b.dtype for _, b in grads})

# %% [markdown]
# What changes follows this device's lists (for the block on a CPU, nothing). The float32
# region above does change: its forward runs in float32, but called inside the context, its
# backward matmul is on autocast's list again. The `head` region, traced with its backward:

# %%
def head_backward(backward_inside: bool) -> None:
    with torch.autocast(device, dtype=dtype):
        with torch.autocast(device, enabled=False):
            out = head(x)  # float32
        if backward_inside:
            out.square().mean().backward()
    if not backward_inside:
        out.square().mean().backward()


for inside in (True, False):
    ran = trace_fn(partial(head_backward, inside), device=device, enabled=False)
    matmuls = " ".join(f"mm->{short(r.dtype)}" for r in ran.ops("mm"))
    print("backward", "inside: " if inside else "outside:", matmuls)

# %% [markdown]
# ## Custom autograd functions: `custom_fwd` and `custom_bwd`
#
# Autograd calls the `backward` you write for a `torch.autograd.Function` wherever
# `loss.backward()` is called. A plain matmul as a custom function, with no autocast
# decorators. **Predict**: under autocast, which dtype reaches `backward` as `grad`, and
# which dtype does the saved `b` have?

# %%
class PlainMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b  # autocast runs this in 16-bit

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors  # the float32 inputs
        return grad @ b.T, a.T @ grad


a = torch.randn(8, 16, device=device, requires_grad=True)
b = torch.randn(16, 4, device=device, requires_grad=True)

# %%
with expect_error(RuntimeError):
    with torch.autocast(device, dtype=dtype):
        out = PlainMatmul.apply(a, b)
    out.float().sum().backward()  # outside autocast, as the card says

# %% [markdown]
# The forward's matmul ran in 16-bit, so `grad` is 16-bit, but the saved inputs are
# float32, and outside autocast `grad @ b.T` mixes the two. Call the same backward
# *inside* the context and it works, because autocast now casts inside `backward` too:

# %%
with torch.autocast(device, dtype=dtype):
    out = PlainMatmul.apply(a, b)
    out.float().sum().backward()  # inside: autocast is still on
print("out", out.dtype, "| a.grad", a.grad.dtype, "| b.grad", b.grad.dtype)

# %% [markdown]
# The fix is two decorators, used together: `torch.amp.custom_fwd(device_type=...)`
# records the autocast state of the forward, and `torch.amp.custom_bwd(device_type=...)`
# runs `backward` in that state, wherever `backward()` is called (`custom_bwd` alone raises
# an `AttributeError`: the state it reads is set by `custom_fwd`).

# %%
class AmpMatmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type=device)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type=device)
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.T, a.T @ grad


a.grad = b.grad = None
with torch.autocast(device, dtype=dtype):
    out = AmpMatmul.apply(a, b)
out.float().sum().backward()  # outside again, and now it works
print("out", out.dtype, "| a.grad", a.grad.dtype, "| b.grad", b.grad.dtype)

# %% [markdown]
# For an op that must run in float32 (a kernel written only for float32, say),
# `custom_fwd(device_type=..., cast_inputs=torch.float32)` does what the `enabled=False`
# section did by hand, when called inside an autocast region (outside one it does nothing):
# it casts the floating-point tensors among its inputs on that device type to float32
# (float64 ones excepted) and runs `forward` with autocast off.
# Traced under autocast with a 16-bit input:

# %%
class Float32Matmul(AmpMatmul):  # AmpMatmul's backward, a float32 forward
    @staticmethod
    @torch.amp.custom_fwd(device_type=device, cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b


print(trace_fn(partial(Float32Matmul.apply, a.detach().to(dtype), b.detach()),
               device=device, dtype=dtype).oneline())

# %% [markdown]
# ## Try it: the traced table, live
#
# Pick a model and a 16-bit dtype (and a device, where this machine has more than one);
# the table is traced again on every click.

# %%
from amp_lessons.widgets import autocast_explorer

autocast_explorer(device, precision=dtype)

# %% [markdown]
# ## Remember
#
# - `torch.autocast(device, dtype)` wraps the forward pass and the loss. Inside it, matmuls
#   and convolutions ran in 16-bit; the losses came out float32 (the traces above).
# - Autocast never converts the model: it casts a float32 weight to 16-bit for the ops on
#   its lower-precision list (the `_to_copy` rows); the `LayerNorm` weights went in as
#   float32. Parameters and their `.grad` stayed float32.
# - Each device type has its own lists (trace on the device you train on). Ops on no list
#   run in the dtype their inputs give them (the residual `add` came out float32 by type
#   promotion, not because of autocast).
# - "Reductions stay float32" is true on CUDA for `sum`, not for `mean`, and on a CPU for
#   neither.
# - Call `backward()` outside the context.
#
# ## Watch out
#
# - Autocast skips in-place ops, `out=` and float64, and on CUDA calls that name their
#   `dtype=` (so CUDA's `cross_entropy` runs its log-softmax in 16-bit).
# - `torch.autocast(device, enabled=False)` casts nothing back: call `.float()` on each
#   tensor that comes in from the autocast region.
# - A custom function whose `backward` only works when `backward()` is called inside the
#   context has a latent dtype bug (in eager mode); `torch.amp.custom_fwd` and
#   `torch.amp.custom_bwd` together fix it.
#
# ## Exercise: predict the dtype
#
# A small convolutional net, traced under autocast with this lesson's dtype on this device.
# For each op below, predict the dtype of its output (`"fp32"`, `"bf16"` or `"fp16"`),
# replace the `"?"`s, and run the cells. Reason with the three rules and this device's
# lists; `_log_softmax` is the `LogSoftmax` module, `nll_loss_forward` the loss. A wrong
# prediction gets a question that points to the rule; `reveal=True` adds the answer.
# Then predict for CUDA and check against the replay (`trace_model(..., device="cuda",
# simulate=True)`). The net:

# %%
from amp_lessons.exercises import check_dtype_predictions, dtype_exercise

net, images, labels, nll = dtype_exercise(device)
print(" -> ".join(type(layer).__name__ for layer in net), "| loss:", nll.__name__)

# %%
predictions = {
    "convolution": "?",
    "native_group_norm": "?",
    "gelu": "?",
    "_log_softmax": "?",
    "nll_loss_forward": "?",
}

# %%
check_dtype_predictions(predictions, trace_model(net, images, labels, nll, dtype=dtype))

# %% [markdown]
# ## Sources
#
# What this lesson says that the cells above do not compute, or compute only in a replay:
#
# - The autocast lists of each device type, `binary_cross_entropy`'s ban on CUDA, and the
#   `promote` (CPU: `cat`, `stack`, `index_copy`; CUDA: `dot`, `cross` and others) and
#   `fp32_set_opt_dtype` policies: `aten/src/ATen/autocast_mode.cpp` (CUDA's block is
#   registered under the key `Autocast`, `AutocastCUDA`'s alias in `c10/core/DispatchKey.h`;
#   the `AutocastCPU` and `AutocastMPS` blocks) and `autocast_mode.h`; the AMP docs' "Autocast
#   Op Reference" (`docs/source/amp.md`).
# - The calls autocast skips (in-place, `out=`, float64, an explicit `dtype=`): "Op
#   Eligibility" in `docs/source/amp.md`, which says it of every device (`prod` on the
#   CPU's float32 list: the `AutocastCPU` block).
# - The cast cache (16-bit casts of float32 leaf tensors that require grad): `cached_cast`
#   in `aten/src/ATen/autocast_mode.cpp`; dropped when the outermost region exits:
#   `torch/amp/autocast_mode.py`.
# - `cross_entropy` as `log_softmax(x, 1, dtype=x.dtype)` then `nll_loss`:
#   `cross_entropy_loss` in `aten/src/ATen/native/LossNLL.cpp`; a float16 CUDA softmax read
#   directly (`half_to_float`): `softmax` in `aten/src/ATen/native/SoftMax.cpp`.
# - `rms_norm` calling `_fused_rms_norm` (a CUDA kernel in CUDA builds, else a composite):
#   `rms_norm_symint` in `aten/src/ATen/native/layer_norm.cpp`.
# - Backward ops running in the dtype autocast chose for their forward op, and backward
#   outside autocast: `torch.autocast`'s docstring in `torch/amp/autocast_mode.py`.
# - A compiled region's backward compiled for its forward's autocast state:
#   `backward_pass_autocast = "same_as_forward"` in `torch/_functorch/config.py`, and the
#   docs page "torch.compile has different autograd semantics" (`torch.compiler_backward`).
# - `custom_fwd` and `custom_bwd` (and `cast_inputs`, a no-op outside autocast):
#   `torch/amp/autocast_mode.py`, where `custom_bwd` reads the `_fwd_used_autocast` that
#   `custom_fwd` sets.
# - Lesson 00's precision by compute capability: `amp_lessons.hardware.recommend`.
# - The tracer sitting below autocast: `TorchDispatchMode` in
#   `torch/utils/_python_dispatch.py`; the autocast dispatch keys in
#   `c10/core/DispatchKey.h`.
