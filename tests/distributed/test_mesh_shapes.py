"""Rank-0 load on 2-D meshes (issue 13), 4 gloo processes: HSDP 2 x 2 and FSDP 2 x TP 2 (the model's own TP
plan) through ``Accelerator`` with accelerate's ``ParallelismConfig`` (which stock accelerate refuses on a CPU,
and whose TP prepare fails with transformers 5.x), and torch's TP layout through ``distribute_from_rank0``.
Every rank ends bitwise with the single-process weights and receives only its own block."""

from __future__ import annotations

import pytest

from tests import releases
from tests.distributed import workers_mesh, workers_prepare
from tests.spawn import run_on_ranks


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory):
    from accelerate_memsafe.models import save_llama

    return save_llama(tmp_path_factory.mktemp("small-llama"), "small")


def test_hsdp_2x2_rank0_load_is_bitwise_a_single_process_load(small_llama_dir):
    results = run_on_ranks(
        workers_prepare.prepare_llama, 4, init_process_group=False, timeout=240, model_dir=str(small_llama_dir),
        track=True, full=True, parallelism={"dp_replicate_size": 2, "dp_shard_size": 2},
        plugin_kwargs={"bucket_bytes": 256 * 1024, "load_source": "rank0"},
    )
    total = sum(4 * _numel(s) for s in results[0]["full_shapes"].values())
    for rank, res in enumerate(results):
        assert res["differs_from_single_process"] == [], f"rank {rank}"
        assert set(res["placements"].values()) == {"(Replicate(), Shard(dim=0))"}
        ran = {r["stage"]: r for r in res["report"]["records"] if r["rank"] == rank}
        assert all(ran[s]["status"] == "ran" for s in ("meta_placement", "shard", "rank0_distribute", "buffer_init"))
        if rank:
            full = {s for s in res["full_shapes"].values() if s[0] >= 2}
            assert [a for a in res["allocs"] if a[1] in full] == [], f"rank {rank} allocated a full-size parameter"
            received = ran["rank0_distribute"]["details"]["bytes_received"]
            # its HSDP share (half the model: one of 2 shards) and no more, up to uneven rows and alignment
            assert total / 2 <= received <= total / 2 * 1.05 + 16 * 1024, (received, total)
    assert results[0]["loss"] == results[1]["loss"] == results[2]["loss"] == results[3]["loss"]


