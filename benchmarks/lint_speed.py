"""How long ``python -m amp_lessons lint`` takes: start-up (a one-line file, in a fresh
interpreter, median of runs) and generated training files of growing size, both shapes that
stress a checker: many training functions, and one loop whose body holds every call.

    python benchmarks/lint_speed.py [--sizes 0.125 0.25 1 5] [--repeats 5]

Timings depend on the machine: nothing asserts them. tests/test_lint_input.py counts the
checker's work on the same generated files instead (it grows in proportion to the size).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FUNCTION = '''
def train_{i}(model, optimizer, scheduler, scaler, loader, accum_steps, device):
    for step, (x, y) in enumerate(loader):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss = loss / accum_steps
        scaler.scale(loss).backward()
        if (step + 1) % accum_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
'''

LOOP_HEAD = '''import torch

scaler = torch.amp.GradScaler(device.type)
for step, (x, y) in enumerate(loader):
'''

LOOP_BODY = '''    with torch.autocast(device.type, dtype=torch.float16):
        loss_{i} = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
    scaler.scale(loss_{i}).backward()
    if (step + 1) % accum_steps == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
'''


def generated(size_bytes: int, shape: str = "functions") -> str:
    """A training file of about ``size_bytes``: ``functions`` repeats a correct training
    function; ``loop`` puts every call in one loop's body (one unit, one flow)."""
    if shape == "functions":
        parts, total, i = ["import torch\n"], 0, 0
        while total < size_bytes:
            parts.append(FUNCTION.format(i=i))
            total += len(parts[-1])
            i += 1
        return "".join(parts)
    parts, total, i = [LOOP_HEAD], len(LOOP_HEAD), 0
    while total < size_bytes:
        parts.append(LOOP_BODY.format(i=i))
        total += len(parts[-1])
        i += 1
    return "".join(parts)


def lint_seconds(path: Path) -> tuple[float, float, str]:
    """Wall seconds and CPU seconds (user + system: what a busy machine's other work does not
    add) of ``python -m amp_lessons lint path`` in a fresh interpreter, and its last line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "amp_lessons", "lint", str(path)], capture_output=True,
                         text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip()
    return wall, cpu, last.rsplit(": ", 1)[-1][:40]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.125, 0.25, 1, 5], help="MB")
    parser.add_argument("--repeats", type=int, default=5, help="start-up runs (median)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny.py"
        tiny.write_text("import torch\n")
        runs = [lint_seconds(tiny) for _ in range(args.repeats)]
        print(f"start-up (a one-line file, median of {args.repeats}): "
              f"{statistics.median(r[0] for r in runs):.3f} s wall, {statistics.median(r[1] for r in runs):.3f} s CPU"
              f"  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        print(f"{'shape':<10} {'size':>8} {'wall s':>8} {'CPU s':>8}  result")
        for shape in ("functions", "loop"):
            for mb in args.sizes:
                path = Path(tmp) / f"{shape}_{mb}.py"
                path.write_text(generated(int(mb * 1_000_000), shape))
                wall, cpu, last = lint_seconds(path)
                print(f"{shape:<10} {path.stat().st_size / 1e6:>6.2f}MB {wall:>8.2f} {cpu:>8.2f}  {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
