"""The memory plot: one panel per rank, one colour per stage, each stage drawn where it ran."""

from __future__ import annotations

import numpy as np
import pytest

from accelerate_memsafe import MemoryReport, StageRecord
from accelerate_memsafe.memory.plot import DPI, FIG_WIDTH_IN, PANEL_HEIGHT_IN, hook_calls, plot_report, stage_colors
from accelerate_memsafe.pipeline import HOOKS
from accelerate_memsafe.stages import STAGE_REGISTRY

MIB = 2**20


def _record(hook, stage, rank, segments, mib, status="ran"):
    timeline = [[a + wall * k / 4, (mib + 100 + k) * MIB, (mib + k) * MIB] for a, wall in segments for k in range(5)]
    return StageRecord(hook=hook, stage=stage, rank=rank, status=status, reason="no PEFT model" if status == "skipped" else None,
                       wall_s=sum(w for _, w in segments), start_s=segments[0][0], segments=[list(s) for s in segments],
                       timeline=[] if status == "skipped" else timeline)


def _two_rank_report() -> MemoryReport:
    recs = []
    for rank in (0, 1):
        t = 2.0 + 3 * rank  # every rank has its own origin
        recs += [_record("prepare", "meta_placement", rank, [(t, 0.2)], 300),
                 _record("prepare", "rank0_distribute", rank, [(t + 0.2, 0.5)], 310),
                 _record("prepare", "accelerate.prepare", rank, [(t + 0.7, 0.3)], 330),
                 _record("save_state", "atomic_checkpoint", rank, [(t + 10, 0.1), (t + 10.6, 0.2)], 400),
                 _record("save_state", "accelerate.save_state", rank, [(t + 10.1, 0.5)], 420),
                 _record("load_state", "optimizer_cpu_reload", rank, [(t + 20, 0.3), (t + 20.6, 0.4)], 430),
                 _record("load_state", "peft_cpu_reload", rank, [(t + 20.3, 0.0)], 430, status="skipped"),
                 _record("load_state", "accelerate.load_state", rank, [(t + 20.3, 0.3)], 440)]
    return MemoryReport(recs)


def test_every_stage_and_accelerate_call_has_its_own_colour():
    names = list(STAGE_REGISTRY) + [f"accelerate.{h}" for h in HOOKS] + [f"custom_{i}" for i in range(40)]
    colors = stage_colors(names)
    assert len(set(colors.values())) == len(names), "two stages share a colour"
    assert colors == stage_colors(reversed(names)), "a stage's colour depends on its name, not on the order"
    assert stage_colors(["shard"])["shard"] == colors["shard"]


def test_hook_calls_split_a_rank_into_its_calls():
    recs = _two_rank_report().find(rank=1)
    calls = hook_calls(recs + [_record("save_state", "atomic_checkpoint", 1, [(40.0, 0.1)], 400)])
    assert [c.hook for c in calls] == ["prepare", "save_state", "load_state", "save_state"]
    assert (calls[1].start, calls[1].end) == (15.0, pytest.approx(15.8))


def test_plot_of_a_multi_rank_report_draws_each_stage_in_its_colour(tmp_path):
    from PIL import Image

    report = _two_rank_report()
    png = plot_report(report, tmp_path / "r.png")
    with Image.open(png) as im:
        assert im.format == "PNG"
        assert im.size == (int(FIG_WIDTH_IN * DPI), int(PANEL_HEIGHT_IN * 2 * DPI))
        pixels = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(int)
    colors = stage_colors(r.stage for r in report.records)

    def count(hex_color: str) -> int:  # a stage's span: its colour at the plot's alpha over white
        rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
        shaded = np.rint(0.35 * rgb + 0.65 * 255)
        return int((np.abs(pixels - shaded).max(axis=1) <= 2).sum())

    for stage in {r.stage for r in report.records if r.status == "ran"}:
        assert count(colors[stage]) > 500, f"{stage} is not drawn in its colour"
    assert count(colors["peft_cpu_reload"]) == 0, "a skipped stage is drawn"


def test_plot_refuses_an_empty_report(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        plot_report(MemoryReport(), tmp_path / "x.png")
