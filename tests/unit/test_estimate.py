"""`accelerate-memsafe estimate`: per-stage predictions from headers and config only, term by term."""

from __future__ import annotations

import json

import pytest
import torch

from accelerate_memsafe.cli.main import main
from accelerate_memsafe.memory.estimate import (
    DISTRIBUTE_OVERHEAD,
    FULLY_SHARD_OVERHEAD,
    CheckpointSummary,
    TensorSpec,
    layout,
    mesh_blocks,
    predict,
    released_by_rank0,
    summarize_checkpoint,
)

MIB = 2**20


def _summary(*tensors: TensorSpec) -> CheckpointSummary:
    numel = sum(t.numel for t in tensors)
    largest = max(tensors, key=lambda t: t.numel)
    return CheckpointSummary("x", len(tensors), numel, 4 * numel, largest.name, largest.numel, tensors=tensors)


def _by_stage(preds, path="memsafe", hook="prepare"):
    return {(p.stage, p.rank): p for p in preds if p.path == path and p.hook == hook}


def test_summary_reads_headers_and_config_only(tiny_llama_dir, monkeypatch):
    from accelerate_memsafe.io import safetensors_source

    monkeypatch.setattr(safetensors_source.SafetensorsSource, "read", lambda *a, **k: pytest.fail("tensor data was read"))
    s = summarize_checkpoint(tiny_llama_dir)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert s.numel == sum(t.numel() for t in ref.state_dict().values() if t is not None)
    assert s.checkpoint_bytes == 4 * s.numel
    assert s.largest_numel == max(t.numel() for t in ref.state_dict().values())
    # the model's own tensors, built on meta: every parameter, each found in the file under its name and shape
    assert s.layout_from == "LlamaForCausalLM on meta"
    assert sorted((t.name, t.shape) for t in s.tensors) == sorted((n, tuple(p.shape)) for n, p in ref.named_parameters())
    assert all(t.file_itemsize == 4 for t in s.tensors)
    assert "tensors" not in s.to_dict() and s.to_dict()["model_tensors"] == len(s.tensors)


