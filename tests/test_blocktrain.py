"""Lesson 09's block-scaled linear layer: its three matmuls against the quantizers by hand,
stochastic rounding, the swap of layers, and the small-update demonstration."""

import copy
import sys

import pytest
import torch
from torch import nn

from amp_lessons.blockscale import quantize
from amp_lessons.blocktrain import (
    BLOCK_RECIPES,
    BlockLinear,
    convert_to_blocks,
    get_block_recipe,
    small_update_demo,
    torchao_mx,
)


def deq(t, scheme):
    return quantize(t, scheme).dequantize()


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_forward_and_backward_are_the_three_quantized_matmuls(recipe):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    layer = BlockLinear(64, 32, bias=False, recipe=recipe)
    scheme = BLOCK_RECIPES[recipe].forward
    y = layer(x)
    assert torch.equal(y, deq(x.detach(), scheme) @ deq(layer.weight.detach(), scheme).t())
    dy = torch.randn(32, 32, generator=g)
    y.backward(dy)
    w = layer.weight.detach()
    assert torch.equal(x.grad, deq(dy, scheme) @ deq(w.t(), scheme).t())
    assert torch.equal(layer.weight.grad, deq(dy.t(), scheme) @ deq(x.detach().t(), scheme).t())


def test_stochastic_gradients_repeat_with_the_same_seed_and_differ_from_nearest():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g)
    dy = torch.randn(32, 32, generator=g)
    grads = []
    for recipe in ("nvfp4 + stochastic grads", "nvfp4 + stochastic grads", "nvfp4"):
        torch.manual_seed(0)
        layer = BlockLinear(64, 32, bias=False, recipe=recipe, seed=7)
        layer(x).backward(dy)
        grads.append(layer.weight.grad)
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_convert_swaps_the_fitting_linears_and_shares_their_weights():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    before = copy.deepcopy(model)
    convert_to_blocks(model, "mxfp8")
    assert type(model[0]) is BlockLinear and type(model[2]) is nn.Linear
    assert torch.equal(model[0].weight, before[0].weight)
    assert "recipe=mxfp8" in repr(model[0])
    assert BLOCK_RECIPES["mxfp8"].forward.rule == "rceil"  # the rule of torchao's and TE's MXFP8 training


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="recipe must be one of"):
        get_block_recipe("int4")
    with pytest.raises(TypeError, match="float32 inputs"):
        BlockLinear(64, 32)(torch.ones(2, 64, dtype=torch.bfloat16))


def test_round_to_nearest_loses_the_small_values_stochastic_keeps_their_mean():
    demo = small_update_demo(small=0.2, n=15, steps=2000)
    assert demo["nearest"].tolist() == [6.0] + [0.0] * 15 and demo["nearest_mean"] == 0.0
    assert abs(demo["stochastic_mean"] - 0.2) < 0.02
    assert set(demo["stochastic_first"][1:].tolist()) <= {0.0, 0.5}


def test_torchao_missing_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    found, why = torchao_mx()
    assert found is None and "torchao" in why
