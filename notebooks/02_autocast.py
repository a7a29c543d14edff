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
# outside the context. This lesson checks each of those claims on **this** device, by
# recording every operation PyTorch really executed and the dtype it ran in.
#
# Autocast's rules differ from one device type to the next, so the lesson also replays
# **CUDA**'s autocast on this machine, labelled *simulated* wherever it appears: on a CPU you
# see what CUDA's lists would do differently. On a GPU the lesson also traces the real thing,
# and a check compares the two (below).

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
# ## The card's example, as written
#
# Here is the card's code in full: it picks float16 on a GPU and bfloat16 on a CPU, runs
# one training step, and prints two dtypes. **Predict** before you run it: what will
# `logits.dtype` and `loss.dtype` be?

# %%
import torch  # noqa: F811  (the card's code, as written)
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
# The logits came out of a `Linear`, so they are 16-bit; the loss is float32. The model
# itself was never converted: its parameters are still float32 after the step.

# %%
print("logits are 16-bit:", logits.dtype in (torch.bfloat16, torch.float16))
print("loss is float32:  ", loss.dtype == torch.float32)
print("parameter dtypes: ", {p.dtype for p in model.parameters()})

# %% [markdown]
# ## This lesson's device and dtype
#
# The card picks float16 on every GPU. Lesson 00 recommends bfloat16 on Ampere-or-newer GPUs
# (A100, H100, RTX 30xx and later, with native bfloat16: no scaler needed) and float16 with a
# `GradScaler` on older ones with tensor cores (compute capability 7.x: V100, T4), and fp32 on
# a GPU without tensor cores (below 7.0). From here on the lesson picks the device with
# `amp_lessons.pick_device` (which also finds Apple's MPS) and traces in the precision lesson
# 00 recommends for it. Where that is fp32 (a CPU without fast bf16 matmuls, a GPU without
# tensor cores, an Apple GPU), autocast still needs a 16-bit dtype to show anything, so the lesson takes
# autocast's own default for the device type: bfloat16 on a CPU, float16 on CUDA and MPS (`amp_lessons.trace.lesson_dtype`).

# %%
from amp_lessons.trace import lesson_dtype

device = amp_lessons.pick_device().type
dtype = lesson_dtype(report)
print(device, dtype)

# %% [markdown]
# ## Every op, traced
#
# `print(logits.dtype)` shows only the end result. To see each step, `amp_lessons.trace`
# records every aten operation as it executes. It uses a `TorchDispatchMode`, which sits
# *below* autocast in PyTorch's dispatcher: it sees the ops after autocast has chosen their
# dtype, including the casts autocast inserts (they show up as `_to_copy`). Forward hooks
# attribute each op to the module that ran it.
#
# The card's model again, as `amp_lessons.models.card_model()`, with the same batch
# shapes. **Predict**: how many casts will autocast insert, and which ops will come out float32?

# %%
from amp_lessons.trace import example, trace_model

mlp, x, y, loss_fn = example("card_model", device)
mlp_trace = trace_model(mlp, x, y, loss_fn, dtype=dtype)
print(mlp_trace.table())

# %% [markdown]
# How to read it. The `_to_copy` rows are casts, and the `cast` column says who inserted
# them: `autocast`, or `explicit` for a cast the code wrote itself (such as `h.float()`)
# or an op made inside itself (below, `rms_norm`).
# Before each `Linear`'s `addmm`, autocast cast the float32 weight and bias to 16-bit, and
# for the first layer the float32 input too (the shape column tells which is which); the
# matmul then ran in 16-bit, and so did the `relu` that followed it. The last column marks
# the computing ops whose result is float32, and says why:
#
# - `<- autocast fp32`: autocast made the op float32 (it cast the op's 16-bit input up, or
#   asked the op for a float32 result);
# - `<- already fp32`: autocast did nothing to this op; its inputs were float32 already.
#
# What the loss did depends on the device. On a CPU, `cross_entropy` is on autocast's
# float32 list: autocast casts the 16-bit logits to float32 (the cast in the `(loss)` rows),
# `_log_softmax` runs on that float32 copy, and `nll_loss_forward` (the second half of
# cross-entropy) gets float32 from it. CUDA's lists in torch's C++ have no entry for
# `cross_entropy`; a section below traces what it does instead.
#
# Per module, the same trace:

# %%
print(mlp_trace.summary())

