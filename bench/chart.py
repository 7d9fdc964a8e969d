"""The chart: how each limiter spreads the same burst over time.

Top: starts in the trailing window (what a window limit bounds) against the limit.
Below, one row per limiter: starts per 100 ms, with the aligned window boundaries, where
the fixed window's 2x burst shows.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Any

COLORS = {
    "sliding": "#1f77b4",
    "fixed": "#ff7f0e",
    "naive fixed (seed)": "#d62728",
    "naive sliding log": "#9467bd",
    "celery rate_limit": "#2ca02c",
}


def draw(burst: dict[str, Any], path: Path, title: str) -> Path:
    """Write the chart for ``burst`` ({variant: {"times", "limit", "window"}}) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in COLORS if v in burst and burst[v]["times"]]
    variants += [v for v in burst if v not in variants and burst[v]["times"]]
    if not variants:
        raise ValueError("no burst data to draw")
    limit = burst[variants[0]]["limit"]
    window = burst[variants[0]]["window"]
    # Each run on its own axis: 0 is the aligned window boundary before its first start.
    series = {}
    ends = {}
    for v in variants:
        ts = sorted(burst[v]["times"])
        origin = math.floor(ts[0] / window) * window
        rel = [t - origin for t in ts]
        series[v] = rel
        ends[v] = rel[-1]
    # A very slow tail (Celery's rate_limit) would squeeze the rest: cut the axis at the
    # last start of the others plus two windows, and say so in the legend.
    others = [e for v, e in ends.items() if v != "celery rate_limit"] or list(ends.values())
    horizon = min(max(ends.values()), max(others) + 2 * window)
    horizon = math.ceil(horizon / window + 0.25) * window

    fig = plt.figure(figsize=(12, 3.2 + 1.25 * len(variants)), dpi=110)
    grid = fig.add_gridspec(1 + len(variants), 1, height_ratios=[3.2] + [1.0] * len(variants), hspace=0.35)
    top = fig.add_subplot(grid[0])
    step = 0.01
    xs = [i * step for i in range(int(horizon / step) + 1)]
    for v in variants:
        rel = series[v]
        # starts in (x - window, x]: the count a window limit bounds
        ys = [bisect_right(rel, x) - bisect_right(rel, x - window) for x in xs]
        label = f"{v} (max {max(ys)})"
        if ends[v] > horizon:
            label += f", last start at {ends[v]:.0f}s"
        top.plot(xs, ys, color=COLORS.get(v), lw=1.6, label=label)
    top.axhline(limit, color="black", ls="--", lw=1.2, label=f"limit {limit} per {window:g}s")
    top.axhline(2 * limit, color="grey", ls=":", lw=1.0, label="2 x limit")
    top.set_xlim(0, horizon)
    top.set_ylim(0, max(2.3 * limit, top.get_ylim()[1]))
    top.set_ylabel(f"starts in the last {window:g}s")
    top.set_title(title, fontsize=11)
    top.legend(loc="upper right", fontsize=8, ncol=2)
    top.grid(alpha=0.3)

    bin_s = 0.1
    nbins = int(horizon / bin_s)
    per_bin_cap = 0
    counts = {}
    for v in variants:
        rel = series[v]
        c = [bisect_left(rel, (i + 1) * bin_s) - bisect_left(rel, i * bin_s) for i in range(nbins)]
        counts[v] = c
        per_bin_cap = max(per_bin_cap, max(c, default=0))
    for row, v in enumerate(variants, start=1):
        ax = fig.add_subplot(grid[row], sharex=top)
        ax.bar([i * bin_s for i in range(nbins)], counts[v], width=bin_s, align="edge",
               color=COLORS.get(v, "#555555"), edgecolor="none")
        k = 0
        while k * window <= horizon:
            ax.axvline(k * window, color="black", lw=0.6, alpha=0.5)
            k += 1
        ax.set_ylim(0, per_bin_cap * 1.15 + 1)
        ax.set_ylabel("per 100ms", fontsize=8)
        ax.text(0.005, 0.92, v, transform=ax.transAxes, fontsize=9, va="top", fontweight="bold")
        ax.tick_params(labelsize=8)
        if row < len(variants):
            plt.setp(ax.get_xticklabels(), visible=False)
    fig.axes[-1].set_xlabel("seconds from the window boundary before the first start "
                            "(vertical lines: aligned window boundaries)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
