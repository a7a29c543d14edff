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
# # 05 · Putting it together: speed, memory, master weights, TF32
#
# The card opens with a promise: *"Mixed precision typically gives 2-3x faster training
# and halves activation memory on modern GPUs."* This lesson trains one model in every
# precision your device runs, side by side in one process, and sets both numbers against
# what the card says. Then it shows the rule that keeps mixed precision correct, not just
# fast: keep the weights in float32 (no `model.half()`); and what
# `torch.set_float32_matmul_precision("high")` really changes.
#
# Every verdict below is computed from this run's measurements, so on another device it
# reports what that device does. The stored outputs come from a CPU.

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
from amp_lessons import bench, benchcli

device = amp_lessons.pick_device()
print(bench.device_line(device))

# %% [markdown]
# ## One model, every precision
#
# The precisions this device can run, and the reason for each one it cannot:

# %%
from amp_lessons.hardware import supported_precisions

why_not = supported_precisions(device)
runnable = [p for p, why in why_not.items() if why is None]
print("runs here:", ", ".join(runnable))
for p, why in why_not.items():
    if why:
        print(f"not here: {p}: {why}")

# %% [markdown]
# One small MLP on the 8x8 handwritten digits, trained through the course's `Trainer`
# in each of them: fp32, bf16 (no scaler), fp16 with a `GradScaler`, and tf32 where it
# exists. Every run starts from the same weights and sees the same batches; the runs take
# their optimizer steps in turn, so no run has a quiet or a busy minute to itself.
#
# **Predict**: will the 16-bit runs reach a lower test accuracy than fp32? Which run will
# take the least time per step?

# %%
from amp_lessons.data import digits
from amp_lessons.models import mlp

data = digits()
result = bench.train_side_by_side(lambda: mlp(64, 128, 10, depth=2), data, runnable, steps=150,
                                  device=device, lr=1e-3, batch_size=64)
print(result.quality_table())

# %% [markdown]
# The accuracy column answers the first question. Checked, against fp32, in accuracy and
# in the mean loss of the last 20 steps:

# %%
from amp_lessons.claims import at_least, at_most, check, measured

fp32_run = result.runs["fp32"]
for p, run in result.runs.items():
    if p != "fp32":
        print(at_most(f"{p} reaches fp32's test accuracy within 0.02", abs(run.accuracy - fp32_run.accuracy), 0.02))
        late = abs(sum(run.losses[-20:]) - sum(fp32_run.losses[-20:])) / 20
        print(at_most(f"{p}'s late loss is within 0.05 of fp32's", late, 0.05))

# %% [markdown]
# `Trainer.evaluate` runs the test set under the same autocast as training, inside
# `torch.no_grad()`: no backward, so no GradScaler and no saved activations. The same
# autocast on the trained models, by hand:

# %%
from amp_lessons.precision import dtype_of

for p in [p for p in result.runs if p in ("bf16", "fp16")]:
    model = result.runs[p].trainer.model
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype_of(p)):
        logits = model(data.x_test.to(device))
    model.train()
    print(f"{p}: logits {logits.dtype}, autograd graph recorded: {logits.requires_grad}")

# %% [markdown]
# `skipped` counts the steps fp16's `GradScaler` threw away (lesson 03). The figure's lower
# right panel adds up, by kind, what a training step holds; only the activations shrink:

# %%
from amp_lessons import plots

plots.side_by_side(result)

# %% [markdown]
# ## Memory: "halves activation memory"
#
# Activation memory is what autograd keeps from the forward pass for the backward pass.
# `amp_lessons.measure` counts those bytes exactly, on any device, with
# `torch.autograd.graph.saved_tensors_hooks`, each storage once. Autocast's 16-bit *copies
# of the weights* are saved too; they do not grow with the batch, so they are counted
# apart. Per dtype, for one batch of 64:

# %%
from amp_lessons.measure import saved_memory

x, y = (t.to(device) for t in data.batch(0, 64))
for p, run in result.runs.items():
    print(f"--- {p}\n{saved_memory(run.trainer.model, x, y, p).table()}")