# %% [markdown]
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

# %%
print(block_trace.summary())

# %% [markdown]
# The two traces side by side, one cell per op in the order the ops ran. A grey cell is a
# cast; the figure does not show which way it went (the tables above do):

# %%
from amp_lessons.plots import op_dtypes

op_dtypes({"card_model": mlp_trace, "TransformerBlock": block_trace})

# %% [markdown]
# The dtype each kind of op produced in the block:

# %%
from functools import partial

from amp_lessons.trace import short, trace_fn

for op in ("addmm", "bmm", "_softmax", "gelu", "native_layer_norm", "add", "mse_loss"):
    print(f"{op:<18} {' '.join(sorted(short(d) for d in block_trace.dtypes_of(op)))}")

# %% [markdown]
# Three rules produce that list:
#
# 1. Ops on the **lower-precision list** (matmul, `linear`, `bmm`, convolutions) get their
#    float32 inputs cast to 16-bit and run in 16-bit.
# 2. Ops on the **float32 list** (most losses, and others that differ by device: linear
#    algebra on a CPU, `softmax` and `layer_norm` on CUDA and MPS, below) get their 16-bit
#    inputs cast to float32 (or are asked for a float32 result) and run in float32. Not every
#    loss: on CUDA, `binary_cross_entropy` is banned under autocast and raises "... unsafe to
#    autocast" (use `binary_cross_entropy_with_logits`; `binary_cross_entropy_banned` in
#    `autocast_mode.cpp`).
# 3. Every other op runs in the dtype of its inputs, with ordinary type promotion when
#    they differ. (A few ops are on a third list, `promote`: autocast casts their inputs to
#    the widest dtype among them, `cat` and `stack` on a CPU, `index_put` and `addcmul` among
#    others on CUDA; the `promote` kernels in `autocast_mode.cpp`.) The residual `add` gets the block's float32 input plus a 16-bit branch,
#    so its result is float32: that is type promotion, not autocast (`<- already fp32`). It
#    is also why both `layer_norm`s here got a float32 input (the block's input, then the
#    residual sum).
#
# Convolutions are on the lower-precision list with the matmuls. A `Conv2d` on a float32
# image, traced on its own:

# %%
conv = nn.Conv2d(3, 8, 3).to(device)
image = torch.randn(2, 3, 8, 8, device=device)
print(trace_fn(conv, image, device=device, dtype=dtype).oneline())

# %% [markdown]
# An op on no list can still cast inside itself. `torch.rms_norm` upcasts a 16-bit input to
# float32, normalizes, and casts back; the tracer labels those casts `explicit`, the op's own,
# unless this device's autocast has a kernel for `rms_norm`. The CPU's has none. CUDA's has
# one in torch 2.13, which puts `rms_norm` on CUDA's float32 list, and none in torch 2.11
# (the cell after the next section's table prints what this release has):

# %%
print(trace_fn(partial(torch.rms_norm, torch.randn(4, 16, device=device).to(dtype), (16,)),
               device=device, dtype=dtype).table())

# %% [markdown]
# ## CPU and CUDA keep different lists
#
# Each device type has its own autocast lists, in PyTorch's `aten/src/ATen/autocast_mode.cpp`
# and `autocast_mode.h`; PyTorch's AMP documentation prints the CUDA and CPU ones under
# "Autocast Op Reference". No public API returns them. A private one answers per op, with
# no GPU: `torch._C._dispatch_has_kernel_for_dispatch_key` says whether autocast has a
# kernel for an op on a device type (not which list, nor what the kernel does: tracing shows
# that):

# %%
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
ops = ["aten::mm", "aten::softmax.int", "aten::layer_norm", "aten::sum",
       "aten::relu", "aten::nll_loss", "aten::cross_entropy_loss"]
print(f"{'op':<26}{'AutocastCPU':>12}{'AutocastCUDA':>13}")
for op in ops:
    print(f"{op:<26}{has_kernel(op, 'AutocastCPU')!s:>12}{has_kernel(op, 'AutocastCUDA')!s:>13}")

# %%
# NBVAL_IGNORE_OUTPUT
# rms_norm's row depends on the torch release (CUDA's kernel: in 2.13, not in 2.11)
print(f"torch {torch.__version__}: aten::rms_norm  AutocastCPU {has_kernel('aten::rms_norm', 'AutocastCPU')}, "
      f"AutocastCUDA {has_kernel('aten::rms_norm', 'AutocastCUDA')}")

