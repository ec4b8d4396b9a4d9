"""FSDP2 on 2 CPU gloo ranks through the plugin: sharding, report, and attach() == subclass."""

from __future__ import annotations

import torch

from tests.distributed import workers, workers_prepare
from tests.spawn import run_on_ranks


def test_subclass_shards_with_fsdp2_and_reports(tiny_llama_dir):
    results = run_on_ranks(workers.prepare_tiny_llama, 2, init_process_group=False, model_dir=str(tiny_llama_dir))
    for rank, res in enumerate(results):
        assert res["distributed_type"] == "DistributedType.FSDP"
        assert res["is_fsdp2"] is True
        assert res["opt_params_are_model_params"], "optimizer must hold the sharded parameters"
        for name, p in res["params"].items():
            assert p["dtensor"] and p["shard0"], f"{name} on rank {rank}: {p['placements']}"
        records = [r for r in res["report"]["records"] if r["stage"] == "shard" and r["hook"] == "prepare"]
        assert sorted(r["rank"] for r in records) == [0, 1], "one shard record per rank"
        for r in records:
            assert r["status"] == "ran"
            assert r["wall_s"] > 0
            assert r["cpu_rss_peak_bytes"] and r["cpu_rss_peak_bytes"] > 0
            # the parts of the stage a stock prepare runs too (accelerate's wrapping, freeing the unsharded weights)
            # are timed inside it: what the plugin adds is the rest (benchmarks/overhead.py's own time)
            details = r["details"]
            assert 0 < details["fsdp2_wrap_s"] and 0 <= details["unsharded_release_s"], details
            assert details["fsdp2_wrap_s"] + details["unsharded_release_s"] <= r["wall_s"], (details, r["wall_s"])
            assert 0 < details["own_in_wrap_s"] < details["fsdp2_wrap_s"], details  # the group filter ran inside
            # the counts the stage reads from its remapping walk (`_compat.local_numel`) are the public API's:
            # this rank's `named_parameters`, and the elements of their `DTensor.to_local()` shards
            mine = results[r["rank"]]["params"]
            assert details["parameters"] == len(mine), (details, len(mine))
            assert details["local_elements"] == sum(p["local"].numel() for p in mine.values()), details
        assert "| prepare | shard |" in res["markdown"]
    # half the rows of every parameter on each rank (tiny llama dims are even)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).state_dict()
    for name, p in results[0]["params"].items():
        full = ref[name]
        rows = full.shape[0] // 2
        assert p["local"].shape[0] == rows, name
        assert torch.equal(p["local"], full[:rows]), f"rank 0 shard of {name} differs from the checkpoint"
        assert torch.equal(results[1]["params"][name]["local"], full[rows:]), f"rank 1 shard of {name}"


def test_attach_gives_the_same_sharded_result(tiny_llama_dir):
    sub = run_on_ranks(workers.prepare_tiny_llama, 2, init_process_group=False, model_dir=str(tiny_llama_dir))
    att = run_on_ranks(workers.prepare_tiny_llama, 2, init_process_group=False, model_dir=str(tiny_llama_dir), attach=True)
    for rank in range(2):
        assert att[rank]["class"] == "MemSafeAccelerator"
        assert att[rank]["distributed_type"] == "DistributedType.FSDP"
        assert att[rank]["params"].keys() == sub[rank]["params"].keys()
        for name in sub[rank]["params"]:
            a, s = att[rank]["params"][name], sub[rank]["params"][name]
            assert a["placements"] == s["placements"], name
            assert torch.equal(a["local"], s["local"]), name
        assert any(r["stage"] == "shard" for r in att[rank]["report"]["records"])


def test_preflight_refuses_on_every_rank_before_anything_is_modified(tiny_llama_dir):
    results = run_on_ranks(workers.prepare_with_tiny_budget, 2, init_process_group=False, timeout=120,
                           model_dir=str(tiny_llama_dir))
    for res in results:
        assert res["message"] is not None, "prepare must be refused"
        assert "stage `rank0_distribute` at hook `prepare` on rank 0 would not fit" in res["message"]
        assert "on rank 1" not in res["message"]
        assert "CPU: needs" in res["message"] and "preflight_memory_check=False" in res["message"]
        assert "available by the cgroup memory.max of /sys/fs/cgroup/rank0" in res["message"]
        assert res["unchanged"], "no parameter may be moved or modified"


