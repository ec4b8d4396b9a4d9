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