# %% [markdown]
# The transformer block cannot show the difference for `layer_norm`, whose input was float32
# anyway. Single calls on a 16-bit input can, but this machine may have no GPU.
#
# ### Replaying CUDA's autocast here: `simulate=True`
#
# Autocast decides every cast in C++ before any kernel runs, from the op, its arguments'
# devices and dtypes and the autocast dtype, never from the data. So the tracer can replay a
# device it does not have: with `simulate=True` it turns the tensors into `FakeTensor`s on
# `"cuda"` (a shape, a dtype and a device, but no data), switches CUDA's autocast on, and
# records the aten ops it dispatches. Nothing is computed, there is no backward pass, and
# every simulated trace says "(simulated)". One thing a replay may not reproduce: autocast
# caches the 16-bit copy of a float32 weight within a context (`cached_casts` in
# `autocast_mode.cpp`), so a real trace that uses a weight twice may show one cast where the
# replay shows two.
#
# Can a replay be trusted? On any device the tracer can run a call both ways, for real and
# simulated, and compare them op by op. Here, for the lesson's three models (the exercise at
# the end has the third) and 17 single calls:

# %%
from amp_lessons.devicechecks import simulation_verdicts

for verdict in simulation_verdicts(device, [dtype]):
    print(verdict)

# %% [markdown]
# On a CPU this checks the replay machinery against the CPU's own autocast, not CUDA's. On a
# CUDA GPU the same cell compares the CUDA replay with real CUDA traces, and `make gpu-check`
# runs that comparison for both 16-bit dtypes; the stored outputs of this lesson come from a
# CPU, so they hold no such comparison.
#
# Now single calls, each on this device and replayed on CUDA, side by side, for both 16-bit
# dtypes (`x` is a 16-bit activation; the other inputs are described in the first line).
# **Predict** which of them CUDA will run in float32.

# %%
from amp_lessons.trace import PROBE_INPUTS, probe_table

print(PROBE_INPUTS)
for d in (torch.bfloat16, torch.float16):
    print(probe_table(["relu(x)", "softmax(x)", "log_softmax(x)", "layer_norm(x)", "group_norm(x)"], d), "\n")

# %% [markdown]
# In a `cpu` column, a 16-bit input gives a 16-bit `_softmax`, `_log_softmax`,
# `native_layer_norm` and `native_group_norm`, exactly like `relu`, which is on no list. In
# the `cuda` columns the four come out float32, while `relu` stays 16-bit.
#
# Does CUDA always insert a `_to_copy` first? Autocast itself casts only `layer_norm`'s and
# `group_norm`'s input (their policy is `fp32`). For `softmax` and `log_softmax` (policy
# `fp32_set_opt_dtype`, whatever the 16-bit dtype) it casts nothing: it calls the op with
# `dtype=float32`. What happens next is the op's own code, `softmax` in
# `aten/src/ATen/native/SoftMax.cpp`: a float16 CUDA input asked for float32 goes straight to
# `_softmax(input, dim, half_to_float=true)`, a kernel that reads float16 and writes float32;
# any other input is first cast with `input.toType(dtype)`. So with bfloat16 the `_to_copy`
# before `_softmax` is there, but it is the op's cast, and the `cuda` columns label it
# `explicit`, as with `rms_norm`; the op is still marked `<- autocast fp32`, because autocast
# asked for float32. The replay runs that same C++ code with CUDA's dispatch keys, so it takes
# the same branch. The bfloat16 `softmax`, next to `layer_norm`, in full:

# %%
from amp_lessons.trace import probe

for call in ("softmax(x)", "layer_norm(x)"):
    print(probe(call, torch.bfloat16, "cuda", simulate=True).table(), "\n")

# %% [markdown]
# The same transformer block, on this device and replayed on CUDA:

# %%
cuda_block = trace_example("TransformerBlock", dtype, "cuda", simulate=True)
op_dtypes([block_trace, cuda_block])