def test_preflight_asks_no_estimate_of_a_stage_the_announcements_rule_out(tiny_llama_dir):
    """Every rank holds rank 0's mapped bytes (transformers' zero-copy load): the weights stay in place and
    `rank0_distribute` does not run, so a budget that holds the in-place path's needs but not the distribution's
    prepares (its estimate is not even computed); with `load_source="rank0"` the same budget is refused, naming it."""
    budget = 64 * 1024  # the pagemap scan of a few hundred KiB of weights fits, the distribution's buffers do not
    stock_like = run_on_ranks(workers.prepare_with_tiny_budget, 2, init_process_group=False, timeout=120,
                              model_dir=str(tiny_llama_dir), rank0_bytes=budget, load_source="auto")
    for res in stock_like:
        assert res["message"] is None, res["message"]
        assert res["asked"] == ["meta_placement"], res["asked"]
    refused = run_on_ranks(workers.prepare_with_tiny_budget, 2, init_process_group=False, timeout=120,
                           model_dir=str(tiny_llama_dir), rank0_bytes=budget, load_source="rank0")
    for res in refused:
        assert res["message"] is not None and res["unchanged"]
        assert "stage `rank0_distribute` at hook `prepare` on rank 0 would not fit" in res["message"]
        assert "rank0_distribute" in res["asked"], res["asked"]


def test_preflight_counts_the_ranks_that_share_a_cgroup_together(tiny_llama_dir):
    """Two ranks in one pod: a limit that holds either rank's estimate but not both is refused, naming
    the shared limit; a limit that holds both passes."""
    probe = run_on_ranks(workers.prepare_with_tiny_budget, 2, init_process_group=False, timeout=120,
                         model_dir=str(tiny_llama_dir), shared_bytes=1 << 50)
    assert all(r["message"] is None for r in probe)
    needs = [r["cpu_estimate"] for r in probe]
    both = sum(needs)
    refused = run_on_ranks(workers.prepare_with_tiny_budget, 2, init_process_group=False, timeout=120,
                           model_dir=str(tiny_llama_dir), shared_bytes=both - 1)
    assert max(needs) < both - 1  # each rank alone would fit
    for res in refused:
        assert res["message"] is not None and res["unchanged"]
        assert "the 2 ranks sharing this limit need" in res["message"]
        assert "available by the cgroup memory.max of /sys/fs/cgroup/pod (test)" in res["message"]


def test_a_model_prepared_alone_is_stocks_and_its_optimizer_prepared_after_trains_as_stocks(tiny_llama_dir):
    # accelerate 1.16 takes an FSDP2 model without its optimizer (to evaluate it, or to build the optimizer from the
    # sharded parameters and prepare both after, as torchtitan builds it): with the plugin, with either loader, the
    # evaluation logits and the step after the second `prepare` are stock's bitwise (`transformer_based_wrap` and
    # activation checkpointing, which the second call must not apply twice); the plugin's stages ran in the first call
    # and skip in the second. Before 1.16 both refuse the first call, with the same exception type.
    from accelerate_memsafe import _compat

    runs = ("stock", "plugin", "plugin_memsafe_loader")
    results = run_on_ranks(workers_prepare.prepare_model_alone, 2, timeout=300, model_dir=str(tiny_llama_dir), runs=runs)
    if not _compat.fsdp2_prepares_a_model_alone():
        for res in results:
            assert "must be passed together" in res["stock"]["error"]
            assert all("exactly one model and its optimizer" in res[run]["error"] for run in runs[1:])
        return
    for rank, res in enumerate(results):
        stock = res["stock"]
        assert stock["optimizer_exact"]
        for run in runs[1:]:
            got = res[run]
            assert torch.equal(got["logits"], stock["logits"]), (run, rank)
            assert [n for n in stock["stepped"] if not torch.equal(got["stepped"][n], stock["stepped"][n])] == [], run
            assert got["optimizer_exact"], (run, rank)
            first = dict(got["records"][:len(got["records"]) // 2])
            second = dict(got["records"][len(got["records"]) // 2:])
            assert first["shard"] == "ran" and first["meta_placement"] == "ran", (run, first)
            assert second["shard"] == "skipped" and second["meta_placement"] == "skipped", (run, second)