# %% [markdown]
# In the 16-bit runs almost every activation is stored in 16 bits. The float32 bytes
# that remain belong to the loss: on a CPU autocast casts the logits to float32 for it, and
# its `log_softmax` saves its float32 output. On CUDA `cross_entropy` asks `log_softmax` for
# its input's dtype, so it runs in 16 bits, but `nll_loss` is on CUDA's float32 list and
# saves a float32 copy of the log-probabilities (lesson 02, Sources). The labels are int64. The ratio to fp32 (exact byte counts), and
# the card's claim against it:

# %%
from amp_lessons.precision import sixteen_bit

for p in sixteen_bit(result.runs):
    ratio = result.memory_ratio(p)
    print(check(f"{p} keeps half of fp32's activation bytes, as the card says (0.45 to 0.55)",
                0.45 <= ratio <= 0.55, f"{ratio:.2f}"))

# %% [markdown]
# That holds for these MLPs, whose saved tensors are almost all matmul inputs. Lesson 02's
# `TransformerBlock` (layer norms, softmax attention, GELU), for one batch of 8 sequences of
# 16 tokens, under this device's autocast lists (CUDA's differ, lesson 02), and which layers
# save its float32 bytes (`saved_by_layer` runs the same hook per layer, weight copies left
# out):

# %%
from amp_lessons.measure import saved_by_layer
from amp_lessons.models import TransformerBlock

block, tokens = TransformerBlock().to(device), torch.zeros(8, 16, 64, device=device)
low16 = sixteen_bit(result.runs)[0]
kept = saved_memory(block, tokens, precision=low16)
block_ratio = kept.activation_bytes / saved_memory(block, tokens).activation_bytes
print(f"{low16}: the block keeps {block_ratio:.2f} of fp32's activation bytes "
      f"({'inside' if 0.45 <= block_ratio <= 0.55 else 'outside'} the card's half, 0.45 to 0.55), "
      f"{kept.by_dtype.get('float32', 0) / kept.activation_bytes:.0%} of them float32")
print(f"{low16}, saved activation bytes by layer and dtype:", saved_by_layer(block, tokens, low16))
with torch.no_grad(), torch.autocast(device.type, dtype=dtype_of(low16)):
    out = block(tokens)
print(f"the block's output under {low16} autocast: {out.dtype}; a {low16} tensor plus a float32 one: "
      f"{(torch.ones(1, dtype=dtype_of(low16)) + torch.ones(1)).dtype}")

# %% [markdown]
# Here the float32 bytes are the layer norms' (each saves its input and its per-token mean
# and 1/std). On a CPU no autocast list makes them float32 (`layer_norm` is on none, lesson
# 02): the residual stream does. The block's input is float32, and `x + attn(ln1(x))` adds
# a 16-bit result to it, which type promotion makes float32, so both layer norms read
# float32. On CUDA, `layer_norm` and `softmax` are on the float32 lists (lesson 02), so the
# attention's softmax saves float32 too.

# %% [markdown]
# ### What a batch twice as large costs
#
# A training step holds more than its activations: the float32 weights, their gradients
# and AdamW's two moments, autocast's 16-bit weight copies, and the input batch itself.
#
# **Predict**: in the memory fp32 needs for a batch of 64, how large a batch fits in bf16?
#
# `doubled_batch` adds up, by kind, the bytes a step holds, at the batch and at twice it: a
# sum, not a measured peak (temporaries are left out). The batch column is `x` and the labels
# as given, counted once in every precision: fp32's first matmul saves that `x` itself,
# while autocast saves a 16-bit copy of it, which counts as an activation.

# %%
from amp_lessons.measure import doubled_batch

low = sixteen_bit(result.runs)  # tf32, where it runs, keeps float32 tensors
cost = doubled_batch(result.runs["fp32"].trainer.model, x, y, low)
print(cost.table())
print("\n".join(cost.fits_lines()))