# %% [markdown]
# On CUDA the `_softmax` inside the attention is orange: the block computes its attention
# weights in float32 there. In a `cpu` panel the same op is blue, 16-bit. If a softmax or a
# normalization must be float32 on every device, say so explicitly (the `enabled=False`
# section below shows how).
#
# ## The loss on CUDA, and the calls autocast skips
#
# CUDA's lists in the C++ have no entry for `cross_entropy` (the `False` for
# `cross_entropy_loss` above), yet the docs' Op Reference lists `cross_entropy` among CUDA's
# float32 ops. Both hold: the docs list what the call gives, and the loss does come out
# float32, because it decomposes into ops that are on the list. PyTorch computes
# `log_softmax(x, 1, dtype=x.dtype)`, then `nll_loss`. `log_softmax` is on CUDA's float32
# list (the tables above), yet here autocast leaves it alone, because the call names its own
# dtype; `nll_loss` is on the list too, so its input is cast to float32. **Predict** the CUDA
# column for the two calls below.

# %%
print(probe_table(["cross_entropy(x, y)", "softmax(x, dtype=x.dtype)"], dtype))

# %% [markdown]
# The loss itself is float32 on both devices, as the card says; on CUDA its `_log_softmax`
# ran in 16-bit. The rule behind it is in PyTorch's autocast documentation ("Op
# Eligibility"). Autocast skips:
#
# - on CUDA, calls that pass an explicit `dtype=` to an op of the `fp32_set_opt_dtype`
#   policy (the output respects it; the policy's kernels in `autocast_mode.cpp`). The CPU's
#   and MPS's lists have no such policy: on a CPU, `torch.prod(x, 1, dtype=torch.bfloat16)`
#   still gets its input cast to float32 (`KERNEL_CPU(prod, dim_int, fp32)` there), and
#   MPS's replay below shows the same;
# - in-place ops (`x.exp_()`, `c.addmm_(a, b)`) and calls with `out=`;
# - float64 tensors, and tensors that are not floating point.
#
# Each, traced next to the call that autocast does handle:

# %%
print(probe_table(["mm(a, b)", "mm(a, b, out=c)", "addmm(c, a, b)", "c.addmm_(a, b)",
                   "mm(a64, b64)", "exp(x)", "x.exp_()"], dtype))

# %% [markdown]
# ## "Reductions stay float32"?
#
# The card says reductions are kept in float32. **Predict**: what do `sum` and `mean` of a
# 16-bit tensor produce?

# %%
print(probe_table(["sum(x)", "mean(x)"], dtype))

# %% [markdown]
# On CUDA, `sum` is on the float32 list (so are `prod`, `cumsum` and the norms) and comes out
# float32, with no separate cast (autocast sets its `dtype=`). `mean` is on no list and stays
# 16-bit. On a CPU both stay 16-bit; of the common reductions only `prod` is on the CPU's
# float32 list. A trace shows the dtype each op returns, not how its kernel accumulates
# inside.
#
# `python -m amp_lessons selfcheck` (and `make gpu-check`) checks this lesson's statements
# about CUDA as verdicts on CUDA traces: on a CPU, on the replay, so a verdict there says
# only that the replayed lists agree with the sentence; on a CUDA GPU, on real traces.

# %% [markdown]
# ## Apple GPUs (MPS)
#
# What is known: PyTorch added autocast on MPS for float16 in release 2.5
# ([pytorch#99272](https://github.com/pytorch/pytorch/pull/99272)) and for bfloat16 in 2.6
# ([pytorch#139390](https://github.com/pytorch/pytorch/pull/139390)), which needs macOS 14
# or later. Its lists are in the same `autocast_mode.cpp` (the `AutocastMPS` block):
# matmuls and convolutions run 16-bit, and `softmax`, `log_softmax`, `layer_norm`,
# `group_norm`, `sum`, `exp` and most losses are on its float32 list, as on CUDA (not
# `binary_cross_entropy`, which CUDA bans and MPS's list leaves out). This course
# has not been run on Apple hardware; the column below replays the lists of the torch
# installed here, on FakeTensors, and is labelled simulated.

# %%
mps_columns = [device, "mps (simulated)"]
print(probe_table(["softmax(x)", "layer_norm(x)", "sum(x)", "mean(x)", "cross_entropy(x, y)"],
                  dtype, mps_columns))

# %% [markdown]
# In the replay every op on the MPS float32 list gets a separate cast, with no `dtype=`
# shortcut: autocast casts `log_softmax`'s input to float32 even when `cross_entropy` names
# its dtype, and the named dtype then casts it back.
#
# ## Weights and gradients stay float32; backward runs outside
#
# The card: keep the weights in float32, run `backward()` outside the autocast context.
# `trace_model(..., backward="outside")` does exactly that and traces the backward pass
# too. **Predict**: what dtype will each `.grad` have, given that the matmuls ran in 16-bit?