def test_fused_experts_are_the_models_tensors_and_travel_through_rank0(tmp_path):
    """A Qwen3-MoE checkpoint stores one tensor per expert; the model fuses them (3-D, not in the file under
    that name): they cannot be read by every rank, so rank 0 scatters them even with load_source='auto'."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=10, num_experts_per_tok=2)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    s = summarize_checkpoint(tmp_path)
    fused = [t for t in s.tensors if len(t.shape) == 3]
    assert s.layout_from == "Qwen3MoeForCausalLM on meta"
    assert sorted(t.shape for t in fused) == [(10, 32, 16), (10, 32, 32)] and all(t.file_itemsize is None for t in fused)
    assert all(t.file_itemsize == 2 for t in s.tensors if t not in fused)
    n = 4
    preds = _by_stage(predict(s, num_processes=n, dtype="bf16", mixed_precision="bf16"))
    # FSDP2 pads 10 experts to 3 rows on each of 4 ranks; every tensor in fp32 (master weights)
    shard = sum(-(-t.shape[0] // n) * t.numel // t.shape[0] * 4 for t in s.tensors)
    sent = n * sum(-(-t.shape[0] // n) * t.numel // t.shape[0] * 4 for t in fused)
    chunk = max(-(-t.shape[0] // n) * t.numel // t.shape[0] * 2 for t in s.tensors if t not in fused)  # bf16 rows, cast
    # rank 0 sends the fused bf16 experts as they are (no ring); each rank widens them into its fp32 shard through
    # a staging buffer: one bucket holds a rank's rows of both, each bf16 piece written at its fp32 offset in the
    # rank's slot, so the pages touched are those of [0, a / 2) and [a, a + b / 2) (a, b: its fp32 rows of each)
    a, b = (3 * t.numel // t.shape[0] * 4 for t in fused)
    page = 4096
    staged = len(set(range(0, -(-(a // 2) // page))) | set(range(a // page, -(-(a + b // 2) // page)))) * page
    assert preds[("rank0_distribute", 0)].cpu_anon_bytes == shard + max(chunk - sent // n, 0) + DISTRIBUTE_OVERHEAD
    assert preds[("rank0_distribute", 1)].cpu_anon_bytes == shard + max(chunk, staged) + DISTRIBUTE_OVERHEAD
    assert released_by_rank0(layout(s.tensors, world_size=n, load_bytes=2, mixed_precision="bf16")) == \
        sum(t.numel * 2 for t in fused)  # the bf16 copies transformers fused, freed as they are sent


def test_predictions_follow_the_mechanisms():
    # 400 MiB of fp32 in one 40 MiB tensor with 10 rows and 360 MiB in 4096 rows, both in the file as they are
    big, rest = TensorSpec("big", (10, 2**20), 4), TensorSpec("rest", (4096, 90 * 256), 4)
    s = _summary(big, rest)
    n, bucket, budget = 4, 64 * MIB, 16 * MIB
    shard = (3 * 4 + 90) * MIB  # 10 rows padded to 3 per rank (12 MiB) + 1024 rows (90 MiB)
    # fp32, rank0 on gloo: rank 0 sends its own tensors as they are and every rank receives into its shard
    rank0 = _by_stage(predict(s, num_processes=n, bucket_bytes=bucket, load_source="rank0"))
    assert rank0[("rank0_distribute", 0)].cpu_anon_bytes == rank0[("rank0_distribute", 1)].cpu_anon_bytes == shard + DISTRIBUTE_OVERHEAD
    # every_rank (what auto predicts): each rank reads its own rows; no copy when the dtypes match
    auto = _by_stage(predict(s, num_processes=n))
    assert auto[("rank0_distribute", 0)].cpu_anon_bytes == auto[("rank0_distribute", 3)].cpu_anon_bytes == shard + DISTRIBUTE_OVERHEAD
    # a bf16 file trained in fp32: every_rank reads one chunk of file rows at a time (at most the budget) ...
    b16 = _summary(TensorSpec("big", (10, 2**20), 2), TensorSpec("rest", (4096, 90 * 256), 2))
    cast = _by_stage(predict(b16, num_processes=n, dtype="bf16", mixed_precision="bf16"))
    assert cast[("rank0_distribute", 1)].cpu_anon_bytes == shard + min(budget, 1024 * 90 * 256 * 2) + DISTRIBUTE_OVERHEAD
    # ... and rank 0 sends the other ranks' bf16 rows as they are (views of the file, no ring), each rank widening
    # them into its shard through two alternating staging buffers, each written with at most its share of a bucket
    # in bf16: half of it
    ring = _by_stage(predict(b16, num_processes=n, dtype="bf16", mixed_precision="bf16", load_source="rank0"))
    assert ring[("rank0_distribute", 0)].cpu_anon_bytes == shard + DISTRIBUTE_OVERHEAD
    assert ring[("rank0_distribute", 1)].cpu_anon_bytes == shard + 2 * (budget // n // 2) + DISTRIBUTE_OVERHEAD
    # half the bucket: big's 4 MiB rows exceed a rank's share, so they are cut along dim 1 and copied, in bf16,
    # into at most prefetch + 1 ring buffers of the other ranks' slots (half a bucket of fp32 bytes each)
    half = _by_stage(predict(b16, num_processes=n, dtype="bf16", mixed_precision="bf16", load_source="rank0",
                             bucket_bytes=bucket // 2))
    assert half[("rank0_distribute", 0)].cpu_anon_bytes == shard + 3 * (budget // 2) * 3 // 4 // 2 + DISTRIBUTE_OVERHEAD
    # (each rank receives its bf16 pieces into its two staging buffers: half of its share of a bucket in each)
    assert half[("rank0_distribute", 1)].cpu_anon_bytes == shard + 2 * (budget // 2 // n // 2) + DISTRIBUTE_OVERHEAD
    # the same cut in fp32, no cast at all: rank 0 copies a dim-1 range into the ring too (in fp32 this time: it
    # sends no view of a column range), while a receiver gets it straight into its shard (one row's range of columns
    # is contiguous there), with no staging buffer
    cut32 = _by_stage(predict(s, num_processes=n, bucket_bytes=bucket // 2, load_source="rank0"))
    assert cut32[("rank0_distribute", 0)].cpu_anon_bytes == shard + 3 * (budget // 2) * 3 // 4 + DISTRIBUTE_OVERHEAD
    assert cut32[("rank0_distribute", 1)].cpu_anon_bytes == shard + DISTRIBUTE_OVERHEAD
    # the other stages: fully_shard's bookkeeping, rank 0's pagemap scan of the mapped weights, nothing else
    assert auto[("shard", 2)].cpu_anon_bytes == FULLY_SHARD_OVERHEAD
    # (53 bytes per 4 KiB page of one scan window: 400 MiB are more than one window of 1 << 14 pages)
    assert auto[("meta_placement", 0)].cpu_anon_bytes == 53 * (1 << 14) and auto[("meta_placement", 1)].cpu_anon_bytes == 0
    assert auto[("buffer_init", 0)].cpu_anon_bytes == auto[("accelerate.prepare", 0)].cpu_anon_bytes == 0
    # stock: every rank upcasts to fp32 (the bf16 copies are the file's pages, nothing private is freed);
    # ranks > 0 receive each whole tensor and split it
    stock = _by_stage(predict(b16, num_processes=n, dtype="bf16", mixed_precision="bf16"), path="stock")
    assert stock[("accelerate.prepare", 0)].cpu_anon_bytes == shard + 400 * MIB + FULLY_SHARD_OVERHEAD
    assert stock[("accelerate.prepare", 1)].cpu_anon_bytes == shard + 400 * MIB + 2 * 360 * MIB + FULLY_SHARD_OVERHEAD
    with pytest.raises(ValueError, match="unknown dtype"):
        predict(s, num_processes=2, dtype="int3")


def test_hsdp_and_a_declined_tp_plan_hold_a_block_per_dp_shard_not_per_rank():
    """HSDP 2 x 2 and FSDP 2 x TP 2 with the plan declined: 4 ranks, 2 distinct blocks of each weight, each held twice.
    The old estimate took 1/4 of every weight per rank: half of what a rank holds."""
    w = TensorSpec("w", (10, 2**20), 4)  # 40 MiB of fp32, 10 rows of 4 MiB
    s = _summary(w)
    plain = _by_stage(predict(s, num_processes=4, load_source="rank0"))
    hsdp = _by_stage(predict(s, num_processes=4, load_source="rank0", dp_replicate_size=2))
    declined = _by_stage(predict(s, num_processes=4, load_source="rank0", tp_size=2, tp_applied=False))
    applied = _by_stage(predict(s, num_processes=4, load_source="rank0", tp_size=2))
    quarter, half = 3 * 4 * MIB, 5 * 4 * MIB  # 10 rows padded to 3 per block of 4, 5 per block of 2
    for rank in (1, 2, 3):
        assert plain[("rank0_distribute", rank)].cpu_anon_bytes == quarter + DISTRIBUTE_OVERHEAD
        assert hsdp[("rank0_distribute", rank)].cpu_anon_bytes == half + DISTRIBUTE_OVERHEAD
        assert declined[("rank0_distribute", rank)].cpu_anon_bytes == half + DISTRIBUTE_OVERHEAD
        assert applied[("rank0_distribute", rank)].cpu_anon_bytes == quarter + DISTRIBUTE_OVERHEAD
    # stock holds the same blocks; the resumed AdamW state is two fp32 moments of a rank's block
    stock = _by_stage(predict(s, num_processes=4, dp_replicate_size=2), path="stock")
    assert stock[("accelerate.prepare", 0)].cpu_anon_bytes == half + FULLY_SHARD_OVERHEAD
    resume = _by_stage(predict(s, num_processes=4, dp_replicate_size=2), hook="load_state")
    assert resume[("optimizer_cpu_reload", 3)].cpu_anon_bytes == 2 * 20 * MIB + 20 * MIB
    # which rank holds which block: HSDP repeats the blocks across replicas, a declined TP plan within a TP group
    assert [mesh_blocks(4, dp_replicate=2).of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [mesh_blocks(4, tp=2, tp_applied=False).of(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="multiple of their product"):
        predict(s, num_processes=6, dp_replicate_size=4)


def test_staging_buffers_follow_the_block_a_rank_holds():
    """On gloo a bf16 row widened into an fp32 shard arrives in a staging buffer: a rank's pieces are those of the
    block it holds, so under HSDP the last rank (block 1 of 2) receives 4 of 9 rows where on plain FSDP it receives
    the 0 rows left for block 3 of 4 (rows 9.. of 9, padded)."""
    from accelerate_memsafe.memory.estimate import staging_touched

    t = TensorSpec("w", (9, 1024), 2)
    kw = dict(load_bytes=2, mixed_precision="bf16")
    plain = layout([t], world_size=4, **kw)
    hsdp = layout([t], world_size=4, blocks=mesh_blocks(4, dp_replicate=2), **kw)
    narrow = lambda _: True  # noqa: E731
    assert staging_touched(plain, list(plain.tensors), budget=1 << 20, narrow=narrow, rank=3) == 0
    assert staging_touched(hsdp, list(hsdp.tensors), budget=1 << 20, narrow=narrow, rank=3) == 2 * 4096  # 4 rows of 1024 bf16
    assert staging_touched(hsdp, list(hsdp.tensors), budget=1 << 20, narrow=narrow, rank=2) == \
        staging_touched(hsdp, list(hsdp.tensors), budget=1 << 20, narrow=narrow, rank=0)


def test_cuda_keeps_the_shards_on_the_device_unless_cpu_offload():
    s = _summary(TensorSpec("w", (1024, 1024), 4))
    cuda = _by_stage(predict(s, num_processes=2, device="cuda", load_source="rank0"))
    assert cuda[("rank0_distribute", 1)].device_bytes >= 2 * MIB and cuda[("rank0_distribute", 1)].cpu_anon_bytes < MIB
    offload = _by_stage(predict(s, num_processes=2, device="cuda", cpu_offload=True, load_source="rank0"))
    assert offload[("rank0_distribute", 1)].device_bytes == 0 and offload[("rank0_distribute", 1)].cpu_anon_bytes >= 2 * MIB


def test_the_preflight_estimates_count_fp32_master_weights_padding_and_the_pagemap_scan():
    """The stages' own estimates (before prepare): a bf16 model under mixed precision is placed in fp32, and
    FSDP2 pads 10 rows to 3 per rank on 4 ranks (the old estimate took the bf16 bytes / N)."""
    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.pipeline import HookContext
    from accelerate_memsafe.stages.meta_placement import MetaPlacementStage
    from accelerate_memsafe.stages.rank0_distribute import Rank0DistributeStage

    model = torch.nn.Linear(2**20, 10, bias=False).to(torch.bfloat16)  # weight: 10 rows of 1 Mi elements
    plugin = MemSafePlugin(load_source="rank0")
    ctx = HookContext(hook="prepare", rank=1, world_size=4, device=torch.device("cpu"), options=plugin, model=model,
                      is_fsdp2=True, mixed_precision="bf16")
    est = Rank0DistributeStage(plugin).estimate(ctx)
    # its 3 rows of fp32, and two alternating staging buffers into which the bf16 rows arrive before they are
    # widened: one 4 MiB fp32 row per bucket (a rank's share, 64 MiB // 4 // 4 ranks), 2 MiB in bf16
    assert est.cpu_bytes == 3 * 4 * MIB + 2 * 2 * MIB + DISTRIBUTE_OVERHEAD and est.device_bytes == 0
    # meta_placement: rank 0 scans the pagemap of the 20 MiB of bf16 weights it holds (53 bytes per page)
    assert MetaPlacementStage(plugin).estimate(ctx) is None
    ctx.rank = 0
    assert MetaPlacementStage(plugin).estimate(ctx).cpu_bytes == 53 * (20 * MIB // 4096)


def test_the_preflight_estimate_holds_a_block_per_dp_shard_under_hsdp_and_a_declined_tp_plan():
    """The stage's own estimate reads the mesh from the accelerator's ParallelismConfig, and whether the TP plan is
    applied from the `shard` stage's verdicts in the preflight exchange: 10 rows over 2 blocks is 5 per rank."""
    from accelerate.utils import ParallelismConfig

    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY, HookContext
    from accelerate_memsafe.stages.rank0_distribute import Rank0DistributeStage

    model = torch.nn.Linear(2**20, 10, bias=False)  # 10 fp32 rows of 4 MiB
    stage = Rank0DistributeStage(MemSafePlugin(load_source="rank0"))

    def estimate(pc, verdicts=None):
        ctx = HookContext(hook="prepare", rank=1, world_size=4, device=torch.device("cpu"), options=stage.options,
                          model=model, is_fsdp2=True, mixed_precision="no",
                          scratch={"parallelism_config": pc, **({ANNOUNCED_KEY: {"shard": verdicts}} if verdicts else {})})
        return stage.estimate(ctx).cpu_bytes - DISTRIBUTE_OVERHEAD

    assert estimate(None) == 3 * 4 * MIB
    assert estimate(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)) == 5 * 4 * MIB
    tp = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert estimate(tp, [("tp", None)] * 4) == 3 * 4 * MIB, "every rank applies the plan: 1/4 of the weight"
    assert estimate(tp, [("tp", None)] * 3 + [("tp", "rank 3 declined it")]) == 5 * 4 * MIB
    # without the exchange's verdicts the stage asks the same check itself (a bare Linear has no TP plan)
    assert estimate(tp) == 5 * 4 * MIB