# %% [markdown]
# Only the activations column shrinks, and by less than the half measured above: there
# fp32's saved bytes included `x`, which here is in the batch column, while autocast's
# 16-bit copy of `x` stays an activation. The weight copies grow with the weights, not the
# batch. The bench's larger MLP at its batch:

# %%
big_model, big_x, big_y = bench.build("mlp", bench.default_sizes("mlp", device), device)
big = doubled_batch(big_model, big_x, big_y, low)
print(big.table())
print("\n".join(big.fits_lines()))

# %% [markdown]
# Where the 16-bit weight copies outweigh the activation bytes saved, a 16-bit step's sum
# exceeds fp32's (the total column). A larger batch shrinks the weights' share, but the
# ratio only grows towards fp32's bytes per example over 16 bits': the input batch (float32
# `x`, int64 labels) and the loss's float32 bytes do not halve, and the 16-bit copy of `x`
# comes on top:

# %%
limits = {f"{label} {p}": c.ratio_limit(p) for label, c in (("digits MLP", cost), ("bench MLP", big)) for p in low}
print(check("at no batch does a 16-bit step of these MLPs fit twice fp32's batch in fp32's memory",
            all(r < 2 for r in limits.values()),
            "the limits: " + ", ".join(f"{k} {r:.3f}x" for k, r in limits.items())))

# %% [markdown]
# ## Speed: "2-3x faster"
#
# **Predict**: the card says 2-3x *on modern GPUs*. What will the ratio be on the device
# this notebook runs on?
#
# The digits runs' median ms per optimizer step, speed against fp32 (above 1 is faster) and
# matmul rate; timings change from run to run (the `≈`):

# %%
print(result.speed_table())

# %% [markdown]
# The stored run's digits steps are slower in 16 bits than in fp32. For fp16 the reasons
# below show why on that CPU (it has no fast fp16 matmul kernel); for bf16 no cell here
# profiles this small step, so its reason is not shown.
#
# The bench runs a larger MLP and a matmul microbenchmark, every precision side by side;
# its ms/step times the card's step alone (`bench.make_step`: forward, loss, backward,
# AdamW). Its table is collapsed below; the first verdict after it prints this lesson's
# headline speedup, the bench MLP's, against the card's 2-3x, with reasons read from the
# measurements and this device's hardware report:

# %% jupyter={"outputs_hidden": true}
# NBVAL_IGNORE_OUTPUT
b = bench.run_bench(("mlp",), runnable, device, warmup=1, repeats=5, breakdown=True, profile_steps=3)
print(benchcli.table(b, breakdown=False))

# %%
# NBVAL_IGNORE_OUTPUT
digits_rate = {"the digits MLP": result.runs["fp32"].gflops}
for p in [p for p in result.runs if p != "fp32"]:
    row = b.row("mlp", p)
    print(f"bench MLP: {bench.speed_verdict(row.speedup, p, row)}\nWhy:")
    print("\n".join("  - " + reason for reason in bench.speed_reasons(b, p, digits_rate, with_shares=False)))
print("And for both steps:")
print("\n".join("  - " + reason for reason in bench.share_reasons(b, result.runs, digits_rate, amdahl=False)))

# %%
plots.matmul_rates(b)

# %% [markdown]
# The card's 2-3x is PyTorch's AMP recipe's figure for its own large linear layers in
# float16 on Volta, Turing and Ampere GPUs, and the recipe warns: "Small networks may be
# CPU bound". An NVIDIA GPU's 16-bit matmul hardware is **tensor cores** (fp16 from Volta
# on, bf16 from Ampere on, on the cards of those generations that have them). On an x86
# CPU it is
# **AMX tiles** (Intel: bf16 from Sapphire Rapids on, fp16 from Granite Rapids on), or the
# vector units' AVX512-BF16 dot product and AVX512-FP16 arithmetic; the reasons above name
# the ones this device has, and the matmul figure measures them.
#
# ## Where one step's time goes
#
# Besides its matmuls, a step runs elementwise ops, autocast's casts, the optimizer (on
# float32 master weights in every precision), the Trainer's bookkeeping and the batch
# fetch. The bench profiled Trainer steps of its MLP with `torch.profiler`, each op's own
# time added to one category (`amp_lessons.breakdown` has the mapping); the figure after
# the table draws it.
#
# **Predict**: which categories will be as long in bf16 as in fp32?

