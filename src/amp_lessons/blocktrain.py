"""Training below 8 bits, emulated: lesson 08's fp8 linear layer with block scales (MXFP8,
NVFP4), round-to-nearest against stochastic rounding for fp4 gradients, and torchao's MX
formats where torchao is installed. Used in 09_block_scales.

Every matmul operand is quantized along the dimension its matmul sums over
(:func:`amp_lessons.blockscale.quantize`), dequantized, and multiplied in float32: the
numbers a block-scaled kernel computes, up to float32 accumulation order
(:func:`amp_lessons.blockscale.block_mm`), without its speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .blockscale import Scheme, quantize, round_e2m1, with_scales


@dataclass(frozen=True)
class BlockRecipe:
    """The scheme (a name or a :class:`~amp_lessons.blockscale.Scheme`) of the forward operands
    (input, weight) and of the output gradient, and how the gradient is rounded
    (``"stochastic"`` only for e2m1 elements)."""

    name: str
    forward: str | Scheme
    grad: str | Scheme
    grad_rounding: str = "nearest"


# rceil e8m0 scales: the rule of torchao 0.18's MXFP8TrainingOpConfig and of Transformer
# Engine's MXFP8 recipe (the OCP floor rule saturates the top of some blocks).
MXFP8_RCEIL = with_scales("MXFP8", "e8m0", "rceil")

BLOCK_RECIPES = {
    "mxfp8": BlockRecipe("mxfp8", MXFP8_RCEIL, MXFP8_RCEIL),
    "nvfp4": BlockRecipe("nvfp4", "NVFP4", "NVFP4"),
    "nvfp4 + stochastic grads": BlockRecipe("nvfp4 + stochastic grads", "NVFP4", "NVFP4", "stochastic"),
}


def get_block_recipe(recipe) -> BlockRecipe:
    """A :class:`BlockRecipe` from its name or itself."""
    if isinstance(recipe, BlockRecipe):
        return recipe
    if recipe not in BLOCK_RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(BLOCK_RECIPES)}; got {recipe!r}")
    return BLOCK_RECIPES[recipe]


def _qmm(a, b, a_scheme, b_scheme, a_rounding="nearest", generator=None) -> torch.Tensor:
    """``a @ b.T`` with both operands block-quantized along K (their last dimension)."""
    qa = quantize(a, a_scheme, rounding=a_rounding, generator=generator).dequantize()
    qb = quantize(b, b_scheme).dequantize()
    return (qa @ qb.t()).to(a.device)


class BlockMatmul(torch.autograd.Function):
    """``x @ weight.T`` with every matmul's operands block-quantized, forward and backward:

    forward:   y  = x  @ W.T     x (M, K), W (N, K), blocks along K
    backward:  dx = dy @ W       dy (M, N), W.T (K, N), blocks along N
               dW = dy.T @ x     dy.T (N, M), x.T (K, M), blocks along M (the batch)

    The output gradient is rounded as the recipe says (nearest, or stochastic with the
    layer's generator)."""

    @staticmethod
    def forward(ctx, x, weight, recipe, generator=None):
        ctx.recipe, ctx.generator = recipe, generator
        ctx.save_for_backward(x, weight)
        return _qmm(x, weight, recipe.forward, recipe.forward)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        r, g = ctx.recipe, ctx.generator
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _qmm(grad_out, weight.t(), r.grad, r.forward, r.grad_rounding, g)
        if ctx.needs_input_grad[1]:
            grad_w = _qmm(grad_out.t(), x.t(), r.grad, r.forward, r.grad_rounding, g)
        return grad_x, grad_w, None, None


class BlockLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls are block-quantized (:class:`BlockMatmul`); weights,
    bias and output stay float32. Stochastic rounding draws from the layer's own generator."""

    def __init__(self, in_features, out_features, bias=True, recipe="mxfp8", seed=0, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_block_recipe(recipe)
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="mxfp8", seed=0) -> BlockLinear:
        """A BlockLinear sharing ``linear``'s weight and bias (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                  seed=seed, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError(f"BlockLinear takes float32 inputs (it quantizes them itself); got {x.dtype}. "
                            "Run it outside autocast.")
        flat = x.reshape(-1, x.shape[-1])
        y = BlockMatmul.apply(flat, self.weight, self.recipe, self.generator).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def fits_blocks(linear: nn.Module, block: int = 32) -> bool:
    """True for a Linear whose two dimensions are multiples of ``block`` (a 10-class head is not)."""
    return isinstance(linear, nn.Linear) and linear.in_features % block == 0 and linear.out_features % block == 0


def convert_to_blocks(model: nn.Module, recipe="mxfp8", keep=fits_blocks) -> nn.Module:
    """Swap, in place, every ``nn.Linear`` that ``keep`` accepts for a :class:`BlockLinear`
    sharing its parameters (each with its own generator seed); returns ``model``."""
    get_block_recipe(recipe)
    count = 0

    def swap(module):
        nonlocal count
        for name, child in module.named_children():
            if type(child) is nn.Linear and keep(child):
                setattr(module, name, BlockLinear.from_linear(child, recipe, seed=count))
                count += 1
            else:
                swap(child)

    swap(model)
    return model


# -- the small updates round-to-nearest loses ---------------------------------------------------------


def small_update_demo(small: float = 0.2, large: float = 6.0, n: int = 15, steps: int = 1000, seed: int = 0) -> dict:
    """A block of e2m1-scaled gradient values: one ``large`` (the block's amax, on 6) and ``n``
    equal ``small`` ones below e2m1's smallest step. Round-to-nearest maps every small one to
    the same value each step; stochastic rounding, over ``steps`` draws, averages to ``small``.
    Returns the values and the mean each rounding gives the small ones."""
    block = torch.tensor([large] + [small] * n)
    nearest = round_e2m1(block)
    g = torch.Generator().manual_seed(seed)
    draws = torch.stack([round_e2m1(block, "stochastic", g) for _ in range(steps)])
    return {"block": block, "nearest": nearest, "nearest_mean": float(nearest[1:].mean()),
            "stochastic_mean": float(draws[:, 1:].mean()), "stochastic_first": draws[0]}


# -- torchao's MX formats (optional) ------------------------------------------------------------------


def torchao_mx():
    """torchao's ``MXTensor`` if torchao is installed and imports here, else ``(None, reason)``.
    Optional: ``pip install -e ".[fp8]"``."""
    import contextlib
    import io
    import logging
    import warnings

    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            try:
                from torchao.prototype.mx_formats.mx_tensor import MXTensor
            finally:
                logging.disable(logging.NOTSET)
    except ImportError as err:
        return None, f"torchao is not installed, or has no MX formats ({err}); pip install -e \".[fp8]\""
    except Exception as err:  # a torchao built for another torch fails in many ways
        return None, f"torchao did not import with torch {torch.__version__}: {type(err).__name__}: {err}"
    return MXTensor, None
