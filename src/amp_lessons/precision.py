"""Precision names, parsed in one place: fp32, tf32, bf16, fp16.

Every lesson and command that takes a precision goes through :func:`parse_precision`,
so ``"float16"``, ``"half"`` and ``torch.float16`` all mean ``"fp16"``, and a typo is a
``ValueError`` that lists the valid names. Used in every lesson.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32", "single": "fp32",
    "tf32": "tf32", "tensorfloat32": "tf32", "tensorfloat-32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
}

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_precision(name) -> str:
    """Return the canonical name (fp32, tf32, bf16 or fp16) for a name or a torch dtype."""
    if isinstance(name, torch.dtype):
        for canonical in ("fp32", "bf16", "fp16"):
            if _DTYPES[canonical] == name:
                return canonical
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got dtype {name}")
    if isinstance(name, str):
        key = name.strip().lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")


def dtype_of(precision) -> torch.dtype:
    """The dtype that autocast computes in (float32 for fp32 and tf32)."""
    return _DTYPES[parse_precision(precision)]


def uses_autocast(precision) -> bool:
    """True for the 16-bit precisions, which run the forward pass under torch.autocast."""
    return parse_precision(precision) in ("bf16", "fp16")


def sixteen_bit(precisions) -> list[str]:
    """The 16-bit precisions among ``precisions`` (bf16, fp16), in their order: tf32 keeps
    float32 tensors, so its memory is fp32's. Used in 05's memory cells."""
    return [p for p in map(parse_precision, precisions) if uses_autocast(p)]


def needs_scaler(precision) -> bool:
    """Only fp16 needs a GradScaler: its narrow range flushes small gradients (lesson 03)."""
    return parse_precision(precision) == "fp16"


@contextlib.contextmanager
def float32_matmul_precision(precision):
    """Inside: ``set_float32_matmul_precision("high")`` for tf32, ``"highest"`` otherwise.

    The previous setting is restored on exit, also after an exception. Used in 05.
    """
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if parse_precision(precision) == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
