"""Activation memory (saved tensors) and step timing: against hand-computed sizes."""

import pytest
import torch
from torch import nn

from amp_lessons.measure import (
    SavedTensorsMeter,
    Timing,
    available_memory,
    cuda_peak_memory,
    saved_memory,
    time_interleaved,
    time_step,
)
from amp_lessons.models import TinyTransformer, mlp

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_linear_saves_its_input_in_the_compute_dtype(precision):
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    mem = saved_memory(lin, x, precision=precision)
    assert mem.activation_bytes == 16 * 64 * BYTES[precision]
    assert mem.weight_copy_bytes == 0  # x needs no grad: the weight is not needed for backward


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_weight_copies_are_counted_apart_from_activations(precision):
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    mem = saved_memory(lin, x, precision=precision)
    assert mem.activation_bytes == 16 * 64 * BYTES[precision]
    if precision == "fp32":  # the parameter itself is saved: no extra memory
        assert (mem.weight_copy_bytes, mem.parameter_bytes) == (0, 32 * 64 * 4)
    else:  # autocast's 16-bit copy of the weight
        assert (mem.weight_copy_bytes, mem.parameter_bytes) == (32 * 64 * 2, 0)


def test_a_frozen_weight_copy_is_recognised_by_its_values():
    lin = nn.Linear(64, 32)
    lin.weight.requires_grad_(False)  # no autograd history: found by comparing values
    x = torch.randn(16, 64, requires_grad=True)
    mem = saved_memory(lin, x, precision="bf16")
    assert mem.weight_copy_bytes == 32 * 64 * 2
    assert mem.activation_bytes == 0  # only x needs a gradient: the input is not saved


def test_views_of_one_tensor_are_counted_once():
    x = torch.randn(8, 8, requires_grad=True)
    with SavedTensorsMeter() as meter:
        y = x * 2
        z = y[:4] * y[4:]  # mul saves two views of y's storage
    assert z.shape == (4, 8)
    assert meter.result.n_saved == 2
    assert meter.result.activation_bytes == 8 * 8 * 4


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_mlp_activations_halve_in_16_bit(low):
    model = mlp(256, 512, 10, depth=3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    fp32 = saved_memory(model, x, y, "fp32")
    half = saved_memory(model, x, y, low)
    assert half.activation_bytes / fp32.activation_bytes == pytest.approx(0.5, rel=0.02)
    # 3 hidden layers + head whose inputs need grads: 2 x 512x512 + 512x10 weights, in 16 bits
    assert half.weight_copy_bytes == 2 * (2 * 512 * 512 + 512 * 10)
    assert set(half.by_dtype) == {str(torch.bfloat16 if low == "bf16" else torch.float16)[6:],
                                  "float32", "int64"}  # the loss stays float32; labels int64


def test_transformer_activations_roughly_halve_in_bf16():
    model = TinyTransformer(64, dim=128, heads=4, depth=2)
    x, y = torch.randn(8, 32, 64), torch.randint(0, 10, (8,))
    ratio = saved_memory(model, x, y, "bf16").activation_bytes / saved_memory(model, x, y, "fp32").activation_bytes
    assert 0.45 <= ratio <= 0.55


def test_saved_memory_leaves_no_graph_and_no_hooks_behind():
    model = mlp(16, 16, 4)
    x = torch.randn(4, 16)
    saved_memory(model, x, precision="bf16")
    out = model(x)  # outside the meter: nothing is counted, nothing breaks
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_time_step_calls_warmup_then_repeats():
    calls = []
    timing = time_step(lambda: calls.append(1), "cpu", warmup=3, repeats=5)
    assert len(calls) == 8
    assert len(timing.times_ms) == 5 and all(t >= 0 for t in timing.times_ms)
    assert timing.min_ms <= timing.median_ms


def test_time_interleaved_alternates_the_steps():
    order = []
    timings = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                               warmup=1, repeats=3)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert {k: len(t.times_ms) for k, t in timings.items()} == {"a": 3, "b": 3}


def test_timing_median_and_spread():
    t = Timing((1.0, 3.0, 2.0))
    assert (t.median_ms, t.min_ms, t.spread) == (2.0, 1.0, 0.5)  # quartiles 1.5 and 2.5
    # one interrupted run moves neither the median nor the spread much
    assert Timing((10.0, 10.0, 10.0, 10.0, 500.0)).spread == 0.0
    assert Timing((4.0,)).spread == 0.0


