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