# %%
# NBVAL_IGNORE_OUTPUT
print("\n".join(benchcli.breakdown_lines(b, "mlp", amdahl=False)))

# %%
plots.step_breakdown(b, "mlp")

# %% [markdown]
# The optimizer, the bookkeeping and the batch fetch do the same work in bf16 as in fp32
# (AdamW updates the float32 master weights from float32 gradients): none of it is 16-bit
# work, so bf16 does not shorten it. Where one of these bars differs between the two, that
# is not 16-bit arithmetic: the steps took turns in the same rounds, but each bar is a
# median of three steps, and this lesson does not find a cause. The casts are new work.
#
# The `vs fp32` column of the table's last block is not the headline remeasured: it times
# Trainer steps, run apart from the bench table. The categories account for each profiled
# step:

# %%
coverage = [s.coverage for s in b.breakdowns if s.model == "mlp"]
print(check("the categories account for each profiled step, within 10% (0.9 to 1.1)",
            all(0.9 <= c <= 1.1 for c in coverage),
            f"from {measured(min(coverage), '.2f')} to {measured(max(coverage), '.2f')}"))
fp32_step = b.breakdown("mlp", "fp32")
print(at_least("matmuls are a large part, at least 20%, of the bench MLP's fp32 step",
               fp32_step.matmul_share, 0.2, ".2f"))

# %% [markdown]
# **Amdahl's law** estimates what faster matmuls alone give: with a matmul share *f* of the
# fp32 step and matmuls *r* times faster, 1 / ((1 - f) + f / r);
# `python -m amp_lessons bench --breakdown` prints it. It is no cap: elementwise ops on
# 16-bit tensors move half the bytes and run faster where memory bandwidth limits them
# (NVIDIA's mixed-precision guide), and autocast's casts add work.
#
# The table's last block times three changes aimed at the rest of the step:
# `grad_stats=False` (no per-step gradient statistics, which lessons 03 and 04 read), then
# `AdamW(foreach=True)` (each operation one `torch._foreach_*` call on the list of
# tensors, not a Python loop) and `AdamW(fused=True)` (the whole update one
# `torch._fused_adamw_` call). On a CPU both still loop over the tensors in C++, one op or
# one fused kernel per tensor; on CUDA both run through `multi_tensor_apply`, whose kernel
# launches each cover chunks of many tensors (Sources). On a busy machine these gains are
# noisy (where the OS reports it, the table ends with the load average).
# `python -m amp_lessons bench --breakdown --compile` adds `torch.compile`.
#
# ## Master weights: why not `model.half()`?
#
# The card: *"Keep the model's weights in float32 (do not call model.half() for
# training); autocast handles the casts."* A float16 number near 0.05 has 10 mantissa
# bits: the next float16 above it is a fixed step away. An update smaller than half that
# step rounds back to the same weight. The step, in float16 and in float32:

# %%
from amp_lessons.master import spacing

w = torch.tensor([0.05, 0.5])
{str(dt): [f"{s:.2e}" for s in spacing(w, dt).tolist()] for dt in (torch.float16, torch.float32)}

# %% [markdown]
# So in float16, 0.05 minus 1e-5 is still 0.05:

# %%
w16 = torch.tensor(0.05, dtype=torch.float16)
(w16 - 1e-5 == w16).item(), (torch.tensor(0.05) - 1e-5 == torch.tensor(0.05)).item()

# %% [markdown]
# **Predict**: SGD with `lr=1e-3` multiplies this model's gradients (their spread is printed
# first below). What share of the weights will one step leave unchanged, in float16? In
# float32?
#
# `lost_updates` takes the gradients of one batch on the fp32 model trained above, then
# applies one optimizer step to float32 master weights and to a `.half()` copy. It counts
# the weights whose exact update is nonzero but which did not move, and, as `predicted`,
# those whose update is below half their spacing:

