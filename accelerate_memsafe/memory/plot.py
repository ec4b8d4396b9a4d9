"""Memory timeline plot: one panel per rank, RSS and RssAnon over each hook call, every stage in its colour.

The hook calls (``prepare``, ``save_state``, ...) are laid side by side: the training between them is not
sampled, so it is left out, and the same call of every rank lines up in one column. Each column's ticks are
seconds since that call started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .report import MemoryReport, StageRecord

#: Size of the written figure in inches and its resolution: 12x(3·ranks) inches at 100 dpi.
FIG_WIDTH_IN = 12.0
PANEL_HEIGHT_IN = 3.0
DPI = 100

#: Fixed colours of the built-in stages and of accelerate's own calls (shades of grey: stock accelerate's
#: work), so a stage has the same colour in every plot. Other stage names get :data:`_EXTRA_COLORS` in
#: sorted order; no two names of one plot share a colour.
STAGE_COLORS = {
    "meta_placement": "#9467bd",
    "shard": "#ff7f0e",
    "rank0_distribute": "#1f77b4",
    "buffer_init": "#bcbd22",
    "optimizer_offload": "#e377c2",
    "dataloader_resume": "#17becf",
    "atomic_checkpoint": "#2ca02c",
    "optimizer_cpu_reload": "#d62728",
    "peft_cpu_reload": "#8c564b",
    "offloaded_save": "#e6ab02",
    "accelerate.prepare": "#8c8c8c",
    "accelerate.load_state": "#5f5f5f",
    "accelerate.save_state": "#b0b0b0",
    "accelerate.save_model": "#cfcfcf",
}
_EXTRA_COLORS = (
    "#1b9e77", "#e7298a", "#393b79", "#a6761d", "#66a61e", "#7570b3", "#843c39", "#637939", "#7b4173", "#8c6d31",
    "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#6baed6",
    "#fd8d3c", "#74c476", "#9e9ac8", "#d95f02", "#8dd3c7", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
)  # fmt: skip

#: Share of the axis width a hook call gets at least, so that a short one stays readable.
MIN_CALL_WIDTH = 0.12
#: Gap between two hook calls, as a share of the axis width.
CALL_GAP = 0.025
#: The axes' left and right edges (figure fractions): the legend goes right of the data.
PLOT_LEFT, PLOT_RIGHT = 0.075, 0.80
LABEL_PT = 7
MIB = 2**20


def stage_colors(names) -> dict[str, str]:
    """One colour per stage name: the fixed one of :data:`STAGE_COLORS`, else the next unused one of a
    qualitative palette in sorted name order (the same names always get the same colours).

    Example:
        >>> c = stage_colors(["shard", "accelerate.prepare", "mine"])
        >>> c["shard"], len(set(c.values()))
        ('#ff7f0e', 3)
    """
    names = sorted(set(names))
    out = {n: STAGE_COLORS[n] for n in names if n in STAGE_COLORS}
    free = [c for c in _EXTRA_COLORS if c not in out.values()]
    others = [n for n in names if n not in out]
    if len(others) > len(free):  # more custom stages than the palette: evenly spaced hues
        import colorsys

        hues = (colorsys.hsv_to_rgb(i / len(others), 0.6, 0.8) for i in range(len(others)))
        free += ["#" + "".join(f"{int(255 * v):02x}" for v in rgb) for rgb in hues]
    for name, color in zip(others, free):
        out[name] = color
    return out


@dataclass
class _Call:
    """One hook call on one rank: its records (in start order) and its time span."""

    hook: str
    records: list[StageRecord]
    start: float
    end: float


def hook_calls(records: list[StageRecord]) -> list[_Call]:
    """Splits one rank's records into its hook calls: a call ends where the hook changes or a stage repeats.

    Example:
        >>> from accelerate_memsafe import StageRecord
        >>> recs = [StageRecord("save_state", s, 0, "ran", None, 0.1, start_s=t) for s, t in [("a", 0), ("a", 5)]]
        >>> [(c.hook, c.start) for c in hook_calls(recs)]
        [('save_state', 0.0), ('save_state', 5.0)]
    """
    calls: list[_Call] = []
    for r in sorted(records, key=lambda r: r.start_s):
        spans = r.spans()
        current = calls[-1] if calls else None
        if current is None or current.hook != r.hook or any(o.stage == r.stage for o in current.records):
            current = _Call(r.hook, [], spans[0][0], spans[0][1])
            calls.append(current)
        current.records.append(r)
        current.start = min(current.start, *(a for a, _ in spans))
        current.end = max(current.end, *(b for _, b in spans))
    return calls


class _Layout:
    """Where each hook call goes on the shared x axis: call ``i`` of every rank starts at ``x0[i]``; a call
    narrower than :data:`MIN_CALL_WIDTH` of the axis is stretched (its own ticks keep real seconds)."""

    def __init__(self, calls_by_rank: dict[int, list[_Call]]) -> None:
        n = max(len(c) for c in calls_by_rank.values())
        self.duration = [max((c[i].end - c[i].start for c in calls_by_rank.values() if i < len(c)), default=0.0)
                         for i in range(n)]
        self.duration = [max(d, 1e-3) for d in self.duration]
        total = sum(self.duration)
        min_width = min(MIN_CALL_WIDTH, 0.8 / n) * total / max(1e-9, 1 - CALL_GAP * (n - 1))
        self.width = [max(d, min_width) for d in self.duration]
        self.gap = CALL_GAP * sum(self.width) / max(1e-9, 1 - CALL_GAP * (n - 1))
        self.x0 = []
        x = 0.0
        for w in self.width:
            self.x0.append(x)
            x += w + self.gap
        self.xmax = x - self.gap

    def x(self, i: int, call: _Call, t):
        """The x position of time ``t`` (a float or a list) of ``call``, the ``i``-th call of its rank."""
        scale = self.width[i] / self.duration[i]
        if isinstance(t, list):
            return [self.x0[i] + (v - call.start) * scale for v in t]
        return self.x0[i] + (t - call.start) * scale


def _nice_ticks(duration: float, width_share: float) -> list[float]:
    from matplotlib.ticker import MaxNLocator

    ticks = MaxNLocator(nbins=max(1, round(10 * width_share)), steps=[1, 2, 2.5, 5, 10]).tick_values(0, duration)
    return [float(t) for t in ticks if 0 <= t <= duration * 1.0001]


def _fmt_seconds(t: float) -> str:
    return f"{t:g}" if t else "0 s"


def plot_report(report: MemoryReport, path: str | os.PathLike) -> Path:
    """Draws the memory timeline of every rank, hook call by hook call, and writes a PNG.

    One panel per rank (same axes for every rank): private memory (RssAnon, what the OOM killer counts) as
    a solid line, RSS (which also counts file pages, e.g. a memory-mapped checkpoint) as a dashed one. Each
    stage's time is shaded in its colour (:func:`stage_colors`; accelerate's own call in grey), each stage's
    RssAnon peak is marked, and the highest peaks are labelled in MiB. Skipped stages are not drawn (the
    table lists them with their reason).

    Args:
        report: A (gathered) report whose records carry timelines.
        path: Output PNG path.

    Returns:
        The written path.

    Raises:
        ValueError: If the report has no records.

    Example:
        >>> # plot_report(MemoryReport.from_json("run.json"), "run.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not report.records:
        raise ValueError("the report has no records to plot; run a hook with the plugin first.")
    ranks = sorted({r.rank for r in report.records})
    calls_by_rank = {rank: hook_calls(report.find(rank=rank)) for rank in ranks}
    layout = _Layout(calls_by_rank)
    drawn = [r for r in report.records if r.status != "skipped"]
    colors = stage_colors(r.stage for r in drawn)

    height = PANEL_HEIGHT_IN * len(ranks)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(FIG_WIDTH_IN, height), dpi=DPI, squeeze=False,
                             sharex=True, sharey=True)
    fig.subplots_adjust(left=PLOT_LEFT, right=PLOT_RIGHT, top=1 - 0.85 / height, bottom=0.55 / height, hspace=0.12)
    values = [s[k] / MIB for r in drawn for s in r.timeline for k in (1, 2)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = max(hi - lo, 1.0)
    for ax in axes[:, 0]:
        ax.set_ylim(lo - 0.08 * pad, hi + 0.22 * pad)
        ax.set_xlim(-layout.gap / 2, layout.xmax + layout.gap / 2)
    for ax, rank in zip(axes[:, 0], ranks):
        _draw_rank(ax, rank, calls_by_rank[rank], layout, colors, span_y=pad)

    top = axes[0, 0]
    for i in range(len(layout.width)):
        hooks = sorted({calls[i].hook for calls in calls_by_rank.values() if i < len(calls)})
        top.text(layout.x0[i] + layout.width[i] / 2, 1.03, f"{' / '.join(hooks)}\n{layout.duration[i]:.2f} s",
                 transform=top.get_xaxis_transform(), ha="center", va="bottom", fontsize=9, fontweight="bold")
    ticks, labels = [], []
    for i, width in enumerate(layout.width):
        for t in _nice_ticks(layout.duration[i], width / layout.xmax):
            if i + 1 < len(layout.width) and t * width / layout.duration[i] > width - 0.03 * layout.xmax:
                continue  # would touch the next call's "0 s"
            ticks.append(layout.x0[i] + t * width / layout.duration[i])
            labels.append(_fmt_seconds(t))
    bottom = axes[-1, 0]
    bottom.set_xticks(ticks, labels, fontsize=7)
    bottom.set_xlabel("seconds into each hook call (the training between the calls is not sampled and left out)", fontsize=8)
    fig.suptitle("Memory per rank during the plugin's hook calls", x=PLOT_LEFT, ha="left", fontsize=11)

    handles = [Line2D([], [], color="#1a1a1a", lw=1.6, label="RssAnon (private)"),
               Line2D([], [], color="#1a1a1a", lw=1.0, ls="--", alpha=0.6, label="RSS (+ file pages)"),
               Line2D([], [], color="#1a1a1a", marker="o", ls="", ms=5, mfc="white", label="peak (+ rise in the stage)")]
    order = list(dict.fromkeys(r.stage for r in sorted(drawn, key=lambda r: (r.rank, r.start_s))))
    handles += [Patch(facecolor=colors[name], alpha=0.45, label=name) for name in order]
    if any(r.status == "failed" for r in drawn):
        handles.append(Patch(facecolor="white", edgecolor="#d62728", hatch="xx", label="failed"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(PLOT_RIGHT + 0.01, 1 - 0.85 / height), fontsize=8,
               frameon=False, title="stages", title_fontsize=9, alignment="left")
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw_rank(ax, rank: int, calls: list[_Call], layout: _Layout, colors: dict[str, str], *, span_y: float) -> None:
    peaks = []  # (call index, x, peak MiB, rise MiB, stage)
    for i, call in enumerate(calls):
        for r in call.records:
            if r.status == "skipped":
                continue
            for a, b in r.spans():
                x0, x1 = layout.x(i, call, a), layout.x(i, call, b)
                failed = r.status == "failed"
                ax.axvspan(x0, x1, facecolor=colors[r.stage], alpha=0.35, lw=0, zorder=1,
                           hatch="xx" if failed else None, edgecolor="#d62728" if failed else None)
                pts = [p for p in r.timeline if a <= p[0] <= b]
                if not pts:
                    continue
                xs = layout.x(i, call, [p[0] for p in pts])
                ax.plot(xs, [p[2] / MIB for p in pts], color="#1a1a1a", lw=1.6, zorder=3, solid_capstyle="butt")
                ax.plot(xs, [p[1] / MIB for p in pts], color="#1a1a1a", lw=1.0, ls="--", alpha=0.6, zorder=2)
            if r.timeline:
                t, _, anon = max(r.timeline, key=lambda p: p[2])
                peaks.append((i, layout.x(i, call, t), anon / MIB, _rise(r) / MIB, r.stage, r.wall_s))
    for i in range(len(layout.width) - 1):  # the training between two calls, left out
        x0 = layout.x0[i] + layout.width[i]
        ax.axvspan(x0, x0 + layout.gap, facecolor="white", hatch="////", edgecolor="#dddddd", lw=0, zorder=0)
        ax.text(layout.x0[i] + layout.width[i] + layout.gap / 2, 0.5, "training", transform=ax.get_xaxis_transform(),
                rotation=90, ha="center", va="center", fontsize=7, color="#8c8c8c")
    _label_peaks(ax, peaks, layout, colors, span_y)
    ax.set_ylabel(f"rank {rank}\nMiB", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", color="#dddddd", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _label_peaks(ax, peaks, layout: _Layout, colors: dict[str, str], span_y: float) -> None:
    """Marks and labels, per hook call, its highest RssAnon point and every stage whose RssAnon rose
    markedly above where it started (by 2 MiB and 2 % of the axis), leaving out a label that would overlap
    one already placed."""
    placed: list[tuple[float, float, float, float]] = []  # label boxes in data units
    x_per_pt = (layout.xmax + layout.gap) / (FIG_WIDTH_IN * 72 * (PLOT_RIGHT - PLOT_LEFT))
    y0, y1 = ax.get_ylim()
    y_per_pt = (y1 - y0) / (PANEL_HEIGHT_IN * 72 * 0.8)
    rise_needed = max(2.0, 0.02 * span_y)
    for i in sorted({p[0] for p in peaks}):
        mine = [p for p in peaks if p[0] == i]
        height = max(p[2] for p in mine)
        # the highest point; where several stages reach it (memory stays up after a stage), the one that rose
        # most to it, then the longest
        top = max((p for p in mine if p[2] >= height - 0.01 * span_y), key=lambda p: (p[3], p[5]))
        chosen = [top] + sorted((p for p in mine if p is not top and p[3] >= rise_needed), key=lambda p: -p[3])
        for _, x, y, rise, stage, _ in chosen:
            text = f"{stage}\n{y:,.0f} MiB" + (f" (+{rise:,.0f})" if rise >= rise_needed else "")
            share = (x - layout.x0[i]) / layout.width[i]  # keep the label over its own call if it fits
            preferred = "right" if share > 0.7 else "left" if share < 0.3 else "center"
            width = (max(len(line) for line in text.splitlines()) * 0.55 * LABEL_PT + 4) * x_per_pt
            for ha in dict.fromkeys((preferred, "center", "right", "left")):
                left = {"right": x + 4 * x_per_pt - width, "left": x - 4 * x_per_pt, "center": x - width / 2}[ha]
                box = (left, left + width, y, y + (7 + 2.5 * LABEL_PT) * y_per_pt)
                if not any(box[0] < b[1] and b[0] < box[1] and box[2] < b[3] and b[2] < box[3] for b in placed):
                    break
            else:
                continue
            placed.append(box)
            ax.plot([x], [y], marker="o", ms=5, mfc="white", mec=colors[stage], mew=1.8, zorder=4)
            ax.annotate(text, (x, y), xytext={"right": (4, 7), "left": (-4, 7), "center": (0, 7)}[ha],
                        textcoords="offset points", ha=ha, va="bottom", fontsize=LABEL_PT, zorder=5,
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.85))


def _rise(record: StageRecord) -> float:
    """How far RssAnon rose within the stage: the largest peak above the start of one of its parts (not
    across accelerate's call between two parts)."""
    rise = 0.0
    for a, b in record.spans():
        pts = [p[2] for p in record.timeline if a <= p[0] <= b]
        if pts:
            rise = max(rise, max(pts) - pts[0])
    return rise
