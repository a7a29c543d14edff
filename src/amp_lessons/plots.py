"""Figures for the lessons. Each function returns a matplotlib ``Figure`` (the notebook
shows it; nothing is printed), with labelled axes and a title that states the point.
"""

from __future__ import annotations

import matplotlib.pyplot as plt  # noqa: F401  (used by the sections below)

from .claims import measured
from .clipping import measured_thresholds
from .formats import FORMATS, check_scale, format_info, scaled_census
from .fp8 import get_recipe
from .measure import MiB, training_memory
from .scaling import scale_changes
from .trace import short

# --- 01_number_formats ---------------------------------------------------------------

_BAND = {"normal": "#4c78a8", "subnormal": "#9ecae9"}
_REGION = {"flushed": "#e45756", "subnormal": "#f2cf5b", "overflow": "#b279a2"}


def format_ranges(names=None, values=None):
    """01: each format's range on a log2 number line: subnormal band (light), normal (dark),
    labelled with the smallest subnormal (a power of two) and the largest value (with its
    power of two).

    ``values`` (a tensor, e.g. the captured gradients) adds a grey span from its smallest
    to its largest nonzero magnitude.
    """
    import math

    import torch

    fmts = [format_info(n) for n in (names or FORMATS)]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * len(fmts)))
    for i, f in enumerate(fmts):
        y = len(fmts) - 1 - i
        lo, mid, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        ax.barh(y, mid - lo, left=lo, height=0.6, color=_BAND["subnormal"])
        ax.barh(y, hi - mid, left=mid, height=0.6, color=_BAND["normal"])
        ax.text(lo - 2, y, f"2^{lo:.0f}", ha="right", va="center", fontsize=8)
        top = f"{f.max:.6g}" if f.max < 1e6 else f"{f.max:.3g}"
        ax.text(hi + 2, y, f"{top} (~2^{float(f'{hi:.1f}'):g})", ha="left", va="center", fontsize=8)
    if values is not None:
        mags = values.detach().cpu().abs().flatten().double()
        mags = mags[mags > 0]
        if mags.numel():
            lo, hi = torch.log2(mags.min()).item(), torch.log2(mags.max()).item()
            ax.axvspan(lo, hi, color="0.5", alpha=0.25, label="your gradients (smallest to largest)")
            ax.legend(loc="lower right", fontsize=9, frameon=False)
    ax.axvline(0, color="0.3", lw=0.6, ls=":")
    ax.set_yticks(range(len(fmts)), [f.name for f in reversed(fmts)])
    ax.set_xlim(-195, 170)  # room for fp32's labels: 2^-149 clear of the y-axis ticks, 3.4e+38 (~2^128)
    ax.set_xlabel("log2 |value|   (x = -24 means 2^-24; light: subnormal, dark: normal)")
    spans = {f.name: math.log2(f.max) - math.log2(f.smallest_subnormal) for f in fmts}
    if "fp16" in spans and "bf16" in spans:
        title = (f"fp16 covers {spans['fp16']:.0f} powers of two; bf16 covers "
                 f"{spans['bf16']:.0f}, nearly fp32's range")
    else:
        title = ", ".join(f"{k} covers {v:.0f} powers of two" for k, v in spans.items())
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right", "left"]].set_visible(False)
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