# %%
from amp_lessons.master import gradients, lost_fraction_by_lr, lost_updates

trained = result.runs["fp32"].trainer.model
grads = gradients(trained, x, y)
magnitudes = torch.cat([g.abs().flatten() for g in grads]).double()
magnitudes = magnitudes[magnitudes > 0]
q10, q50, q90 = (torch.quantile(magnitudes, q).item() for q in (0.1, 0.5, 0.9))
print(f"|gradient|: 10% below {measured(q10, '.0e')}, median {measured(q50, '.0e')}, 90% below {measured(q90, '.0e')}")
lost = lost_updates(trained, grads, lr=1e-3, optimizer="sgd")
for r in lost.values():
    print(r.line())
print(at_most("the half-spacing rule predicts how many updates vanish, within 1%",
              max(abs(r.unchanged - r.predicted) / max(1, r.unchanged) for r in lost.values()), 0.01))
print(at_least("model.half() leaves at least 10x as many weights unchanged as float32 master weights",
               max(1, lost["model.half()"].unchanged) / max(1, lost["fp32 master"].unchanged), 10))

# %%
n_weights = sum(p.numel() for p in trained.parameters())
print(f"the model has {n_weights:,} weights; {measured(lost['fp32 master'].meant, ',')} of them get a nonzero "
      f"update from these gradients (the 'of' above); inf/NaN counts are out of all {n_weights:,}")

# %% [markdown]
# The half-spacing rule predicts how many updates vanish. float32 loses only updates at or
# below 2^-24 of the weight (a tie rounds to the even neighbour). Across learning rates:

# %%
lrs = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]
plots.lost_updates(lrs, lost_fraction_by_lr(trained, grads, lrs), at_lr=1e-3)

# %% [markdown]
# With autocast, the forward's matmuls run in 16 bits but the optimizer adds each update to
# the float32 master weight, which loses at most the updates at or below 2^-24 of the weight. That
# is why mixed precision needs no trade-off here, and `model.half()` does.
#
# Adam has a second problem. **Predict**: its default `eps=1e-8` is added to the
# denominator `sqrt(v) + eps`. What is `1e-8` stored in each format?

# %%
from amp_lessons.master import eps_in

{p: f"{eps_in(p):.3g}" for p in ("fp32", "bf16", "fp16")}

# %% [markdown]
# In float16, `eps` is 0. After its first step Adam's second moment is
# `v = (1 - β2) g² = 0.001 g²`, which rounds to 0 in float16 below half its smallest
# subnormal, and there `m / (sqrt(v) + eps)` divides by zero (0/0 where the gradient is 0
# too). One step with the same gradients, in Adam's for-loop implementation (torch's
# default on a CPU; on CUDA its default is `foreach`):

# %%
tiny16 = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps / 2
g_min = (tiny16 / 0.001) ** 0.5
print(f"0.001 g² rounds to 0 in float16 where |g| < {g_min:.2g}: "
      f"{measured((magnitudes < g_min).double().mean().item(), '.0%')} of the nonzero gradients")
for r in lost_updates(trained, grads, lr=1e-3, optimizer="adam").values():
    print(r.line())

# %% [markdown]
# torch has three Adam implementations: the for-loop, `foreach=True` and `fused=True`.
# `half_adam` takes five steps of each on a `.half()` copy of the trained model, counting
# the weights that are inf/NaN after each step and the largest change of one finite weight:

# %%
from amp_lessons.master import ADAM_IMPLEMENTATIONS, half_adam

adam = {impl: half_adam(trained, data, impl, device=device) for impl in ADAM_IMPLEMENTATIONS}
for run in adam.values():
    print(run.line())