def test_the_preflight_estimate_holds_the_parameters_fsdp_ignores_whole():
    """`ignored_modules` (a pattern, as scripts and `FSDP_IGNORED_MODULES` give it): fully_shard leaves those parameters
    whole on every rank, so the estimate counts all their rows; the look moves no module."""
    from types import SimpleNamespace

    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.pipeline import HookContext
    from accelerate_memsafe.stages.rank0_distribute import Rank0DistributeStage

    model = torch.nn.Sequential(torch.nn.Linear(2**20, 10, bias=False), torch.nn.Linear(2**20, 10, bias=False))
    stage = Rank0DistributeStage(MemSafePlugin(load_source="rank0"))

    def estimate(ignored):
        ctx = HookContext(hook="prepare", rank=1, world_size=4, device=torch.device("cpu"), options=stage.options,
                          model=model, is_fsdp2=True, mixed_precision="no",
                          fsdp_plugin=SimpleNamespace(ignored_modules=ignored, cpu_offload=None))
        return stage.estimate(ctx).cpu_bytes - DISTRIBUTE_OVERHEAD

    assert estimate(None) == 2 * 3 * 4 * MIB  # 3 of the 10 fp32 rows of each weight
    # the second weight whole, and the broadcast buffer it arrives in (alone: larger than a group's 16 MiB budget)
    assert estimate("1") == 3 * 4 * MIB + 10 * 4 * MIB + 10 * 4 * MIB
    assert estimate([model[0]]) == 10 * 4 * MIB + 3 * 4 * MIB + 10 * 4 * MIB