def gradient_histogram(values, scale: float = 1.0, names=("fp16", "bf16"), bins_per_octave: int = 4,
                       max_scale: float = 2.0**24):
    """01: the histogram of log2|value| (nonzero values, times ``scale``; the x-label counts
    the exact zeros left out), bins ``1 / bins_per_octave`` of a power of two wide, under a strip of
    each format's subnormal (light) and normal (dark) band, with the narrowest format's
    regions shaded behind the bars: flushed to zero (red), subnormal (yellow), overflow
    (purple), and a key for the strip. The title says which share of the nonzero values each
    format flushes to zero (and overflows).

    The x-axis spans the values at every scale from 1 to ``max_scale`` (01's slider goes
    to 2^24), so figures of the same values at different scales share one axis: the bars
    slide, the formats' bands stay put.
    """
    import math

    import numpy as np
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, NullLocator

    scale = check_scale(scale)
    unscaled = values.detach().cpu().abs().flatten().double()
    unscaled = unscaled[unscaled > 0]
    logs = np.log2((unscaled * scale).numpy())
    fmts = [format_info(n) for n in names]
    narrow = min(fmts, key=lambda f: f.max)
    cuts = [math.log2(narrow.flush_below), math.log2(narrow.normal_from), math.log2(narrow.overflow_from)]
    # the axis holds the values at every scale from min(1, scale) to max(scale, max_scale)
    small, large = ((math.log2(unscaled.min().item()), math.log2(unscaled.max().item()))
                    if unscaled.numel() else (cuts[0], cuts[2]))
    lo = math.floor(min(small + math.log2(min(1.0, scale)), cuts[0] - 2)) - 1
    hi = math.ceil(max(large + math.log2(max(scale, check_scale(max_scale))), cuts[2] + 2)) + 1
    fig, (top, ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 4.8), layout="constrained",
                                  gridspec_kw={"height_ratios": [0.25 * len(fmts), 3]})
    for i, f in enumerate(fmts):
        y = len(fmts) - 1 - i
        sub, nor, mx = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        top.barh(y, nor - sub, left=sub, height=0.7, color=_BAND["subnormal"])
        top.barh(y, mx - nor, left=nor, height=0.7, color=_BAND["normal"])
    top.set_yticks(range(len(fmts)), [f.name for f in reversed(fmts)])
    top.legend(handles=[Patch(color=_BAND[k], label=f"{k} range") for k in ("subnormal", "normal")],
               loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    top.tick_params(bottom=False)
    top.spines[["top", "right", "bottom"]].set_visible(False)
    regions = [(lo, cuts[0], "flushed"), (cuts[0], cuts[1], "subnormal"), (cuts[2], hi, "overflow")]
    for a, b, kind in regions:
        ax.axvspan(a, b, color=_REGION[kind], alpha=0.25, lw=0)
    counts, edges = np.histogram(logs, bins=np.arange(lo, hi + 1e-9, 1 / bins_per_octave))
    ax.stairs(np.maximum(counts, 0.5), edges, fill=True, baseline=0.5, color="0.3")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))  # 1, 10, 100: plain text
    ax.yaxis.set_minor_locator(NullLocator())  # no 2..9 ticks between the decades
    ax.set_ylim(0.7, None)
    ax.set_xlim(lo, hi)
    k = math.log2(scale)
    label = f"2^{k:.0f}" if k == round(k) else f"{scale:g}"
    zeros = int((values.detach().flatten() == 0).sum())
    ax.set_xlabel("log2 |gradient|" + ("" if scale == 1 else f" after the loss scale {label}")
                  + (f"   (the {zeros:,} exact zeros have no log2: not drawn)" if zeros else ""))
    width = f"1/{bins_per_octave} of a power of two" if bins_per_octave > 1 else "one power of two"
    ax.set_ylabel(f"gradient values per bin\n(a bin: {width};\nlog scale)")
    # Where each region starts, in the prose's notation. fp16's strip starts at its smallest
    # subnormal, 2^-24, but only values up to 2^-25 flush: those between round up to 2^-24.
    p2 = lambda v: f"2^{math.log2(v):g}"  # noqa: E731
    tiny, edge = p2(narrow.smallest_subnormal), p2(narrow.flush_below)
    spans = {"flushed": f"flushed to 0: up to {edge}",
             "subnormal": f"subnormal: above {edge} to {p2(narrow.smallest_normal)}\n"
                          f"(above {edge}, below {tiny}: rounds up to {tiny})",
             "overflow": f"overflow to inf: from {narrow.overflow_from:g}"}
    fig.legend(handles=[Patch(color=_REGION[k], alpha=0.4, label=f"{narrow.name} {spans[k]}")
                        for _, _, k in regions], loc="outside lower center", ncol=3,
               fontsize=9, frameon=False)
    census = [scaled_census(values, f.name, scale) for f in fmts]
    first, *rest = census
    title = ("" if scale == 1 else f"loss scale {label}: ") + (
        f"{first.format} flushes {first.fraction('flushed'):.2%} of the nonzero gradients to zero")
    title += "".join(f", {c.format} {c.fraction('flushed'):.2%}" for c in rest)
    if any(c.overflow for c in census):
        title += "; " + ", ".join(f"{c.format} overflows {c.fraction('overflow'):.2%}" for c in census)
    top.set_title(title, fontsize=10)
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 02_autocast ---------------------------------------------------------------------


