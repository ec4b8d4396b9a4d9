"""``load_source`` (issue 13): ``every_rank`` reads each rank's block from the checkpoint itself, with no
weight byte through a collective, only where rank 0's weights are the file's bytes and every rank sees
the same files; ``auto`` falls back to rank 0 otherwise (saying why), ``every_rank`` refuses on every rank."""

from __future__ import annotations

import pytest

from tests.distributed import workers_prepare as w
from tests.spawn import run_on_ranks


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory):
    from accelerate_memsafe.models import save_llama

    return save_llama(tmp_path_factory.mktemp("small-llama"), "small")


def _distribute(res, rank):
    return next(r for r in res["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == rank)


def test_every_rank_reads_its_own_block_and_sends_nothing(small_llama_dir):
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           full=True, track=True, plugin_kwargs={"load_source": "auto", "bucket_bytes": 256 * 1024})
    for rank, res in enumerate(results):
        d = _distribute(res, rank)["details"]
        assert d["load_source"] == "every_rank" and "rank0_because" not in d
        assert d["bytes_sent"] == d["bytes_received"] == 0, "a weight byte went through a collective"
        assert d["local_tensors"] == d["sharded_tensors"] + d["replicated_tensors"] > 0
        assert res["differs_from_single_process"] == [], f"rank {rank}"
        full = {s for s in res["full_shapes"].values() if s[0] >= 2}
        assert [a for a in res["allocs"] if a[1] in full] == [], f"rank {rank} allocated a full-size parameter"
    assert results[0]["loss"] == results[1]["loss"]


def test_a_weight_rank0_edited_in_place_is_sent_by_rank0_the_rest_is_read(small_llama_dir):
    edited = "model.layers.0.mlp.up_proj.weight"
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           full=True, edit=edited, plugin_kwargs={"load_source": "every_rank"})
    for rank, res in enumerate(results):
        d = _distribute(res, rank)["details"]
        assert d["load_source"] == "every_rank+rank0"
        # the edited tensor, and its neighbours on the pages the edit wrote, come from rank 0
        assert 0 < d["local_tensors"] <= d["sharded_tensors"] + d["replicated_tensors"] - 1
        assert res["differs_from_single_process"] == [], f"rank {rank} does not hold rank 0's edited model"
    assert _distribute(results[1], 1)["details"]["bytes_received"] > 0


def test_auto_falls_back_to_rank0_when_a_rank_sees_another_checkpoint(small_llama_dir):
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           full=True, other_checkpoint_on=1, plugin_kwargs={"load_source": "auto"})
    for rank, res in enumerate(results):
        d = _distribute(res, rank)["details"]
        assert d["load_source"] == "rank0" and "rank 1: sees another checkpoint" in d["rank0_because"]
        assert res["differs_from_single_process"] == []
    assert _distribute(results[1], 1)["details"]["bytes_received"] > 0


def test_every_rank_refuses_on_every_rank_when_a_rank_sees_another_checkpoint(small_llama_dir):
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           other_checkpoint_on=1, expect_failure=True, plugin_kwargs={"load_source": "every_rank"})
    for status, payload in results:
        assert status == "error" and "load_source='every_rank'" in payload and "rank 1: sees another checkpoint" in payload


def _record(res, rank, stage):
    return next(r for r in res["report"]["records"] if r["stage"] == stage and r["rank"] == rank)


@pytest.mark.parametrize("drop", [False, True], ids=["default", "drop_file_pages"])
def test_auto_keeps_weights_in_place_when_every_rank_maps_the_same_unmodified_checkpoint(small_llama_dir, drop):
    # transformers' zero-copy load on every rank: every rank's bytes are rank 0's, so fully_shard keeps each
    # rank's own rows (as stock accelerate does); nothing goes to meta, nothing is read again or sent
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           loader="hf", full=True, track=True,
                           plugin_kwargs={"load_source": "auto", "drop_file_pages": drop})
    for rank, res in enumerate(results):
        placement = _record(res, rank, "meta_placement")
        assert placement["details"]["in_place"] is True and "not_in_place_because" not in placement["details"]
        dist = _record(res, rank, "rank0_distribute")
        assert dist["status"] == "skipped" and "unmodified views of one mapped checkpoint" in dist["reason"]
        buffers = _record(res, rank, "buffer_init")["details"]
        assert buffers["already_equal"] == 2  # inv_freq, original_inv_freq
        assert buffers["checked_in_preflight"] is True  # the rows travelled in the preflight exchange
        shard = _record(res, rank, "shard")["details"]
        if drop:  # each group's file pages are dropped once fully_shard copied its rows: every weight's whole pages
            import math

            full = sum(4 * math.prod(s) for s in res["full_shapes"].values())
            dropped = shard["file_pages_dropped_bytes"]
            assert full - 2 * 4096 * len(res["full_shapes"]) <= dropped <= full, (dropped, full)
        else:  # the default keeps them mapped, as stock accelerate does
            assert "file_pages_dropped_bytes" not in shard, shard
        assert res["differs_from_single_process"] == [], f"rank {rank}"
        # fully_shard's padded shards are the largest allocations: no full-size copy of any weight
        largest_shard = max(p["local"].numel() * p["local"].element_size() for p in res["params"].values())
        assert max(a[2] for a in res["allocs"]) == largest_shard, f"rank {rank}"
    assert results[0]["loss"] == results[1]["loss"] == results[0]["single_process_loss"]