def test_no_preflight_estimate_where_the_fsdp2_stages_skip_and_no_tp_rehearsal_for_it(monkeypatch):
    """A model transformers already parallelised while loading (`tp_plan`: DTensor weights) goes to accelerate's own
    prepare: `shard` skips (its verdict is missing from the exchange), nothing is sent, and the estimate neither
    predicts a distribution nor rehearses the TP plan on the parallelised model."""
    import torch.distributed as dist
    from accelerate.utils import ParallelismConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import accelerate_memsafe.distributed.tensor_parallel as tensor_parallel
    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY, HookContext
    from accelerate_memsafe.stages.rank0_distribute import Rank0DistributeStage
    from tests.spawn import free_port

    def rehearsed(*_):
        raise AssertionError("the TP plan of an already parallelised model was rehearsed")

    monkeypatch.setattr(tensor_parallel, "tp_plan_problem", rehearsed)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,))))
        stage = Rank0DistributeStage(MemSafePlugin())
        ctx = HookContext(hook="prepare", rank=0, world_size=4, device=torch.device("cpu"), options=stage.options,
                          model=model, is_fsdp2=True, mixed_precision="no",
                          scratch={"parallelism_config": ParallelismConfig(dp_shard_size=2, tp_size=2),
                                   ANNOUNCED_KEY: {"shard": [None] * 4, "meta_placement": [None] * 4}})
        assert stage.needs_estimate(ctx)
        assert stage.estimate(ctx) is None
    finally:
        dist.destroy_process_group()