def op_dtypes(traces: dict, columns: int = 5):
    """02: each traced call's ops of forward + loss, in the order they ran, coloured by dtype.

    ``traces`` maps a label to an :class:`amp_lessons.trace.Trace`, or is a list of traces
    (labelled with their model's name); devices may be mixed: each panel says where it
    ran, "(simulated)" included. The ops read like text, left to right, then down,
    ``columns`` to a line, each named in a 9 pt label. Blue: ran 16-bit; orange: autocast
    put it in float32; sand: float32 already (autocast cast none of its inputs); grey: a cast autocast
    inserted; white: anything else (int, float64). Views are left out.
    """
    import textwrap

    from matplotlib.patches import Patch, Rectangle

    colors = {"low": "#4c78a8", "to_fp32": "#f58518", "already": "#f3dfb8", "cast": "#bab0ac",
              "other": "#ffffff"}
    labels = {"low": "ran 16-bit", "to_fp32": "autocast put it in float32",
              "already": "float32 already (no input cast)", "cast": "cast (_to_copy)",
              "other": "other (int, float64)"}

    def key(r):
        if r.kind == "cast":
            return "cast"
        return "low" if r.low else "to_fp32" if r.to_fp32 else "already" if r.already_fp32 else "other"

    pairs = list(traces.items()) if isinstance(traces, dict) else [(t.model or "call", t) for t in traces]
    rows = [[r for r in t.rows() if r.module != "(backward)"] for _, t in pairs]
    lines = [max(1, -(-len(recs) // columns)) for recs in rows]
    heights = [0.9 + 0.42 * n for n in lines]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9.5, sum(heights) + 1.2), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    used = set()
    for ax, (label, tr), recs, n_lines in zip(axes[:, 0], pairs, rows, lines):
        for i, r in enumerate(recs):
            x, y = i % columns, -(i // columns)
            k = key(r)
            used.add(k)
            ax.add_patch(Rectangle((x + 0.02, y + 0.06), 0.96, 0.88, facecolor=colors[k],
                                   edgecolor="#888888" if k == "other" else "none"))
            ax.text(x + 0.06, y + 0.5, f"{i + 1}. {r.op}", fontsize=9, va="center", ha="left",
                    color="white" if k in ("low", "to_fp32") else "black", clip_on=True)
        ax.set(xlim=(0, columns), ylim=(-n_lines + 1, 1))
        ax.axis("off")
        c = tr.counts()
        mode = f"autocast {short(tr.dtype)}" if tr.dtype is not None else "autocast off"
        ax.set_title(f"{label} on {tr.where}, {mode}: {c['low']} of {c['compute']} computing ops "
                     f"ran 16-bit, {c['to_fp32']} autocast put in float32, {c['already_fp32']} "
                     "float32 already", fontsize=10, loc="left")
    head = "Which dtype each op of forward + loss ran in, in the order the ops ran (left to right, then down)"
    fig.suptitle("\n".join(textwrap.wrap(head, 100)), fontsize=11, x=0.01, ha="left")
    order = [k for k in colors if k in used]
    fig.legend(handles=[Patch(facecolor=colors[k], edgecolor="#888888", label=labels[k]) for k in order],
               loc="lower left", ncol=3, fontsize=9, frameon=False, bbox_to_anchor=(0.01, 0.0))
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(order) > 3), 1, 1))
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 03_grad_scaler ------------------------------------------------------------------