# %% [markdown]
# The fused kernel does its arithmetic, `eps` included, in float32 (`opmath_t`, in its CPU
# and its CUDA source), so its first step is finite; but it stores `v` back in float16,
# where it rounds to 0. From step 2 on, `m` still remembers the earlier gradients while `v`
# has forgotten them, and the steps grow far past the learning rate of 1e-3 (the largest
# changes above). By step 5 the weights still finite are the ones no step moved:

# %%
print(at_least("for-loop and foreach: one step makes at least half of the weights inf/NaN",
               min(adam[i].nonfinite[0] for i in ("for-loop", "foreach")) / n_weights, 0.5, ".0%"))
fused = adam["fused"]
if fused.error is None:
    print(check("fused: every weight is finite after step 1, and exp_avg_sq is 0 in float16 for at least "
                "half the nonzero gradients", fused.nonfinite[0] == 0 and fused.v_zero >= fused.nonzero_grads / 2,
                f"{measured(fused.v_zero / fused.nonzero_grads, '.0%')} of them"))
    print(check("fused: after step 5 no weight that ever had a nonzero gradient is still finite",
                fused.finite_with_gradient == 0))

# %% [markdown]
# ## TF32: `set_float32_matmul_precision("high")`
#
# The card: *"lets float32 matmuls use TF32 tensor cores on NVIDIA GPUs, a near-free
# speedup for code you do not convert."* TF32 is not a storage format: tensors stay
# float32, but an Ampere-or-newer tensor core multiplies with only 10 of each input's 23
# mantissa bits (lesson 01). `tf32_error` rounds the inputs to 10 bits, so the precision
# cost shows on any device; on an NVIDIA GPU with TF32 it also measures the real thing.
#
# **Predict**: will TF32's error be closer to float32's or to bfloat16's?

# %%
from amp_lessons.matmul import tf32_error

err = tf32_error(256, device)
print(err.table())

# %% [markdown]
# The exact errors depend on the machine's matmul kernels; their order does not:

# %%
print(check("float32's error < TF32's < bf16's", err.fp32 < err.tf32_emulated < err.bf16,
            f"{measured(err.fp32, '.1e')} < {measured(err.tf32_emulated, '.1e')} < {measured(err.bf16, '.1e')}"))
print(check("on a log scale TF32's error is closer to bf16's than to float32's",
            err.tf32_emulated / err.fp32 > err.bf16 / err.tf32_emulated,
            f"{measured(err.tf32_emulated / err.fp32, '.0f')}x float32's, {measured(err.bf16 / err.tf32_emulated, '.0f')}x below bf16's"))
amx_fp16 = getattr(torch._C._cpu, "_get_cpu_capability", dict)().get("amx_fp16", False)  # torch's CPU probe
tf32_path = amx_fp16 if device.type == "cpu" else why_not["tf32"] is None
print(check("'high' changes this device's float32 matmul only where it has a TF32 path "
            "(an NVIDIA GPU with TF32; a CPU with AMX-FP16, lesson 00, where oneDNN may take it)",
            err.high_changes_result <= tf32_path))

# %% [markdown]
# `"medium"` is the setting to watch: on a CPU it lets oneDNN, the library behind many CPU
# matmuls, compute a float32 model's matmuls in bf16, with bf16's 7-bit mantissa, where
# torch's `mkldnn_bf16_device_check` passes (on x86 it asks for AVX512BW, VL and DQ, or
# AVX-NE-CONVERT, not for bf16 matmul hardware); whether oneDNN then picks a bf16 kernel is
# oneDNN's choice for the CPU, and `ONEDNN_VERBOSE=1` prints the kernel it ran (Sources). On
# an NVIDIA GPU with TF32 it
# means TF32, as `"high"` does. **Predict** which error this device's float32 matmul has
# under `"medium"`:

# %%
# NBVAL_IGNORE_OUTPUT
level = {"between": "neither float32's nor bf16's"}.get(err.medium_level, f"{err.medium_level}'s")
print(f"float32 matmul error: 'highest' {err.highest:.1e}, 'medium' {err.medium:.1e}; a bf16 matmul's: "
      f"{err.bf16:.1e}: here 'medium' gave {level} accuracy")