def test_estimate_command_prints_tables_and_json(tiny_llama_dir, capsys):
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "2"]) == 0
    out = capsys.readouterr().out
    assert "| prepare | rank0_distribute | 1 | memsafe |" in out and "model tensors from LlamaForCausalLM on meta" in out
    assert "fits" in out
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "2", "--json", "--budget-bytes", "1KiB"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"]["memsafe"]["fits"] is False, "1 KiB cannot hold the shards"
    assert data["checkpoint"]["layout_from"] == "LlamaForCausalLM on meta"
    stages = {(p["stage"], p["rank"]) for p in data["predictions"] if p["path"] == "memsafe"}
    assert {("meta_placement", 0), ("shard", 1), ("rank0_distribute", 0), ("buffer_init", 1), ("accelerate.prepare", 1)} <= stages


def test_estimate_command_takes_the_mesh_and_checks_the_tp_plan_as_prepare_does(tiny_llama_dir, capsys):
    from accelerate_memsafe.memory.estimate import tp_plan_declined

    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "4", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "4", "--dp-replicate-size", "2", "--json"]) == 0
    hsdp = json.loads(capsys.readouterr().out)
    assert hsdp["parallelism"] == {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "from": "--dp-replicate-size"}

    def held(doc, rank):
        return next(p["cpu_anon_bytes"] for p in doc["predictions"]
                    if p["path"] == "memsafe" and p["stage"] == "rank0_distribute" and p["rank"] == rank)

    assert held(hsdp, 3) > held(plain, 3), "each rank of HSDP 2 x 2 holds half of every weight, not a quarter"
    # the TP plan is checked as the `shard` stage checks it (the same function, on the model built on meta)
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "4", "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    why = tp_plan_declined(tiny_llama_dir, 2)
    assert "mesh: dp_replicate 1 x dp_shard 2 x tp 2" in out and "(from --tp-size)" in out
    assert ("(the model's TP plan applies)" in out) if why is None else (f"TP plan declined ({why})" in out)
    assert main(["estimate", str(tiny_llama_dir), "--num-processes", "6", "--tp-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "6 processes" in err and "--tp-size 4" in err and "multiple of their product" in err


def test_a_resume_holds_the_state_of_the_rows_a_rank_holds_unpadded():
    """10 expert rows over 4 ranks: 3, 3, 3 and 1 (FSDP2 pads the shard, the optimizer's state is of the unpadded
    rows). The plugin reads the state into new tensors (S + its largest tensor), stock holds two copies (2 S)."""
    experts = TensorSpec("experts", (10, 1024, 256), 2)  # 1 MiB of fp32 per row
    s = _summary(experts)
    plugin = _by_stage(predict(s, num_processes=4, dtype="bf16", mixed_precision="bf16"), hook="load_state")
    stock = _by_stage(predict(s, num_processes=4, dtype="bf16", mixed_precision="bf16"), path="stock", hook="load_state")
    for rank, rows in ((0, 3), (2, 3), (3, 1)):
        state = 2 * rows * MIB
        assert plugin[("optimizer_cpu_reload", rank)].cpu_anon_bytes == state + rows * MIB
        assert stock[("accelerate.load_state", rank)].cpu_anon_bytes == 2 * state


def test_estimate_command_takes_the_mesh_from_where_the_process_count_comes(tiny_llama_dir, capsys, tmp_path, monkeypatch):
    """`accelerate config` writes the mesh in the launch config's `parallelism_config`; `accelerate launch
    --use_parallelism_config` passes it to the job as PARALLELISM_CONFIG_*: the estimate reads it where it reads
    the process count, and a flag still wins."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launch = tmp_path / "launch.yaml"
    launch.write_text("num_processes: 4\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                      "  parallelism_config_dp_shard_size: 2\n")
    assert main(["estimate", str(tiny_llama_dir), "--config_file", str(launch), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["parallelism"]
    assert got == {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "from": f"parallelism_config in {launch}"}
    assert main(["estimate", str(tiny_llama_dir), "--config_file", str(launch), "--dp-replicate-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallelism"]["dp_shard_size"] == 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    assert main(["estimate", str(tiny_llama_dir)]) == 0
    assert "mesh: dp_replicate 2 x dp_shard 2 (from PARALLELISM_CONFIG_* in the environment)" in capsys.readouterr().out
    launch.write_text("num_processes: 4\nparallelism_config:\n  parallelism_config_tp_size: two\n")
    assert main(["estimate", str(tiny_llama_dir), "--config_file", str(launch)]) == 2
    assert "parallelism_config_tp_size of 'two'" in capsys.readouterr().err
