"""amp_lessons: the helper package of the amp-lessons course.

Importing it changes no global state (no seeding, no backend flags): each lesson's setup
cell calls :func:`seed_everything` itself. Modules, one home per topic:

- ``precision``  precision names (fp32, tf32, bf16, fp16), parsed in one place
- ``hardware``   device, native vs emulated bf16, TF32, CPU ISA, recommended precision (00)
- ``seeding``    seeds and RNG state (every lesson's setup cell; checkpoints)
- ``formats``    bit layouts, rounding and underflow of fp32/tf32/bf16/fp16/fp8 (01)
- ``trace``      which aten op ran in which dtype under autocast (02)
- ``models``     the small models the lessons train and trace (02-05)
- ``data``       the lessons' datasets, generated or shipped offline with scikit-learn
- ``training``   the one training loop, ``Trainer``, whose step reads as the recipe (01, 03-05)
- ``history``    a run's per-step records and their table (01, 03-05)
- ``checkpoints`` save and load a run: exact resume or a refusal that names why (03)
- ``arguments``  the checks of every training entry point's arguments (01, 03-05)
- ``scaling``    lesson 03's configuration: small gradients, flush reports, scale changes
- ``clipping``   lesson 04's clip orders, accumulation variants and the scaled-clip diagnostic
- ``measure``    activation memory, what a training step holds, and step timing (05)
- ``matmul``     matmul throughput per dtype, TF32's and "medium"'s error (01, 05)
- ``master``     why master weights stay float32: lost updates, Adam's eps in fp16 (05)
- ``bench``      ``python -m amp_lessons bench`` (05)
- ``breakdown``  where a step's time goes (torch.profiler categories, Amdahl's bound) and
                 the changes that close part of the gap (05, ``bench --breakdown``)
- ``plots``      figures; ``widgets`` the interactive controls; ``exercises`` the checkers
- ``show``       ``expect_error``: a cell that fails on purpose prints and goes on (00, 02, 04)
- ``claims``     ``measured`` figures (``≈``, masked by the tests) and the verdicts drawn from
                 them, with their margins (every lesson)
- ``progress``   progress bars: a widget view in notebooks (not compared by nbval), tqdm elsewhere
- ``selfcheck``  ``python -m amp_lessons selfcheck`` (``make gpu-check``): every lesson as a
                 script, every verdict, the device checks
- ``errors``     the messages of lesson 06, reproduced from minimal loops, and their fixes (06)
- ``lint``       ``check_loop`` / ``python -m amp_lessons lint``: AMP mistakes read from a loop's source (06)
- ``distributed`` DDP and FSDP2 on N real ranks: ``launch``, the records, memory per rank,
  ``python -m amp_lessons dist`` (07); ``dist_worker`` is what each rank runs
- ``fp8``        amax scales per tensor and per row, quantize, the census in e4m3/e5m2,
  ``torch._scaled_mm``, a minimal fp8 linear layer (08)
"""

from .hardware import hardware_report, pick_device
from .precision import PRECISIONS, parse_precision
from .seeding import seed_everything

__version__ = "0.1.0"

__all__ = ["PRECISIONS", "hardware_report", "parse_precision", "pick_device", "seed_everything"]
