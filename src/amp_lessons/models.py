"""The small models the lessons train, trace and measure. One home: lessons import them.

- :func:`card_model`: the seed card's own example, Linear-ReLU-Linear (02, 05).
- :class:`TransformerBlock`: pre-norm attention (softmax) + GELU MLP, with layer_norm (02, 05).
- :func:`mlp`: a plain MLP of any depth, for the digits runs (01, 03, 04, 05) and the bench.
"""

from __future__ import annotations

import math

from torch import nn
from torch.nn import functional as F


def card_model(d_in: int = 512, hidden: int = 512, classes: int = 10) -> nn.Sequential:
    """``nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))``, as on the card."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def mlp(d_in: int, hidden: int, classes: int, depth: int = 2) -> nn.Sequential:
    """``depth`` hidden Linear-ReLU layers, then a Linear classifier head."""
    layers: list[nn.Module] = []
    width = d_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class SelfAttention(nn.Module):
    """Multi-head self-attention written out (q·kᵀ, softmax, ·v) so a trace shows each op."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with GELU."""

    def __init__(self, dim: int = 64, heads: int = 4, mlp_ratio: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A stack of :class:`TransformerBlock` over a sequence of vectors, mean-pooled to logits."""

    def __init__(self, d_in: int, dim: int = 64, heads: int = 4, depth: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.Sequential(*[TransformerBlock(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):  # x: (batch, tokens, d_in)
        h = self.blocks(self.embed(x))
        return self.head(self.ln(h).mean(dim=1))
