"""`accelerate-memsafe estimate`: per-stage predictions from headers only."""

from __future__ import annotations

import json

import pytest

from accelerate_memsafe.cli.main import main
from accelerate_memsafe.memory.estimate import CheckpointSummary, predict, summarize_checkpoint


def test_summary_reads_headers_only(tiny_llama_dir, monkeypatch):
    from accelerate_memsafe.io import safetensors_source

    monkeypatch.setattr(safetensors_source.SafetensorsSource, "read", lambda *a, **k: pytest.fail("tensor data was read"))
    s = summarize_checkpoint(tiny_llama_dir)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert s.numel == sum(t.numel() for t in ref.state_dict().values() if t is not None)
    assert s.checkpoint_bytes == 4 * s.numel
    assert s.largest_numel == max(t.numel() for t in ref.state_dict().values())


def test_predictions_follow_the_paths():
    s = CheckpointSummary("x", 10, 100 * 2**20, 400 * 2**20, "w", 10 * 2**20)  # P = 400 MiB fp32, T = 40 MiB
    preds = {(p.stage, p.rank, p.path): p for p in predict(s, num_processes=2, bucket_bytes=64 * 2**20, load_source="rank0")}
    mib = 2**20
    assert preds[("accelerate.prepare", 1, "stock")].cpu_anon_bytes == (200 + 80) * mib
    assert preds[("rank0_distribute", 0, "memsafe")].cpu_anon_bytes == (200 + 96) * mib
    assert preds[("rank0_distribute", 1, "memsafe")].cpu_anon_bytes == (200 + 16) * mib
    bf16 = {(p.stage, p.rank, p.path): p for p in predict(s, num_processes=2, dtype="bf16", mixed_precision="bf16",
                                                          load_source="rank0")}
    # accelerate upcasts every trainable weight to fp32 on every rank: + P (fp32) per rank
    assert bf16[("accelerate.prepare", 1, "stock")].cpu_anon_bytes == (200 + 80 + 400) * mib
    assert bf16[("rank0_distribute", 1, "memsafe")].cpu_anon_bytes == (200 + 16) * mib
    # every_rank (what "auto" predicts): its shard, plus one cast chunk when the file dtype differs
    auto = {(p.stage, p.rank, p.path): p for p in predict(s, num_processes=2)}
    assert auto[("rank0_distribute", 0, "memsafe")].cpu_anon_bytes == auto[("rank0_distribute", 1, "memsafe")].cpu_anon_bytes == 200 * mib
    cast = {(p.stage, p.rank, p.path): p for p in predict(s, num_processes=2, dtype="bf16", mixed_precision="bf16")}
    assert cast[("rank0_distribute", 0, "memsafe")].cpu_anon_bytes == (200 + 16) * mib
    with pytest.raises(ValueError, match="unknown dtype"):
        predict(s, num_processes=2, dtype="int3")


def test_estimate_command_prints_tables_and_json(tiny_llama_dir, capsys):
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "2"]) == 0
    out = capsys.readouterr().out
    assert "| prepare | rank0_distribute | 1 | memsafe |" in out
    assert "fits" in out
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "2", "--json", "--budget-bytes", "1KiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"]["memsafe"]["fits"] is False, "1 KiB cannot hold the shards"
    stages = {(p["stage"], p["rank"]) for p in data["predictions"] if p["path"] == "memsafe"}
    assert {("meta_placement", 0), ("shard", 1), ("rank0_distribute", 0), ("buffer_init", 1)} <= stages