# %%
mlp, x, y, loss_fn = example("card_model", device)
mlp_backward = trace_model(mlp, x, y, loss_fn, dtype=dtype, backward="outside")
for name, p in mlp.named_parameters():
    print(f"{name:<9} parameter {p.dtype}   grad {p.grad.dtype}")

# %% [markdown]
# The backward pass ran its matmuls in 16-bit as well (the `(backward)` row): with autocast
# off, as here, each backward op runs in the dtype its forward op chose (called inside the
# context, autocast can change that: the next section). Every cast autocast inserted has a
# backward of its own, a cast the other way, so the gradient reaching a float32 weight is cast back
# to float32: the `_to_copy` casts in the `(backward)` row.

# %%
print(mlp_backward.summary())

# %% [markdown]
# ## What if backward is called inside the context?
#
# The card says to call `backward()` outside. What changes if you don't? Run the block
# twice from the same weights, once with `loss.backward()` after the `with` block and once
# inside it, and compare the backward ops and the gradients.

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
# On this device, the cell above printed what changed. That is this device's lists, not a
# rule: autocast acts inside `backward()` on every op on its lists. The backward pass here
# reduces the bias gradients of its `Linear` layers with `sum`, which is on CUDA's float32 list (`sum` above) and
# not on the CPU's, so on CUDA those sums may come out float32 when `backward()` runs inside
# the context. The replay has no backward pass, so this lesson cannot show CUDA's case. The
# card's rule keeps backward free of such accidents: the next two sections show code whose
# gradients do depend on where `backward()` is called.
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
# float32, and without autocast to reconcile them the matmul refuses to mix dtypes. The
# region needs an explicit `.float()` on every tensor that comes in from the autocast region:

# %%
with torch.autocast(device, dtype=dtype):
    h = mlp[0](x)
    with torch.autocast(device, enabled=False):
        out = head(h.float())
print(h.dtype, "->", out.dtype)

# %% [markdown]
# The region's forward ran in float32. Its backward runs in float32 only if autocast is off
# when it runs: called inside the context, autocast is on again, and the backward matmuls
# of `head` are on its list. **Predict**: does `head`'s weight gradient depend on where
# `backward()` is called?

# %%
def head_weight_grad(backward_inside: bool) -> torch.Tensor:
    head.weight.grad = None
    with torch.autocast(device, dtype=dtype):
        with torch.autocast(device, enabled=False):
            out = head(mlp[0](x).float())
        if backward_inside:
            out.square().mean().backward()
    if not backward_inside:
        out.square().mean().backward()
    return head.weight.grad


print("head.weight.grad identical, backward inside vs outside:",
      torch.equal(head_weight_grad(True), head_weight_grad(False)))

# %% [markdown]
# ## Custom autograd functions: `custom_fwd` and `custom_bwd`
#
# A custom `torch.autograd.Function` has a `backward` that you write, and autograd calls it
# wherever `loss.backward()` is called: outside the context, autocast is off there. Here is
# a plain matmul as a custom function, with no autocast decorators. **Predict**: under
# autocast, which dtype reaches `backward` as `grad`, and which dtype does the saved `b`
# have?

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
# Code that works only when `backward()` is called in one place is fragile. The fix is
# two decorators: `torch.amp.custom_fwd(device_type=...)` records the autocast state of the
# forward, and `torch.amp.custom_bwd(device_type=...)` runs `backward` in that same state,
# wherever `backward()` is called.

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
# section did by hand: it casts the floating-point inputs to float32 and runs `forward`
# with autocast off. Traced with a 16-bit input:

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
# The view shows `autocast_table`'s text; here it is for float16 on the CPU, which every
# machine has:

# %%
from amp_lessons.widgets import autocast_table

print(autocast_table("card_model", "fp16", "cpu").split("\n\n")[0])