def loss_curves(runs: dict, loss_weight: float = 1.0, tail: int = 10, title: str | None = None):
    """03: the loss of several runs over the same steps, in one axes to compare them.

    ``runs`` maps a label to a :class:`amp_lessons.training.History`. Losses are divided by
    ``loss_weight`` (03's runs train on cross-entropy times ``2^-15``), so the axis reads
    cross-entropy. Skipped steps (an inf loss) leave a gap. The title names the run that
    ends highest and the one that ends lowest (mean of the last ``tail`` steps; 07 passes
    ``tail=1``, the last step's loss). A ``title`` replaces it (07 names what its two runs
    differ in).
    """
    import math
    import statistics

    styles = [dict(color="#4c78a8", lw=4, alpha=0.4), dict(color="#e45756", lw=1.4),
              dict(color="#f58518", lw=1.2, ls="--"), dict(color="#54a24b", lw=1.2, ls=":"),
              dict(color="#b279a2", lw=1.2, ls="-.")]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ends = {}
    for (label, h), style in zip(runs.items(), styles * len(runs)):
        losses = [v / loss_weight if math.isfinite(v) else math.nan for v in h["loss"]]
        ax.plot(h["step"], losses, label=label, **style)
        finite = [v for v in losses[-tail:] if math.isfinite(v)]
        ends[label] = statistics.fmean(finite) if finite else math.nan
    k = math.log2(loss_weight)
    weight = f"2^{k:g}" if k == int(k) else f"{loss_weight:g}"
    ylabel = ("training loss, cross-entropy (nats)" if loss_weight == 1.0
              else f"cross-entropy (nats);\nthe loss trained on is {weight} x it")
    ax.set(xlabel="optimizer step", ylabel=ylabel)
    ax.legend(frameon=False)
    known = {k: v for k, v in ends.items() if math.isfinite(v)}
    if title is not None:
        ax.set_title(title, fontsize=10)
    elif len(known) >= 2:
        hi, lo = max(known, key=known.get), min(known, key=known.get)
        steps = max(len(h) for h in runs.values())
        close = "ends close to " + ("the other" if len(known) == 2 else "the rest")
        verb = "lags" if known[hi] > 1.2 * known[lo] else close
        stat = "loss at the last step" if tail == 1 else f"mean loss of the last {tail} steps"
        ax.set_title(f"after {steps} steps, {hi} {verb}; {stat}: {hi} {known[hi]:.2f}, {lo} {known[lo]:.2f}",
                     fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


def scale_plot(history, final_scale=None, growth_interval=None, injected=(), ax=None):
    """03: GradScaler's loss scale at each step (log2 axis), skipped steps marked with a red x.

    ``history`` is a :class:`amp_lessons.training.History` of a run with a scaler;
    ``final_scale`` the scale after its last step (``trainer.current_scale()``); ``injected``
    the steps whose loss was made inf on purpose (dotted lines). The title counts the
    skipped steps and the growths.
    """
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    steps, scales = history["step"], history["scale"]
    end = final_scale if final_scale is not None else scales[-1]
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(9, 3.4), layout="constrained")
    else:
        fig = ax.figure
    ax.step([*steps, steps[-1] + 1], [*scales, end], where="post", color="#4c78a8", lw=1.6,
            label="scale used by the step\n(past the last: the scale now)")
    skipped = [r for r in history if r.skipped]
    if skipped:
        ax.plot([r.step for r in skipped], [r.scale for r in skipped], "x", color="#e45756", ms=9,
                mew=2, label=f"skipped step ({len(skipped)})")
    for i, step in enumerate(s for s in injected if 0 <= s < len(history)):
        ax.axvline(step, color="0.4", ls=":", lw=1, label="inf injected" if i == 0 else None)
    ax.set_yscale("log", base=2)
    low, high = math.floor(math.log2(min(*scales, end))), math.ceil(math.log2(max(*scales, end)))
    # Ticks at whole powers of two strictly inside the axes, labelled as plain text "2^k"
    # (no mathtext: the same notation as the prose, and quick to draw in the widget); none
    # sits on the top edge, where its label would run into the title.
    ax.set_ylim(2 ** (low - 0.7), 2 ** (high + 0.7))
    every = max(1, math.ceil((high - low + 1) / 8))
    ax.yaxis.set_major_locator(FixedLocator([2.0**k for k in range(low, high + 1, every)]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"2^{math.log2(v):g}"))
    ax.set(xlabel="training step (skipped ones included)", ylabel="loss scale (log2 axis)")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    grew = sum(kind == "grew" for _, kind, _, _ in scale_changes(history, end))
    interval = f" (every {growth_interval} clean steps)" if growth_interval else ""
    ax.set_title(f"{len(skipped)} of {len(history)} steps skipped, each halving the scale; it grew "
                 f"{grew} times{interval}; now 2^{math.log2(end):g}", fontsize=10, pad=8)
    ax.spines[["top", "right"]].set_visible(False)
    if own:
        plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 04_clipping ---------------------------------------------------------------------


