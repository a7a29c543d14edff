"""What the course's Trainer costs over the card's hand-written loop (a benchmark, not a test).

    python benchmarks/loop_overhead.py                # 4x1024 MLP, batch 256 and 512, fp32/bf16/fp16
    python benchmarks/loop_overhead.py --batch 256 --precisions bf16 fp32 --seconds 60
    python benchmarks/loop_overhead.py --threads 1

Both loops take turns training one model, with one optimizer and one GradScaler, on the
same batches, in the same precision and process, so the weights, the optimizer state and
the memory they sit in are the same for both and only the loop differs: the Trainer, with
its per-step history (loss, scale, skip, gradient norm, zero count, lr, time), and the
recipe written out by hand with nothing else::

    with torch.autocast(device.type, dtype=dtype, enabled=use_amp):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)

Blocks of about 0.3 s alternate between the two loops (which one goes first alternates too)
for ``--seconds`` per row (at least 7 pairs). The table gives the median ms per step of
each; ``+ms``, the median of the differences of neighbouring blocks (what the Trainer adds
to a step); ``ratio``, the median of their ratios (the figure judged against the budget),
and the ``quartiles`` of those ratios (how far one run can be trusted: on a machine shared
with other processes they spread by a few percent); and ``best``, the ratio of the two
fastest blocks (the least disturbed by other processes). On a busy machine add
``--threads 1``: one thread is slowed less by other processes than two that wait for each
other.

Why a 4x1024 MLP: one step is 4.2 M weights x rows x 6 FLOPs for forward + backward (6.4
GFLOP at batch 256), tens of milliseconds on a CPU, so what is compared is the loop's
bookkeeping against real work, not Python call overhead against a tiny step. Most of the
bookkeeping is the two gradient statistics of the history, exact every step: the L2 norm
(a dot product) and the count of values that are exactly zero (count_nonzero and a min
over the bits as integers, so that -0.0 counts). Both read all of the gradients, which
backward has just left in main memory, so their cost grows with the parameters and not
with the batch, while the step's work grows with both: ``+ms`` stays put as ``--batch``
grows and the ratio shrinks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from amp_lessons.data import random_task
from amp_lessons.hardware import pick_device, supported_precisions
from amp_lessons.models import mlp
from amp_lessons.precision import dtype_of, float32_matmul_precision, uses_autocast
from amp_lessons.seeding import seed_everything
from amp_lessons.training import Trainer

BUDGET = 0.05  # the Trainer may add at most 5% to a step


def hand_loop(model, opt, scaler, data, precision, device, batch_size, seed=0):
    """The card's recipe, nothing else, on the given model, optimizer and scaler: returns
    ``run(first_step, steps)``."""
    dtype, use_amp = dtype_of(precision), uses_autocast(precision)

    def run(first, steps):
        with float32_matmul_precision(precision):
            for i in range(first, first + steps):
                x, y = data.batch(i, batch_size, seed)
                x, y = x.to(device), y.to(device)
                with torch.autocast(device.type, dtype=dtype, enabled=use_amp):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def compare(precision, device, depth, width, batch_size, seconds, block_s=0.3, min_pairs=7, lr=1e-4):
    """Both loops side by side for about ``seconds``: median ms per step of each, and the
    median ratio of neighbouring blocks (each block about ``block_s`` long)."""
    data = random_task(n=max(4 * batch_size, 2048), d_in=width, classes=10)
    seed_everything(0)
    model = mlp(width, width, 10, depth=depth)
    trainer = Trainer(model, data, precision=precision, device=device,
                      optimizer="adamw", lr=lr, batch_size=batch_size, progress=False)
    # One model, optimizer and scaler for both loops: the weights, the optimizer state and
    # the memory they sit in are the same for both, so only the loop itself differs.
    hand = hand_loop(trainer.model, trainer.optimizer, trainer.scaler, data, precision, device,
                     batch_size)
    trainer.fit(1)  # warm-up: kernels, allocator, optimizer state
    hand(0, 1)
    samples = []
    for i in (1, 2):  # the step time, for the block size: the faster of a few steps
        start = time.perf_counter()
        hand(i, 1)
        samples.append(time.perf_counter() - start)
    trainer.fit(2)
    step_s = min(samples)
    steps = max(1, round(block_s / step_s))
    pairs = max(min_pairs, round(seconds / (2 * steps * step_s)))
    times = {"trainer": [], "hand": []}
    first = 3
    for r in range(pairs):
        order = ("trainer", "hand") if r % 2 == 0 else ("hand", "trainer")
        for name in order:
            start = time.perf_counter()
            if name == "trainer":
                trainer.fit(steps)
            else:
                hand(first, steps)
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
        first += steps
    # The ratio of each pair of neighbouring blocks, then their median: a burst of load
    # from another process slows one pair, not the estimate.
    ratios = [t / h for t, h in zip(times["trainer"], times["hand"])]
    extra = [t - h for t, h in zip(times["trainer"], times["hand"])]
    return {"precision": precision, "batch": batch_size, "hand_ms": statistics.median(times["hand"]),
            "trainer_ms": statistics.median(times["trainer"]), "extra_ms": statistics.median(extra),
            "ratio": statistics.median(ratios), "quartiles": statistics.quantiles(ratios, n=4)[::2],
            "best_ratio": min(times["trainer"]) / min(times["hand"]),
            "pairs": pairs, "steps": steps, "skipped": trainer.history.skipped}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default=None, help="auto (default), cpu, cuda")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    parser.add_argument("--width", type=int, default=1024, help="input and hidden width (default 1024)")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 512],
                        help="rows per step, one table row each (default 256 512)")
    parser.add_argument("--seconds", type=float, default=20.0, help="time per row of the table (default 20)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    can = supported_precisions(device)
    params = sum(p.numel() for p in mlp(args.width, args.width, 10, depth=args.depth).parameters())
    print(f"{args.depth}x{args.width} MLP ({params / 1e6:.1f} M parameters), {device}, "
          f"{torch.get_num_threads()} threads; medians of interleaved blocks")
    print(f"{'batch':>5}  {'precision':<10}{'hand ms':>9}{'Trainer ms':>12}{'+ms':>7}{'ratio':>8}"
          f"{'quartiles':>14}{'best':>7}{'blocks':>14}  within {BUDGET:.0%}")
    worst = 0.0
    for batch in args.batch:
        for p in args.precisions:
            if can[p] is not None:
                print(f"{batch:>5}  {p:<10}  skipped: {can[p]}")
                continue
            row = compare(p, device, args.depth, args.width, batch, args.seconds)
            worst = max(worst, row["ratio"])
            blocks = f"{row['pairs']}x{row['steps']} steps"
            quartiles = "{:.3f}-{:.3f}".format(*row["quartiles"])
            print(f"{batch:>5}  {p:<10}{row['hand_ms']:>9.1f}{row['trainer_ms']:>12.1f}{row['extra_ms']:>7.2f}"
                  f"{row['ratio']:>8.3f}{quartiles:>14}{row['best_ratio']:>7.3f}{blocks:>14}  "
                  f"{'yes' if row['ratio'] <= 1 + BUDGET else 'NO'}", flush=True)
    print(f"worst ratio {worst:.3f}: the Trainer adds {max(0.0, worst - 1):.1%} to a step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