def test_bad_repeats_say_what_to_do():
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        time_step(lambda: None, repeats=0)


def test_cuda_peak_is_none_off_cuda_and_cpu_memory_is_known():
    assert cuda_peak_memory(lambda: None, "cpu") is None
    free = available_memory("cpu")
    assert free is None or free > 0


def test_step_flops_of_a_linear_layer_by_hand():
    from amp_lessons.measure import step_flops

    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    # forward 2*B*in*out; backward only the weight gradient (x needs none): 2*B*in*out
    assert step_flops(lin, x) == 4 * 16 * 64 * 32
    assert step_flops(lin, x.requires_grad_()) == 6 * 16 * 64 * 32
    assert lin.weight.device.type == "cpu" and lin.weight.grad is None  # the model is untouched


def test_training_memory_counts_every_kind_by_hand():
    from amp_lessons.measure import optimizer_state_bytes, training_memory

    model = mlp(32, 64, 10, depth=2)  # layers 32->64, 64->64, 64->10
    params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    # AdamW: two float32 moments per weight and a float32 step count per tensor
    assert optimizer_state_bytes(model) == 2 * 4 * params + 4 * 6
    fp32 = training_memory(model, x, y, "fp32")
    assert (fp32.weights, fp32.gradients, fp32.weight_copies) == (4 * params, 4 * params, 0)
    batch = 4 * 16 * 32 + 8 * 16  # float32 x, int64 labels
    saved = saved_memory(model, x, y, "fp32")
    assert saved.input_bytes == batch  # the first matmul saves x itself, the loss the labels
    assert (fp32.input_batch, fp32.activations) == (batch, saved.activation_bytes - batch)
    bf16 = training_memory(model, x, y, "bf16")
    # only activations and the 16-bit weight copies change; weights, grads and Adam state do not
    assert (bf16.weights, bf16.gradients, bf16.optimizer_state) == (fp32.weights, fp32.gradients,
                                                                     fp32.optimizer_state)
    assert bf16.weight_copies == 2 * (64 * 64 + 64 * 10)  # the layers whose input needs a gradient
    assert bf16.input_batch == batch  # x as given, float32, in every precision
    assert saved_memory(model, x, y, "bf16").input_bytes == 8 * 16  # only the labels: x is saved as a bf16 copy
    assert bf16.total == sum((bf16.weights, bf16.gradients, bf16.optimizer_state, bf16.weight_copies,
                              bf16.input_batch, bf16.activations))
    assert fp32.cuda_peak is None and all(p.grad is None for p in model.parameters())  # untouched


def test_a_doubled_batch_costs_only_its_activations_and_the_fit_is_exact():
    from amp_lessons.measure import doubled_batch

    model = mlp(32, 64, 10, depth=2)
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    cost = doubled_batch(model, x, y, ("bf16", "fp16"))
    assert list(cost.rows) == ["fp32", "bf16", "fp16"] and cost.batch == 256
    for one, two in cost.rows.values():
        assert two.batch == 512
        # nothing else grows: the batch itself, and what autograd saves from it
        assert two.total - one.total == (two.input_batch - one.input_batch) + (two.activations - one.activations)
    budget = cost.rows["fp32"][0].total
    n = cost.batch_in_fp32_memory("bf16")
    one, two = cost.rows["bf16"]
    per_example = (two.total - one.total) // 256
    assert one.total + (n - 256) * per_example <= budget < one.total + (n + 1 - 256) * per_example
    assert 256 < n < 512  # more than fp32's batch, not twice it
    assert cost.largest_batch("fp32", budget) == 256
    (line, _) = cost.fits_lines()
    assert line.startswith(f"in the {budget / 2**20:.2f} MiB fp32 holds at batch 256, bf16 fits batch {n}, ")
    assert line.endswith("as large: not 2x")
    assert "fp32" in cost.table() and "x2 batch" in cost.table()
    assert "summed by kind (not a measured peak)" in cost.table()
    assert cost.peak_line().startswith("peak memory of a whole step: GPU only (on cpu")