def clipping_runs(runs: dict, max_norm: float):
    """04: the same training run clipped three ways, step by step, in three stacked panels.

    ``runs`` maps a label to a :class:`amp_lessons.training.History` of a clipped run; the
    first is the reference. Top: the norm the clip saw, against ``max_norm``. Middle: the
    norm of the (unscaled) gradient the optimizer applied, with each run's effective
    threshold (``max_norm`` over the scale when the clip ran before ``unscale_``) dashed.
    Bottom: the loss. One column at 9 inches, legends inside the panels in 9 pt (the runs
    named at the top; the middle legend gives each threshold once, in grey, with the runs that share it), so the
    plots take the figure's width. The title compares the run with the smallest updates to
    the reference on the steps where the reference clipped too (float-kernel figures,
    marked ``≈``).
    """
    import statistics

    fig, axes = plt.subplots(3, 1, figsize=(9, 8.6), layout="constrained")
    colors = ["#4c78a8", "#54a24b", "#e45756", "#b279a2", "#f58518"]
    shared: dict[str, list[str]] = {}  # each threshold, once, with the runs that apply it
    for i, ((label, h), color) in enumerate(zip(runs.items(), colors)):
        steps = h["step"]
        # the reference wide and pale underneath, so a run that tracks it stays visible on top
        style = dict(color=color, lw=4, alpha=0.4) if i == 0 else dict(color=color, lw=1.4)
        axes[0].plot(steps, h["clip_seen_norm"], label=label, **style)
        axes[1].plot(steps, h["applied_norm"], label="_" + label, **style)  # named in the top legend
        threshold = statistics.median(measured_thresholds(h, max_norm))
        shared.setdefault(f"{threshold:.3g}", []).append(label)
        axes[2].plot(steps, h["loss"], label="_" + label, **style)
    dashes = [(0, (6, 3)), (0, (1.5, 2)), (0, (8, 2, 1.5, 2))]
    for (name, users), ls in zip(shared.items(), dashes * len(shared)):  # on top of the runs' lines
        axes[1].axhline(float(name), color="black", ls=ls, lw=1.1, zorder=3, label=f"{name}: {', '.join(users)}")
    axes[0].axhline(max_norm, color="black", ls=":", lw=1, label=f"max_norm = {max_norm:g}")
    axes[0].set(yscale="log", xlabel="optimizer step", ylabel="L2 norm the clip\ncompared (log axis)",
                title="what clip_grad_norm_ saw")
    axes[1].set(yscale="log", xlabel="optimizer step",
                ylabel="L2 norm of the applied\ngradient (log axis)",
                title="what the optimizer applied (unscaled)")
    axes[2].set(xlabel="optimizer step", ylabel="training loss\n(cross-entropy, nats)",
                title="loss")
    axes[0].legend(fontsize=9, frameon=False, loc="best")  # the runs and max_norm
    axes[1].legend(fontsize=9, frameon=False, loc="best", title="black: the threshold each run applied",
                   title_fontsize=9)
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    labels = list(runs)
    ref = runs[labels[0]]
    worst = min(labels, key=lambda k: statistics.median(runs[k]["applied_norm"]))
    # compared where the reference clipped too: there both applied norms are set by a threshold
    both = [i for i, r in enumerate(ref) if r.grad_norm > max_norm] or list(range(len(ref)))
    ratio = (statistics.median(ref["applied_norm"][i] for i in both)
             / statistics.median(runs[worst]["applied_norm"][i] for i in both))
    tail = max(1, len(ref) // 10)
    fig.suptitle(f"{worst}: updates {measured(ratio, ',.0f')}x smaller than {labels[0]}'s\non the "
                 f"{measured(len(both), 'd')} of {len(ref)} steps {labels[0]} clipped too; mean loss of the last "
                 f"{tail} steps {measured(statistics.fmean(runs[worst]['loss'][-tail:]), '.2f')} vs "
                 f"{measured(statistics.fmean(ref['loss'][-tail:]), '.2f')}", fontsize=11)
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 05_putting_it_together ----------------------------------------------------------

_PRECISION_COLORS = {"fp32": "#4c78a8", "tf32": "#72b7b2", "bf16": "#54a24b", "fp16": "#e45756"}


def _step_memory(result) -> dict:
    """Per precision of a :class:`~amp_lessons.bench.SideBySide`, what one training step
    holds (:func:`amp_lessons.measure.training_memory`), on the trainer's own first batch,
    loss and optimizer."""
    out = {}
    for p, run in result.runs.items():
        t = run.trainer
        if t is None:
            raise ValueError(f"the {p} run has no trainer to measure; pass memory={{precision: "
                             "measure.training_memory(...)}} or use bench.train_side_by_side, which keeps it")
        x, y = t.data.batch(0, t.batch_size, t.seed)
        out[p] = training_memory(t.model, x.to(t.device), y.to(t.device), p,
                                 optimizer=type(t.optimizer), loss_fn=t.loss_fn)
    return out


# What a training step holds, bottom to top: what 16-bit does not change, then what it adds,
# then the one part it shrinks.
_MEMORY_PARTS = (("weights", "weights (float32)", "#9d9d9d"), ("gradients", "gradients (float32)", "#bdbdbd"),
                 ("optimizer_state", "optimizer state", "#dcdcdc"),
                 ("input_batch", "input batch (x and labels, as given)", "#f0e0b0"),
                 ("weight_copies", "autocast's 16-bit weight copies", "white"),
                 ("activations", "activations saved for backward", None))


def side_by_side(result, memory: dict | None = None):
    """05: one model trained in each precision: loss curves (top), ms per step and the
    memory a training step holds (bottom), at 9 inches wide so it reads at JupyterLab's width.

    ``result`` is a :class:`amp_lessons.bench.SideBySide`. The memory bars stack what a
    step holds (:class:`amp_lessons.measure.TrainingMemory`): the float32 weights, their
    gradients and the optimizer state, which mixed precision leaves as they are, autocast's
    16-bit weight copies, which it adds, the input batch, and the activations, which it shrinks; ``memory``
    maps a precision to one (default: measured on each run's trainer). The title gives
    the activation bars' ratio to fp32 and the whole step's (exact byte counts), then the
    speed and accuracy (float-kernel figures, marked ``≈``).
    """
    runs = result.runs
    names = list(runs)
    colors = [_PRECISION_COLORS.get(p, "grey") for p in names]
    memory = memory if memory is not None else _step_memory(result)
    fig = plt.figure(figsize=(9, 7.4), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.15])
    curves, times, held = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    for i, (p, color) in enumerate(zip(names, colors)):
        losses = runs[p].losses
        # fp32 wide and pale underneath, so a run that tracks it stays visible on top
        style = dict(lw=4, alpha=0.4) if p == "fp32" else dict(lw=1.2, ls=("-", "--", ":")[i % 3])
        curves.plot(range(len(losses)), losses, color=color, label=p, **style)
    gap = max((max(abs(a - b) for a, b in zip(runs[p].losses, runs[names[0]].losses)) for p in names[1:]
               if runs[p].losses), default=None)
    curves.set(xlabel="optimizer step", ylabel="training loss\n(cross-entropy, nats)",
               title="the same run in each precision" + ("" if gap is None else
                     f": the curves overlap (largest gap to {names[0]}'s at one step {measured(gap, '.2g')})"))
    curves.legend(frameon=False, fontsize=9)
    times.bar(names, [runs[p].ms for p in names], color=colors)
    times.set(ylabel="median ms per optimizer step", title="step time (this run; varies)")
    bottom = [0.0] * len(names)
    for attr, label, color in _MEMORY_PARTS:
        values = [getattr(memory[p], attr) / MiB for p in names]
        face = colors if color is None else color
        held.bar(names, values, bottom=bottom, color=face, edgecolor="black", lw=0.6,
                 hatch="//" if attr == "weight_copies" else None,
                 label=label if color is not None else label + " (colour of the precision)")
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        held.annotate(f"{total:.2f} MiB", (x, total), ha="center", va="bottom", fontsize=9,
                      xytext=(0, 2), textcoords="offset points")
    batch = next(iter(memory.values())).batch
    held.set(ylabel="MiB a step holds, summed\n(not a measured peak)", ylim=(0, 1.15 * max(bottom)),
             title=f"memory of a training step, batch {batch}")
    fig.legend(*held.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=9,
               frameon=False, reverse=True)
    for ax in (curves, times, held):
        ax.spines[["top", "right"]].set_visible(False)
    low = [p for p in names if p in ("bf16", "fp16")]
    if low:
        lines = [f"{p}: activations {memory[p].activations / memory['fp32'].activations:.2f}x fp32's, "
                 "the step's summed memory "
                 f"{memory[p].total / memory['fp32'].total:.2f}x, speed {measured(result.speedup(p), '.2f')}x, "
                 f"test accuracy {measured(runs[p].accuracy, '.2f')}" for p in low]
        fig.suptitle(f"on {result.device}, against fp32 (test accuracy "
                     f"{measured(runs['fp32'].accuracy, '.2f')}):\n" + "\n".join(lines), fontsize=10)
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