@pytest.mark.parametrize("edit_on", [0, 1])
def test_an_edit_on_any_rank_stops_the_in_place_path_and_rank0s_model_wins(small_llama_dir, edit_on):
    edited = "model.layers.0.mlp.up_proj.weight"
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           loader="hf", full=True, edit=edited, edit_on=edit_on, plugin_kwargs={"load_source": "auto"})
    for rank, res in enumerate(results):
        placement = _record(res, rank, "meta_placement")["details"]
        assert placement["in_place"] is False
        # the edited weight and its neighbours on the pages the edit wrote; the other rank is not blamed
        assert placement["not_in_place_because"].startswith(f"rank {edit_on}: ")
        assert "weight(s) are not unmodified views" in placement["not_in_place_because"]
        assert f"rank {1 - edit_on}" not in placement["not_in_place_because"]
        # rank 0's edit reaches every rank; rank 1's own edit does not survive (rank 0's bytes are the truth)
        assert res["differs_from_single_process"] == [], f"rank {rank} does not hold rank 0's model"
        assert _record(res, rank, "rank0_distribute")["status"] == "ran"
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.parametrize("swap_on", [0, 1])
def test_weights_swapped_on_any_rank_stop_the_in_place_path_and_rank0s_model_wins(small_llama_dir, swap_on):
    # both weights are still unmodified views of the file, each under the other's name: the claim proves where each
    # name's bytes lie in the file, so the ranks' claims differ; rank 0's arrangement reaches every rank
    swap = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight")
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           loader="hf", full=True, swap=swap, swap_on=swap_on, plugin_kwargs={"load_source": "auto"})
    for rank, res in enumerate(results):
        placement = _record(res, rank, "meta_placement")["details"]
        assert placement["in_place"] is False
        assert placement["not_in_place_because"] == "rank 1 maps another checkpoint or model than rank 0"
        assert res["differs_from_single_process"] == [], f"rank {rank} does not hold rank 0's model"
    assert results[0]["loss"] == results[1]["loss"]


def test_mixed_precision_upcast_keeps_the_meta_path(tmp_path):
    # accelerate would cast every bf16 weight to fp32 master weights: a private full copy on every rank; the meta
    # path casts each rank's own rows only
    import torch

    from accelerate_memsafe.models import save_llama

    path = save_llama(tmp_path / "bf16", "tiny", dtype=torch.bfloat16)
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(path), loader="hf",
                           dtype="bfloat16", mixed_precision="bf16", plugin_kwargs={"load_source": "auto"})
    for rank, res in enumerate(results):
        placement = _record(res, rank, "meta_placement")["details"]
        assert placement["in_place"] is False and "cast" in placement["not_in_place_because"]
        assert {p["local"].dtype for p in res["params"].values()} == {torch.float32}


def test_a_rank_that_maps_another_checkpoint_stops_the_in_place_path(small_llama_dir):
    # rank 1 sees files with another identity (a node's own copy): its bytes are not proved to be rank 0's
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir),
                           loader="hf", full=True, other_checkpoint_on=1, plugin_kwargs={"load_source": "auto"})
    for rank, res in enumerate(results):
        placement = _record(res, rank, "meta_placement")["details"]
        assert placement["in_place"] is False
        assert placement["not_in_place_because"] == "rank 1 maps another checkpoint or model than rank 0"
        assert _record(res, rank, "rank0_distribute")["details"]["load_source"] == "rank0"
        assert res["differs_from_single_process"] == [], f"rank {rank}"