def test_on_a_gpu_with_tf32_the_memory_cells_compare_only_the_16_bit_precisions():
    from amp_lessons.measure import doubled_batch
    from amp_lessons.precision import sixteen_bit

    runs = ["fp32", "tf32", "bf16", "fp16"]  # what a GPU with TF32 runs (lesson 05's result.runs)
    assert sixteen_bit(runs) == ["bf16", "fp16"]
    assert sixteen_bit(["fp32", "tf32"]) == [] and sixteen_bit(["half", "fp32"]) == ["fp16"]
    cost = doubled_batch(mlp(32, 64, 10, depth=2), torch.randn(16, 32), torch.randint(0, 10, (16,)),
                         sixteen_bit(runs))
    assert list(cost.rows) == ["fp32", "bf16", "fp16"]
    assert [line.split(", ")[1].split()[0] for line in cost.fits_lines()] == ["bf16", "fp16"]


def test_the_input_batch_is_counted_once_in_every_precision_so_the_totals_compare():
    from amp_lessons.measure import training_memory

    # one layer: fp32's matmul saves the caller's float32 x, bf16's a bf16 copy of it (and no
    # weight copy: x needs no gradient); the step holds the float32 x in both, so bf16 holds
    # exactly that copy more (counting x only where it is saved made bf16's total the smaller)
    model, x, y = nn.Linear(32, 10), torch.randn(16, 32), torch.randint(0, 10, (16,))
    fp32, bf16 = (training_memory(model, x, y, p) for p in ("fp32", "bf16"))
    assert fp32.input_batch == bf16.input_batch == 4 * 16 * 32 + 8 * 16
    assert bf16.weight_copies == 0 and bf16.total - fp32.total == 2 * 16 * 32


def test_where_weight_copies_outweigh_the_saving_16_bit_fits_a_smaller_batch():
    from amp_lessons.measure import doubled_batch

    # 16 examples of a 64-wide MLP: the 16-bit weight copies cost more than the activations save
    cost = doubled_batch(mlp(32, 64, 10, depth=2), torch.randn(16, 32), torch.randint(0, 10, (16,)), ["bf16"])
    assert cost.batch_in_fp32_memory("bf16") < 16


def test_the_batch_ratio_approaches_the_bytes_per_example_ratio_and_stays_under_2():
    from amp_lessons.measure import doubled_batch

    model = mlp(32, 64, 10, depth=2)
    small = doubled_batch(model, torch.randn(16, 32), torch.randint(0, 10, (16,)), ["bf16"])
    large = doubled_batch(model, torch.randn(4096, 32), torch.randint(0, 10, (4096,)), ["bf16"])
    limit = small.ratio_limit("bf16")
    assert limit == large.ratio_limit("bf16")  # bytes per example do not depend on the batch
    # by hand: fp32 saves 4 bytes a value, bf16 2, but the loss's log_softmax stays float32
    # and the labels int64 in both, so the ratio is below 2
    one, two = small.rows["fp32"]
    mine, mine2 = small.rows["bf16"]
    assert limit == ((two.input_batch + two.activations - one.input_batch - one.activations)
                     / (mine2.input_batch + mine2.activations - mine.input_batch - mine.activations))
    assert 1 < limit < 2
    ratios = [c.batch_in_fp32_memory("bf16") / c.batch for c in (small, large)]
    assert ratios[0] < ratios[1] < limit


def test_saved_by_layer_adds_up_to_the_activations_and_leaves_the_weight_copies_out():
    from amp_lessons.measure import saved_by_layer
    from amp_lessons.models import TransformerBlock

    block, tokens = TransformerBlock(), torch.zeros(2, 4, 64)
    for precision in ("fp32", "bf16"):
        by_layer = saved_by_layer(block, tokens, precision)
        kept = saved_memory(block, tokens, precision=precision)
        assert sum(by_layer.values()) == kept.activation_bytes
        assert {layer for layer, _ in by_layer} <= {name for name, _ in block.named_children()} | {"<model>"}
    assert ("ln1", "float32") in by_layer and ("mlp", "bfloat16") in by_layer
    # a single Linear: its input (2*4*64 bf16 values) is saved, its weight's bf16 copy is not counted here
    seq = nn.Sequential(nn.Linear(64, 8))
    x = torch.randn(8, 64, requires_grad=True)
    assert saved_by_layer(seq, x, "bf16") == {("0", "bfloat16"): 8 * 64 * 2}
    assert not seq[0]._forward_hooks and not seq[0]._forward_pre_hooks
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        saved_by_layer("block", x)
