"""Seeding and RNG state: every lesson's setup cell calls ``seed_everything(0)``.

Checkpoints (``checkpoints``) save and restore the same RNG states, so a resumed run
continues exactly like an uninterrupted one.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .arguments import check_seed


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device).

    Returns nothing, so a setup cell that ends with it shows no stray ``Out:``."""
    seed = check_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The RNG states of Python, NumPy and torch (and CUDA when present), for checkpoints."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