def matmul_rates(result):
    """05: achieved GFLOP/s of an n x n matmul per precision, from :func:`amp_lessons.bench.run_bench`.

    The title compares each precision's best rate (its best n) with fp32's best, the ratio
    the bench's reasons print (timings: marked ``≈``). The rate axis is logarithmic so that
    a slow precision's bars stay visible; a size the bench skipped is marked "skipped".
    """
    import numpy as np

    rows = [m for m in result.matmul if m.gflops]
    sizes = sorted({m.n for m in rows})
    names = list(dict.fromkeys(m.precision for m in rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(names))
    for i, p in enumerate(names):
        values = [next((m.gflops for m in rows if m.n == n and m.precision == p), None) for n in sizes]
        xs = np.arange(len(sizes)) + i * width
        ax.bar(xs, [v or 0.0 for v in values], width, label=p, color=_PRECISION_COLORS.get(p, "grey"))
        for x, v in zip(xs, values):
            if v is None:  # bench skips sizes too slow for a precision
                ax.annotate("skipped", (x, 0), xycoords=("data", "axes fraction"), rotation=90,
                            ha="center", va="bottom", fontsize=7, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(np.arange(len(sizes)) + width * (len(names) - 1) / 2, [f"n = {n}" for n in sizes])
    ax.set(ylabel="achieved GFLOP/s (log scale)", xlabel="matrix size (n x n @ n x n)")
    if rows:
        ax.set_yscale("log")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not on them
    fp32 = result.peak("fp32")
    parts = [f"{p} {measured(result.peak(p)[0] / fp32[0], '.2f')}x" for p in names
             if p != "fp32" and fp32 and result.peak(p)]
    ax.set_title(f"{result.device}: best matmul rate vs fp32's best: " + (", ".join(parts) or "fp32 only"),
                 fontsize=10)
    fig.tight_layout()
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


def lost_updates(lrs, fractions: dict, optimizer: str = "sgd", at_lr: float | None = None):
    """05: the fraction of an optimizer step's updates that did not happen, against the lr.

    ``fractions`` maps a label (``"fp32 master"``, ``"model.half()"``) to one fraction per
    learning rate, from :func:`amp_lessons.master.lost_fraction_by_lr`. The title quotes
    the learning rate ``at_lr`` (one of ``lrs``; default the middle one).
    """
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = {"fp32 master": _PRECISION_COLORS["fp32"], "model.half()": _PRECISION_COLORS["fp16"]}
    for label, values in fractions.items():
        ax.plot(lrs, [100 * v for v in values], "o-", color=colors.get(label, "grey"), label=label)
    ax.set(xscale="log", xlabel=f"learning rate ({optimizer})",
           ylabel="% of the nonzero updates\nthe step left undone", ylim=(-3, 103))
    ax.legend(frameon=False)
    if at_lr is not None and at_lr not in lrs:
        raise ValueError(f"at_lr={at_lr:g} is not one of the learning rates plotted ({lrs}): pass one of them")
    i = len(lrs) // 2 if at_lr is None else list(lrs).index(at_lr)
    half, master = fractions.get("model.half()"), fractions.get("fp32 master")
    if half and master:
        ax.set_title(f"one {optimizer} step at lr={lrs[i]:g}: model.half() loses {half[i]:.0%} of the "
                     f"updates, fp32 master weights {master[i]:.1%}", fontsize=10)
    fig.tight_layout()
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 08_fp8 ---------------------------------------------------------------------------


def fp8_training(runs: dict, scales: dict, recipe="tensorwise"):
    """08: left, the training loss of each run (``{label: History}``); right, the log2 of
    each fp8 operand's per-tensor scale at every step (``{"layer.kind": [log2 scale]}``,
    from :class:`amp_lessons.fp8.ScaleHistory`). The legend and the right title name each kind's
    format in ``recipe`` (:func:`amp_lessons.fp8.get_recipe`), since ``scale = fmt.max / amax``
    depends on it as much as on amax."""
    r = get_recipe(recipe)
    formats = {"input": r.forward_format, "weight": r.forward_format, "grad_output": r.grad_format}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = [dict(color="#4c78a8", lw=4, alpha=0.4), dict(color="#e45756", lw=1.4),
              dict(color="#f58518", lw=1.2, ls="--"), dict(color="#54a24b", lw=1.2, ls=":")]
    for (label, h), style in zip(runs.items(), styles * len(runs)):
        left.plot(h["step"], h["loss"], label=label, **style)
    left.set(xlabel="optimizer step", ylabel="training loss, cross-entropy (nats)",
             title="training loss, both runs")
    left.title.set_fontsize(10)
    left.legend(frameon=False)
    colors = {"input": "#4c78a8", "weight": "#54a24b", "grad_output": "#e45756"}
    dashes = ["-", "--", ":", "-."]
    layers = sorted({key.rsplit(".", 1)[0] for key in scales})
    for key, values in scales.items():
        layer, kind = key.rsplit(".", 1)
        fmt = (formats.get(kind) or "").removeprefix("fp8_")
        right.plot(range(len(values)), values, color=colors.get(kind, "grey"),
                   ls=dashes[layers.index(layer) % len(dashes)], lw=1.2,
                   label=f"layer {layer}: {kind}" + (f" ({fmt})" if fmt else ""))
    right.set(xlabel="optimizer step", ylabel="log2 of the scale (scale = fmt.max / amax)")
    right.legend(frameon=False, fontsize=8, ncol=2)
    maxima = ", ".join(f"{name.removeprefix('fp8_')}'s {format_info(name).max:g}"
                       for name in dict.fromkeys(formats.values()) if name)
    right.set_title(f"each fp8 operand's scale, every step\n(fmt.max: {maxima})", fontsize=10)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig


# --- 05: where a step's time goes (bench --breakdown) ---------------------------------

_CATEGORY_COLORS = {
    "forward matmuls": "#4c78a8", "backward matmuls": "#9ecae9", "forward rest": "#f58518",
    "backward rest": "#ffbf79", "autocast casts": "#e45756", "optimizer": "#54a24b",
    "bookkeeping": "#b279a2", "data": "#bab0ac", "GPU idle": "#eeeeee",
}


def step_breakdown(result, model: str = "mlp"):
    """05: one Trainer step per precision as a stacked bar of its categories (ms), from
    :func:`amp_lessons.bench.run_bench` with ``breakdown=True``.

    The title states the matmul share of the fp32 step: only what the bars show.
    """
    bds = [b for b in result.breakdowns if b.model == model]
    if not bds:
        raise ValueError(f"no breakdown for {model!r}: run the bench with breakdown=True (--breakdown)")
    names = [c for c in bds[0].ms if any(b.ms[c] for b in bds)]
    fig, ax = plt.subplots(figsize=(9, 3.6))  # one size for any number of precisions (the repr is compared)
    for i, b in enumerate(reversed(bds)):
        left = 0.0
        for c in names:
            ax.barh(i, b.ms[c], left=left, height=0.6, color=_CATEGORY_COLORS.get(c, "grey"),
                    label=c if i == 0 else None)
            left += b.ms[c]
        ax.text(left, i, f"  {left:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(bds)), [b.precision for b in reversed(bds)])
    ax.set_xlabel("ms per Trainer step (profiled; medians per category)")
    ax.legend(ncol=4, fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.28))
    fp32 = next((b for b in bds if b.precision == "fp32"), None)
    title = model
    if fp32 is not None:
        title += f": matmuls are {fp32.matmul_share:.0%} of the fp32 step"
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    plt.close(fig)  # pyplot lets go of it: a notebook shows the returned figure once, not twice
    return fig
