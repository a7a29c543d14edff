"""The lessons' data: scikit-learn's 8x8 handwritten digits (shipped with the package,
loaded offline) and generated tasks. Nothing is downloaded. Used in 01, 03, 04, 05.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import check_seed


@dataclass
class Dataset:
    """Inputs and labels, already split; ``batch(step)`` is deterministic for a given seed."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str = "dataset"

    @property
    def n_features(self) -> int:
        return int(self.x_train[0].numel())

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()).item()) + 1

    def batch(self, index: int, batch_size: int, seed: int = 0):
        """The ``index``-th training batch: epochs are seeded permutations, so a resumed run
        draws exactly the batches an uninterrupted one would."""
        n = len(self.x_train)
        if batch_size > n:
            raise ValueError(f"batch_size {batch_size} is larger than the {n} training examples")
        per_epoch = n // batch_size
        epoch, pos = divmod(index, per_epoch)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        idx = torch.randperm(n, generator=g)[pos * batch_size:(pos + 1) * batch_size]
        return self.x_train[idx], self.y_train[idx]


def digits(test_fraction: float = 0.2, seed: int = 0, tokens: bool = False) -> Dataset:
    """scikit-learn's 1,797 8x8 digit images, pixel values scaled to [0, 1].

    ``tokens=True`` shapes each image as 8 tokens of 8 pixels (rows), for the transformer.
    """
    from sklearn.datasets import load_digits

    if not (isinstance(test_fraction, (int, float)) and 0 <= test_fraction < 1):
        raise ValueError(f"test_fraction must be at least 0 (no test split) and below 1; got {test_fraction!r}")
    seed = check_seed(seed)
    raw = load_digits()
    x = torch.tensor(raw.data, dtype=torch.float32) / 16.0
    y = torch.tensor(raw.target, dtype=torch.long)
    if tokens:
        x = x.view(-1, 8, 8)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], name="digits")


def random_task(n: int = 2048, d_in: int = 512, classes: int = 10, seed: int = 0) -> Dataset:
    """Gaussian inputs labelled by a random linear teacher: learnable, any size (bench, 02)."""
    g = torch.Generator().manual_seed(check_seed(seed))
    x = torch.randn(n, d_in, generator=g)
    teacher = torch.randn(d_in, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    cut = n * 4 // 5
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], name="random_task")
