"""MemoryReport: dict/JSON/markdown, gather without a process group."""

from __future__ import annotations

import json

import pytest

from accelerate_memsafe import MemoryReport, StageRecord
from accelerate_memsafe.memory.report import RECORD_KEYS


def _rec(stage="shard", rank=0, **kw):
    base = dict(hook="prepare", stage=stage, rank=rank, status="ran", reason=None, wall_s=0.25,
                cpu_rss_peak_bytes=3 * 2**20, cpu_rss_delta_bytes=2**20, cpu_anon_peak_bytes=2 * 2**20,
                cpu_anon_delta_bytes=2**19, live_tensor_peak_bytes=2**20)
    base.update(kw)
    return StageRecord(**base)


def test_to_dict_has_the_public_keys_and_round_trips_through_json(tmp_path):
    report = MemoryReport([_rec(), _rec(rank=1, status="skipped", reason="not FSDP2")])
    data = report.to_dict()
    assert list(data) == ["records"] and len(data["records"]) == 2
    for rec in data["records"]:
        assert set(RECORD_KEYS) <= set(rec)
    path = report.to_json(tmp_path / "r.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(data))
    again = MemoryReport.from_json(path)
    assert again.to_dict() == data


def test_from_json_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a memsafe report"):
        MemoryReport.from_json(bad)


def test_markdown_table_has_one_row_per_record():
    md = MemoryReport([_rec(), _rec(stage="buffer_init", status="skipped", reason="no buffers")]).to_markdown()
    lines = md.splitlines()
    assert lines[0].startswith("| hook | stage | rank |")
    assert len(lines) == 4
    assert "| prepare | shard | 0 | ran | 0.250 | 3.0 |" in md
    assert "no buffers" in md


def test_gather_without_process_group_is_a_copy():
    report = MemoryReport([_rec()])
    gathered = report.gather()
    assert gathered is not report and gathered.to_dict() == report.to_dict()


def _outside_spans(record: StageRecord) -> list[float]:
    spans = record.spans()
    return [t for t, _, _ in record.timeline if not any(a <= t <= b for a, b in spans)]


def test_every_records_samples_lie_within_its_time_span_on_real_hooks(tmp_path):
    """Issue 15: a stage with an ``after`` part (run before accelerate's call, after it) had one record whose
    samples spanned accelerate's call while its ``wall_s`` was the stage's own time (``load_state
    atomic_checkpoint``: wall 0.03 s, samples over 2.4 s), and every probe kept the sampler thread's samples
    taken after the region's end; the plot drew lines backwards across the hook."""
    import torch
    from torch.utils.data import DataLoader

    from accelerate_memsafe import Accelerator, MemSafePlugin

    accelerator = Accelerator(plugins=[MemSafePlugin()], cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, data = accelerator.prepare(model, opt, DataLoader(torch.randn(16, 64), batch_size=4))
    for x in data:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.load_state(str(tmp_path / "ckpt"))
    records = accelerator.memsafe_plugin.report.records
    assert {r.hook for r in records} == {"prepare", "save_state", "load_state"}
    assert {(r.hook, r.stage) for r in records if r.timeline} >= {(h, f"accelerate.{h}") for h in ("prepare", "save_state", "load_state")}
    for r in records:
        assert _outside_spans(r) == [], f"{r.hook} {r.stage}: samples outside {r.spans()}"
        assert abs(sum(b - a for a, b in r.spans()) - r.wall_s) < 1e-9 and r.spans()[0][0] == r.start_s
    two_parts = [r for r in records if len(r.spans()) == 2]
    assert {(r.hook, r.stage) for r in two_parts} >= {("load_state", "optimizer_cpu_reload"), ("prepare", "dataloader_resume")}
    for r in two_parts:  # the parts are the run before accelerate's call and the after part behind it
        upstream = accelerator.memsafe_plugin.report.find(hook=r.hook, stage=f"accelerate.{r.hook}")[0]
        (a0, a1), (b0, b1) = r.spans()
        assert a1 <= upstream.start_s and upstream.start_s + upstream.wall_s <= b0
        assert any(a0 <= t <= a1 for t, _, _ in r.timeline) and any(b0 <= t <= b1 for t, _, _ in r.timeline)
    again = MemoryReport.from_json(accelerator.memsafe_plugin.report.to_json(tmp_path / "r.json"))
    assert [r.spans() for r in again.records] == [r.spans() for r in records]


def test_the_report_keeps_a_bounded_number_of_timeline_samples_and_every_figure(tmp_path):
    # a run that saves every few steps for days adds records forever: their figures stay, the oldest timelines go
    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.memory.report import MAX_TIMELINE_SAMPLES

    assert MemSafePlugin().report.max_timeline_samples == MAX_TIMELINE_SAMPLES
    report = MemoryReport(max_timeline_samples=1000)
    for i in range(30):  # 200 samples each (a probe keeps fewer than 400)
        report.add(_rec(stage=f"s{i}", hook="save_state", timeline=[[i + k / 200, 2**20 + k, k] for k in range(200)]))
    report.add(_rec(stage="skipped", status="skipped", reason="n/a"))  # no timeline: nothing to count
    kept = [len(r.timeline) for r in report.records]
    assert sum(kept) <= 1000 and kept[-6:-1] == [200] * 5 and kept[:25] == [0] * 25, kept
    assert report.timelines_dropped == 25
    assert [r.stage for r in report.records[:30]] == [f"s{i}" for i in range(30)], "no record is dropped"
    assert all(r.cpu_anon_peak_bytes == 2 * 2**20 and r.wall_s == 0.25 for r in report.records[:30])
    again = MemoryReport.from_json(report.to_json(tmp_path / "r.json"))
    assert again.timelines_dropped == 25 and again.to_dict() == report.to_dict()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": [], "timelines_dropped": "many"}))
    with pytest.raises(ValueError, match=r"bad\.json is not a memsafe report: 'timelines_dropped' is 'many'"):
        MemoryReport.from_json(bad)
    assert report.gather().timelines_dropped == 25
    one = MemoryReport(max_timeline_samples=10)
    one.add(_rec(timeline=[[0.0, 1, 1]] * 50))  # the newest record keeps its timeline even over the bound
    assert len(one.records[0].timeline) == 50 and one.timelines_dropped == 0
    unbounded = MemoryReport(max_timeline_samples=None)
    for _ in range(3):
        unbounded.add(_rec(timeline=[[0.0, 1, 1]] * 50))
    assert [len(r.timeline) for r in unbounded.records] == [50, 50, 50]