# %%
from amp_lessons.matmul import medium_levels

print(check("'medium' gives an error torch's source allows here (on a CPU float32's or bf16's, "
            "on an NVIDIA GPU with TF32 TF32's, each within 3x), nothing between",
            err.medium_level in medium_levels(device)))

# %% [markdown]
# On an NVIDIA GPU with TF32, the speedup of `"high"`:

# %%
from amp_lessons.matmul import tf32_speedup

speedup = tf32_speedup(device=device)
print("not measured: tf32 does not run here (the reason is printed at the top)" if speedup is None else f"tf32 matmul: {measured(speedup, '.1f')}x fp32's speed")

# %% [markdown]
# Tensor cores also care about shapes: NVIDIA's guide recommends dimensions that are
# multiples of 16 bytes (8 fp16 or bf16 elements, 4 TF32 ones); nanoGPT pads GPT-2's 50257
# tokens further, "up to nearest multiple of 64 for efficiency". On a CUDA GPU the cell
# below times a 4096 matmul against a 4095 one; a CPU has no tensor cores:

# %%
# NBVAL_IGNORE_OUTPUT
from amp_lessons.matmul import matmul_gflops

if device.type == "cuda":
    p = amp_lessons.hardware_report(device).recommended
    aligned, ragged = matmul_gflops(4096, p, device), matmul_gflops(4095, p, device)
    print(f"{p}: n=4096 {aligned:,.0f} GFLOP/s, n=4095 {ragged:,.0f} GFLOP/s ({aligned / ragged:.2f}x)")
else:
    print(f"not measured on {device.type}: no tensor cores; padding 50257 to a multiple of 64 gives "
          f"{-(-50257 // 64) * 64}")

# %% [markdown]
# ## Remember
#
# The card's checklist, each line with the lesson that showed it:
#
# - autocast wraps forward + loss; backward goes outside:
#   [02 autocast](02_autocast.ipynb) traced which op ran in which dtype.
# - bfloat16 needs no scaler; float16 needs GradScaler: the ranges in
#   [01 number formats](01_number_formats.ipynb), the flushed gradients and the scaler
#   at work in [03 grad scaler](03_grad_scaler.ipynb).
# - Keep master weights in float32: the lost updates above, and Adam on `.half()` weights
#   going inf/NaN in each of its three implementations.
# - For these MLPs the saved activation bytes (the first table) halve under bf16 and fp16
#   (a transformer block whose residual stream is float32 keeps more: here its layer norms
#   save float32). Still no batch
#   twice as large fits in fp32's memory: autocast adds 16-bit copies of the weights and of
#   the input, and some bytes never halve (the input batch, float32 `x` and int64 labels,
#   and the loss's float32).
# - In the stored run the bench MLP's bf16 speedup came from its matmuls (the breakdown),
#   and the small digits MLP ran slower in 16 bits than in fp32. Amdahl's law on the matmul
#   share estimates a step's speedup: `python -m amp_lessons bench --breakdown` prints it.
# - `set_float32_matmul_precision("high")` means TF32 on Ampere-or-newer NVIDIA GPUs, and
#   on CPUs with AMX-FP16 where oneDNN takes it; `"medium"` also allows bf16 for a CPU's
#   float32 matmuls.
# - Which precision to use on a given machine: [00 start here](00_start_here.ipynb).
#
# ## Watch out
#
# - Clipping gradients that are still scaled; call `scaler.unscale_(opt)` first:
#   [04 clipping](04_clipping.ipynb) measured the threshold shrinking by the scale.
# - A speed figure is a ratio measured on one machine: time precisions side by side in
#   one process (warm-up, synchronize, median), as the bench does, before switching.
# - `model.half()` with Adam: `eps` is 0 in float16, and so is `v` wherever a gradient is 0
#   or below 5.5e-3 (computed above); the for-loop and `foreach` kernels make those weights
#   inf/NaN in one step, the fused kernel a few steps later.
#
# ## Exercise: fix the setup
#
# The function below returns the pieces of a float16 mixed-precision run: model,
# optimizer, GradScaler and autocast dtype. Two of its lines are wrong. Read it:

# %%
import inspect

from amp_lessons.exercises import broken_setup, check_setup

print(inspect.getsource(broken_setup))

# %% [markdown]
# Copy it into the cell below as `def my_setup(device_type):`, fix it, and run the cell.
# The checker inspects the dtype, the weights, the optimizer and the scaler, then trains
# five steps on the digits with the card's recipe and looks for inf/NaN weights or losses
# and weights that never moved. As given, it checks the broken setup:

# %%
my_setup = broken_setup  # replace with your fixed copy: def my_setup(device_type): ...

check_setup(my_setup, device)

# %% [markdown]
# ## Sources
#
# What this lesson says of PyTorch and hardware that no cell computes here:
#
# - `"highest"`, `"high"` and `"medium"`: the docstring of
#   `torch.set_float32_matmul_precision` (`torch/__init__.py`); per backend,
#   `Context::setFloat32MatmulPrecision` (`aten/src/ATen/Context.cpp`) and the "MKLDNN
#   backend" notes (`docs/source/notes/mkldnn.md`); on a CPU, `use_mkldnn_bf32_matmul`
#   and `mkldnn_gemm` (`aten/src/ATen/native/mkldnn/Matmul.cpp`), `mkldnn_bf16_device_check`
#   (`aten/src/ATen/native/mkldnn/Utils.h`, via ideep's `has_bf16_type_support`), oneDNN's
#   "Floating-point Math Mode" page, and its "Verbose Mode" page for `ONEDNN_VERBOSE`.
# - TF32's 10 bits on Ampere and later: PyTorch's CUDA semantics notes
#   (`docs/source/notes/cuda.md`) and numerical-accuracy notes
#   (`docs/source/notes/numerical_accuracy.md`).
# - Which ops autocast runs in float32, per device: the Autocast Op Reference,
#   `docs/source/amp.md` (lesson 02 traces them). The loss on CUDA: `cross_entropy_loss`
#   in `aten/src/ATen/native/LossNLL.cpp` (`log_softmax` in the input's dtype, then
#   `nll_loss`) and CUDA's float32 list, `AT_FORALL_FP32` in `aten/src/ATen/autocast_mode.h`.
# - The 2-3x, its scope and "Small networks may be CPU bound": PyTorch's AMP recipe (lesson
#   00's Sources).
# - Which tensor cores take fp16 and bf16: NVIDIA's Volta and Ampere architecture
#   whitepapers; AMX-BF16, AMX-FP16, AVX512-FP16 and AVX512-BF16's dot product
#   (`VDPBF16PS`): Intel's Architecture Instruction Set Extensions Programming Reference.
# - The 16-byte rule and memory-bound ops gaining from 16-bit tensors: NVIDIA's "Matrix
#   Multiplication Background User's Guide" ("Tensor Core Requirements") and "Train With
#   Mixed Precision" guide (Deep Learning Performance docs); the vocabulary of 50304 and its
#   comment: karpathy/nanoGPT `model.py`, `GPTConfig.vocab_size`.
# - Adam's `foreach` and `fused`: the `torch.optim.Adam` docs; the default (foreach on
#   CUDA, the for-loop on a CPU): `_default_to_fused_or_foreach` in
#   `torch/optim/optimizer.py`; the fused kernel's float32 arithmetic on 16-bit tensors
#   (`opmath_t`): `aten/src/ATen/native/cpu/FusedAdamKernel.cpp` and
#   `aten/src/ATen/native/cuda/fused_adam_utils.cuh`. On a CPU, the loop over tensors:
#   `aten/src/ATen/native/FusedAdam.cpp` (`_fused_adamw_kernel_cpu_`) and the `_slow_`
#   kernels of `aten/src/ATen/native/ForeachOpsKernels.cpp`; on CUDA, the chunks:
#   `aten/src/ATen/native/cuda/MultiTensorApply.cuh`.