def test_fsdp_x_tp_2x2_through_accelerate_prepare_is_bitwise_a_single_process_load(small_llama_dir):
    results = run_on_ranks(
        workers_prepare.prepare_llama, 4, init_process_group=False, timeout=240, model_dir=str(small_llama_dir),
        track=True, full=True, parallelism={"dp_shard_size": 2, "tp_size": 2},
        plugin_kwargs={"bucket_bytes": 256 * 1024, "load_source": "rank0"},
    )
    total = sum(4 * _numel(s) for s in results[0]["full_shapes"].values())
    placements = results[0]["placements"]
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"  # rowwise
    assert placements["model.layers.0.mlp.up_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # colwise
    # a weight the TP plan split has two placements (dp_shard, tp), the second not Replicate(); the others are FSDP's only
    tp_split = {n.rsplit(".", 1)[0] for n, p in placements.items() if "), " in p and not p.endswith("Replicate())")}
    layers = {n.split(".")[2] for n in placements if n.startswith("model.layers.")}
    linears = {f"model.layers.{i}.{m}" for i in layers
               for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert linears <= tp_split, sorted(linears - tp_split)
    # 2 ranks along each mesh dimension: a weight is cut in 2 per dimension it is sharded along
    own = sum(4 * _numel(results[0]["full_shapes"][n]) / 2 ** p.count("Shard(") for n, p in placements.items())
    assert total / 4 <= own < total / 2
    for rank, res in enumerate(results):
        assert res["differs_from_single_process"] == [], f"rank {rank}"
        ran = {r["stage"]: r for r in res["report"]["records"] if r["rank"] == rank and r["hook"] == "prepare"}
        assert all(ran[s]["status"] == "ran" for s in ("meta_placement", "shard", "rank0_distribute", "buffer_init"))
        # the modules the report counts are the ones whose weight the TP plan split over the `tp` dimension (how many
        # depends on transformers' plan for Llama: 30 in 5.24, 29 in 5.17), and every decoder linear is among them
        assert ran["shard"]["details"]["tp_size"] == 2 and ran["shard"]["details"]["tp_modules"] == len(tp_split)
        # the TP forward (all-reduces in another order) computes the single-process loss
        assert abs(res["loss"] - res["single_process_loss"]) <= 1e-5, (res["loss"], res["single_process_loss"])
        if rank:
            full = {s for s in res["full_shapes"].values() if s[0] >= 2}
            # (DTensor's strided-shard index arithmetic makes int64 aranges of a norm's length: not weights)
            weights = [a for a in res["allocs"] if a[1] in full and a[2] == 4 * _numel(a[1])]
            assert weights == [], f"rank {rank} allocated a full-size parameter"
            received = ran["rank0_distribute"]["details"]["bytes_received"]
            # its block of each weight: a quarter of those split over both dimensions, half of those FSDP splits only
            # (the norms; and the embedding where transformers' plan leaves it out, as 5.17's does), up to uneven rows
            assert own * 0.95 <= received <= own * 1.05 + 16 * 1024, (received, own, total)
    assert len({res["loss"] for res in results}) == 1


def test_fsdp_x_tp_2x2_with_a_plan_the_plugin_declines_shards_over_dp_shard_only(small_llama_dir):
    # a style torch has no counterpart of: the plan is declined, and FSDP shards over `dp_shard` only, as accelerate's
    # own prepare does with a model no TP plan split (rank 0 still sends each rank its shard: the ranks along `tp` hold
    # the same rows); before, the whole prepare was left to accelerate, which refused the weights on `meta`
    results = run_on_ranks(
        workers_prepare.prepare_llama, 4, init_process_group=False, timeout=240, model_dir=str(small_llama_dir),
        track=True, full=True, parallelism={"dp_shard_size": 2, "tp_size": 2},
        plugin_kwargs={"bucket_bytes": 256 * 1024, "load_source": "rank0"},
        tp_plan={"layers.*.self_attn.q_proj": "packed_colwise"},
    )
    total = sum(4 * _numel(s) for s in results[0]["full_shapes"].values())
    for rank, res in enumerate(results):
        assert res["differs_from_single_process"] == [], f"rank {rank}"
        assert set(res["placements"].values()) == {"(Shard(dim=0),)"}
        ran = {r["stage"]: r for r in res["report"]["records"] if r["rank"] == rank and r["hook"] == "prepare"}
        assert all(ran[s]["status"] == "ran" for s in ("meta_placement", "shard", "rank0_distribute", "buffer_init"))
        shard = ran["shard"]["details"]
        assert shard["tp_size"] == 2 and shard["tp_modules"] == 0 and "packed_colwise" in shard["tp_declined"]
        assert abs(res["loss"] - res["single_process_loss"]) <= 1e-5, (res["loss"], res["single_process_loss"])
        if rank:
            full = {s for s in res["full_shapes"].values() if s[0] >= 2}
            assert [a for a in res["allocs"] if a[1] in full and a[2] == 4 * _numel(a[1])] == [], f"rank {rank}"
            received = ran["rank0_distribute"]["details"]["bytes_received"]
            assert total / 2 <= received <= total / 2 * 1.05 + 16 * 1024, (received, total)  # its dp_shard half
    assert len({res["loss"] for res in results}) == 1


@pytest.mark.slow  # the Accelerator test above covers the same blocks (and cuts them into many buckets)
def test_fsdp_x_tp_2x2_rank0_distribution_fills_every_block(tmp_path):
    results = run_on_ranks(workers_mesh.tp_distribute, 4, timeout=180, bucket_bytes=8 * 1024)
    placements = results[0]["placements"]
    assert "_StridedShard" in placements["blocks.0.up.weight"] and "Shard(dim=1)" in placements["blocks.0.down.weight"]
    for rank, res in enumerate(results):
        assert res["differs"] == [], f"rank {rank}"
        assert res["buckets"] > 3, "the bucket budget cuts the tensors into several scatters"
        if rank:  # its own block of each tensor (uneven blocks: up to the largest rank's), nothing else
            assert res["local_bytes"] <= res["bytes_received"] <= 1.3 * res["local_bytes"] + 16 * 64, res


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("nodes", [False, True], ids=["flat", "node"])
def test_fused_experts_larger_than_a_bucket_arrive_bitwise(nodes):
    # an expert row is 2400 bytes, a rank's share of the 1 KiB bucket budget 512: cut along dim 1 (issue 14)
    results = run_on_ranks(workers_mesh.experts_distribute, 2, timeout=120, bucket_bytes=3 * 1024, nodes=nodes)
    for rank, res in enumerate(results):
        assert res["differs"] == [], f"rank {rank}"
        assert res["bucket_budget"] == 1024 and res["buckets"] > 6 * 50 * 12 * 4 // 1024



def test_a_model_context_parallelism_refuses_is_refused_before_anything_moves_as_stock_refuses_it(tmp_path):
    """FSDP 2 x CP 2 with a model whose layers use sliding-window attention: accelerate's `prepare` refuses it first
    thing (context parallelism drops the attention mask), before it shards anything. The plugin's stages run before
    that call, so until the plugin asked the same check first, every rank's model was sharded and rank 0's weights
    sent before the refusal came. Now both paths raise accelerate's words on every rank with nothing moved."""
    import dataclasses

    from transformers import MistralConfig, MistralForCausalLM

    from accelerate_memsafe.models import llama_config

    if not releases.accelerate_refuses_context_parallel_layer_types():
        # the plugin asks accelerate's own check (`test_context_parallel_refusal_is_accelerates_own_and_attaches_nothing`)
        pytest.skip("accelerate before 1.15 refuses no model under context parallelism: no refusal to match")
    fields = {f.name for f in dataclasses.fields(MistralConfig)} if dataclasses.is_dataclass(MistralConfig) else None
    base = {k: v for k, v in llama_config("tiny").to_dict().items() if fields is None or k in fields}
    cfg = MistralConfig(**{**base, "sliding_window": 8})
    MistralForCausalLM(cfg).save_pretrained(tmp_path / "mistral")
    got = {}
    for path, stages in (("stock", []), ("plugin", None)):
        got[path] = run_on_ranks(workers_mesh.prepare_refused_under_cp, 4, init_process_group=False, timeout=240,
                                 model_dir=str(tmp_path / "mistral"), stages=stages)
    for path, results in got.items():
        for rank, res in enumerate(results):
            assert res["error"] is not None and res["error"]["value_error"], (path, rank, res["error"])
            # 1.15: "... attention layers of type ['sliding_attention'] (model MistralForCausalLM)"; 1.16: "MistralForCausalLM
            # does not support context parallelism ... (sliding-window or chunked)"
            assert "MistralForCausalLM" in res["error"]["message"] and "sliding" in res["error"]["message"], (path, rank)
            assert got["stock"][rank]["error"]["message"] in res["error"]["message"], (path, rank)  # accelerate's words
            assert not res["sharded"] and res["changed"] == [] and res["still_meta"], (path, rank, res)
    assert {r["error"]["type"] for r in got["plugin"]} == {"ConfigError"}
    assert "raised on every rank before `prepare` changed anything" in got["plugin"][0]["error"]["message"]


def test_the_local_block_of_a_dtensor_is_the_dcp_protocols_without_importing_dcp():
    # on every rank and placement (uneven rows and columns, FSDP2's strided shard under TP), the block is what DTensor's
    # __create_chunk_list__ reports and holds the local tensor's values; computing it loaded no torch.distributed.checkpoint
    # (the protocol imports it: about 2 MiB of private memory inside `prepare`, which stock never pays)
    results = run_on_ranks(workers_mesh.dtensor_chunks_against_the_protocol, 4, timeout=180)
    seen = set()
    for rank, res in enumerate(results):
        assert res["ours"] == res["protocol"], rank
        assert all(res["matches"].values()), (rank, res["matches"])
        assert all(res["blocks"][n] == res["ours"][n][0] for n in res["ours"]), rank
        assert not res["dcp_loaded_before"] and not res["dcp_loaded_by_ours"], rank
        seen.add(repr(sorted(res["ours"].items())))
    assert len(seen) == 4  # four ranks, four different blocks: the cases are not all trivial
