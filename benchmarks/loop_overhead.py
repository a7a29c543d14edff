"""What the course's Trainer costs over the card's hand-written loop (a benchmark, not a test).

    python benchmarks/loop_overhead.py                # 4x1024 MLP, batch 256 and 512, fp32/bf16/fp16
    python benchmarks/loop_overhead.py --batch 256 --precisions bf16 fp32 --seconds 60
    python benchmarks/loop_overhead.py --threads 1

Three loops take turns training one model, with one optimizer and one GradScaler, on the
same batches, in the same precision and process, so the weights, the optimizer state and
the memory they sit in are the same for all and only the loop differs:

- ``hand``: the recipe written out by hand, nothing else::

      with torch.autocast(device.type, dtype=dtype, enabled=use_amp):
          loss = F.cross_entropy(model(x), y)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
      opt.zero_grad(set_to_none=True)

- ``stats off``: the Trainer with ``grad_stats=False``, its history without the exact
  gradient statistics (loss, scale, skip, lr, time);
- ``stats on``: the Trainer as the lessons use it, which also records, every step, the
  L2 norm of all the gradients and the count of values that are exactly zero.

Blocks of about 0.3 s rotate between the three loops (which one goes first rotates too)
for ``--seconds`` per row (at least 7 rounds). Per loop, the table gives the median ms per
step; ``ratio``, the median over rounds of the Trainer's block time over the hand loop's
in the same round (the figure judged against the 5% budget, for ``stats off``), and its
``quartiles`` (how far one run can be trusted: on a machine shared with other processes
they spread by a few percent); ``stats +ms``, the median of the per-round differences: what
the statistics add to a step (``stats on`` minus ``stats off``), and ``alone``, the median
time of the two statistics by themselves on gradients of the model's shapes (the same
figure without the noise of whole steps around it). On a busy machine add
``--threads 1``: one thread is slowed less by other processes than two that wait for each
other.

Why a 4x1024 MLP: one step is 4.2 M weights x rows x 6 FLOPs for forward + backward (6.4
GFLOP at batch 256), tens of milliseconds on a CPU, so what is compared is the loop's
bookkeeping against real work, not Python call overhead against a tiny step. The two
statistics read all of the gradients, which backward has just left in main memory, so
their cost grows with the parameters and not with the batch, while the step's work grows
with both: ``+ms`` stays put as ``--batch`` grows and the ratio shrinks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from amp_lessons.breakdown import load_average
from amp_lessons.data import random_task
from amp_lessons.hardware import pick_device, supported_precisions
from amp_lessons.models import mlp
from amp_lessons.precision import dtype_of, float32_matmul_precision, uses_autocast
from amp_lessons.seeding import seed_everything
from amp_lessons.training import Trainer

BUDGET = 0.05  # the Trainer (statistics off) may add at most 5% to a step
LOOPS = ("hand", "stats off", "stats on")


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


def trainers(model, data, precision, device, batch_size, lr):
    """Two Trainers on one model, one optimizer and one GradScaler: statistics on and off."""
    on = Trainer(model, data, precision=precision, device=device, optimizer="adamw", lr=lr,
                 batch_size=batch_size, progress=False, grad_stats=True)
    off = Trainer(on.model, data, precision=precision, device=device, optimizer=lambda _: on.optimizer,
                  lr=lr, batch_size=batch_size, progress=False, grad_stats=False)
    off.scaler = on.scaler
    return on, off


def compare(precision, device, depth, width, batch_size, seconds, block_s=0.3, min_pairs=7, lr=1e-4):
    """The three loops side by side for about ``seconds``: median ms per step of each, and
    the median ratios of each Trainer to the hand loop in the same round (each block about
    ``block_s`` long)."""
    data = random_task(n=max(4 * batch_size, 2048), d_in=width, classes=10)
    seed_everything(0)
    on, off = trainers(mlp(width, width, 10, depth=depth), data, precision, device, batch_size, lr)
    # One model, optimizer and scaler for all loops: the weights, the optimizer state and
    # the memory they sit in are the same for all, so only the loop itself differs.
    hand = hand_loop(on.model, on.optimizer, on.scaler, data, precision, device, batch_size)
    run = {"hand": lambda first, steps: hand(first, steps),
           "stats off": lambda first, steps: off.fit(steps),
           "stats on": lambda first, steps: on.fit(steps)}
    for name in LOOPS:  # warm-up: kernels, allocator, optimizer state
        run[name](0, 1)
    samples = []
    for i in (1, 2):  # the step time, for the block size: the faster of a few steps
        start = time.perf_counter()
        hand(i, 1)
        samples.append(time.perf_counter() - start)
    step_s = min(samples)
    steps = max(1, round(block_s / step_s))
    rounds = max(min_pairs, round(seconds / (len(LOOPS) * steps * step_s)))
    times = {name: [] for name in LOOPS}
    first = 3
    for r in range(rounds):
        order = LOOPS[r % 3:] + LOOPS[:r % 3]
        for name in order:
            start = time.perf_counter()
            run[name](first, steps)
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
        first += steps
    # Ratios of blocks in the same round, then their median: a burst of load from another
    # process slows one round, not the estimate.
    row = {"precision": precision, "batch": batch_size, "rounds": rounds, "steps": steps,
           "hand_ms": statistics.median(times["hand"]), "load": load_average(),
           "skipped": on.history.skipped + off.history.skipped}
    for name, key in (("stats off", "off"), ("stats on", "on")):
        ratios = [t / h for t, h in zip(times[name], times["hand"])]
        row[f"{key}_ms"] = statistics.median(times[name])
        row[f"{key}_ratio"] = statistics.median(ratios)
        row[f"{key}_quartiles"] = statistics.quantiles(ratios, n=4, method="inclusive")[::2]
    row["stats_ms"] = statistics.median(a - b for a, b in zip(times["stats on"], times["stats off"]))
    row["stats_alone_ms"] = statistics_alone_ms(on.model)
    return row


def statistics_alone_ms(model, repeats=21) -> float:
    """The two statistics by themselves, on gradients shaped like ``model``'s: the median ms
    of what ``grad_stats=True`` adds to a step (the zero count and the L2 norm the Trainer
    computes), without the noise of whole steps around it."""
    from amp_lessons.training import _count_zeros, _global_norm  # what the Trainer runs

    grads = [torch.randn_like(p) for p in model.parameters()]
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        float(_count_zeros(grads)), float(_global_norm(grads))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


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
    print(f"{'batch':>5}  {'precision':<10}{'hand ms':>9}{'stats off':>11}{'ratio':>7}{'quartiles':>13}"
          f"{'stats on':>10}{'ratio':>7}{'quartiles':>13}{'stats +ms':>11}{'alone':>7}{'rounds':>14}"
          f"  off within {BUDGET:.0%}")
    worst = 0.0
    for batch in args.batch:
        for p in args.precisions:
            if can[p] is not None:
                print(f"{batch:>5}  {p:<10}  skipped: {can[p]}")
                continue
            row = compare(p, device, args.depth, args.width, batch, args.seconds)
            worst = max(worst, row["off_ratio"])
            blocks = f"{row['rounds']}x{row['steps']} steps"
            q_off = "{:.3f}-{:.3f}".format(*row["off_quartiles"])
            q_on = "{:.3f}-{:.3f}".format(*row["on_quartiles"])
            print(f"{batch:>5}  {p:<10}{row['hand_ms']:>9.1f}{row['off_ms']:>11.1f}{row['off_ratio']:>7.3f}"
                  f"{q_off:>13}{row['on_ms']:>10.1f}{row['on_ratio']:>7.3f}{q_on:>13}{row['stats_ms']:>11.2f}"
                  f"{row['stats_alone_ms']:>7.2f}"
                  f"{blocks:>14}  {'yes' if row['off_ratio'] <= 1 + BUDGET else 'NO'}", flush=True)
    load = load_average()
    print(f"worst ratio with statistics off {worst:.3f}: the Trainer adds {max(0.0, worst - 1):.1%} to a step"
          + (f" (load average {load[0]:.1f} on this machine)" if load else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
