"""amp_lessons: the helper package of the amp-lessons course.

Importing it changes no global state (no seeding, no backend flags): each lesson's setup
cell calls :func:`seed_everything` itself. Modules, one home per topic:

- ``precision``  precision names (fp32, tf32, bf16, fp16), parsed in one place
- ``hardware``   device, native vs emulated bf16, TF32, CPU ISA, recommended precision (00)
- ``seeding``    seeds and RNG state (every lesson's setup cell; checkpoints)
- ``formats``    bit layouts, rounding and underflow of fp32/tf32/bf16/fp16/fp8 (01); a sum by order (00)
- ``trace``      which aten op ran in which dtype under autocast (02)
- ``models``     the small models the lessons train and trace (02-05)
- ``data``       the lessons' datasets, generated or shipped offline with scikit-learn
- ``training``   the one training loop, ``Trainer``, whose step reads as the recipe (01, 03-05)
- ``history``    a run's per-step records and their table (01, 03-05)
- ``checkpoints`` save and load a run: exact resume or a refusal that names why (03)
- ``arguments``  the checks of every training entry point's arguments (01, 03-05)
- ``scaling``    lesson 03's configuration: small gradients, flush reports, scale changes
- ``clipping``   lesson 04's clip orders, accumulation variants and the scaled-clip diagnostic
- ``measure``    activation memory, what a training step holds, step timing, matmul rates (05)
- ``matmul``     TF32's and "medium"'s error, TF32's speed on a GPU (01, 05)
- ``master``     why master weights stay float32: lost updates, Adam's eps in fp16 (05)
- ``bench``      the measurements of ``python -m amp_lessons bench`` (05); ``benchcli`` its
                 command line and tables
- ``breakdown``  where a step's time goes (torch.profiler categories, Amdahl's bound) and
                 the changes that close part of the gap (05, ``bench --breakdown``)
- ``plots``      figures; ``widgets`` the interactive controls; ``exercises`` the checkers
- ``show``       ``expect_error``: a cell that fails on purpose prints and goes on (00, 02, 04)
- ``claims``     ``measured`` figures (``≈``, masked by the tests) and the verdicts drawn from
                 them, with their margins (every lesson)
- ``progress``   progress bars: a widget view in notebooks (not compared by nbval), tqdm elsewhere
- ``selfcheck``  ``python -m amp_lessons selfcheck`` (``make gpu-check``): every lesson as a
                 script, every verdict, the device checks
- ``devicechecks`` what the lessons say about devices, as verdicts: real on CUDA, replayed or
                 simulated elsewhere (02's simulation check; ``make gpu-check``)
- ``errors``     the messages of lesson 06, reproduced from minimal loops, and their fixes (06)
- ``lint``       ``check_loop`` / ``python -m amp_lessons lint``: AMP mistakes read from a loop's
                 source, without importing torch (06): ``source``, ``walk``, ``rules``, ``cli``
- ``distributed`` DDP and FSDP2 on N real ranks: ``launch``, the records, memory per rank,
  ``python -m amp_lessons dist`` (07); ``dist_worker`` is what each rank runs
- ``fp8``        amax scales per tensor and per row, quantize, the census in e4m3/e5m2,
  ``torch._scaled_mm``, a minimal fp8 linear layer (08)
- ``blockscale`` e2m1/e8m0, MXFP8/MXFP4/NVFP4 and 1x128/128x128 blocks, the block-scaled matmul
  (09); ``delayed``, ``blocktrain``, ``blockplots``, ``block_exercise``: its scaling, layers, figures, checker
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {"hardware_report": "hardware", "pick_device": "hardware", "PRECISIONS": "precision",
            "parse_precision": "precision", "seed_everything": "seeding"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The exports are imported when first used (PEP 562), so that ``import amp_lessons.lint``
    and ``python -m amp_lessons lint`` leave torch unimported."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
