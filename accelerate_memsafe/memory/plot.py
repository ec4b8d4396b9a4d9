"""Memory timeline plot: one panel per rank, RSS and RssAnon over time, stage boundaries shaded."""

from __future__ import annotations

import os
from pathlib import Path

from .report import MemoryReport

#: Size of the written figure in inches and its resolution: 12x(3·ranks) inches at 100 dpi.
FIG_WIDTH_IN = 12.0
PANEL_HEIGHT_IN = 3.0
DPI = 100


def plot_report(report: MemoryReport, path: str | os.PathLike) -> Path:
    """Draws the memory timeline of every rank with stage boundaries and writes a PNG.

    Args:
        report: A (gathered) report whose records carry timelines.
        path: Output PNG path.

    Returns:
        The written path.

    Raises:
        ImportError: If matplotlib is not installed (``pip install accelerate-memsafe[plot]``).
        ValueError: If the report has no records.

    Example:
        >>> # plot_report(MemoryReport.from_json("run.json"), "run.png")
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: `pip install 'accelerate-memsafe[plot]'`.") from exc
    if not report.records:
        raise ValueError("the report has no records to plot; run a hook with the plugin first.")
    ranks = sorted({r.rank for r in report.records})
    fig, axes = plt.subplots(len(ranks), 1, figsize=(FIG_WIDTH_IN, PANEL_HEIGHT_IN * len(ranks)), dpi=DPI, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    stage_names = sorted({r.stage for r in report.records})
    color_of = {name: colors[i % len(colors)] for i, name in enumerate(stage_names)}
    for ax, rank in zip(axes[:, 0], ranks):
        recs = sorted(report.find(rank=rank), key=lambda r: r.start_s)
        first = True
        for r in recs:  # one segment per stage: between hooks the run is training, which is not sampled
            pts = sorted(r.timeline)
            if not pts:
                continue
            t = [p[0] for p in pts]
            ax.plot(t, [p[1] / 2**20 for p in pts], label="RSS" if first else None, color="black", lw=1.2, marker=".", ms=2)
            ax.plot(t, [p[2] / 2**20 for p in pts], label="RssAnon" if first else None, color="tab:red", lw=1.2, marker=".", ms=2)
            first = False
        labelled = set()
        for r in recs:
            span_end = r.start_s + max(r.wall_s, 1e-4)
            label = None if r.stage in labelled else f"{r.stage}"
            labelled.add(r.stage)
            ax.axvspan(r.start_s, span_end, color=color_of[r.stage], alpha=0.18, label=label)
            ax.axvline(r.start_s, color=color_of[r.stage], lw=0.6, alpha=0.7)
        ax.set_title(f"rank {rank}")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds since the plugin was created")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