# %% [markdown]
# ## Remember
#
# - `torch.autocast(device, dtype)` wraps the forward pass and the loss. Inside it, matmuls
#   and convolutions ran in 16-bit; the losses came out float32 (the traces above).
# - Autocast never converts the model: it casts each float32 weight to 16-bit as an op uses
#   it (the `_to_copy` rows). Parameters and their `.grad` stayed float32.
# - Each device type has its own lists (trace on the device you train on). Ops on no list
#   follow their inputs, with type promotion (the residual `add` came out float32 because
#   its input was float32 already, not because of autocast).
# - On CUDA, autocast skips calls that name their `dtype=` (a CPU and MPS cast anyway), and
#   everywhere in-place ops, `out=` and float64. That is why CUDA runs `cross_entropy`'s
#   log-softmax in 16-bit: it passes `dtype=x.dtype`.
# - "Reductions stay float32" is true on CUDA for `sum`, not for `mean`, and on a CPU for
#   neither.
# - Apple GPUs (MPS) keep lists like CUDA's; replayed here, each float32 op there gets its
#   own cast.
# - Call `backward()` outside the context. Custom autograd functions get
#   `torch.amp.custom_fwd(device_type=...)` and `torch.amp.custom_bwd(device_type=...)`.
#
# ## Watch out
#
# - `torch.autocast(device, enabled=False)` casts nothing: tensors from the autocast region
#   stay 16-bit, so call `.float()` on them, or get a dtype-mismatch error.
# - A custom function whose `backward` only works when `backward()` is called inside the
#   context has a latent dtype bug; `custom_bwd` fixes it.
# - What runs in 16-bit depends on the device: trace on the device you train on, or replay
#   it with `simulate=True` (`trace_model(..., device="cuda", simulate=True)`), which is a
#   replay of the lists, not a run.
# - The card's example uses float16 on every GPU; on an Ampere-or-newer GPU lesson 00
#   recommends bfloat16, which needs no scaler.
#
# ## Exercise: predict the dtype
#
# A small convolutional net, traced under autocast with this lesson's dtype on this device.
# For each op below, predict the dtype of its output (`"fp32"`, `"bf16"` or `"fp16"`; TF32 is
# a matmul mode, not a dtype), replace the `"?"`s, and run the two cells. Reason with the
# three rules and this device's lists. `_log_softmax` is the `LogSoftmax` module;
# `nll_loss_forward` is the loss. The net, layer by layer:

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

# %% [markdown]
# A wrong prediction gets the rule that decided that op, as a question, not the answer; pass
# `reveal=True` to see what each op ran in.

# %%
check_dtype_predictions(predictions, trace_model(net, images, labels, nll, dtype=dtype))

# %% [markdown]
# When all five are right, print the trace's table (`trace_model(...).table()`) and find
# the rows that made each answer. Then predict again for CUDA, and check against the replay:
# `trace_model(net, images, labels, nll, dtype=dtype, device="cuda", simulate=True)`. Not
# every answer is the same as on a CPU.

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch that the traces above do not compute, or compute only in
# a replay:
#
# - The autocast lists of each device type: `aten/src/ATen/autocast_mode.cpp` (the
#   `AutocastCUDA`, `AutocastCPU` and `AutocastMPS` blocks) and `autocast_mode.h`; the AMP
#   docs' "Autocast Op Reference" (`docs/source/amp.md`), which lists Python-level calls
#   such as `cross_entropy`.
# - The calls autocast skips (in-place, `out=`, float64; and on CUDA an explicit `dtype=`):
#   "Op Eligibility" in `docs/source/amp.md`; which ops take the `dtype=` shortcut: the
#   `fp32_set_opt_dtype` kernels of CUDA's block in `aten/src/ATen/autocast_mode.cpp` (the
#   CPU's block has none).
# - `cross_entropy` as `log_softmax(x, 1, dtype=x.dtype)` then `nll_loss`:
#   `cross_entropy_loss` in `aten/src/ATen/native/LossNLL.cpp`.
# - Backward ops running in the dtype autocast chose for their forward op, and backward
#   outside autocast: "Autocasting" in `docs/source/amp.md`.
# - `custom_fwd` and `custom_bwd` (and `cast_inputs`): `torch/amp/autocast_mode.py`.
# - Autocast on MPS: pytorch/pytorch#99272 (float16, release 2.5) and #139390 (bfloat16,
#   release 2.6).
# - The tracer sitting below autocast: `TorchDispatchMode` in
#   `torch/utils/_python_dispatch.py`; the autocast dispatch keys in
#   `c10/core/DispatchKey.h`.
