"""Figures of lesson 09 (block scales). Each function returns a matplotlib ``Figure`` with
labelled axes and a title that states the point. Used in 09_block_scales.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from .blockscale import get_scheme

_SCHEME_COLORS = {"per tensor": "#bab0ac", "per row": "#9d755d", "1x128": "#4c78a8", "128x128": "#9ecae9",
                  "MXFP8": "#54a24b", "MXFP4": "#f58518", "NVFP4": "#e45756"}


def _scheme_label(name: str) -> str:
    """``"MXFP8 (OCP floor rule)"``: a scheme with e8m0 scales names the rule that picks them."""
    scheme = get_scheme(name)
    if scheme.scale_format != "e8m0":
        return name
    return f"{name} ({'OCP floor' if scheme.rule == 'floor' else scheme.rule} rule)"


def scheme_bars(table: dict):
    """09: SQNR (dB) of every scheme (a bar each) for every tensor kind (a group each), from
    :func:`amp_lessons.blockscale.error_table`. Higher is better; 6 dB is one bit."""
    kinds = list(table)
    schemes = list(next(iter(table.values())))
    width = 0.8 / len(schemes)
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for i, s in enumerate(schemes):
        xs = [k + (i - (len(schemes) - 1) / 2) * width for k in range(len(kinds))]
        ys = [table[kind][s].sqnr for kind in kinds]
        ax.bar(xs, ys, width=width, color=_SCHEME_COLORS.get(s, "grey"), label=_scheme_label(s))
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set(ylabel="SQNR (dB), higher is better")
    ax.legend(frameon=False, ncol=len(schemes), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    def mean(element):
        ys = [table[k][s].sqnr for k in kinds for s in schemes if get_scheme(s).element == element]
        ys = [y for y in ys if math.isfinite(y)]
        return sum(ys) / len(ys) if ys else math.nan

    fig.suptitle(f"e4m3 elements keep {mean('e4m3'):.0f} dB on average here, e2m1 {mean('e2m1'):.0f} dB:\n"
                 "among these schemes the element sets the level, and the scales' blocks and rule move it "
                 "less", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def delayed_scaling(runs: dict, fmt_max: float = 448.0, spike_at: int | None = None, saturate_from: float = 464.0):
    """09: for each run (``{label: [Step, ...]}`` from :mod:`amp_lessons.delayed`), left the
    log2 of the tensor's largest magnitude after scaling, against the format's largest
    value (the band from ``saturate_from``, e4m3's 464, saturates); right the values flushed to zero at each step, on a
    symlog axis so that small counts show beside large ones.
    Runs drawn first are drawn wider, so a later run on the same values stays visible."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.9))
    styles = [dict(color="#4c78a8", lw=5, alpha=0.45), dict(color="#e45756", lw=3.2, alpha=0.7),
              dict(color="#54a24b", lw=1.4, ls="--"), dict(color="#222222", lw=1.0, marker=".", ms=4)]
    top, over = math.log2(fmt_max), math.log2(saturate_from)
    left.axhspan(over, top + 5, color="#e45756", alpha=0.08, lw=0)
    left.axhline(top, color="grey", lw=0.6, ls=":")
    left.text(0, top + 2.5, f"above {saturate_from:g}: saturated (x);\n{fmt_max:g} to {saturate_from:g} "
              f"rounds to {fmt_max:g}", fontsize=8)
    for (label, steps), style in zip(runs.items(), styles * len(runs)):
        xs = [s.step for s in steps]
        left.plot(xs, [math.log2(max(s.scaled_amax, 2.0**-30)) for s in steps], label=label, **style)
        right.plot(xs, [s.flushed for s in steps], **style)
        hit = [s for s in steps if s.saturated]
        left.scatter([s.step for s in hit], [math.log2(s.scaled_amax) for s in hit], color=style["color"],
                     marker="x", s=60, zorder=3)
    left.set(xlabel="step", ylabel="log2 of the largest scaled magnitude")
    # symlog: the margin's hundreds of flushes a step and one history's few extra stay legible
    right.set_yscale("symlog", linthresh=1)
    right.set_ylim(bottom=0)
    right.set(xlabel="step", ylabel="values flushed to zero (of 512, symlog)")
    if spike_at is not None:
        for ax in (left, right):
            ax.axvline(spike_at, color="grey", lw=0.6, ls=":")
    fig.legend(*left.get_legend_handles_labels(), frameon=False, fontsize=8, ncol=len(runs),
               loc="lower center")
    fig.suptitle("delayed scaling: the spike saturates, then shrinks the scale for as long as the "
                 "history holds it", fontsize=10)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plt.close(fig)
    return fig


def _running_mean(ys: list, n: int) -> list:
    """The mean of each value and the ``n - 1`` before it (fewer at the start)."""
    return [sum(ys[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(ys))]


def block_training(runs: dict, smooth: int = 10):
    """09: left the training loss of each run (``{label: History}``, the first the baseline),
    one line each; right each other run's loss minus the baseline's, step by step, as a
    running mean over ``smooth`` steps, so that runs whose curves overlap come apart."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = [dict(color="#4c78a8", lw=4, alpha=0.4), dict(color="#54a24b", lw=1.4),
              dict(color="#e45756", lw=1.2, ls="--"), dict(color="#f58518", lw=1.2, ls=":")]
    (base, hb), *others = runs.items()
    for (label, h), style in zip(runs.items(), styles * len(runs)):
        left.plot(h["step"], h["loss"], label=label, **style)
    for (_, h), style in zip(others, styles[1:] * len(runs)):
        gap = [a - b for a, b in zip(h["loss"], hb["loss"])]
        right.plot(h["step"], _running_mean(gap, smooth), **{**style, "lw": 1.6})
    right.axhline(0, color=styles[0]["color"], lw=4, alpha=0.4)
    left.set(xlabel="optimizer step", ylabel="training loss, cross-entropy (nats)", yscale="log")
    right.set(xlabel="optimizer step", ylabel=f"loss minus {base}'s ({smooth}-step mean)")
    fig.legend(*left.get_legend_handles_labels(), frameon=False, fontsize=8, ncol=len(runs), loc="lower center")
    ends = {label: sum(h["loss"][-20:]) / len(h["loss"][-20:]) for label, h in runs.items()}
    worst = max(abs(v / ends[base] - 1) for k, v in ends.items() if k != base)
    fig.suptitle(f"every run ends within {worst:.0%} of {base}'s loss (mean of the last 20 steps): the curves "
                 "overlap (left); their gaps to it (right)", fontsize=10)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plt.close(fig)
    return fig
