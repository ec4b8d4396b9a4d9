"""``load_source="node"`` (issue 13), 4 gloo processes as 2 "nodes" x 2 (the launcher's ``GROUP_RANK``): each
node's leader is the source for its node. Leaders that see rank 0's checkpoint read it themselves; leaders
that do not get their node's rows from rank 0, at most one copy of the model per node. Every rank ends
bitwise with the single-process weights, on FSDP 4 and HSDP 2 x 2."""

from __future__ import annotations

import pytest

from tests.distributed import workers_prepare as w
from tests.spawn import run_on_ranks

FSDP4 = None
HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory):
    from accelerate_memsafe.models import save_llama

    return save_llama(tmp_path_factory.mktemp("small-llama"), "small")


def _distribute(res, rank):
    return next(r for r in res["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == rank)["details"]


def _run(model_dir, parallelism, **kwargs):
    return run_on_ranks(w.prepare_llama, 4, init_process_group=False, timeout=240, model_dir=str(model_dir), full=True,
                        parallelism=parallelism, ranks_per_node=2, **kwargs)


@pytest.mark.parametrize("parallelism", [pytest.param(FSDP4, marks=pytest.mark.slow), HSDP], ids=["fsdp4", "hsdp2x2"])
def test_leaders_without_the_files_get_at_most_one_copy_per_node_from_rank0(small_llama_dir, parallelism):
    # rank 2, node 1's leader, sees another checkpoint: everything comes from rank 0, through the leaders
    results = _run(small_llama_dir, parallelism, other_checkpoint_on=2, plugin_kwargs={"load_source": "node", "bucket_bytes": 256 * 1024})
    total = 4 * sum(_numel(s) for s in results[0]["full_shapes"].values())
    for rank, res in enumerate(results):
        d = _distribute(res, rank)
        assert d["load_source"] == "node" and d["nodes"] == [[0, 1], [2, 3]]
        assert "rank 2: sees another checkpoint" in d["rank0_because"] and d["local_tensors"] == 0
        assert res["differs_from_single_process"] == [], f"rank {rank}"
    r0 = _distribute(results[0], 0)
    own_node, other_node = r0["bytes_sent_per_node"]
    # node 1 needs its ranks' blocks: half the model under FSDP 4, a whole replica under HSDP; never more
    share = total / 2 if parallelism is FSDP4 else total
    assert share <= other_node <= share * 1.05 + 64 * 1024, (other_node, share)
    assert own_node <= total / 2 * 1.05 + 64 * 1024  # rank 1's rows
    assert r0["bytes_sent"] == own_node + other_node
    # rank 2 received node 1's rows once, and forwarded rank 3's
    assert _distribute(results[2], 2)["bytes_received"] == other_node
    assert 0 < _distribute(results[2], 2)["bytes_sent"] <= other_node
    assert len({res["loss"] for res in results}) == 1


def test_auto_lets_the_node_leaders_read_when_only_they_see_the_checkpoint(small_llama_dir):
    # rank 3 (not a leader) sees another checkpoint: every_rank is not possible, the leaders read for their node
    results = _run(small_llama_dir, HSDP, other_checkpoint_on=3, plugin_kwargs={"load_source": "auto", "bucket_bytes": 256 * 1024})
    for rank, res in enumerate(results):
        d = _distribute(res, rank)
        assert d["load_source"] == "node" and "the node leaders do" in d["rank0_because"]
        assert res["differs_from_single_process"] == [], f"rank {rank}"
    r0 = _distribute(results[0], 0)
    assert r0["bytes_sent_per_node"][1] == 0, "rank 0 sent weights to a node whose leader reads them itself"
    for leader in (0, 2):
        d = _distribute(results[leader], leader)
        assert d["local_tensors"] == d["sharded_tensors"] + d["replicated_tensors"] and d["bytes_read_locally"] > 0
        assert d["bytes_received"] == 0
    for rank in (1, 3):
        assert _distribute(results[rank], rank)["local_tensors"] == 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
